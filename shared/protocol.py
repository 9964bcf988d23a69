"""Wire types between the supervisor and a runner (see docs/protocol.md).

A completion stream is zero or more `Chunk` lines, then exactly one final line: a `Chunk`
with `done: true`, or an error line (`error_line`). An error answered before streaming is an
HTTP status with `error_body`. Both name the error's class in shared/errors.py by its `kind`.
Only these types cross the process boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest, MlxrError

# Ollama's sampling defaults (api/types.go DefaultOptions). Penalties are off unless asked
# for, as in Ollama's own newer engines.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class Options:
    """Per-request model options, with Ollama's names."""

    num_predict: int = -1
    num_ctx: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Options":
        """Parse known option names, ignoring unknown ones (as Ollama does for runner-irrelevant
        options such as num_gpu); bad types raise InvalidRequest."""
        opts = cls()
        if not data:
            return opts
        if not isinstance(data, dict):
            raise InvalidRequest("options must be an object")
        for f in dataclasses.fields(cls):
            if f.name not in data or data[f.name] is None:
                continue
            value = data[f.name]
            setattr(opts, f.name, _coerce_option(f.name, value))
        if opts.seed is not None and opts.seed < 0:
            opts.seed = None  # Ollama: seed -1 means random
        return opts

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d


_INT_OPTIONS = {"num_predict", "num_ctx", "top_k", "repeat_last_n", "seed"}
_FLOAT_OPTIONS = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                  "frequency_penalty"}


def _coerce_option(name: str, value: Any) -> Any:
    if name in _INT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise InvalidRequest(f"option {name} must be an integer")
        return int(value)
    if name in _FLOAT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"option {name} must be a number")
        return float(value)
    if name == "stop":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidRequest("option stop must be a string or a list of strings")
        if len(value) > MAX_STOP_SEQUENCES:
            raise InvalidRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return [s for s in value if s]
    if name == "logit_bias":
        if not isinstance(value, dict):
            raise InvalidRequest("logit_bias must be an object of token id to bias")
        try:
            return {int(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias must map token ids to numbers") from None
    raise AssertionError(name)


@dataclass(slots=True)
class CompletionRequest:
    """The prompt's ids are `tokens` (used as given), then `prompt` tokenized. `add_special`:
    whether the tokenizer adds its special tokens (a BOS) to `prompt`; None means unless
    `tokens` are given. `return_prompt_tokens`: the final chunk carries those ids."""

    prompt: str | None = None
    tokens: list[int] | None = None
    options: Options = field(default_factory=Options)
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output: "json", a JSON schema object, or {"type": "regex", "pattern": "..."}.
    format: Any = None
    add_special: bool | None = None
    return_prompt_tokens: bool = False
    # With `format`: the grammar applies only after the output has produced this text (the
    # end of a thinking section, e.g. "</think>"); before it the output is free.
    format_after: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> "CompletionRequest":
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object")
        prompt, tokens = data.get("prompt"), data.get("tokens")
        if prompt is None and tokens is None:
            raise InvalidRequest("prompt or tokens is required")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string")
        if tokens is not None and (not isinstance(tokens, list)
                                   or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in tokens)):
            raise InvalidRequest("tokens must be a list of integers")
        top = data.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        fmt = data.get("format") or None
        if fmt is not None and not (fmt == "json" or isinstance(fmt, dict)):
            raise InvalidRequest('format must be "json" or a JSON schema object')
        add_special = data.get("add_special")
        if add_special is not None and not isinstance(add_special, bool):
            raise InvalidRequest("add_special must be a boolean")
        after = data.get("format_after") or None
        if after is not None and not isinstance(after, str):
            raise InvalidRequest("format_after must be a string")
        return cls(prompt=prompt, tokens=tokens, options=Options.from_dict(data.get("options")),
                   logprobs=bool(data.get("logprobs")) or top > 0, top_logprobs=top, format=fmt,
                   add_special=add_special,
                   return_prompt_tokens=bool(data.get("return_prompt_tokens")),
                   format_after=after)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"options": self.options.to_dict()}
        if self.prompt is not None:
            d["prompt"] = self.prompt
        if self.tokens is not None:
            d["tokens"] = self.tokens
        if self.logprobs:
            d["logprobs"] = True
            d["top_logprobs"] = self.top_logprobs
        if self.format is not None:
            d["format"] = self.format
        if self.add_special is not None:
            d["add_special"] = self.add_special
        if self.return_prompt_tokens:
            d["return_prompt_tokens"] = True
        if self.format is not None and self.format_after:
            d["format_after"] = self.format_after
        return d


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top_logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """One line of a completion stream. Counts and durations (ns) are set on the final line,
    and `prompt_tokens` (the prompt's ids) there only when the request asked for them."""

    content: str = ""
    done: bool = False
    done_reason: str | None = None  # "stop" | "length"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    prompt_eval_count: int = 0
    prompt_eval_cached_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    prompt_tokens: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"content": self.content, "done": self.done, "tokens": self.tokens}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.done:
            d.update(done_reason=self.done_reason, prompt_eval_count=self.prompt_eval_count,
                     prompt_eval_cached_count=self.prompt_eval_cached_count,
                     prompt_eval_duration=self.prompt_eval_duration,
                     eval_count=self.eval_count, eval_duration=self.eval_duration)
            if self.prompt_tokens is not None:
                d["prompt_tokens"] = self.prompt_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Chunk":
        return cls(**{k: d[k] for k in _CHUNK_FIELDS if k in d and d[k] is not None})


_CHUNK_FIELDS = tuple(f.name for f in dataclasses.fields(Chunk))


def error_body(err: MlxrError) -> dict[str, Any]:
    """The JSON body of an error answered with its HTTP status, before any streaming."""
    return {"error": err.message, "kind": err.kind}


def error_line(err: MlxrError) -> dict[str, Any]:
    """The final line of a stream that failed after streaming began."""
    return {"error": {"message": err.message, "status": err.status, "kind": err.kind}}


@dataclass(slots=True)
class RunnerStatus:
    status: str  # "loading" | "ready" | "error"
    model: str
    progress: float = 0.0
    context_length: int = 0
    memory: int = 0
    kv_bytes: int = 0
    active: int = 0
    waiting: int = 0
    error: str | None = None
    capabilities: list[str] = field(default_factory=list)
    # The library serving cblas_sgemm in the runner ("" for MLX's own) and its description:
    # a benchmark gives its peers exactly this file.
    blas_path: str = ""
    blas_config: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunnerStatus":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


MAX_EMBED_INPUTS = 2048
MAX_EMBED_INPUT_UNITS = 1 << 22  # characters of text plus token ids, over all inputs


@dataclass(slots=True)
class EmbedRequest:
    """`POST /v1/embeddings`. Each input is a text or an array of token ids (used as given:
    no special tokens are added). `truncate: false` makes an input over the model's maximum
    a 400; `dimensions` keeps the first N values and renormalizes."""

    input: list[str | list[int]] = field(default_factory=list)
    truncate: bool = True
    dimensions: int | None = None

    @classmethod
    def from_dict(cls, data: Any) -> "EmbedRequest":
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object")
        raw = data.get("input")
        if raw is None or raw == "":
            raw = []  # Ollama answers an empty input with no embeddings
        elif isinstance(raw, str) or (isinstance(raw, list) and raw and _is_token_ids(raw)):
            raw = [raw]  # one text, or one token array (OpenAI's shape)
        if not isinstance(raw, list):
            raise InvalidRequest("input must be a string, a list of strings or token arrays")
        for item in raw:
            if not (isinstance(item, str) or (isinstance(item, list) and _is_token_ids(item))):
                raise InvalidRequest("each input must be a string or an array of token ids")
        if len(raw) > MAX_EMBED_INPUTS:
            raise InvalidRequest(f"too many inputs ({len(raw)}); at most {MAX_EMBED_INPUTS}")
        if sum(len(item) for item in raw) > MAX_EMBED_INPUT_UNITS:
            raise InvalidRequest(f"input is too large (over {MAX_EMBED_INPUT_UNITS} characters "
                                 "and token ids in all)")
        truncate = data.get("truncate", True)
        truncate = True if truncate is None else truncate
        if not isinstance(truncate, bool):
            raise InvalidRequest("truncate must be a boolean")
        dims = data.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise InvalidRequest("dimensions must be a positive integer")
        return cls(input=raw, truncate=truncate, dimensions=dims)

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "truncate": self.truncate, "dimensions": self.dimensions}


def _is_token_ids(items: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


@dataclass(slots=True)
class EmbedResponse:
    # Rows of floats: lists once parsed; the runner keeps a float32 numpy array so orjson
    # writes float32's shortest digits (as Ollama does) in half the bytes and time.
    embeddings: Any
    prompt_eval_count: int = 0  # tokens over all inputs, after truncation
    total_duration: int = 0  # ns

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it would deep-copy up to millions of floats.
        return {"embeddings": self.embeddings, "prompt_eval_count": self.prompt_eval_count,
                "total_duration": self.total_duration}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmbedResponse":
        return cls(embeddings=d["embeddings"], prompt_eval_count=d.get("prompt_eval_count", 0),
                   total_duration=d.get("total_duration", 0))

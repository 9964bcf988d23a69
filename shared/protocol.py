"""Wire types between the supervisor and a runner (see docs/protocol.md).

A completion stream is zero or more `Chunk` lines, then exactly one final line: a `Chunk`
with `done: true`, or an error line (`error_line`). An error answered before streaming is an
HTTP status with `error_body`. Both name the error's class in shared/errors.py by its `kind`.
Only these types cross the process boundary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest, MlxrError, RunnerFailed

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
    # Tokens at the start of the context a context shift keeps (-1: the whole prompt).
    num_keep: int = 4
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


_INT_OPTIONS = {"num_predict", "num_ctx", "num_keep", "top_k", "repeat_last_n", "seed"}
_FLOAT_OPTIONS = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                  "frequency_penalty"}


def _coerce_option(name: str, value: Any) -> Any:
    if name in _INT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (isinstance(value, float) and not math.isfinite(value)) \
                or value != int(value):
            raise InvalidRequest(f"option {name} must be an integer")
        if not -(1 << 63) <= value < 1 << 63:
            raise InvalidRequest(f"option {name} is out of range for a 64-bit integer")
        return int(value)
    if name in _FLOAT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not _is_finite(value):
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
            bias = {int(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError, OverflowError):
            raise InvalidRequest("logit_bias must map token ids to numbers") from None
        if not all(math.isfinite(v) for v in bias.values()):
            raise InvalidRequest("logit_bias must map token ids to finite numbers")
        return bias
    raise AssertionError(name)


def _is_finite(value: int | float) -> bool:
    """Whether a number is finite and fits a float (an int past 1e308 does not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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
    # With `format_after` or `think_end`: the text that opens the thinking section, where the
    # prompt did not open it. Output that does not begin with it is not thinking: a format
    # holds from its first token, and a thinking budget never forces `think_end`.
    think_open: str | None = None
    # Ollama's `shift`: when the context fills, drop the older half after `num_keep` and go
    # on; False ends the output there (done_reason "length").
    shift: bool = True
    # At most `think_budget` output tokens before `think_end` (the end-of-thinking tag): past
    # the budget the runner writes the tag itself. Both or neither.
    think_budget: int | None = None
    think_end: str | None = None
    # Base64 images for a vision model; `prompt` carries the model's placeholder once for
    # each, in order (and `tokens` must not be given with them).
    images: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> "CompletionRequest":
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object")
        prompt, tokens = data.get("prompt"), data.get("tokens")
        if prompt is None and tokens is None:
            raise InvalidRequest("prompt or tokens is required")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string")
        if tokens is not None and (not isinstance(tokens, list) or not _is_token_ids(tokens)):
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
        opening = data.get("think_open") or None
        if opening is not None and not isinstance(opening, str):
            raise InvalidRequest("think_open must be a string")
        shift = data.get("shift", True)
        if not isinstance(shift, bool):
            raise InvalidRequest("shift must be a boolean")
        budget, end = data.get("think_budget"), data.get("think_end")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise InvalidRequest("think_budget must be a non-negative integer")
        if (budget is None) != (end is None) or (end is not None and
                                                 (not isinstance(end, str) or not end)):
            raise InvalidRequest("think_budget and think_end (a string) go together")
        images = data.get("images") or []
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise InvalidRequest("images must be a list of base64 strings")
        if images and (tokens is not None or not prompt):
            raise InvalidRequest("images need a prompt, and no tokens")
        return cls(images=images, prompt=prompt, tokens=tokens, options=Options.from_dict(data.get("options")),
                   logprobs=bool(data.get("logprobs")) or top > 0, top_logprobs=top, format=fmt,
                   add_special=add_special,
                   return_prompt_tokens=bool(data.get("return_prompt_tokens")),
                   format_after=after, think_open=opening if after or end else None,
                   shift=shift, think_budget=budget, think_end=end)

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
        if not self.shift:
            d["shift"] = False
        if self.think_budget is not None and self.think_end:
            d["think_budget"], d["think_end"] = self.think_budget, self.think_end
        if self.think_open and ("format_after" in d or "think_end" in d):
            d["think_open"] = self.think_open
        if self.images:
            d["images"] = self.images
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
    def from_dict(cls, d: Any) -> "Chunk":
        return cls(**_read_fields(cls, d, "stream line"))


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
    kv_live_bytes: int = 0  # of kv_bytes, what sequences in flight use (not the cached)
    # The KV block pool (runner/kv/pool.py): positions per block, blocks in all, blocks in
    # use (by running sequences or kept for prefix reuse), and of those the cached ones that
    # nothing running reads (freed first when room is needed).
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    # Bytes of keys and values one block holds over every layer (this runner's own shard):
    # with kv_blocks_total, the pool's full size, which the supervisor charges the runner for.
    kv_block_bytes: int = 0
    prefix_hit_rate: float = 0.0  # prompt positions served from the cache, over all admitted
    preemptions: int = 0  # sequences requeued (to recompute) for want of blocks
    active: int = 0
    waiting: int = 0
    error: str | None = None
    # The kind (shared/errors.py) of the error that failed the load, when it has one: a bad
    # model file is `invalid_model_file`, which the supervisor answers as a 400.
    error_kind: str | None = None
    capabilities: list[str] = field(default_factory=list)
    # The library serving cblas_sgemm in the runner ("" for MLX's own) and its description:
    # a benchmark gives its peers exactly this file.
    blas_path: str = ""
    blas_config: str = ""
    # A distributed runner's split ("tensor" or "pipeline") and its number of ranks.
    sharding: str = ""
    ranks: int = 1
    # What the weights are held as: how they were stored ("bfloat16", "4-bit", ...), or
    # "float32 from <stored>" where the runner widened them on the CPU (runner/weights.py).
    weights: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "RunnerStatus":
        return cls(**_read_fields(cls, d, "status"))


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
        if dims is not None and (not _is_int(dims) or dims < 1):
            raise InvalidRequest("dimensions must be a positive integer")
        return cls(input=raw, truncate=truncate, dimensions=dims)

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "truncate": self.truncate, "dimensions": self.dimensions}


def _is_token_ids(items: list[Any]) -> bool:
    """Integers that fit 64 bits (what the wire's JSON writer takes); which ids a model has
    is the runner's to check."""
    return all(isinstance(t, int) and not isinstance(t, bool) and -(1 << 63) <= t < 1 << 63
               for t in items)


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
    def from_dict(cls, d: Any) -> "EmbedResponse":
        fields = _read_fields(cls, d, "embeddings reply")
        rows = fields.get("embeddings")
        if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
            raise RunnerFailed("runner sent an embeddings reply without rows of numbers")
        return cls(**fields)


# -- reading what a runner sent ----------------------------------------------------------------
# Only a runner writes Chunk, RunnerStatus and EmbedResponse, so one that is not what its type
# says is a runner's bug: a RunnerFailed (500) naming the field, never a TypeError later.

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63


def _is_logprobs(value: Any) -> bool:
    def entry(e: Any) -> bool:
        return isinstance(e, dict) and isinstance(e.get("token"), str)
    return isinstance(value, list) and all(
        entry(e) and isinstance(e.get("top_logprobs", []), list)
        and all(entry(t) for t in e.get("top_logprobs", [])) for e in value)


_WIRE_TYPES: dict[str, Any] = {
    "str": lambda v: isinstance(v, str), "str | None": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool), "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "list[int]": lambda v: isinstance(v, list) and _is_token_ids(v),
    "list[int] | None": lambda v: isinstance(v, list) and _is_token_ids(v),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "list[dict[str, Any]] | None": _is_logprobs,
}


def _read_fields(cls: type, d: Any, what: str) -> dict[str, Any]:
    """The fields of the dataclass `cls` found in `d`, each checked against its declared type
    (a null is an absent field); a required one missing, or any of the wrong type, is a
    RunnerFailed."""
    if not isinstance(d, dict):
        raise RunnerFailed(f"runner sent a {what} that is not an object")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = d.get(f.name)
        if value is None:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RunnerFailed(f"runner sent a {what} without {f.name}")
            continue
        if not _WIRE_TYPES.get(str(f.type), lambda v: True)(value):
            raise RunnerFailed(f"runner sent a {what} with a bad {f.name}: {value!r:.80}")
        out[f.name] = value
    return out

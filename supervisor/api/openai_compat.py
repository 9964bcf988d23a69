"""OpenAI's request and response shapes, translated to and from the service's types.

Defaults follow Ollama's OpenAI compatibility layer: temperature and top_p default to 1.0,
`max_tokens` unset means no limit, `n` choices run concurrently in the runner's batch (a given
`seed` becomes seed + choice index, so choices differ but stay reproducible).
"""

from __future__ import annotations

import base64
import json
import secrets
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.inference.service import ChatRequest, Delta, EmbedCall, Final, GenerateRequest
from mlxr.supervisor.inference.tool_calls import ForcedCall

MAX_CHOICES = 16
MAX_PROMPTS = 64
FINISH = {"stop": "stop", "length": "length"}


def _param(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise InvalidRequest(f"'{key}' has the wrong type", param=key)
    return value


@dataclass(slots=True)
class Common:
    """What chat and legacy completions share."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    options: dict[str, Any]
    logprobs: bool = False
    top_logprobs: int = 0
    format: Any = None
    force_call: ForcedCall | None = None  # chat only: tool_choice "required" or a function
    extra: dict[str, Any] = field(default_factory=dict)


def parse_common(body: dict[str, Any], chat: bool) -> Common:
    model = _param(body, "model", (str,))
    if not model:
        raise InvalidRequest("you must provide a model parameter", param="model")
    n = _param(body, "n", (int,), 1)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}", param="n")
    options: dict[str, Any] = {
        "temperature": _param(body, "temperature", (int, float), 1.0),
        "top_p": _param(body, "top_p", (int, float), 1.0),
    }
    if not 0 <= options["temperature"] <= 2:
        raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    max_tokens = _param(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _param(body, "max_tokens", (int,))
    if max_tokens is not None:
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        options["num_predict"] = max_tokens
    for key in ("presence_penalty", "frequency_penalty"):
        value = _param(body, key, (int, float))
        if value is not None:
            if not -2 <= value <= 2:
                raise InvalidRequest(f"{key} must be between -2 and 2", param=key)
            options[key] = value
    for key, kinds in (("seed", (int,)), ("top_k", (int,)), ("min_p", (int, float))):
        value = _param(body, key, kinds)
        if value is not None:
            options[key] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop must be a string or a list of strings", param="stop")
        options["stop"] = stop
    bias = _param(body, "logit_bias", (dict,))
    if bias:
        options["logit_bias"] = bias
    stream = bool(_param(body, "stream", (bool,), False))
    stream_options = _param(body, "stream_options", (dict,), {}) or {}
    if chat:
        logprobs = bool(_param(body, "logprobs", (bool,), False))
        top = _param(body, "top_logprobs", (int,), 0)
    else:  # legacy completions: logprobs is the number of alternatives
        top = _param(body, "logprobs", (int,), None)
        logprobs, top = top is not None, top or 0
    if not 0 <= top <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    return Common(model, n, stream, bool(stream_options.get("include_usage")), options,
                  logprobs or top > 0, top, parse_response_format(body))


def parse_response_format(body: dict[str, Any]) -> Any:
    """`response_format` as the service's `format`; without one, Ollama's own `format` field
    is taken as is (an extension, handy on /v1/completions). The service checks its type."""
    fmt = body.get("response_format")
    if fmt is None:
        return body.get("format")
    if body.get("format") is not None:
        raise InvalidRequest("give response_format or format, not both", param="response_format")
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type",
                             param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequest("response_format.json_schema.schema must be an object",
                                 param="response_format")
        # `strict` needs no handling: the runner's grammar always holds the output to the
        # whole schema, and refuses (400) a schema it could not enforce.
        if not isinstance(spec.get("strict"), (bool, type(None))):
            raise InvalidRequest("response_format.json_schema.strict must be a boolean",
                                 param="response_format")
        return spec["schema"]
    raise InvalidRequest(f"unknown response_format type {kind!r}", param="response_format")


def choice_options(common: Common, index: int) -> dict[str, Any]:
    options = dict(common.options)
    if index and "seed" in options:
        options["seed"] = options["seed"] + index
    return options


# -- chat -------------------------------------------------------------------------------------

def parse_chat(body: dict[str, Any]) -> tuple[Common, list[dict[str, Any]], list[dict[str, Any]]]:
    common = parse_common(body, chat=True)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    tools = _param(body, "tools", (list,), []) or []
    choice = body.get("tool_choice")
    if choice == "none":
        tools = []
    else:
        common.force_call = parse_tool_choice(choice, tools)
    return common, [message_to_ollama(m) for m in raw], tools


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ForcedCall | None:
    """None for "auto" (the model decides); a `ForcedCall` for "required" or a named function.
    Whether the name is one of `tools` is checked where the call's schema is built."""
    if choice in (None, "auto"):
        return None
    if choice == "required":
        forced = ForcedCall()
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        forced = ForcedCall(choice["function"]["name"])
    else:
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             '{"type": "function", "function": {"name": ...}}',
                             param="tool_choice")
    if not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    return forced


def message_to_ollama(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                         "assistant", "tool"):
        raise InvalidRequest("each message needs a role: system, user, assistant or tool",
                             param="messages")
    out: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
    content = m.get("content")
    if isinstance(content, list):
        texts, images = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind == "image_url":
                images.append(_image_data(part.get("image_url")))
            else:
                raise InvalidRequest(f"unsupported content part {kind!r}", param="messages")
        out["content"] = "\n".join(texts)
        if images:
            out["images"] = images
    elif content is None or isinstance(content, str):
        out["content"] = content or ""
    else:
        raise InvalidRequest("message content must be a string or a list of parts",
                             param="messages")
    if m.get("tool_calls"):
        out["tool_calls"] = [_tool_call_to_ollama(c) for c in m["tool_calls"]]
    if m["role"] == "tool" and m.get("name"):
        out["tool_name"] = m["name"]
    reasoning = m.get("reasoning") or m.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out["thinking"] = reasoning
    return out


def _image_data(value: Any) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise InvalidRequest("image_url must have a url", param="messages")
    return url.split(",", 1)[1] if url.startswith("data:") and "," in url else url


def _tool_call_to_ollama(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("tool_calls need a function with a name", param="messages")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidRequest("tool call arguments must be JSON", param="messages") from None
    return {"function": {"name": fn["name"], "arguments": args}}


def chat_request(common: Common, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 index: int) -> ChatRequest:
    return ChatRequest(model=common.model, messages=messages, tools=tools, format=common.format,
                       options=choice_options(common, index), logprobs=common.logprobs,
                       top_logprobs=common.top_logprobs, force_call=common.force_call)


def tool_calls_to_openai(calls: list[dict[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    return [{"index": start + i, "id": c.get("id") or f"call_{secrets.token_hex(6)}",
             "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"].get("arguments", {}))}}
            for i, c in enumerate(calls)]


def logprobs_to_openai(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for e in entries or []:
        out.append({"token": e["token"], "logprob": e["logprob"],
                    "bytes": list(e["token"].encode()),
                    "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                      "bytes": list(t["token"].encode())}
                                     for t in e.get("top_logprobs", [])]})
    return out


def finish_reason(final: Final, saw_tool_calls: bool) -> str:
    if saw_tool_calls:
        return "tool_calls"
    return FINISH.get(final.done_reason, "stop")


def usage(finals: list[Final]) -> dict[str, Any]:
    prompt = finals[0].prompt_eval_count if finals else 0
    completion = sum(f.eval_count for f in finals)
    cached = finals[0].prompt_eval_cached_count if finals else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def envelope(kind: str, ident: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"id": ident, "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": "fp_mlxr", **fields}


def chat_delta(delta: Delta, tool_index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.content:
        out["content"] = delta.content
    if delta.thinking:
        out["reasoning"] = delta.thinking
    if delta.tool_calls:
        out["tool_calls"] = tool_calls_to_openai(delta.tool_calls, tool_index)
    return out


# -- legacy completions ------------------------------------------------------------------------

def parse_completion(body: dict[str, Any]) -> tuple[Common, list[str], str]:
    common = parse_common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequest("prompt must be a string or a non-empty list of strings",
                             param="prompt")
    if len(prompts) * common.n > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts x n per request", param="prompt")
    suffix = _param(body, "suffix", (str,), "") or ""
    return common, prompts, suffix


def generate_request(common: Common, prompt: str, suffix: str, index: int) -> GenerateRequest:
    return GenerateRequest(model=common.model, prompt=prompt, suffix=suffix, raw=not suffix,
                           format=common.format, options=choice_options(common, index),
                           logprobs=common.logprobs, top_logprobs=common.top_logprobs)


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not entries:
        return None
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])}
                             for e in entries],
            "text_offset": []}


# -- embeddings ----------------------------------------------------------------------------

def parse_embeddings(body: dict[str, Any]) -> tuple[EmbedCall, str]:
    model = _param(body, "model", (str,))
    if not model:
        raise InvalidRequest("you must provide a model parameter", param="model")
    raw = body.get("input")
    if raw is None or raw == [] or raw == "":
        raise InvalidRequest("input must not be empty", param="input")
    encoding = _param(body, "encoding_format", (str,), "float")
    if encoding not in ("float", "base64"):
        raise InvalidRequest("encoding_format must be float or base64", param="encoding_format")
    dims = _param(body, "dimensions", (int,))
    return EmbedCall(model=model, input=raw, dimensions=dims), encoding


def encode_embedding(vector: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64 form is the little-endian float32 bytes of the vector."""
    if encoding == "float":
        return vector
    data = array("f", vector)
    if sys.byteorder == "big":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode()

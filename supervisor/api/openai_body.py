"""Validation of OpenAI's /v1 request bodies (chat completions, completions, embeddings):
each field checked and turned into the service's types before anything runs; a bad field is
an `InvalidRequest` (400) that names its `param`. The checks several APIs share are body.py's.

OpenAI defaults follow Ollama's compatibility layer: temperature and top_p default to 1.0, an
unset `max_tokens` means no limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.api.body import (MAX_CHOICES, MAX_PROMPTS, check_top_logprobs, json_text,
                                      reasoning_effort_field)
from mlxr.supervisor.inference.tool_calls import ForcedCall
from mlxr.supervisor.inference.types import EmbedCall

def _param(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise InvalidRequest(f"'{key}' has the wrong type", param=key)
    return value


@dataclass(slots=True)
class OpenAICommon:
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
    think: bool | str | None = None  # chat only: from reasoning_effort (see REASONING_EFFORTS)


def parse_openai_common(body: dict[str, Any], chat: bool) -> OpenAICommon:
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
    top = check_top_logprobs(top, param="top_logprobs")
    return OpenAICommon(model, n, stream, bool(stream_options.get("include_usage")), options,
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


def parse_openai_chat(body: dict[str, Any]
                      ) -> tuple[OpenAICommon, list[dict[str, Any]], list[dict[str, Any]]]:
    """The common fields, the messages in Ollama's shape, and the tools."""
    common = parse_openai_common(body, chat=True)
    common.think = reasoning_effort_field(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    tools = _param(body, "tools", (list,), []) or []
    choice = body.get("tool_choice")
    if choice == "none":
        tools = []
    else:
        common.force_call = parse_tool_choice(choice, tools)
    messages = [message_to_ollama(m) for m in raw]
    for m in messages:  # a tool result names its call by id: find the call's function name
        if m["role"] == "tool" and not m.get("tool_name") and m.get("tool_call_id"):
            m["tool_name"] = _tool_name_for(messages, m["tool_call_id"])
    return common, messages, tools


def _tool_name_for(messages: list[dict[str, Any]], call_id: str) -> str:
    """The function name of the call with this id; the last one wins, as in Ollama."""
    for m in reversed(messages):
        for call in m.get("tool_calls") or []:
            if call.get("id") == call_id:
                return call["function"]["name"]
    return ""


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
    role = m.get("role") if isinstance(m, dict) else None
    role = role.lower() if isinstance(role, str) else role
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise InvalidRequest("each message needs a role: system, user, assistant or tool",
                             param="messages")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
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
        if not isinstance(m["tool_calls"], list):
            raise InvalidRequest("tool_calls must be a list", param="messages")
        out["tool_calls"] = [_tool_call_to_ollama(c) for c in m["tool_calls"]]
    if role == "tool" and isinstance(m.get("name"), str) and m["name"]:
        out["tool_name"] = m["name"]
    if isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]:
        out["tool_call_id"] = m["tool_call_id"]
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
        args = json_text(args, "tool call arguments", "messages") if args.strip() else {}
    if not isinstance(args, dict):  # Ollama's arguments are a map
        raise InvalidRequest("tool call arguments must be a JSON object", param="messages")
    out: dict[str, Any] = {"function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str) and call["id"]:
        out["id"] = call["id"]
    return out


def parse_openai_completion(body: dict[str, Any]) -> tuple[OpenAICommon, list[str], str]:
    """The common fields, the prompts and the suffix of a legacy completion."""
    common = parse_openai_common(body, chat=False)
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


def parse_openai_embeddings(body: dict[str, Any]) -> tuple[EmbedCall, str]:
    """The call and the `encoding_format` (float or base64)."""
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

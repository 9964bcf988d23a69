"""Request validation: a body read as JSON, then each route's fields checked and turned
into the service's types before anything runs. A bad field is an `InvalidRequest` (400); on the
OpenAI routes it names its `param`.

Each rule has one implementation here. Two kinds of check live elsewhere: those that need the
model (capabilities, `think`, `format`), in inference/prepare.py, run where Ollama runs them;
option values are `Options.from_dict`'s (shared/protocol.py), which the runner uses too.
OpenAI's /v1 bodies are openai_body.py's; Anthropic's and the Responses API's are in their
own modules, on top of the shared checks here.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web

from mlxr.shared.config import parse_duration
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import MAX_TOP_LOGPROBS
from mlxr.supervisor.inference.types import ChatRequest, EmbedCall, GenerateRequest

MAX_CHOICES = 16
MAX_PROMPTS = 64


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object. An empty body is Ollama's 400 `missing request body`;
    bad JSON is a 400 too: not UTF-8, a lone surrogate, NaN or Infinity (none of them JSON,
    and Go refuses them too), or nesting deeper than `MAX_JSON_DEPTH`. An integer past 64 bits
    is read as a float, as Go reads a number into an untyped value."""
    raw = await request.read()
    if not raw.strip():
        raise InvalidRequest("missing request body")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_depth(data, raw)
    return data


# Deeper bodies are refused, so that what is accepted can be walked, validated, rendered and
# written again (orjson writes at most 254 levels; Python's json and templates recurse).
MAX_JSON_DEPTH = 64
_CONTAINERS = frozenset((dict, list))


def check_depth(data: Any, raw: bytes = b"") -> None:
    """A 400 when `data` nests deeper than MAX_JSON_DEPTH (the top object is level 1). Walks
    level by level, skipping lists of scalars at C speed: cheap next to reading the body."""
    if raw and raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return  # it cannot nest deeper than it has brackets
    level, depth = [data] if type(data) in _CONTAINERS else [], 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        below = []
        for container in level:
            items = container.values() if type(container) is dict else container
            if not _CONTAINERS.isdisjoint(map(type, items)):
                below.extend(v for v in items if type(v) in _CONTAINERS)
        level, depth = below, depth + 1


def json_text(text: str, what: str, param: str | None = None) -> Any:
    """JSON held in a string field (a tool call's `arguments`), read as a body is: a 400
    when it is not JSON or nests too deep."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise InvalidRequest(f"{what} must be JSON", param=param) from None
    check_depth(value)
    return value


# -- fields several routes share ---------------------------------------------------------------

def str_field(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"{key} must be a string")
    return value


def list_field(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"{key} must be a list")
    return value


def bool_field(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be true or false")
    return value


def keep_alive_field(body: dict[str, Any]) -> float | None:
    value = body.get("keep_alive")
    return None if value is None else parse_duration(value)


def options_field(body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `options` object (its values are checked by `Options.from_dict`)."""
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("options must be an object")
    return options or {}


def check_top_logprobs(top: Any, param: str | None = None) -> int:
    if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
                             param=param)
    return top


def stream_wanted(body: dict[str, Any]) -> bool:
    """Ollama's `stream`: true unless given and false; any other type is a 400."""
    return bool_field(body, "stream", True)


THINK_LEVELS = ("high", "medium", "low", "max")


def think_field(value: Any) -> bool | str | None:
    """Ollama's `think` (api.ThinkValue): true, false, a level (high, medium, low, max) or
    unset. Anything else is a 400 in Ollama's words."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value not in THINK_LEVELS:
            raise InvalidRequest(f'invalid think value: {json.dumps(value)} (must be "high", '
                                 '"medium", "low", "max", true, or false)')
        return value
    raise InvalidRequest('think must be a boolean or string ("high", "medium", "low", "max", '
                         'true, or false)')


# OpenAI's reasoning efforts as Ollama's think values (openai.thinkFromReasoningEffort): the
# tiers past Ollama's ends are clamped to its nearest, "none" turns thinking off.
REASONING_EFFORTS: dict[str, bool | str] = {
    "none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
    "max": "max", "xhigh": "max", "ultra": "max"}


def reasoning_effort_field(body: dict[str, Any]) -> bool | str | None:
    """`reasoning: {effort}` (preferred, as Ollama) or `reasoning_effort` as a think value;
    None (the model's default) when neither is given or the effort is ""."""
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        effort = reasoning.get("effort")
    else:
        effort = body.get("reasoning_effort")
    if effort is None or effort == "":
        return None
    if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"invalid reasoning value: {json.dumps(effort)} (must be "
                             '"minimal", "low", "medium", "high", "xhigh", "ultra", "max", '
                             'or "none")', param="reasoning_effort")
    return REASONING_EFFORTS[effort]


# -- Ollama's /api routes ----------------------------------------------------------------------

def _common(body: dict[str, Any]) -> dict[str, Any]:
    top = check_top_logprobs(body.get("top_logprobs") or 0)
    options = options_field(body)
    stream_wanted(body)  # type-checked here, before anything runs
    return dict(model=str_field(body, "model"), shift=bool_field(body, "shift", True), think=think_field(body.get("think")),
                format=body.get("format"), options=options,
                keep_alive_s=keep_alive_field(body), logprobs=bool_field(body, "logprobs", False),
                top_logprobs=top)


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    context = body.get("context")
    if context is not None and (not isinstance(context, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63
            for t in context)):
        raise InvalidRequest("context must be a list of token ids")
    return GenerateRequest(prompt=str_field(body, "prompt"), suffix=str_field(body, "suffix"),
                           system=str_field(body, "system") or None,
                           template=str_field(body, "template") or None,
                           raw=bool(body.get("raw")), context=context,
                           images=list_field(body, "images"), **_common(body))


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages = list_field(body, "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest("each message must be an object with a role")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise InvalidRequest("message content must be a string")
        if m["role"] != m["role"].lower():  # Ollama lower-cases roles ("USER" is a user turn)
            messages[i] = {**m, "role": m["role"].lower()}
        _check_message_fields(messages, i)
    tools = list_field(body, "tools")
    if not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("tools must be a list of objects")
    return ChatRequest(messages=messages, tools=tools, truncate=bool_field(body, "truncate", True),
                       **_common(body))


def _check_message_fields(messages: list[Any], i: int) -> None:
    """The rest of api.Message's fields have its types (Go's decoder refuses others): text
    fields are strings, `images` a list of strings, and each of `tool_calls` a function
    with a name and an object of arguments (an absent one is {}, as Go reads it)."""
    m = messages[i]
    for key in ("thinking", "tool_name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise InvalidRequest(f"message {key} must be a string")
    images = m.get("images")
    if images is not None and (not isinstance(images, list)
                               or not all(isinstance(x, str) for x in images)):
        raise InvalidRequest("message images must be a list of base64 strings")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidRequest("message tool_calls must be a list")
    checked = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest("each tool call needs a function with a name")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, dict):
            raise InvalidRequest("tool call arguments must be an object")
        checked.append({**call, "function": {**fn, "arguments": args or {}}})
    messages[i] = {**m, "tool_calls": checked}


def parse_embed(body: dict[str, Any]) -> EmbedCall:
    return EmbedCall(model=str_field(body, "model"), input=body.get("input"),
                     truncate=body.get("truncate", True), dimensions=body.get("dimensions"),
                     options=options_field(body), keep_alive_s=keep_alive_field(body))


def parse_embeddings_legacy(body: dict[str, Any]) -> EmbedCall:
    """The older /api/embeddings: one `prompt` (the call's `input`, a string)."""
    prompt = str_field(body, "prompt")
    return EmbedCall(model=str_field(body, "model"), input=prompt, options=options_field(body),
                     keep_alive_s=keep_alive_field(body))


# -- the store's /api routes -------------------------------------------------------------------

def model_field(body: dict[str, Any]) -> str:
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("model is required")
    return name


def parse_copy(body: dict[str, Any]) -> tuple[str, str]:
    source, destination = body.get("source"), body.get("destination")
    if not isinstance(source, str) or not source:
        raise InvalidRequest("source is required")
    if not isinstance(destination, str) or not destination:
        raise InvalidRequest("destination is required")
    return source, destination

"""OpenAI's Responses API (`POST /v1/responses`) as Ollama serves it: a request is translated
into the service's `ChatRequest` (the same inference path as /api/chat and
/v1/chat/completions), and the completion's events are turned into Responses output items by
responses_events.py.

Invariants:
- Every check on the body happens in `parse_responses`, before the service is called: a bad
  field is an `InvalidRequest` (400) naming its `param` (dotted for nested fields, as
  "reasoning.effort"); the middleware renders it as OpenAI's error object.
- Nothing is stored: `previous_response_id`, `conversation` and `background: true` are refused
  (400), as Ollama does not implement them; the whole conversation goes in `input`.
- Input items become Ollama-shaped messages in order. A `function_call` joins the assistant
  message before it (or starts one); a `function_call_output` is a `tool` message carrying the
  call's id and, when the call is in the input, its name; a `reasoning` item's text becomes
  the `thinking` of the next assistant message (Ollama's rule).
- Defaults follow Ollama's layer: temperature 1.0, top_p only when given, no output limit.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.api.body import json_text, read_json
from mlxr.supervisor.api.keys import SERVICE
from mlxr.supervisor.api.responses_events import ResponseBuilder, write_stream
from mlxr.supervisor.inference.tool_calls import ForcedCall
from mlxr.supervisor.inference.types import ChatRequest

# Ollama's `thinkFromReasoningEffort`: an effort is a think level; "none" turns thinking off.
EFFORTS: dict[str, bool | str] = {"none": False, "minimal": "low", "low": "low",
                                  "medium": "medium", "high": "high", "max": "max",
                                  "xhigh": "max", "ultra": "max"}
IMAGE_PREFIXES = ("data:;base64,",) + tuple(f"data:image/{t};base64,"
                                            for t in ("jpeg", "jpg", "png", "webp"))
UNSUPPORTED = {"previous_response_id": "previous_response_id is not supported: responses are "
                                       "not stored, send the whole conversation in input",
               "conversation": "conversation is not supported: responses are not stored, "
                               "send the whole conversation in input"}


@dataclass(slots=True)
class ResponsesCall:
    """A parsed request: what the service runs, and what the response object echoes."""

    chat: ChatRequest
    stream: bool
    echo: dict[str, Any] = field(default_factory=dict)


# -- fields ------------------------------------------------------------------------------------

def _typed(value: Any, kinds: tuple[type, ...], param: str, what: str) -> Any:
    if value is not None and (isinstance(value, bool) and bool not in kinds
                              or not isinstance(value, kinds)):
        raise InvalidRequest(f"{param} must be {what}", param=param)
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = _typed(body.get(key), (int, float), key, "a number")
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{key} must be between {low:g} and {high:g}", param=key)
    return value


def parse_responses(body: dict[str, Any]) -> ResponsesCall:
    """The whole request checked and translated; raises InvalidRequest on any bad field."""
    model = _typed(body.get("model"), (str,), "model", "a string")
    if not model:
        raise InvalidRequest("you must provide a model parameter", param="model")
    for key, message in UNSUPPORTED.items():
        if body.get(key) is not None:
            raise InvalidRequest(message, param=key)
    if _typed(body.get("background"), (bool,), "background", "true or false"):
        raise InvalidRequest("background responses are not supported", param="background")
    instructions = _typed(body.get("instructions"), (str,), "instructions", "a string") or ""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += input_messages(body.get("input"))

    options: dict[str, Any] = {"temperature": _number(body, "temperature", 0, 2)}
    if options["temperature"] is None:
        options["temperature"] = 1.0
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None:
        options["top_p"] = top_p
    limit = _typed(body.get("max_output_tokens"), (int,), "max_output_tokens", "an integer")
    if limit is not None:
        if limit < 1:
            raise InvalidRequest("max_output_tokens must be at least 1", param="max_output_tokens")
        options["num_predict"] = limit

    tools = [t for raw in _list(body, "tools") for t in tool_to_ollama(raw)]
    choice = body.get("tool_choice")
    force = parse_tool_choice(choice, tools)
    if choice == "none":
        tools = []
    reasoning = _typed(body.get("reasoning"), (dict,), "reasoning", "an object") or {}
    text = _typed(body.get("text"), (dict,), "text", "an object") or {}
    fmt, echo_format = text_format(text.get("format"))
    chat = ChatRequest(model=model, messages=messages, tools=tools,
                       think=think_from_effort(reasoning.get("effort")), format=fmt,
                       options=options, force_call=force)
    stream = bool(_typed(body.get("stream"), (bool,), "stream", "true or false"))
    echo = {"instructions": instructions or None, "tools": body.get("tools") or [],
            "tool_choice": choice if choice is not None else "auto",
            "text": {"format": echo_format},
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}
            if reasoning else None,
            "temperature": options["temperature"], "top_p": 1.0 if top_p is None else top_p,
            "max_output_tokens": limit,
            "truncation": body.get("truncation") if isinstance(body.get("truncation"), str)
            else "disabled",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {}}
    return ResponsesCall(chat, stream, echo)


def _list(body: dict[str, Any], key: str) -> list[Any]:
    return _typed(body.get(key), (list,), key, "a list") or []


def think_from_effort(effort: Any) -> bool | str | None:
    """`reasoning.effort` as the service's `think` (None: the model's default)."""
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise InvalidRequest(f"invalid reasoning effort {effort!r}: must be one of "
                             + ", ".join(EFFORTS), param="reasoning.effort")
    return EFFORTS[effort]


def text_format(fmt: Any) -> tuple[Any, dict[str, Any]]:
    """`text.format` as the service's `format`, and the format the response echoes."""
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest("text.format must be an object with a type", param="text.format")
    kind = fmt["type"]
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return "json", {"type": "json_object"}
    if kind != "json_schema":
        raise InvalidRequest(f"unknown text.format type {kind!r}", param="text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("text.format.schema must be an object", param="text.format.schema")
    _typed(fmt.get("name"), (str,), "text.format.name", "a string")
    # `strict` needs nothing more: the runner's grammar always holds output to the whole
    # schema and refuses (400) a schema it cannot enforce.
    _typed(fmt.get("strict"), (bool,), "text.format.strict", "true or false")
    echo = {k: fmt[k] for k in ("type", "name", "schema", "strict", "description") if k in fmt}
    return fmt["schema"], echo


# -- tools -------------------------------------------------------------------------------------

def tool_to_ollama(tool: Any, prefix: str = "") -> list[dict[str, Any]]:
    """A Responses tool as Ollama tools: a function, or a namespace's functions named
    "namespace.function" (as Ollama expands them)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    name = tool.get("name") if isinstance(tool, dict) else None
    if kind == "namespace" and isinstance(name, str) and isinstance(tool.get("tools"), list):
        return [t for member in tool["tools"] for t in tool_to_ollama(member, f"{prefix}{name}.")]
    if kind != "function":
        raise InvalidRequest(f"tool type {kind!r} is not supported: only function tools "
                             "(and namespaces of them)", param="tools")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("each function tool needs a name", param="tools")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(f"the parameters of {name!r} must be a JSON schema object",
                             param="tools")
    description = _typed(tool.get("description"), (str,), "tools", "a list of tools") or ""
    function: dict[str, Any] = {"name": prefix + name, "description": description}
    if params is not None:
        function["parameters"] = params
    return [{"type": "function", "function": function}]


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ForcedCall | None:
    """None for "auto" or "none"; a `ForcedCall` for "required" or {"type": "function",
    "name": ...}. Whether the name is one of the tools is checked when the call's schema is
    built (inference/tool_calls.py: forced_call_schema)."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        forced = ForcedCall()
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("name"), str)):
        forced = ForcedCall(choice["name"])
    else:
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             '{"type": "function", "name": ...}', param="tool_choice")
    if not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    return forced


# -- input -------------------------------------------------------------------------------------

def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items) as Ollama-shaped messages."""
    if isinstance(raw, str):
        if not raw:
            raise InvalidRequest("input must not be empty", param="input")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("input must be a string or a non-empty list of items",
                             param="input")
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for tool messages
    thinking = ""  # a reasoning item's text, waiting for the assistant message it belongs to
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        last = messages[-1] if messages else None
        if kind == "reasoning":
            thinking = reasoning_text(item)
        elif kind == "message":
            msg = message_to_ollama(item, i)
            if msg["role"] == "assistant" and thinking:
                msg["thinking"], thinking = thinking, ""
            following = raw[i + 1] if i + 1 < len(raw) else None
            if (msg["role"] == "assistant" and last is not None and _answers(following, last)):
                # A replayed message between a call and its output stays in the call's
                # message, so the tool result still follows the call it answers.
                last["content"] = "\n".join(t for t in (last["content"], msg["content"]) if t)
                last.setdefault("images", []).extend(msg.get("images", []))
                if not last["images"]:
                    del last["images"]
                continue
            messages.append(msg)
        elif kind == "function_call":
            call = function_call_to_ollama(item, i)
            names[call["id"]] = call["function"]["name"]
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if thinking:
                last["thinking"], thinking = thinking, ""
        elif kind == "function_call_output":
            messages.append(tool_message(item, i, names))
        elif kind == "web_search_call":
            continue  # history of a built-in tool: the message after it carries the result
        else:
            raise InvalidRequest(f"input[{i}]: unknown input item type {kind!r}" if kind
                                 else f"input[{i}] needs a type", param="input")
    if thinking:
        messages.append({"role": "assistant", "content": "", "thinking": thinking})
    return messages


def _answers(item: Any, message: dict[str, Any]) -> bool:
    """Whether `item` is the output of one of `message`'s tool calls."""
    return (isinstance(item, dict) and item.get("type") == "function_call_output"
            and any(c.get("id") == item.get("call_id") for c in message.get("tool_calls", [])))


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: Ollama writes it to `encrypted_content` in plain text; else
    its content or summary parts."""
    if isinstance(item.get("encrypted_content"), str) and item["encrypted_content"]:
        return item["encrypted_content"]
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts
                           if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def message_to_ollama(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"input[{i}]: role must be user, system, developer or assistant",
                             param="input")
    text, images = content_to_ollama(item.get("content"), i)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    if images:
        out["images"] = images
    return out


def content_to_ollama(content: Any, i: int) -> tuple[str, list[str]]:
    """A string, or parts (input_text, output_text, input_image), as text and base64 images.
    Texts are joined as they are, as Ollama joins them."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{i}]: content must be a string or a list of parts",
                             param="input")
    texts, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            value = part.get("text", part.get("refusal"))
            texts.append(_typed(value, (str,), "input", "text") or "")
        elif kind == "input_image":
            images.append(image_data(part.get("image_url"), i))
        elif kind == "input_file":
            raise InvalidRequest("file inputs are not supported", param="input")
        else:
            raise InvalidRequest(f"input[{i}]: unknown content type {kind!r}", param="input")
    return "".join(texts), images


def image_data(url: Any, i: int) -> str:
    """An input_image's data URL as base64; an http(s) URL as it is."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"input[{i}]: input_image needs an image_url (file_id is not "
                             "supported)", param="input")
    if url.startswith(("http://", "https://")):
        return url  # fetched or refused with the request's other images (inference/images.py)
    prefix = next((p for p in IMAGE_PREFIXES if url.startswith(p)), None)
    data = url[len(prefix):] if prefix else ""
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        data = ""
    if not data:
        raise InvalidRequest(f"input[{i}]: invalid image input", param="input")
    return data


def function_call_to_ollama(item: dict[str, Any], i: int) -> dict[str, Any]:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise InvalidRequest(f"input[{i}]: a function_call needs a call_id and a name",
                             param="input")
    args = item.get("arguments") or "{}"
    what = f"input[{i}]: function_call arguments"
    parsed = json_text(args, what, "input") if isinstance(args, str) else None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"input[{i}]: function_call arguments must be a JSON object",
                             param="input")
    return {"id": call_id, "function": {"name": name, "arguments": parsed}}


def tool_message(item: dict[str, Any], i: int, names: dict[str, str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise InvalidRequest(f"input[{i}]: a function_call_output needs a call_id",
                             param="input")
    text, images = content_to_ollama(item.get("output"), i)
    out: dict[str, Any] = {"role": "tool", "content": text, "tool_call_id": call_id}
    if call_id in names:
        out["tool_name"] = names[call_id]
    if images:
        out["images"] = images
    return out


# -- the handler -------------------------------------------------------------------------------

async def create_response(request: web.Request) -> web.StreamResponse:
    call = parse_responses(await read_json(request))
    completion = await request.app[SERVICE].chat(call.chat)
    builder = ResponseBuilder(call.chat.model, call.echo, created_at=int(time.time()))
    try:
        if call.stream:
            return await write_stream(request, builder, completion)
        async for event in completion:
            builder.feed(event)
        return web.json_response(builder.response)
    finally:
        await completion.aclose()

"""Anthropic's Messages requests (`/v1/messages`, `/v1/messages/count_tokens`) validated and
translated into the service's `ChatRequest`: pure functions, no I/O.

Invariants:
- Every malformed field is an `InvalidRequest` (400, Anthropic's `invalid_request_error`)
  raised here, before the service runs; checks that need the model (images on a model without
  vision, tools, thinking) are the service's, as for the other skins.
- Messages come out in Ollama's shape (role, content, images, tool_calls, thinking,
  tool_call_id, tool_name); a user turn's `tool_result` blocks become `tool` messages placed
  before the turn's own text, so the template sees each result right after its call.
- `stop_sequences` are not given to the runner: the skin matches them (anthropic.py) so the
  reply can name the one that matched, which the runner's stop strings do not report.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.api.body import list_field
from mlxr.supervisor.inference.tool_calls import ForcedCall
from mlxr.supervisor.inference.types import ChatRequest

ROLES = ("user", "assistant")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "max"}
# Block types carried by no field of ours that a client may echo back harmlessly.
IGNORED_BLOCKS = ("redacted_thinking",)


@dataclass(slots=True)
class MessagesCall:
    """A translated Messages request: the service's request and what only the skin uses."""

    chat: ChatRequest
    stream: bool = False
    stop_sequences: list[str] = field(default_factory=list)


def parse_messages(body: dict[str, Any]) -> MessagesCall:
    """`POST /v1/messages`: `max_tokens` is required, as Anthropic requires it."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise InvalidRequest("max_tokens: Field required")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidRequest("max_tokens: must be an integer of at least 1")
    chat = _chat_request(body)
    chat.options["num_predict"] = max_tokens
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            if not _is_number(value) or not 0 <= value <= 1:
                raise InvalidRequest(f"{key}: must be a number in range")
            chat.options[key] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < 0:
            raise InvalidRequest("top_k: must be a non-negative integer")
        chat.options["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop_sequences: must be a list of non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
        raise InvalidRequest("stream: must be a boolean")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest("metadata: must be an object")
    # Matched by the skin; the runner sends logprobs only to count the tokens of a reply
    # that ends at a stop sequence (the skin closes it there, so no final counts come).
    chat.logprobs = bool(stops)
    return MessagesCall(chat, bool(stream), list(dict.fromkeys(stops)))


def parse_count_tokens(body: dict[str, Any]) -> ChatRequest:
    """`POST /v1/messages/count_tokens`: the request a Messages call with these fields makes."""
    return _chat_request(body)


def _chat_request(body: dict[str, Any]) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: Field required")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages: must be a non-empty list")
    messages = system_messages(body.get("system"))
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    for i, m in enumerate(raw):
        messages += message_to_ollama(m, i, names)
    tools = [tool_to_ollama(t, i) for i, t in enumerate(list_field(body, "tools"))]
    force = None
    choice = body.get("tool_choice")
    if choice is not None:
        force, keep = tool_choice(choice, tools)
        tools = tools if keep else []
    think, fmt = output_config(body.get("output_config"))
    budget = None
    if body.get("thinking") is not None:
        think, budget = thinking(body["thinking"])
    return ChatRequest(model=model, messages=messages, tools=tools, think=think, format=fmt,
                       force_call=force, think_budget=budget)


# -- fields ------------------------------------------------------------------------------------

def system_messages(system: Any) -> list[dict[str, Any]]:
    """`system` as a string or a list of text blocks (their `cache_control` ignored)."""
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise InvalidRequest("system: must be a string or a list of text blocks")
    texts = []
    for block in system:
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            raise InvalidRequest("system: each block must be a text block")
        texts.append(block["text"])
    text = "\n".join(texts)
    return [{"role": "system", "content": text}] if text else []


def message_to_ollama(m: Any, index: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as Ollama messages: the turn itself, preceded (user turns) by one
    `tool` message per `tool_result` block. `names` maps tool_use ids seen so far to names."""
    where = f"messages.{index}"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or a list of blocks")
    texts: list[str] = []
    out: dict[str, Any] = {"role": role}
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_str(block, "text", at))
        elif kind == "image":
            out.setdefault("images", []).append(image_data(block.get("source"), at))
        elif kind == "tool_use" and role == "assistant":
            call_id, name = _str(block, "id", at), _str(block, "name", at)
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise InvalidRequest(f"{at}.input: must be an object")
            names[call_id] = name
            out.setdefault("tool_calls", []).append(
                {"id": call_id, "function": {"name": name, "arguments": args}})
        elif kind == "tool_result" and role == "user":
            results.append(tool_result(block, at, names))
        elif kind == "thinking" and role == "assistant":
            out["thinking"] = out.get("thinking", "") + _str(block, "thinking", at)
        elif kind not in IGNORED_BLOCKS:
            raise InvalidRequest(f"{at}.type: unsupported content block {kind!r} in a "
                                 f"{role} message")
    out["content"] = "\n".join(texts)
    keep = out["content"] or len(out) > 2 or not results
    return results + ([out] if keep else [])


def tool_result(block: dict[str, Any], at: str, names: dict[str, str]) -> dict[str, Any]:
    """A `tool_result` block as a `tool` message. `is_error` results say so in the text (the
    chat templates have no field for it)."""
    call_id = _str(block, "tool_use_id", at)
    content = block.get("content")
    out: dict[str, Any] = {"role": "tool", "tool_call_id": call_id}
    if call_id in names:
        out["tool_name"] = names[call_id]
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(_str(part, "text", f"{at}.content.{k}"))
            elif kind == "image":
                out.setdefault("images", []).append(
                    image_data(part.get("source"), f"{at}.content.{k}"))
            else:
                raise InvalidRequest(f"{at}.content.{k}.type: a tool_result holds text and "
                                     "image blocks")
        text = "\n".join(texts)
    else:
        raise InvalidRequest(f"{at}.content: must be a string or a list of blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, (bool, type(None))):
        raise InvalidRequest(f"{at}.is_error: must be a boolean")
    out["content"] = f"Error: {text}" if is_error else text
    return out


def image_data(source: Any, at: str) -> str:
    """A base64 image source's data (what Ollama's `images` hold); a URL source's URL, which
    is fetched or refused with the request's other images (inference/images.py)."""
    if isinstance(source, dict) and source.get("type") == "url" and \
            isinstance(source.get("url"), str) and source["url"].startswith(("http://",
                                                                              "https://")):
        return source["url"]
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise InvalidRequest(f"{at}.source: only base64 and url image sources are supported")
    data = source.get("data")
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{at}.source.data: must be base64 image data")
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{at}.source.data: invalid base64 data") from None
    return data


def tool_to_ollama(tool: Any, index: int) -> dict[str, Any]:
    """A client tool (name, description, input_schema) as an Ollama/OpenAI function tool.
    Anthropic's server tools (web search, code execution, ...) are refused: nothing runs them."""
    at = f"tools.{index}"
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{at}: must be an object")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise InvalidRequest(f"{at}.type: server tool {kind!r} is not supported")
    name = _str(tool, "name", at)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{at}.input_schema: must be a JSON schema object")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    description = tool.get("description")
    if description is not None:
        function["description"] = _str(tool, "description", at)
    return {"type": "function", "function": function}


def tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[ForcedCall | None, bool]:
    """`tool_choice` as OpenAI's maps onto the service: the forced call (None: the model
    decides) and whether the tools stay in the prompt ("none" drops them, as OpenAI's)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return None, True
    if kind == "none":
        return None, False
    if kind not in ("any", "tool"):
        raise InvalidRequest("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'")
    if not tools:
        raise InvalidRequest("tool_choice: forcing a tool call needs tools")
    if kind == "any":
        return ForcedCall(), True
    name = _str(choice, "name", "tool_choice")
    if name not in (t["function"]["name"] for t in tools):
        raise InvalidRequest(f"tool_choice.name: no tool named {name!r}")
    return ForcedCall(name), True


def thinking(value: Any) -> tuple[bool | None, int | None]:
    """(think, budget): `{"type": "enabled", "budget_tokens": N}` turns thinking on with at
    most N thinking tokens (the runner then closes the thinking section itself), "disabled"
    off, "adaptive" or none leaves the model's default."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if budget is not None and (not _is_int(budget) or budget < 1):
            raise InvalidRequest("thinking.budget_tokens: must be a positive integer")
        return True, budget
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return None, None
    raise InvalidRequest("thinking.type: must be 'enabled', 'disabled' or 'adaptive'")


def output_config(value: Any) -> tuple[str | None, Any]:
    """`output_config`: its `effort` as a thinking level (Ollama's mapping; `thinking`, when
    given, wins) and its `format` ({"type": "json_schema", "schema": ...}) as the format."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise InvalidRequest("output_config: must be an object")
    effort = value.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort.lower() not in EFFORTS:
            raise InvalidRequest(f"output_config.effort: must be one of {', '.join(EFFORTS)}")
        effort = EFFORTS[effort.lower()]
    fmt = value.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest('output_config.format: must be {"type": "json_schema", '
                                 '"schema": {...}}')
        fmt = fmt["schema"]
    return effort, fmt


# -- helpers -----------------------------------------------------------------------------------

def _str(obj: dict[str, Any], key: str, at: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{at}.{key}: Field required (a string)")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

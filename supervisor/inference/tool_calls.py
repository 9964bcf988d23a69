"""Incremental parsers for model output: thinking blocks and tool calls.

Both take text as it streams (`feed`) and hold back only what could still be the start of a
tag, so content reaches the client as soon as it is known not to be part of one. `finish()`
flushes what is left at the end of the stream. At the end: the schema that forces a tool call
through the runner's grammar, and the parser that reads such a call back.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.inference import gemma4

THINK_TAGS = ("<think>", "</think>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")
_ID_ALPHABET = string.ascii_lowercase + string.digits


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkingParser:
    """Splits output into (thinking, content). Thinking is recognised only at the start of the
    output (after whitespace), as Ollama does; `in_thinking` is for prompts that already end
    with the opening tag. Whitespace right after either tag is dropped."""

    def __init__(self, tags: tuple[str, str] = THINK_TAGS, in_thinking: bool = False,
                 keep: bool = True):
        self.open, self.close = tags
        self._state = "think_ws" if in_thinking else "start"
        self._buf = ""
        self._keep = keep  # False: a thinking block is read and dropped (thinking off)

    def feed(self, text: str) -> tuple[str, str]:
        thinking, content = self._feed(text)
        return (thinking if self._keep else ""), content

    def _feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        thinking, content = "", ""
        while self._buf:
            if self._state == "start":
                trimmed = self._buf.lstrip()
                if trimmed.startswith(self.open):
                    self._buf, self._state = trimmed[len(self.open):], "think_ws"
                elif self.open.startswith(trimmed):  # could still be the tag
                    break
                else:  # no thinking block: the text is content as written (as Ollama does)
                    self._state = "content"
            elif self._state in ("think_ws", "content_ws"):
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = "thinking" if self._state == "think_ws" else "content"
            elif self._state == "thinking":
                idx = self._buf.find(self.close)
                if idx >= 0:
                    thinking += self._buf[:idx]
                    self._buf, self._state = self._buf[idx + len(self.close):], "content_ws"
                    continue
                keep = _partial_suffix(self._buf, self.close)
                thinking += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            else:
                content, self._buf = content + self._buf, ""
        return thinking, content

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "thinking":
            return (buf if self._keep else ""), ""
        if self._state in ("start", "content"):
            return "", buf
        return "", ""


def tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def parse_tool_call(body: str, index: int = 0) -> dict[str, Any] | None:
    """`{"name": ..., "arguments": {...}}` (arguments may be a JSON string, or be called
    `parameters`) as an Ollama tool call; None if it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # model output: it may be nested past Python's stack
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("function"), dict):  # {"type": "function", "function": {...}}
        data = data["function"]
    name = data.get("name")
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return {"id": tool_call_id(), "function": {"index": index, "name": name, "arguments": args}}


class ToolCallParser:
    """Pulls `<tool_call>{json}</tool_call>` blocks (Qwen, Hermes style; `parse` reads another
    body, as Gemma 4's) out of content. A block that does not parse is passed through as
    content, tags and all."""

    def __init__(self, tags: tuple[str, str] = TOOL_TAGS, parse=None):
        self.open, self.close = tags
        self._parse = parse or parse_tool_call
        self._buf = ""
        self._inside = False
        self._count = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        content, calls = [], []
        while self._buf:
            if not self._inside:
                idx = self._buf.find(self.open)
                if idx < 0:
                    keep = _partial_suffix(self._buf, self.open)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:idx])
                self._buf, self._inside = self._buf[idx:], True
            idx = self._buf.find(self.close)
            if idx < 0:
                break
            block = self._buf[:idx + len(self.close)]
            self._buf, self._inside = self._buf[idx + len(self.close):], False
            call = self._parse(block[len(self.open):-len(self.close)], self._count)
            if call is None:
                content.append(block)
            else:
                calls.append(call)
                self._count += 1
        text_out = "".join(content)
        if calls:  # the whitespace models put between calls is not content
            text_out = text_out.strip() and text_out
        return text_out, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """An unterminated block at the end: a call if its JSON is complete, else content."""
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            call = self._parse(buf[len(self.open):], self._count)
            if call is not None:
                self._count += 1
                return "", [call]
        return buf, []


class JsonToolCallParser:
    """For templates without tool-call tags: output that starts with `{` or `[` is held until
    the end and read as one or more tool calls; anything else streams as content."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start | json | content

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._mode == "content":
            return text, []
        self._buf += text
        if self._mode == "start":
            stripped = self._buf.lstrip()
            if not stripped:
                return "", []
            self._mode = "json" if stripped[0] in "{[" else "content"
            if self._mode == "content":
                out, self._buf = self._buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return buf, []
        try:
            data = json.loads(buf)
        except (ValueError, RecursionError):
            return buf, []
        items = data if isinstance(data, list) else [data]
        calls = [parse_tool_call(json.dumps(item), i) for i, item in enumerate(items)]
        if not calls or any(c is None for c in calls):
            return buf, []
        return "", calls  # type: ignore[return-value]


def tool_parser_for(template_text: str):
    """The tool-call parser matching how a template asks the model to call tools."""
    if gemma4.is_gemma4(template_text):
        return ToolCallParser(gemma4.TOOL_TAGS, parse_gemma4_call)
    if TOOL_TAGS[0] in template_text:
        return ToolCallParser(TOOL_TAGS)
    return JsonToolCallParser()


def parse_gemma4_call(body: str, index: int = 0) -> dict[str, Any] | None:
    """A Gemma 4 call block's body (`call:NAME{...}`) as an Ollama tool call, or None."""
    parsed = gemma4.parse_call(body)
    if parsed is None:
        return None
    name, args = parsed
    return {"id": tool_call_id(), "function": {"index": index, "name": name, "arguments": args}}


def thinking_tags_for(template_text: str) -> tuple[str, str] | None:
    if gemma4.is_gemma4(template_text):
        return gemma4.THINK_TAGS
    return THINK_TAGS if THINK_TAGS[0] in template_text and THINK_TAGS[1] in template_text \
        else None


def always_parses_thinking(tags: tuple[str, str] | None) -> bool:
    """Whether output may hold a thinking block even with thinking off (Gemma 4 writes an
    empty one), so it is read, and dropped, then too."""
    return tags == gemma4.THINK_TAGS


class OutputParser:
    """Thinking first, then tool calls in what is left: (thinking, content, tool calls)."""

    def __init__(self, thinking: ThinkingParser | None = None, tools: Any = None):
        self.thinking = thinking
        self.tools = tools

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        thinking, content = self.thinking.feed(text) if self.thinking else ("", text)
        content, calls = self.tools.feed(content) if self.tools else (content, [])
        return thinking, content, calls

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        thinking, content = self.thinking.finish() if self.thinking else ("", "")
        calls: list[dict[str, Any]] = []
        if self.tools:
            content, calls = self.tools.feed(content)
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        return thinking, content, calls


# -- forced tool calls ---------------------------------------------------------------------------
# OpenAI's tool_choice "required" or a named function. The model is held to a JSON schema of
# `{"name": ..., "arguments": ...}` by the runner's grammar (the same `format` path as structured
# output), and its output is read back as one tool call. The output has no tool-call tags: the
# grammar applies from the first token, so the template's own call syntax is not used.

@dataclass(slots=True, frozen=True)
class ForcedCall:
    """The reply must be a tool call: to the tool named `name`, or to any of the tools."""

    name: str | None = None


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


def forced_call_schema(tools: list[dict[str, Any]], forced: ForcedCall) -> dict[str, Any]:
    """The JSON schema of a call to one of `tools` (Ollama/OpenAI tool objects), or to the one
    `forced` names; for several tools an `anyOf`, so the arguments match the chosen name."""
    functions = [t.get("function") for t in tools if isinstance(t, dict)]
    functions = [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)]
    if forced.name is not None:
        functions = [f for f in functions if f["name"] == forced.name]
        if not functions:
            raise InvalidRequest(f"tool_choice names the function {forced.name!r}, "
                                 "which is not in tools", param="tool_choice")
    if not functions:
        raise InvalidRequest("tool_choice needs at least one function in tools",
                             param="tool_choice")
    alternatives = [_call_schema(f) for f in functions]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    # A function without parameters takes none (OpenAI's rule), so its arguments are `{}`.
    parameters = function.get("parameters") or NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"the parameters of {function['name']!r} must be a JSON schema "
                             "object", param="tools")
    return {"type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


class ForcedCallParser:
    """Reads output held to `forced_call_schema` as one tool call, given as soon as the JSON
    object closes (so a stream carries it before its final chunk). Output that stops before
    the object closes (num_predict, a stop string) comes back whole as content from
    `finish()`, and there is no call."""

    def __init__(self) -> None:
        self._buf: list[str] = []
        self._scan = _JsonEnd()
        self._done = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._done:  # the grammar allows only EOS after the object; keep anything else
            return text.strip() and text, []
        end = self._scan.feed(text)
        if end < 0:
            self._buf.append(text)
            return "", []
        self._buf.append(text[:end])
        self._done = True
        body, rest = "".join(self._buf), text[end:]
        self._buf = []
        call = parse_tool_call(body)
        if call is None:  # not a call after all (a hand-made format): give the text back
            return body + rest, []
        return rest.strip() and rest, [call]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        buf, self._buf = "".join(self._buf), []
        return buf, []


class _JsonEnd:
    """Finds where the first top-level JSON object or array in a stream of text closes."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> int:
        """The index in `text` just past the closing bracket, or -1 if not closed yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1

"""gpt-oss's chat format, "harmony", in a model's output: each message is
`<|start|>{role}[ to={recipient}]<|channel|>{channel}[ <|constrain|>json]<|message|>{text}<|end|>`,
and a reply ends with `<|return|>` (an answer) or `<|call|>` (a tool call), both end-of-sequence
tokens the runner does not put in the text. The runner keeps the structural tokens in the text
of a model whose tokenizer has them (runner/text_stream.py `output_decode`).

What goes where, as in Ollama: the `analysis` channel is thinking; `final`, and `commentary`
without a recipient, are the reply; a message to a recipient (`to=functions.get_weather`, on
`commentary` or `analysis`) is a tool call whose text is its JSON arguments. Text outside a
message (before a `<|start|>`) is dropped.

Tool names become TypeScript identifiers in the prompt (harmony declares tools as TypeScript
types): `ToolNames` renames `get-weather` to `get_weather` and maps calls back.

Invariants:
- `feed` emits text as soon as it cannot be part of a structural token; the concatenation of
  what it emits equals what one `feed` of the whole output emits.
- The parser starts where the prompt left off: the prompt's tail after its last `<|start|>`
  (`<|start|>assistant` for a new reply, or a prefilled message) is read, not emitted.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxr.supervisor.inference.tool_calls import _partial_suffix, tool_call_id

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
FINAL_MESSAGE = CHANNEL + "final" + MESSAGE  # where a constrained (`format`) reply begins
_BUILTIN_TOOLS = ("browser.open", "browser.search", "browser.find", "python")


def is_harmony(template: str | None) -> bool:
    """A chat template that writes harmony messages."""
    return bool(template) and all(t in template for t in (START, END, CHANNEL, MESSAGE))


class ToolNames:
    """User tool names <-> harmony (TypeScript identifier) names."""

    def __init__(self, names: list[str]):
        self.to_harmony: dict[str, str] = {}
        self.to_user: dict[str, str] = {}
        for name in names:
            if name in self.to_harmony:
                continue
            candidate = base = name if name in _BUILTIN_TOOLS else _identifier(name)
            count = 2
            while candidate in self.to_user:
                candidate, count = f"{base}_{count}", count + 1
            self.to_harmony[name], self.to_user[candidate] = candidate, name

    def tools(self, tools: list[dict] | None) -> list[dict] | None:
        """The request's tools under their harmony names."""
        if not tools:
            return tools
        return [_renamed_tool(t, self.to_harmony) for t in tools]

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A history whose tool calls and results name tools as the prompt declares them."""
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [_renamed_call(c, self.to_harmony)
                                         for c in m["tool_calls"]]}
            if m.get("tool_name") in self.to_harmony:
                m = {**m, "tool_name": self.to_harmony[m["tool_name"]]}
            out.append(m)
        return out


def _identifier(name: str) -> str:
    name = re.sub(r"[ .\-]", "_", name)
    name = "".join(c for c in name if c.isalnum() or c in "_$")
    if not name:
        return "unnamed"
    return "_" + name if name[0].isdigit() else name


def _renamed_tool(tool: dict, names: dict[str, str]) -> dict:
    function = tool.get("function")
    if not isinstance(function, dict) or function.get("name") not in names:
        return tool
    return {**tool, "function": {**function, "name": names[function["name"]]}}


def _renamed_call(call: dict, names: dict[str, str]) -> dict:
    function = call.get("function") or {}
    if function.get("name") not in names:
        return call
    return {**call, "function": {**function, "name": names[function["name"]]}}


class HarmonyParser:
    """Output text -> (thinking, content, tool calls), the OutputParser interface."""

    def __init__(self, prompt: str = START + "assistant", names: ToolNames | None = None):
        self._names = names or ToolNames([])
        self._buffer = ""
        self._in_message = False
        self._kind = "content"  # of the message being read: content, thinking or call
        self._recipient = ""
        self._call = ""  # a tool call's arguments so far
        self._calls: list[dict[str, Any]] = []
        self._count = 0  # calls made so far
        tail = prompt[prompt.rfind(START):] if START in prompt else START + "assistant"
        self.feed(tail)  # where the prompt left off; nothing of it is emitted
        self._calls.clear()

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        self._buffer += text
        thinking, content = [], []
        while True:
            if not self._in_message:
                at = self._buffer.find(START)
                header_end = self._buffer.find(MESSAGE, at) if at >= 0 else -1
                if header_end < 0:
                    # keep from a start tag on (or what may begin one); drop the rest
                    keep = at if at >= 0 else \
                        len(self._buffer) - _partial_suffix(self._buffer, START)
                    self._buffer = self._buffer[keep:]
                    break
                self._open(self._buffer[at + len(START):header_end])
                self._buffer = self._buffer[header_end + len(MESSAGE):]
                continue
            end = self._buffer.find(END)
            cut = end if end >= 0 else len(self._buffer) - _partial_suffix(self._buffer, END)
            self._emit(self._buffer[:cut], thinking, content)
            if end < 0:
                self._buffer = self._buffer[cut:]
                break
            self._buffer = self._buffer[end + len(END):]
            content.append(self._close())
        return "".join(thinking), "".join(content), self._take_calls()

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """The reply ended (`<|return|>`, `<|call|>`, a length limit): what is held back."""
        thinking: list[str] = []
        content: list[str] = []
        if self._in_message:
            self._emit(self._buffer, thinking, content)
            content.append(self._close())
        self._buffer = ""
        return "".join(thinking), "".join(content), self._take_calls()

    def _open(self, header: str) -> None:
        """Read a message's header: `assistant<|channel|>analysis`,
        `assistant<|channel|>commentary to=functions.f <|constrain|>json`, `to=f ...`."""
        header = header.replace(CONSTRAIN, " " + CONSTRAIN)
        channel = ""
        at = header.find(CHANNEL)
        if at >= 0:
            rest = header[at + len(CHANNEL):]
            channel = rest.split()[0] if rest.split() else ""
            header = header[:at] + " " + rest[len(channel):]
        words = header.split()
        recipient = next((w[3:] for w in words if w.startswith("to=")), "")
        self._in_message, self._recipient = True, recipient
        self._kind = ("call" if recipient and channel in ("commentary", "analysis")
                      else "thinking" if channel == "analysis" else "content")

    def _emit(self, text: str, thinking: list[str], content: list[str]) -> None:
        if self._kind == "call":
            self._call += text
        elif text:
            (thinking if self._kind == "thinking" else content).append(text)

    def _close(self) -> str:
        """End the message; the text of a tool call whose arguments are not a JSON object
        (passed on as content, as the other tool-call parsers do)."""
        left = ""
        if self._kind == "call":
            call = self._tool_call(self._recipient, self._call)
            if call is None:
                left = self._call
            else:
                self._calls.append(call)
                self._count += 1
        self._in_message, self._kind, self._recipient, self._call = False, "content", "", ""
        return left

    def _tool_call(self, recipient: str, arguments: str) -> dict[str, Any] | None:
        name = recipient.removeprefix("functions.")
        name = self._names.to_user.get(name, name)
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
        if not isinstance(args, dict):
            return None
        return {"id": tool_call_id(), "function": {"index": self._count, "name": name,
                                                   "arguments": args}}

    def _take_calls(self) -> list[dict[str, Any]]:
        calls, self._calls = self._calls, []
        return calls



"""Gemma 4's chat format, as its output reads: a thinking block
`<|channel>thought\\n...<channel|>` and tool calls `<|tool_call>call:NAME{...}<tool_call|>`,
whose arguments are JSON-like: keys bare, strings between `<|"|>` marks.

(Prompts are the model's own chat template's to write: its GGUF or tokenizer_config.json
carries one.)
"""

from __future__ import annotations

import json
import re
from typing import Any

THINK_TAGS = ("<|channel>thought", "<channel|>")  # the channel's name belongs to the tag
TOOL_TAGS = ("<|tool_call>", "<tool_call|>")
STRING_MARK = '<|"|>'
_CALL = re.compile(r"\s*call:([^{\s]+)\s*(\{.*\})\s*", re.DOTALL)
_KEY = re.compile(r"[A-Za-z_$][\w$.\-]*")


def is_gemma4(template_text: str) -> bool:
    """A Gemma 4 chat template (its channel and tool-call tags)."""
    return "<|channel>" in template_text and TOOL_TAGS[0] in template_text


def parse_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a call block's body `call:NAME{key:value,...}`; None if it is not
    one."""
    m = _CALL.fullmatch(body)
    if m is None:
        return None
    text = arguments_json(m.group(2))
    if text is None:
        return None
    try:
        args = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return (m.group(1), args) if isinstance(args, dict) else None


def arguments_json(text: str) -> str | None:
    """Gemma 4's argument syntax as JSON: `<|"|>...<|"|>` strings become JSON strings and bare
    object keys are quoted; numbers, true, false, null, JSON strings, arrays and nesting pass
    as they are. None for an unterminated string."""
    out: list[str] = []
    stack: list[str] = []
    expect_key = False
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if text.startswith(STRING_MARK, i):
            end = text.find(STRING_MARK, i + len(STRING_MARK))
            if end < 0:
                return None
            out.append(json.dumps(text[i + len(STRING_MARK):end], ensure_ascii=False))
            i, expect_key = end + len(STRING_MARK), False
            continue
        if ch == '"':
            end = _json_string_end(text, i)
            if end < 0:
                return None
            out.append(text[i:end])
            i, expect_key = end, False
            continue
        if ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
        elif ch in "}]":
            if stack:
                stack.pop()
            expect_key = False
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch == ":":
            expect_key = False
        elif expect_key and (m := _KEY.match(text, i)):
            out.append(json.dumps(m.group(0)))
            i, expect_key = m.end(), False
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _json_string_end(text: str, start: int) -> int:
    """The index just past the JSON string starting at `start`; -1 if it does not end."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return -1

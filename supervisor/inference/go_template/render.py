"""A renderer for the subset of Go's text/template that Ollama Modelfile TEMPLATEs use.

Supported: text with `{{- -}}` trimming and `{{/* comments */}}`; fields (`.System`,
`.Function.Name`, `.`), variables (`$`, `$x`, `$x := ...`, `$x = ...`, `range $i, $m := ...`);
`if / else if / else / end`, `range ... else`, `with`, `break`, `continue`; pipelines with `|`
and parentheses; string, raw-string, number, bool and nil literals; the functions and, or, not,
eq, ne, lt, le, gt, ge, len, index, slice, print, printf, println, html, json, currentDate
and yesterdayDate.
Not supported (a TemplateError): define, template, block.

Templates come from requests, so running one is bounded (`Limits`): at most `max_steps` steps
(a node, an operand, a range iteration; a function call one more per KiB or so of data it
reads and makes) and at most `max_output_chars` written (a function's result may not be
longer either), whatever the loops; past either the render stops with a TemplateError (a 400).
Nesting is bounded by the parser (parse.MAX_NESTING).

Data is plain Python: the top level is a dict with Go field names ("Messages", "System"); below
it, fields are looked up by exact key, then by snake_case (`.ToolCalls` finds "tool_calls").
"""

from __future__ import annotations

import datetime
import html
import json
import re
from dataclasses import dataclass
from typing import Any

from mlxr.supervisor.inference.go_template.parse import (Branch, Field, Ident, Literal, Pipe, Sub,
                                          TemplateError, Var, parse)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one render may do. A chat template costs a few dozen steps per message."""

    max_steps: int = 1_000_000
    # Past any context a model has; a bound on memory rather than a policy.
    max_output_chars: int = 1 << 26


class _Cut(Exception):
    """Raised at `.Response` when rendering the last turn of a legacy template; it carries the
    response so far (a final assistant message the reply continues, as in Ollama)."""

    def __init__(self, response: Any = ""):
        super().__init__()
        self.response = response


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


# -- evaluation ------------------------------------------------------------------------------

def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _get(value: Any, name: str) -> Any:
    """A field of a map; nothing on other values (the data is plain JSON, and a template
    must not reach Python attributes such as `.__class__`)."""
    if isinstance(value, dict):
        if name in value:
            return value[name]
        return value.get(_snake(name))
    return None


def truth(value: Any) -> bool:
    """Go's notion of a non-empty value."""
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, (str, list, tuple, dict)):
        return len(value) > 0
    return True


def go_json(value: Any) -> str:
    """Like Go's json.Marshal: compact, with <, > and & escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def go_str(value: Any) -> str:
    """Like fmt.Sprint for the values templates print."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, dict) or (isinstance(value, (list, tuple)) and value
                                   and isinstance(value[0], dict)):
        # Ollama's tool types (functions, arguments, tool lists) print themselves as JSON.
        return go_json(value)
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(go_str(v) for v in value) + "]"
    return str(value)


def _printf(fmt: str, *args: Any) -> str:
    out, args_iter = [], iter(args)

    def repl(m: re.Match) -> str:
        verb = m.group(1)
        if verb == "%":
            return "%"
        arg = next(args_iter, None)
        if verb == "q":
            return json.dumps(go_str(arg))
        if verb == "d":
            return str(int(arg or 0))
        return go_str(arg)
    out.append(re.sub(r"%[-+# 0-9.]*([a-zA-Z%])", repl, fmt))
    return "".join(out)


def _print(*args: Any) -> str:
    parts = []
    for i, a in enumerate(args):  # Sprint adds spaces between operands when neither is a string
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            parts.append(" ")
        parts.append(go_str(a))
    return "".join(parts)


def _index(value: Any, *keys: Any) -> Any:
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else value[int(k)]
    return value


FUNCS = {
    "not": lambda a: not truth(a),
    "eq": lambda a, *bs: any(a == b for b in bs),
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "len": lambda a: len(a) if a is not None else 0,
    "index": _index,
    "slice": lambda a, *ij: a[int(ij[0]) if ij else 0:int(ij[1]) if len(ij) > 1 else None],
    "print": _print,
    "println": lambda *a: " ".join(go_str(x) for x in a) + "\n",
    "printf": _printf,
    "html": lambda a: html.escape(go_str(a)),
    "json": go_json,
    # Ollama's date functions take (and ignore) a format argument.
    "currentDate": lambda *_: datetime.date.today().isoformat(),
    "yesterdayDate": lambda *_: (datetime.date.today() - datetime.timedelta(days=1)).isoformat(),
}


def _cost(value: Any) -> int:
    """Steps for a value a function reads or makes: a step is a microsecond or two, about what
    writing 64 characters of JSON or copying a thousand list items takes."""
    if isinstance(value, str):
        return len(value) // 64
    if isinstance(value, (list, tuple, dict)):
        return len(value) // 1024
    return 0


class _Scope:
    def __init__(self, root: Any):
        self.frames: list[dict[str, Any]] = [{"$": root}]

    def get(self, name: str) -> Any:
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        raise TemplateError(f"template: undefined variable {name}")

    def set(self, name: str, value: Any) -> None:
        for frame in reversed(self.frames):
            if name in frame:
                frame[name] = value
                return
        raise TemplateError(f"template: undefined variable {name}")


class _Budget:
    """The steps and characters left to one execution (a legacy template's renders, one per
    turn, share one)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.num_steps = 0
        self.num_chars = 0

    def step(self, num_steps: int = 1) -> None:
        self.num_steps += num_steps
        if self.num_steps > self.limits.max_steps:
            raise TemplateError(f"template: more than {self.limits.max_steps} steps "
                                "(a range too long?)")

    def check_size(self, num_chars: int) -> None:
        if num_chars > self.limits.max_output_chars:
            raise TemplateError(f"template: output longer than {self.limits.max_output_chars} "
                                "characters")

    def add_chars(self, num_chars: int) -> None:
        self.num_chars += num_chars
        self.check_size(self.num_chars)


class _Render:
    def __init__(self, root: Any, cut_at_response: bool, budget: _Budget):
        self.scope = _Scope(root)
        self.cut = cut_at_response
        self.budget = budget
        self.step = budget.step
        self.out: list[str] = []

    def emit(self, text: str) -> None:
        self.budget.add_chars(len(text))
        self.out.append(text)

    def nodes(self, nodes: list[Any], dot: Any) -> None:
        for node in nodes:
            self.step()
            if isinstance(node, str):
                if node == "break":
                    raise _Break
                if node == "continue":
                    raise _Continue
                self.emit(node)
            elif isinstance(node, Pipe):
                value = self.pipe(node, dot)
                if not node.decl:
                    self.emit(go_str(value))
            else:
                self.branch(node, dot)

    def branch(self, node: Branch, dot: Any) -> None:
        self.scope.frames.append({})
        try:
            value = self.pipe(node.pipe, dot, declare=node.kind != "range")
            if node.kind == "range":
                self._range(node, value, dot)
            elif truth(value):
                self.nodes(node.body, value if node.kind == "with" else dot)
            else:
                self.nodes(node.orelse, dot)
        finally:
            self.scope.frames.pop()

    def _range(self, node: Branch, value: Any, dot: Any) -> None:
        if not truth(value) or (isinstance(value, int) and value < 0):
            self.nodes(node.orelse, dot)
            return
        if isinstance(value, dict):
            self.step(_cost(value))  # the sort
            items: Any = sorted(value.items())
        elif isinstance(value, int) and not isinstance(value, bool):
            items = ((i, i) for i in range(value))  # lazily: the steps bound it, not memory
        elif isinstance(value, (list, tuple, str)):
            items = enumerate(value)
        else:
            raise TemplateError(f"template: range can't iterate over {go_str(value)[:40]}")
        for key, elem in items:
            self.step()
            frame = self.scope.frames[-1]
            if len(node.pipe.decl) == 1:
                frame[node.pipe.decl[0]] = elem
            elif len(node.pipe.decl) == 2:
                frame[node.pipe.decl[0]], frame[node.pipe.decl[1]] = key, elem
            try:
                self.nodes(node.body, elem)
            except _Continue:
                continue
            except _Break:
                break

    def pipe(self, pipe: Pipe, dot: Any, declare: bool = True) -> Any:
        value: Any = None
        for i, cmd in enumerate(pipe.cmds):
            value = self.command(cmd, dot, piped=(value,) if i else ())
        if pipe.decl and declare:
            for name in pipe.decl:
                if pipe.assign:
                    self.scope.set(name, value)
                else:
                    self.scope.frames[-1][name] = value
        return value

    def command(self, cmd: list[Any], dot: Any, piped: tuple) -> Any:
        head = cmd[0]
        if isinstance(head, Ident):
            if head.name in ("and", "or"):
                return self._and_or(head.name, cmd[1:], dot, piped)
            fn = FUNCS.get(head.name)
            if fn is None:
                raise TemplateError(f'template: function "{head.name}" not defined')
            args = [self.arg(a, dot) for a in cmd[1:]] + list(piped)
            try:
                result = fn(*args)
            except (TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
                raise TemplateError(f"template: error calling {head.name}: {exc}") from None
            if isinstance(result, str):  # `print $x $x` doubles: bound it before the output
                self.budget.check_size(len(result))
            # A call's work grows with what it reads and makes (json of all the messages, a
            # slice of them), and so does what it is charged, so no loop repeats it unbounded.
            self.step(1 + sum(map(_cost, args)) + _cost(result))
            return result
        if len(cmd) > 1 or piped:
            raise TemplateError("template: can't give arguments to a non-function")
        return self.arg(head, dot)

    def _and_or(self, name: str, args: list[Any], dot: Any, piped: tuple) -> Any:
        value: Any = None
        thunks = [lambda a=a: self.arg(a, dot) for a in args] + [lambda p=p: p for p in piped]
        for thunk in thunks:  # short-circuit, returning the deciding operand (as Go does)
            value = thunk()
            if truth(value) != (name == "and"):
                return value
        return value

    def arg(self, node: Any, dot: Any) -> Any:
        self.step()  # an action of many operands is as many steps
        if isinstance(node, Literal):
            return node.value
        if isinstance(node, Field):
            if self.cut and node.chain and node.chain[0] == "Response":
                raise _Cut(self._chain(dot, node.chain))
            return self._chain(dot, node.chain)
        if isinstance(node, Var):
            return self._chain(self.scope.get(node.name), node.chain)
        if isinstance(node, Sub):
            return self._chain(self.pipe(node.pipe, dot), node.chain)
        if isinstance(node, Ident):
            return self.command([node], dot, ())
        raise TemplateError(f"template: bad operand {node!r}")

    @staticmethod
    def _chain(value: Any, chain: list[str]) -> Any:
        for name in chain:
            value = _get(value, name)
        return value


def _identifiers(nodes: list[Any]) -> set[str]:
    names: set[str] = set()

    def pipe(p: Pipe) -> None:
        for cmd in p.cmds:
            for a in cmd:
                if isinstance(a, (Field, Var)):
                    names.update(n.lower() for n in a.chain)
                elif isinstance(a, Sub):
                    pipe(a.pipe)
                    names.update(n.lower() for n in a.chain)

    def walk(ns: list[Any]) -> None:
        for n in ns:
            if isinstance(n, Pipe):
                pipe(n)
            elif isinstance(n, Branch):
                pipe(n.pipe)
                walk(n.body)
                walk(n.orelse)

    walk(nodes)
    return names


class GoTemplate:
    """A parsed template; `execute` follows Ollama's template.Execute."""

    def __init__(self, source: str, limits: Limits = Limits()):
        self.source = source
        self.limits = limits
        self.nodes = parse(source)
        self.vars = _identifiers(self.nodes)
        if "messages" not in self.vars and "response" not in self.vars:
            self.nodes.append(Pipe([[Field(["Response"])]]))  # Ollama appends {{ .Response }}
            self.vars.add("response")

    def render(self, data: dict[str, Any], cut_at_response: bool = False,
               budget: _Budget | None = None) -> str:
        r = _Render(data, cut_at_response, budget or _Budget(self.limits))
        try:
            r.nodes(self.nodes, data)
        except _Cut as cut:
            r.emit(go_str(cut.response))
        except (_Break, _Continue):
            raise TemplateError("template: break or continue outside range") from None
        return "".join(r.out)

    def execute(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                prompt: str = "", suffix: str = "", think: bool = False,
                think_set: bool = False, think_level: str = "") -> str:
        """`think_level`: Ollama's .ThinkLevel, "medium" for a plain true, "" when off."""
        base = {"Think": think, "ThinkLevel": think_level, "IsThinkSet": think_set,
                "Response": ""}
        if prompt and suffix:
            return self.render({**base, "Prompt": prompt, "Suffix": suffix})
        system, collated = collate(messages)
        if "messages" in self.vars:
            return self.render({**base, "System": system, "Messages": collated,
                                "Tools": tools or []})
        # A template without .Messages renders once per turn; the last turn stops at .Response.
        out: list[str] = []
        turn = {"System": "", "Prompt": "", "Response": ""}
        budget = _Budget(self.limits)

        def flush() -> None:
            out.append(self.render({**base, **turn}, budget=budget))
            turn.update(System="", Prompt="", Response="")

        for m in collated:
            role, content = m.get("role"), m.get("content") or ""
            if role == "system":
                if turn["Prompt"] or turn["Response"]:
                    flush()
                turn["System"] = content
            elif role == "user":
                if turn["Response"]:
                    flush()
                turn["Prompt"] = content
            elif role == "assistant":
                turn["Response"] = content
        out.append(self.render({**base, **turn}, cut_at_response=True, budget=budget))
        return "".join(out)


def collate(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """System text (all system messages joined) and the messages with consecutive same-role
    messages merged, except tool results (Ollama's collate)."""
    system = [m.get("content") or "" for m in messages if m.get("role") == "system"]
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and out[-1].get("role") == m.get("role") and m.get("role") != "tool":
            out[-1] = {**out[-1], "content": (out[-1].get("content") or "") + "\n\n"
                       + (m.get("content") or "")}
        else:
            out.append(dict(m))
    return "\n\n".join(system), out

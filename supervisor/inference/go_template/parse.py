"""Lexer and parser for the Go text/template subset (see render.py).

Templates come from requests (`template`, a Modelfile's TEMPLATE), so parsing is bounded:
blocks (if, range, with, else-if chains) and parentheses nest at most `MAX_NESTING` levels,
and every malformed template is a `TemplateError` (a 400), never another exception."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest


class TemplateError(InvalidRequest):
    pass


MAX_NESTING = 100  # Ollama's templates nest a handful of levels; this keeps recursion shallow


def _check_nesting(depth: int) -> None:
    if depth > MAX_NESTING:
        raise TemplateError(f"template: nested deeper than {MAX_NESTING} levels")


# -- parse tree ------------------------------------------------------------------------------

@dataclass(slots=True)
class Field:
    chain: list[str]  # [] is "." itself


@dataclass(slots=True)
class Var:
    name: str  # "$" or "$x"
    chain: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Literal:
    value: Any


@dataclass(slots=True)
class Ident:
    name: str  # a function name


@dataclass(slots=True)
class Sub:
    pipe: "Pipe"
    chain: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Pipe:
    cmds: list[list[Any]]
    decl: list[str] = field(default_factory=list)
    assign: bool = False  # `=` rather than `:=`


@dataclass(slots=True)
class Branch:
    kind: str  # if | range | with
    pipe: Pipe
    body: list[Any] = field(default_factory=list)
    orelse: list[Any] = field(default_factory=list)


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\]
              |\\(?:x[0-9A-Fa-f]{2}|[0-7]{3}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.))')
  | (?P<num>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
  | (?P<decl>:=)
  | (?P<op>[|(),=])
  | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)
  | (?P<field>(?:\.[A-Za-z0-9_]+)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
""", re.VERBOSE)
_GO_SPACE = " \t\r\n"


def _split(source: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", s) pieces, with trim markers applied."""
    pieces: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    while True:
        start = source.find("{{", pos)
        text = source[pos:] if start < 0 else source[pos:start]
        if trim_next:
            text = text.lstrip(_GO_SPACE)
        if start < 0:
            pieces.append(("text", text))
            return pieces
        inner_start = start + 2
        if source.startswith("-", inner_start) and source[inner_start + 1:inner_start + 2] in \
                tuple(_GO_SPACE):
            text = text.rstrip(_GO_SPACE)
            inner_start += 1
        pieces.append(("text", text))
        end = _find_close(source, inner_start)
        inner = source[inner_start:end]
        trim_next = False
        if inner.endswith("-") and inner[-2:-1] in tuple(_GO_SPACE):
            inner, trim_next = inner[:-1], True
        pieces.append(("action", inner.strip()))
        pos = end + 2


def _find_close(source: str, pos: int) -> int:
    quote = None
    i = pos
    while i < len(source):
        c = source[i]
        if quote:
            if c == "\\" and quote != "`":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"`'":
            quote = c
        elif source.startswith("}}", i):
            return i
        i += 1
    raise TemplateError("template: unclosed action")


class _Parser:
    def __init__(self, source: str):
        self.pieces = _split(source)
        self.i = 0
        self.depth = 0  # open blocks

    def parse(self) -> list[Any]:
        nodes, stop = self._list()
        if stop is not None:
            raise TemplateError(f"template: unexpected {{{{{stop}}}}}")
        return nodes

    def _list(self) -> tuple[list[Any], str | None]:
        nodes: list[Any] = []
        while self.i < len(self.pieces):
            kind, text = self.pieces[self.i]
            self.i += 1
            if kind == "text":
                if text:
                    nodes.append(text)
                continue
            if text.startswith("/*"):
                continue
            word = text.split(None, 1)[0] if text else ""
            if word in ("end", "else"):
                return nodes, text
            if word in ("if", "range", "with"):
                nodes.append(self._branch(word, text[len(word):]))
            elif word in ("break", "continue"):
                nodes.append(word)
            elif word in ("define", "template", "block"):
                raise TemplateError(f"template: {word} is not supported")
            else:
                nodes.append(_parse_pipe(text))
        return nodes, None

    def _branch(self, kind: str, rest: str) -> Branch:
        self.depth += 1
        _check_nesting(self.depth)
        try:
            return self._branch_body(kind, rest)
        finally:
            self.depth -= 1

    def _branch_body(self, kind: str, rest: str) -> Branch:
        node = Branch(kind, _parse_pipe(rest))
        node.body, stop = self._list()
        if stop is None:
            raise TemplateError(f"template: unexpected EOF in {kind}")
        if stop.startswith("else"):
            rest = stop[4:].strip()
            if rest.startswith(("if ", "with ")):  # else if / else with: a nested branch
                word = rest.split(None, 1)[0]
                # The nested branch consumes the chain's single {{end}}.
                node.orelse = [self._branch(word, rest[len(word):])]
                return node
            node.orelse, stop = self._list()
            if stop != "end":
                raise TemplateError(f"template: expected end, got {stop!r}")
        return node


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise TemplateError(f"template: unexpected {text[pos:]!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
    return out


def _parse_pipe(text: str) -> Pipe:
    toks = _tokens(text)
    pipe, pos = _pipe(toks, 0)
    if pos != len(toks):
        raise TemplateError(f"template: unexpected {toks[pos][1]!r} in {text!r}")
    return pipe


def _pipe(toks: list[tuple[str, str]], pos: int, depth: int = 0) -> tuple[Pipe, int]:
    _check_nesting(depth)
    decl: list[str] = []
    assign = False
    # `$x :=`, `$x =`, `$i, $e :=`
    j = pos
    names = []
    while j < len(toks) and toks[j][0] == "var" and "." not in toks[j][1]:
        names.append(toks[j][1])
        j += 1
        if j < len(toks) and toks[j] == ("op", ","):
            j += 1
            continue
        break
    if names and j < len(toks) and (toks[j][0] == "decl" or toks[j] == ("op", "=")):
        decl, assign, pos = names, toks[j][0] != "decl", j + 1
    cmds: list[list[Any]] = [[]]
    while pos < len(toks):
        kind, value = toks[pos]
        if (kind, value) == ("op", ")"):
            break
        pos += 1
        if (kind, value) == ("op", "|"):
            cmds.append([])
            continue
        if (kind, value) == ("op", "("):
            sub, pos = _pipe(toks, pos, depth + 1)
            if pos >= len(toks) or toks[pos] != ("op", ")"):
                raise TemplateError("template: unclosed (")
            pos += 1
            chain = []
            while pos < len(toks) and toks[pos][0] == "field" and toks[pos][1] != ".":
                chain += toks[pos][1].split(".")[1:]
                pos += 1
            cmds[-1].append(Sub(sub, chain))
        else:
            cmds[-1].append(_operand(kind, value))
    if any(not c for c in cmds):
        raise TemplateError("template: missing value in pipeline")
    return Pipe(cmds, decl, assign), pos


def _operand(kind: str, value: str) -> Any:
    if kind == "field":
        return Field([] if value == "." else value.split(".")[1:])
    if kind == "var":
        name, *chain = value.split(".")
        return Var(name, chain)
    if kind == "str":
        return Literal(unquote(value[1:-1]))
    if kind == "raw":
        return Literal(value[1:-1])
    if kind == "char":
        body = value[1:-1]  # a \x or octal escape is the code point itself, as in Go
        if body[:2] in ("\\x", "\\0", "\\1", "\\2", "\\3") and len(body) == 4:
            return Literal(int(body[2:], 16) if body[1] == "x" else int(body[1:], 8))
        char = unquote(body, quote="'")
        if len(char) != 1:
            raise TemplateError(f"template: malformed character constant {value}")
        return Literal(ord(char))
    if kind == "num":
        try:
            return Literal(float(value) if any(c in value for c in ".eE") else int(value))
        except ValueError:  # an int past Python's digit limit
            raise TemplateError(f"template: number too long: {value[:20]}...") from None
    if kind == "ident":
        return {"true": Literal(True), "false": Literal(False), "nil": Literal(None)}.get(
            value, Ident(value))
    raise TemplateError(f"template: unexpected {value!r}")


_ESCAPE = re.compile(r"\\(?:([abfnrtv\\'\"])|x([0-9A-Fa-f]{2})|([0-7]{3})"
                     r"|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|(.?))", re.S)
_SIMPLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           "\\": "\\", "'": "'", '"': '"'}


def unquote(body: str, quote: str = '"') -> str:
    """A Go string (or character) literal's text with its escapes applied, as strconv.Unquote
    does: \\x and octal escapes are bytes (invalid UTF-8 becomes U+FFFD); a surrogate, a
    code point past U+10FFFF or an unknown escape is a TemplateError."""
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(body):
        out += body[pos:m.start()].encode("utf-8", "surrogatepass")
        pos = m.end()
        simple, hex2, octal, u4, u8, bad = m.groups()
        if simple is not None and simple in "'\"" and simple != quote:
            bad = m.group()
        if bad is not None:
            raise TemplateError(f"template: unknown escape sequence {m.group()!r}")
        if simple is not None:
            out += _SIMPLE[simple].encode()
        elif hex2 is not None or octal is not None:
            code = int(hex2, 16) if hex2 is not None else int(octal, 8)
            if code > 0xFF:
                raise TemplateError(f"template: octal escape out of range {m.group()!r}")
            out.append(code)
        else:
            code = int(u4 or u8, 16)
            if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
                raise TemplateError(f"template: escape sequence is invalid Unicode code point "
                                    f"{m.group()!r}")
            out += chr(code).encode()
    out += body[pos:].encode("utf-8", "surrogatepass")
    return out.decode("utf-8", "replace")


def parse(source: str) -> list[Any]:
    """The node list of a template: text strings, Pipe actions and Branch blocks."""
    return _Parser(source).parse()

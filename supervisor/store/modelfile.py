"""Modelfiles: parse `FROM / PARAMETER / TEMPLATE / SYSTEM / LICENSE / MESSAGE / ADAPTER`, type
parameters as Ollama does, and render the text forms that `/api/show` returns."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest

# Ollama's api.Options field types (a Modelfile's PARAMETER names).
_INT_PARAMS = {"num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx",
               "num_batch", "num_gpu", "main_gpu", "num_thread", "draft_num_predict"}
_FLOAT_PARAMS = {"top_p", "min_p", "typical_p", "temperature", "repeat_penalty",
                 "presence_penalty", "frequency_penalty"}
_BOOL_PARAMS = {"use_mmap", "distributed"}
_LIST_PARAMS = {"stop"}
# mlxr's own, read when the model loads (docs/distributed.md): `distributed` (shard over the
# server's hostfile, or not), `sharding` (how).
_CHOICE_PARAMS = {"sharding": ("auto", "tensor", "pipeline")}
MESSAGE_ROLES = ("system", "user", "assistant")
COMMANDS = ("from", "parameter", "template", "system", "license", "message", "adapter")


@dataclass(slots=True)
class Modelfile:
    from_: str
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    adapter: str | None = None  # ADAPTER: a path (directory or file) to a LoRA adapter


def parse_parameter(name: str, value: Any) -> Any:
    """One parameter value typed like Ollama (`stop` is a list of strings)."""
    def bad(kind: str) -> InvalidRequest:
        return InvalidRequest(f"invalid {kind} value for parameter {name}: {value!r}")

    if name in _LIST_PARAMS:
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise bad("string")
        return list(values)
    if name in _INT_PARAMS:
        if isinstance(value, bool):
            raise bad("int")
        if isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, int):
            number = value
        else:
            try:
                number = int(str(value).strip())
            except ValueError:
                raise bad("int") from None
        if not -(1 << 63) <= number < 1 << 63:  # Go's int64
            raise bad("int")
        return number
    if name in _FLOAT_PARAMS:
        if isinstance(value, bool):
            raise bad("float")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise bad("float") from None
        if not math.isfinite(number):  # "nan", "inf": no sampler takes them
            raise bad("float")
        return number
    if name in _BOOL_PARAMS:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "t", "true"):
            return True
        if text in ("0", "f", "false"):
            return False
        raise bad("bool")
    if name in _CHOICE_PARAMS:
        text = str(value).strip().lower()
        if text not in _CHOICE_PARAMS[name]:
            raise InvalidRequest(f"invalid value for parameter {name}: {value!r} "
                                 f"(one of {', '.join(_CHOICE_PARAMS[name])})")
        return text
    raise InvalidRequest(f"unknown parameter '{name}'")


def normalize_parameters(params: Any) -> dict[str, Any]:
    """Type a JSON `parameters` object (from /api/create)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidRequest("parameters must be an object")
    return {str(k): parse_parameter(str(k), v) for k, v in params.items()}


def _unquote(value: str, lines: list[str], i: int, start_line: int) -> tuple[str, int]:
    """The value starting on line i (already stripped of its command); returns (text, next i)."""
    for quote in ('"""', '"'):
        if not value.startswith(quote):
            continue
        body = value[len(quote):]
        parts: list[str] = []
        while True:
            end = body.rstrip()
            if end.endswith(quote) and (parts or len(body.rstrip()) >= len(quote)):
                parts.append(end[:-len(quote)])
                return "\n".join(parts), i + 1
            parts.append(body)
            i += 1
            if i >= len(lines):
                raise InvalidRequest(f"Modelfile line {start_line}: unterminated {quote} value")
            body = lines[i]
    return value, i + 1


def parse_modelfile(text: str) -> Modelfile:
    """Parse a Modelfile. Errors (unknown command, bad role, no FROM) are `InvalidRequest`."""
    lines = text.lstrip("\ufeff").replace("\r\n", "\n").split("\n")
    out = Modelfile(from_="")
    raw_params: dict[str, list[str]] = {}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        number = i + 1
        if not line or line.startswith("#"):
            i += 1
            continue
        command, _, rest = line.partition(" ")
        if "\t" in command:
            command, _, more = command.partition("\t")
            rest = more + " " + rest
        command, rest = command.lower(), rest.strip()
        if command not in COMMANDS:
            raise InvalidRequest(f"Modelfile line {number}: unknown command \"{command}\"; "
                                 f"expected one of {', '.join(c.upper() for c in COMMANDS)}")
        key = ""
        if command in ("parameter", "message"):
            key, _, rest = rest.partition(" ")
            rest = rest.strip()
            if not key:
                raise InvalidRequest(f"Modelfile line {number}: {command.upper()} needs a name "
                                     "and a value")
        if not rest:
            raise InvalidRequest(f"Modelfile line {number}: {command.upper()} needs a value")
        value, i = _unquote(rest, lines, i, number)
        if command == "from":
            out.from_ = value
        elif command == "parameter":
            raw_params.setdefault(key, []).append(value)
        elif command == "template":
            out.template = value
        elif command == "system":
            out.system = value
        elif command == "license":
            out.license.append(value)
        elif command == "message":
            if key not in MESSAGE_ROLES:
                raise InvalidRequest(f"Modelfile line {number}: message role must be one of "
                                     + ", ".join(f'"{r}"' for r in MESSAGE_ROLES))
            out.messages.append({"role": key, "content": value})
        else:  # adapter: one per model, as Ollama applies one; a later line wins
            out.adapter = value
    if not out.from_:
        raise InvalidRequest("Modelfile has no FROM line")
    for key, values in raw_params.items():
        out.parameters[key] = (parse_parameter(key, values) if key in _LIST_PARAMS
                               else parse_parameter(key, values[-1]))
    return out


def _go_value(v: Any) -> str:
    """A value as Go's `%#v` prints it in `ollama show` (strings quoted, numbers bare)."""
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def format_parameters(params: dict[str, Any]) -> str:
    """The `parameters` text of /api/show: one `name  value` line per value."""
    lines = []
    for k in sorted(params):
        values = params[k] if isinstance(params[k], list) else [params[k]]
        lines.extend(f"{k:<30} {_go_value(v)}" for v in values)
    return "\n".join(lines)


def _quote(s: str) -> str:
    if "\n" in s or s.startswith(" ") or s.endswith(" ") or '"' in s:
        return f'"""{s}"""'
    return s


def render_modelfile(from_: str, *, template: str | None = None, system: str | None = None,
                     params: dict[str, Any] | None = None, license: list[str] | None = None,
                     messages: list[dict[str, Any]] | None = None,
                     adapters: list[str] | None = None) -> str:
    """The `modelfile` text of /api/show; parsing it back gives the same model settings.
    `adapters`: the paths of the model's LoRA adapter blobs (ADAPTER lines, as Ollama's)."""
    out = ['# Modelfile generated by "ollama show"',
           "# To build a new Modelfile based on this one, replace the FROM line with:",
           f"# FROM {' '.join(from_.splitlines())}", "", f"FROM {_quote(from_)}"]
    out.extend(f"ADAPTER {path}" for path in adapters or [])
    if template:
        out.append(f'TEMPLATE """{template}"""')
    if system:
        out.append(f"SYSTEM {_quote(system)}")
    for k in sorted(params or {}):
        values = params[k] if isinstance(params[k], list) else [params[k]]
        out.extend(f"PARAMETER {k} {_quote(v) if isinstance(v, str) else _go_value(v)}"
                   for v in values)
    for text in license or []:
        out.append(f'LICENSE """{text}"""')
    for m in messages or []:
        out.append(f"MESSAGE {m.get('role', '')} {_quote(str(m.get('content', '')))}")
    return "\n".join(out) + "\n"

"""Newline-delimited JSON helpers."""

from __future__ import annotations

from typing import Any

import orjson


def dumps_line(obj: Any) -> bytes:
    return orjson.dumps(obj) + b"\n"


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)

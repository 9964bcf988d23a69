"""The installed distribution's version: `mlxr --version` and `/api/version` both show it."""

from __future__ import annotations

import importlib.metadata


def version() -> str:
    try:
        return importlib.metadata.version("mlxr")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"

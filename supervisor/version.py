"""Versions: the installed distribution's (`mlxr --version`, and `/api/version`'s
`mlxr_version`), and the Ollama release whose API mlxr implements (`/api/version`'s `version`,
which Ollama clients read to decide which features a server has)."""

from __future__ import annotations

import importlib.metadata

# The Ollama release whose API this matches: think levels including "max", reasoning efforts
# clamped as openai.thinkFromReasoningEffort does (0.32.11 on), logprobs with `bytes`,
# capabilities in /api/tags. Checked against Ollama's source at v0.32.15.
OLLAMA_API_VERSION = "0.32.15"


def version() -> str:
    try:
        return importlib.metadata.version("mlxr")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"

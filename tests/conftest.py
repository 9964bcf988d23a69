"""Shared fixtures: random-weight test models, made once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.registry.random_model import write_random_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    made: dict[tuple[str, int], Path] = {}

    def make(preset: str = "tiny", seed: int = 0) -> Path:
        key = (preset, seed)
        if key not in made:
            made[key] = write_random_model(tmp_path_factory.mktemp(f"model-{preset}-{seed}"),
                                           preset, seed)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    """Untied-head random qwen3: greedy output varies with the whole context."""
    return model_factory("tiny")


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """The environment for real mlxr processes started by tests."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env

"""Shared fixtures: random-weight test models, made once per session. Also prints the time
each tier took (tests/unit: no MLX, no processes; tests/mlx: MLX in this process;
tests/integration: real processes) at the end of a run, and orders the run longest first."""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

import pytest

from mlxr.supervisor.store.random_model import write_random_model

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


@pytest.fixture(scope="module", autouse=True)
def _module_folders_go_with_the_module(request, tmp_path_factory):
    """A module's own tmp_path_factory folders (stores, model copies, registries: 50-550 MB
    each, about 7 GB a run in all) are removed when its fixtures end, unless one of its tests
    failed. model_factory's models serve the whole session and stay. A test's tmp_path goes
    when the test passes (tmp_path_retention_policy in pyproject.toml)."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for path in set(base.iterdir()) - before:
        if not path.name.startswith("model-"):
            shutil.rmtree(path, ignore_errors=True)


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
    # No spare runner (supervisor/runners/spare.py) unless a test asks: tests count a
    # server's child processes, and most start a server for one load or none.
    env.setdefault("MLXR_SPARE_RUNNER", "0")
    return env


@pytest.fixture(scope="session")
def reference(tiny_model):
    """mlx-lm's own greedy generation of a prompt, alone."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    model, tokenizer = load(str(tiny_model))

    def generate(prompt_tokens: list[int], n: int) -> list[int]:
        steps = generate_step(mx.array(prompt_tokens), model, max_tokens=n,
                              sampler=make_sampler(0.0))
        return [int(t) for t, _ in steps][:n]

    generate.tokenizer = tokenizer
    return generate


# The modules that take longest (about a minute or more of one worker's time), run first,
# then the rest by tier, slowest tier first. `make test` hands whole files to its 2 workers
# in this order (--no-loadscope-reorder; xdist's own order, most tests first, put these few-
# test files last, and one of them would then run alone at the end).
LONGEST_FIRST = ("test_distributed.py", "test_model_formats.py", "test_vision_api.py",
                 "test_cli_commands.py", "test_make_serve.py", "test_structured_api.py",
                 "test_vision_formats.py", "test_ollama_scheduling.py",
                 "test_runner_kv_pool.py")
TIER_ORDER = ("integration", "mlx", "fuzz", "unit")


def pytest_collection_modifyitems(items) -> None:
    def key(item) -> tuple[int, int]:
        path = Path(str(item.fspath))
        tier = path.relative_to(ROOT / "tests").parts[0] if path.is_relative_to(
            ROOT / "tests") else ""
        longest = LONGEST_FIRST.index(path.name) if path.name in LONGEST_FIRST else \
            len(LONGEST_FIRST)
        return (longest, TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER))
    items.sort(key=key)  # stable: each module keeps its own order


_TIER_SECONDS: dict[str, float] = collections.defaultdict(float)
_TIER_COUNTS: dict[str, int] = collections.defaultdict(int)
_FILE_SECONDS: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    _TIER_SECONDS[tier] += report.duration  # setup, call and teardown all count
    _FILE_SECONDS[report.nodeid.split("::")[0]] += report.duration
    if report.when == "call":
        _TIER_COUNTS[tier] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _TIER_SECONDS:
        terminalreporter.write_line("time per tier: " + ", ".join(
            f"{tier} {_TIER_COUNTS[tier]} tests {seconds:.1f} s"
            for tier, seconds in sorted(_TIER_SECONDS.items())))
        slowest = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]
        terminalreporter.write_line("slowest files: " + ", ".join(
            f"{Path(name).name} {seconds:.0f} s" for name, seconds in slowest))

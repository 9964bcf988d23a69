"""`mlxr setup-demo` then `mlxr serve`: what `make serve` runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness.server import ROOT, start_server

pytestmark = pytest.mark.timeout(180)


def mlxr(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_setup_demo_then_serve(tmp_path, subprocess_env):
    env = {**subprocess_env, "MLXR_MODELS": str(tmp_path / "models")}
    first = mlxr("setup-demo", env=env)
    assert first.returncode == 0, first.stderr
    assert "success" in first.stdout and "demo:latest is ready" in first.stdout
    assert "all-minilm:latest is ready" in first.stdout
    again = mlxr("setup-demo", env=env)
    assert again.returncode == 0 and "success" not in again.stdout  # already there

    server = start_server(tmp_path, subprocess_env, models_dir=tmp_path / "models")
    try:
        client = server.client()
        models = {m.model: m for m in client.list().models}
        assert sorted(models) == ["all-minilm:latest", "demo:latest"]
        assert models["demo:latest"].details.family == "qwen3"
        reply = client.generate(model="demo", prompt="Hello", options={"num_predict": 3})
        assert reply.eval_count == 3 and reply.done_reason == "length"
        # The demo's own default length: random weights never end a reply by themselves.
        assert client.generate(model="demo", prompt="Hello").eval_count == 64
        assert "random test model" in client.show("demo").modelinfo["general.description"]
        [vector] = client.embed(model="all-minilm", input="Hello").embeddings
        assert len(vector) == 384 and abs(sum(v * v for v in vector) - 1) < 1e-4
        assert "embedding" in client.show("all-minilm").capabilities
    finally:
        server.stop()


def test_help(subprocess_env):
    out = mlxr("--help", env=subprocess_env)
    assert out.returncode == 0 and "serve" in out.stdout and "setup-demo" in out.stdout
    env = {**subprocess_env, "MLXR_HOST": "127.0.0.1:1"}  # no server there: client version only
    version = mlxr("--version", env=env)
    assert version.returncode == 0
    assert "client version is" in version.stdout + version.stderr, version

"""The config file as a user meets it: `mlxr config` shows each setting and its source, `mlxr
serve` listens where the file says, and a bad file stops `mlxr serve` with a message naming
the key and the file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness.server import answers, free_port, wait_for

pytestmark = pytest.mark.timeout(120)

MLXR = [sys.executable, "-m", "mlxr.supervisor.cli"]


def test_config_shows_each_setting_and_where_it_came_from(tmp_path, subprocess_env):
    config = tmp_path / "config.toml"
    config.write_text('[scheduler]\nnum_parallel = 4\nmax_queue = 9\n[server]\nkeep_alive = "10m"\n')
    env = {**subprocess_env, "MLXR_CONFIG": str(config), "MLXR_MAX_QUEUE": "12"}
    env.pop("MLXR_HOST", None)
    out = subprocess.run([*MLXR, "config"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = {line.split("=")[0].strip(): line for line in out.stdout.splitlines() if "=" in line}
    assert f"# config file: {config}" in out.stdout
    assert lines["num_parallel"].startswith("num_parallel = 4") and \
        lines["num_parallel"].endswith(f"# file {config}")
    assert lines["max_queue"].startswith("max_queue = 12") and \
        lines["max_queue"].endswith("# environment")
    assert lines["keep_alive"].startswith("keep_alive = 600.0")
    assert lines["context_length"].endswith("# default")


def test_serve_listens_where_the_file_says_and_refuses_a_bad_file(tmp_path, subprocess_env):
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1:{port}"\nstate_dir = "{tmp_path}/state"\n'
                      f'[store]\nmodels = "{tmp_path}/models"\n')
    env = {k: v for k, v in subprocess_env.items()
           if k not in ("MLXR_HOST", "OLLAMA_HOST", "MLXR_MODELS")}
    env["MLXR_CONFIG"] = str(config)
    proc = subprocess.Popen([*MLXR, "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: answers(f"http://127.0.0.1:{port}/api/tags"), timeout=30)
        assert (tmp_path / "models").is_dir()
        assert (tmp_path / "state" / f"serve-127.0.0.1-{port}.pid").exists()
    finally:
        proc.terminate()
        proc.wait(30)
    config.write_text("[scheduler]\nnum_parallel = \"many\"\n")
    bad = subprocess.run([*MLXR, "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert f"{config}: [scheduler] num_parallel: must be an integer" in bad.stderr

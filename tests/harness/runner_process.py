"""A real runner subprocess for tests: `python -m mlxr.runner` on a free port, given its secret
on stdin and stopped by closing stdin (the way the supervisor does). The URL it yields carries
the secret as basic-auth credentials (`http://runner:SECRET@127.0.0.1:PORT`), which httpx
sends on every request, so tests call the runner with plain `httpx.get(url + path)`."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from mlxr.shared.runner_auth import make_token
from tests.harness.server import free_port


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(url + "/v1/status", timeout=1).json()["status"] == "ready":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("runner did not become ready")


@contextlib.contextmanager
def running(model_dir: Path, env: dict[str, str], **config) -> Iterator[str]:
    """A ready runner for `model_dir` (RunnerConfig fields as keywords); yields its URL."""
    port = free_port()
    full = {"model_dir": str(model_dir), "port": port, "watch_stdin": True, "token_stdin": True,
            **config}
    proc = subprocess.Popen([sys.executable, "-m", "mlxr.runner", "--config", json.dumps(full)],
                            env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    token = make_token()
    proc.stdin.write(token.encode() + b"\n")
    proc.stdin.flush()
    try:
        url = f"http://runner:{token}@127.0.0.1:{port}"
        wait_ready(url, proc)
        yield url
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

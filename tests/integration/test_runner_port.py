"""Starting a runner when another process binds its port first: `free_port` hands out a port
that is free now, and a runner binds it a second or two later. Under a parallel test run, two
supervisors got the same port; the one whose runner lost the race asked the other's runner
for its status (a 401, read as "a status without status") and answered a chat with a 500."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx

from mlxr.shared.config import RunnerConfig, Settings
from mlxr.supervisor.runners import client as runner_client
from tests.harness.server import free_port

FAKE = "tests.harness.fake_runner"
ROOT = Path(__file__).resolve().parents[2]


class NoBlas:
    async def choice(self):
        return types.SimpleNamespace(path=None)


def test_a_runner_whose_port_another_process_took_starts_on_another(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    taken = free_port()
    other = RunnerConfig(model_dir=str(tmp_path), model_name="other:latest", port=taken,
                         token_stdin=True)
    squatter = subprocess.Popen([sys.executable, "-m", FAKE, "--config",
                                 json.dumps(other.to_dict())],
                                stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        squatter.stdin.write(b"another-runners-secret\n")
        squatter.stdin.flush()
        deadline = time.monotonic() + 30
        while True:  # serving: it answers us with a 401 (we have not its secret)
            try:
                assert httpx.get(f"http://127.0.0.1:{taken}/v1/status").status_code == 401
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and squatter.poll() is None
                time.sleep(0.1)
        handed = iter([taken])
        monkeypatch.setattr(runner_client, "free_port",
                            lambda host="127.0.0.1": next(handed, None) or free_port())
        settings = dataclasses.replace(Settings(), runner_module=FAKE, load_timeout_s=60.0)
        spec = types.SimpleNamespace(model_dir=tmp_path, name="m:latest", context_length=2048,
                                     kv_cache_bytes=1 << 30, local_ranks=1,
                                     sharding="auto", hosts=())
        start = runner_client.make_runner_factory(settings, NoBlas())

        async def started():
            client = await start(spec)
            try:
                return client.config.port, (await client.status()).status
            finally:
                await client.stop()

        port, status = asyncio.run(started())
        assert port != taken and status == "ready"
        assert squatter.poll() is None  # the other one was left alone
    finally:
        squatter.kill()
        squatter.wait()

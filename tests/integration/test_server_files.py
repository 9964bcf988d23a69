"""What `mlxr serve` leaves for the people who look after it: a pid file while it runs (a second
server on the same address is refused with a message naming the first; a stale pid file is
replaced), a log file beside stderr, and a clear message when another program holds the
port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.harness.server import answers, free_port, start_server, wait_for

pytestmark = pytest.mark.timeout(120)

SERVE = [sys.executable, "-m", "mlxr.supervisor.cli", "serve"]


def serve_env(base: dict, address: str, state) -> dict:
    return {**base, "MLXR_HOST": address, "MLXR_STATE_DIR": str(state),
            "MLXR_MODELS": str(state / "models")}


def test_pid_file_and_log_file_and_a_second_server_is_refused(tmp_path, subprocess_env):
    server = start_server(tmp_path, subprocess_env)
    try:
        address = server.url.removeprefix("http://")
        key = address.replace(":", "-")
        pid_file = tmp_path / "state" / f"serve-{key}.pid"
        assert pid_file.read_text().strip() == str(server.proc.pid)
        second = subprocess.run(SERVE, env=serve_env(subprocess_env, address, tmp_path / "state"),
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert f"an mlxr server (pid {server.proc.pid}) is already serving {address}" in \
            second.stderr
        assert pid_file.read_text().strip() == str(server.proc.pid)  # left alone
        server.http().get("/api/tags")
        log = tmp_path / "state" / "logs" / f"server-{key}.log"
        assert wait_for(lambda: log.exists() and "GET /api/tags 200" in log.read_text())
        assert "Listening on" in log.read_text()
    finally:
        server.stop()
    assert not pid_file.exists()


def test_a_stale_pid_file_is_replaced(tmp_path, subprocess_env):
    port = free_port()
    state = tmp_path / "state"
    state.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = state / f"serve-127.0.0.1-{port}.pid"
    stale.write_text(dead + "\n")
    proc = subprocess.Popen(SERVE, env=serve_env(subprocess_env, f"127.0.0.1:{port}", state),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # once it serves, SIGTERM is handled (and the pid file removed)
        assert wait_for(lambda: answers(f"http://127.0.0.1:{port}/"), timeout=30)
        assert stale.read_text().strip() == str(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    assert not stale.exists()


def test_a_port_held_by_another_program_is_named(tmp_path, subprocess_env):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(SERVE, env=serve_env(subprocess_env, f"127.0.0.1:{port}",
                                                   tmp_path / "state"),
                              capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"127.0.0.1:{port} is already in use by another program" in done.stderr
    assert not list((tmp_path / "state").glob("*.pid"))
    assert os.path.isdir(tmp_path / "state")

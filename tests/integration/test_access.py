"""Who can reach what: the runners' secret (a real supervisor and real runners on a tiny
model), the Host check against DNS rebinding, the Unix-socket listener (with the CLI), and
runners that never outlive a supervisor killed with SIGKILL."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from tests.harness.server import (ROOT, kill9, pid_alive, start_server, wait_for,
                                  write_fake_model)

pytestmark = pytest.mark.timeout(120)
RUNNER_ROUTES = [("GET", "/v1/status", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                 ("POST", "/v1/tokenize", {"content": "hi"}),
                 ("POST", "/v1/detokenize", {"tokens": [1]}),
                 ("POST", "/v1/embeddings", {"input": "hi"})]


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env):
    server = start_server(tmp_path_factory.mktemp("access"), subprocess_env)
    yield server
    server.stop()


def runner_config(pid: int) -> dict:
    argv = psutil.Process(pid).cmdline()
    return json.loads(argv[argv.index("--config") + 1])


def test_runners_need_their_secret_and_die_with_a_killed_supervisor(
        tmp_path, subprocess_env, tiny_model):
    server = start_server(tmp_path, subprocess_env)
    try:
        client = server.client()
        client.create(model="tiny", from_=str(tiny_model))
        # The request waits for the load; the supervisor will be killed while it runs.
        threading.Thread(target=_ignore_errors, daemon=True, args=(
            lambda: client.generate(model="tiny", prompt="hi", options={"num_predict": 1000}),
        )).start()
        assert wait_for(lambda: len(server.runner_pids()) == 1, timeout=30)
        [pid] = server.runner_pids()
        config = runner_config(pid)
        assert config["token_stdin"] is True and not config["token_file"]
        with httpx.Client(base_url=f"http://127.0.0.1:{config['port']}", trust_env=False,
                          timeout=30) as http:
            assert wait_for(lambda: _answers(http), timeout=30)
            for method, path, body in RUNNER_ROUTES:
                for headers in ({}, {"Authorization": "Bearer guess"}):
                    resp = http.request(method, path, json=body, headers=headers)
                    assert resp.status_code == 401, (path, resp.text)
                    assert resp.json() == {"error": "missing or wrong runner token",
                                           "kind": "unauthorized"}
        kill9(server.proc.pid)
        server.proc.wait(5)
        assert wait_for(lambda: not pid_alive(pid), timeout=5), "the runner outlived it"
    finally:
        server.stop()


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/v1/status").status_code == 401
    except httpx.TransportError:
        return False


def _ignore_errors(call) -> None:
    try:
        call()
    except Exception:
        pass


def test_a_rebound_host_name_is_refused(server):
    with server.http() as http:
        resp = http.get("/api/tags", headers={"Host": "attacker.example:11434"})
        assert resp.status_code == 403 and "attacker.example" in resp.json()["error"]
        resp = http.post("/api/generate", json={"model": "tiny", "prompt": "hi"},
                         headers={"Host": "rebind.attacker.example"})
        assert resp.status_code == 403
        assert http.get("/api/tags", headers={"Host": "localhost:11434"}).status_code == 200


def test_the_api_on_a_unix_socket(tmp_path, subprocess_env):
    path = tmp_path / "run" / "mlxr.sock"
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX)  # a server that died left its socket file
    stale.bind(str(path))
    stale.close()
    model = write_fake_model(tmp_path / "fake")
    server = start_server(tmp_path, subprocess_env, socket_path=path,
                          MLXR_RUNNER_MODULE="tests.harness.fake_runner")
    try:
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        client = server.client()
        client.create(model="a", from_=str(model))
        assert client.generate(model="a", prompt="hi", options={"num_predict": 3}).eval_count == 3
        with server.http() as http:  # no Host check on a socket: its mode is the access rule
            assert http.get("/api/tags", headers={"Host": "attacker.example"}).status_code == 200
        env = {**subprocess_env, "MLXR_HOST": f"unix://{path}"}
        env.pop("OLLAMA_HOST", None)
        listed = subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", "list"], env=env,
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "a:latest" in listed.stdout, listed.stderr
        server.stop()
        assert server.proc.returncode == 0 and not os.path.exists(path)
        down = subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", "list"], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert down.returncode == 1 and f"unix:{path}" in down.stderr
    finally:
        server.stop()


def test_a_runner_started_by_hand_makes_its_secret_and_says_where(tmp_path, subprocess_env,
                                                                    tiny_model):
    proc = subprocess.Popen([sys.executable, "-m", "mlxr.runner", "--model", str(tiny_model),
                             "--port", "0"], env={**subprocess_env, "MLXR_OPENBLAS": "off"},
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if '"event": "listening"' in line:
                event = json.loads(line)
                break
        path = event["token_file"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        token = open(path).read().strip()
        url = f"http://127.0.0.1:{event['port']}/v1/status"
        assert httpx.get(url, trust_env=False).status_code == 401
        assert httpx.get(url, trust_env=False, auth=("", token)).status_code == 200
        assert httpx.get(url, trust_env=False,
                         headers={"Authorization": f"Bearer {token}"}).status_code == 200
        proc.terminate()
        assert proc.wait(10) == 0 and not os.path.exists(os.path.dirname(path))
    finally:
        proc.kill()
        proc.wait()


def test_a_runner_whose_parent_died_during_the_blas_re_exec_exits(tmp_path, subprocess_env,
                                                                   tiny_model):
    # The pid handed across the re-exec is not the new image's parent: the parent died in
    # between (and the runner was re-parented), so it must not go on serving.
    done = subprocess.run([sys.executable, "-m", "mlxr.runner", "--model", str(tiny_model),
                           "--port", "0"], env={**subprocess_env, "MLXR_RUNNER_PARENT": "1",
                                                "MLXR_OPENBLAS": "off"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "listening" not in done.stderr

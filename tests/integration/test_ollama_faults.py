"""Crash, queue, load-failure, memory and lifetime behaviour of a real `mlxr serve`, with the
fake runner (tests/harness/fake_runner.py) so the timing is exact and nothing loads weights."""

from __future__ import annotations

import json
import re
import threading
import time

import ollama
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.server import (kill9, pid_alive, start_server, wait_for, write_fake_model)

pytestmark = pytest.mark.timeout(120)
FAKE = "tests.harness.fake_runner"


@pytest.fixture(scope="module")
def fake_model_dir(tmp_path_factory):
    return write_fake_model(tmp_path_factory.mktemp("fake-model"))


def serve(tmp_path, subprocess_env, fake_model_dir, models=("a",), knobs=None, **env):
    server = start_server(tmp_path, subprocess_env, MLXR_RUNNER_MODULE=FAKE,
                          FAKE_RUNNER=json.dumps(knobs or {}), **env)
    client = server.client()
    for name in models:
        client.create(model=name, from_=str(fake_model_dir))
    return server, client


def stream_generate(client, model="a", num_predict=200, **kw):
    return client.generate(model=model, prompt="hi", stream=True,
                           options={"num_predict": num_predict}, **kw)


def runner_requests(server) -> float:
    text = server.http().get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "mlxr_runner_requests":
            return sum(s.value for s in family.samples)
    return 0.0


def test_runner_killed_mid_stream(tmp_path, subprocess_env, fake_model_dir):
    server, client = serve(tmp_path, subprocess_env, fake_model_dir, knobs={"delay_s": 0.02})
    try:
        errors: list[tuple[str, float]] = []

        def other_stream():  # a second client in flight on the same runner
            try:
                for _ in client.chat(model="a", messages=[{"role": "user", "content": "x"}],
                                     stream=True, options={"num_predict": 500}):
                    pass
            except ollama.ResponseError as exc:
                errors.append((exc.error, time.monotonic()))

        stream = stream_generate(client)
        assert next(stream).response
        thread = threading.Thread(target=other_stream)
        thread.start()
        assert wait_for(lambda: runner_requests(server) == 2)
        [pid] = server.runner_pids()
        kill9(pid)
        killed = time.monotonic()
        with pytest.raises(ollama.ResponseError) as info:
            for _ in stream:
                pass
        assert time.monotonic() - killed < 1.0
        assert "was killed by SIGKILL (killed) while serving" in info.value.error
        thread.join(5)
        assert errors and errors[0][1] - killed < 1.0
        assert "was killed by SIGKILL" in errors[0][0]

        reply = client.generate(model="a", prompt="again", options={"num_predict": 3})
        assert reply.done_reason == "length" and reply.eval_count == 3
        assert server.runner_pids() and server.runner_pids() != [pid]
    finally:
        server.stop()


def test_queue_overflow_is_503(tmp_path, subprocess_env, fake_model_dir):
    server, client = serve(tmp_path, subprocess_env, fake_model_dir, knobs={"delay_s": 0.05},
                           MLXR_NUM_PARALLEL="1", MLXR_MAX_QUEUE="2")
    try:
        client.generate(model="a", keep_alive="10m")  # load first
        results: list[int] = []

        def run():
            reply = client.generate(model="a", prompt="hi", options={"num_predict": 40})
            results.append(reply.eval_count)

        threads = [threading.Thread(target=run) for _ in range(3)]  # 1 running + 2 queued
        for t in threads:
            t.start()
        assert wait_for(lambda: runner_requests(server) == 3)
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model="a", prompt="one too many")
        assert info.value.status_code == 503
        assert "server busy" in info.value.error
        for t in threads:
            t.join(10)
        assert results == [40, 40, 40]
        client.generate(model="a", prompt="room again", options={"num_predict": 1})
    finally:
        server.stop()


def test_client_disconnect_releases_the_runner(tmp_path, subprocess_env, fake_model_dir):
    server, client = serve(tmp_path, subprocess_env, fake_model_dir, knobs={"delay_s": 0.05})
    try:
        with server.http() as http:
            with http.stream("POST", "/api/generate", json={
                    "model": "a", "prompt": "hi", "options": {"num_predict": 1000}}) as resp:
                lines = resp.iter_lines()
                next(lines)
                assert runner_requests(server) == 1
        assert wait_for(lambda: runner_requests(server) == 0, timeout=3)
    finally:
        server.stop()


def test_load_failures_carry_the_runner_message(tmp_path, subprocess_env, fake_model_dir):
    knobs = {"models": {"bad:latest": {"fail_load": "weights are corrupt"},
                        "dies:latest": {"exit_on_start": "fatal: out of cheese"},
                        "sigill:latest": {"signal_on_start": "SIGILL"}}}
    server, client = serve(tmp_path, subprocess_env, fake_model_dir,
                           models=("bad", "dies", "sigill"), knobs=knobs)
    try:
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model="bad", prompt="hi")
        assert info.value.status_code == 500 and "weights are corrupt" in info.value.error
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model="dies", messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 500
        assert "out of cheese" in info.value.error
        assert "runner for dies:latest exited with code 3 while loading" in info.value.error
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model="sigill", prompt="hi")
        assert info.value.status_code == 500
        assert ("runner for sigill:latest was killed by SIGILL (illegal instruction) while "
                "loading; this CPU cannot run an instruction") in info.value.error
        # no raw return code (-4) anywhere; the message may name a file such as
        # openblas-shim-46240df5.so, whose hash can start with "4"
        assert not re.search(r"(?<![\w-])-4\b", info.value.error), info.value.error
        assert client.ps().models == []
    finally:
        server.stop()


def test_model_that_cannot_fit_is_507(tmp_path, subprocess_env, fake_model_dir):
    huge = tmp_path / "huge"
    write_fake_model(huge)
    config = json.loads((huge / "config.json").read_text())
    config.update(num_hidden_layers=4096, num_key_value_heads=64, head_dim=256)  # ~TBs of KV
    (huge / "config.json").write_text(json.dumps(config))
    server, client = serve(tmp_path, subprocess_env, fake_model_dir)
    try:
        client.create(model="huge", from_=str(huge))
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model="huge", prompt="hi")
        assert info.value.status_code == 507
        assert "model requires more system memory" in info.value.error
        assert client.generate(model="a", prompt="hi", options={"num_predict": 2}).eval_count == 2
    finally:
        server.stop()


def test_keep_alive_expiry_and_supervisor_kill(tmp_path, subprocess_env, fake_model_dir):
    server, client = serve(tmp_path, subprocess_env, fake_model_dir, models=("a", "b"))
    try:
        client.generate(model="b", prompt="hi", keep_alive=-1, options={"num_predict": 1})
        client.generate(model="a", prompt="hi", keep_alive="1s", options={"num_predict": 1})
        assert server.ps_names() == ["a:latest", "b:latest"]
        assert wait_for(lambda: server.ps_names() == ["b:latest"], timeout=5)
        client.generate(model="a", prompt="hi", options={"num_predict": 1})
        assert wait_for(lambda: len(server.runner_pids()) == 2)  # the expired one has exited
        pids = server.runner_pids()
        kill9(server.proc.pid)
        server.proc.wait(5)
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=5)
    finally:
        server.stop()


def test_sigterm_stops_runners_and_exits_cleanly(tmp_path, subprocess_env, fake_model_dir):
    server, client = serve(tmp_path, subprocess_env, fake_model_dir)
    try:
        client.generate(model="a", prompt="hi", keep_alive=-1, options={"num_predict": 1})
        pids = server.runner_pids()
        assert len(pids) == 1
        server.proc.terminate()
        assert server.proc.wait(10) == 0
        assert not any(pid_alive(p) for p in pids)
        assert "unloading a:latest (shutdown)" in server.log()
    finally:
        server.stop()

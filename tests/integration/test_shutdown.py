"""Graceful shutdown and crash loops of a real `mlxr serve`, with the fake runner
(tests/harness/fake_runner.py) so the timing is exact and nothing loads weights."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import ollama
import pytest

from tests.harness.server import pid_alive, start_server, wait_for, write_fake_model

pytestmark = pytest.mark.timeout(60)
FAKE = "tests.harness.fake_runner"
DELAY_S = 0.05  # between tokens


@pytest.fixture(scope="module")
def fake_model_dir(tmp_path_factory):
    return write_fake_model(tmp_path_factory.mktemp("fake-model"))


class Reader(threading.Thread):
    """Reads one streamed reply line by line (NDJSON or SSE `data:` lines) into `lines`."""

    def __init__(self, http: httpx.Client, path: str, body: dict):
        super().__init__(daemon=True)
        self.http, self.path, self.body = http, path, body
        self.lines: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.http.stream("POST", self.path, json=self.body) as resp:
                for line in resp.iter_lines():
                    line = line.removeprefix("data: ")
                    if line.strip() and line != "[DONE]":
                        self.lines.append(json.loads(line))
        except BaseException as exc:  # the test asserts on it
            self.error = exc


def test_sigterm_lets_short_streams_finish_and_ends_the_rest_with_an_error(
        tmp_path, subprocess_env, fake_model_dir):
    server = start_server(tmp_path, subprocess_env, MLXR_RUNNER_MODULE=FAKE,
                          FAKE_RUNNER=json.dumps({"delay_s": DELAY_S}), MLXR_SHUTDOWN_GRACE="1.5s")
    try:
        server.client().create(model="a", from_=str(fake_model_dir))
        http = server.http()
        short = Reader(http, "/api/generate", {"model": "a", "prompt": "hi",
                                               "options": {"num_predict": 20}})  # ~1 s
        long = Reader(http, "/api/generate", {"model": "a", "prompt": "hi",
                                              "options": {"num_predict": 2000}})  # ~100 s
        openai = Reader(http, "/v1/chat/completions", {
            "model": "a", "stream": True, "max_tokens": 2000,
            "messages": [{"role": "user", "content": "hi"}]})
        for reader in (short, long, openai):
            reader.start()
        assert wait_for(lambda: all(r.lines for r in (short, long, openai)), timeout=20)
        [runner] = server.runner_pids()
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert server.proc.wait(15) == 0
        took = time.monotonic() - sent
        for reader in (short, long, openai):
            reader.join(5)
            assert reader.error is None, reader.error

        assert short.lines[-1]["done"] is True and short.lines[-1]["eval_count"] == 20
        assert long.lines[-1] == {"error": "server shutting down"}
        assert not any(line.get("done") for line in long.lines[:-1])
        assert openai.lines[-1]["error"]["message"] == "server shutting down"
        assert 1.5 <= took < 8, took
        assert not pid_alive(runner)
        with pytest.raises(httpx.ConnectError):
            http.get("/api/tags")
    finally:
        server.stop()


def test_sigint_with_nothing_running_exits_at_once(tmp_path, subprocess_env, fake_model_dir):
    server = start_server(tmp_path, subprocess_env, MLXR_RUNNER_MODULE=FAKE,
                          MLXR_SHUTDOWN_GRACE="30s")
    try:
        client = server.client()
        client.create(model="a", from_=str(fake_model_dir))
        client.generate(model="a", prompt="hi", keep_alive=-1, options={"num_predict": 1})
        [runner] = server.runner_pids()
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C
        sent = time.monotonic()
        assert server.proc.wait(10) == 0
        assert time.monotonic() - sent < 5, "no stream: the grace period is not waited for"
        assert not pid_alive(runner)
    finally:
        server.stop()


def test_a_crash_looping_model_fails_fast_until_it_is_re_created(
        tmp_path, subprocess_env, fake_model_dir):
    knobs = {"models": {"dies:latest": {"exit_on_start": "fatal: out of cheese"}}}
    server = start_server(tmp_path, subprocess_env, MLXR_RUNNER_MODULE=FAKE,
                          FAKE_RUNNER=json.dumps(knobs), MLXR_MAX_LOAD_FAILURES="2")
    try:
        client = server.client()
        client.create(model="dies", from_=str(fake_model_dir))
        for _ in range(2):
            with pytest.raises(ollama.ResponseError) as info:
                client.generate(model="dies", prompt="hi")
            assert "exited with code 3 while loading" in info.value.error
        assert server.log().count("started runner pid") == 2

        t0 = time.monotonic()
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model="dies", messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 < 1.0
        assert info.value.status_code == 500
        assert "dies:latest failed to load 2 times in a row" in info.value.error
        assert "out of cheese" in info.value.error
        assert server.log().count("started runner pid") == 2, "no runner spawned"

        changed = write_fake_model(tmp_path / "changed")
        (changed / "config.json").write_text(
            (changed / "config.json").read_text().replace('"hidden_size": 8', '"hidden_size": 8 '))
        client.create(model="dies", from_=str(changed))  # a new digest
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model="dies", prompt="hi")
        assert "exited with code 3 while loading" in info.value.error
        assert wait_for(lambda: server.log().count("started runner pid") == 3)
    finally:
        server.stop()

"""Two real models on a real runner with MLXR_MAX_LOADED_MODELS=1: requests that alternate
between them swap the runner and each gets its own model's answer; killing the supervisor
takes its runners down."""

from __future__ import annotations

import threading

import pytest

from tests.harness.server import kill9, pid_alive, start_server, wait_for

pytestmark = pytest.mark.timeout(180)
OPTIONS = {"temperature": 0, "num_predict": 10}
PROMPT = "Tell me a story"


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, model_factory):
    srv = start_server(tmp_path_factory.mktemp("sched"), subprocess_env,
                       MLXR_MAX_LOADED_MODELS="1")
    client = srv.client()
    client.create(model="one", from_=str(model_factory("tiny", 0)))
    client.create(model="two", from_=str(model_factory("tiny", 1)))
    yield srv
    srv.stop()


def answer(server, model: str) -> str:
    return server.client().generate(model=model, prompt=PROMPT, options=OPTIONS,
                                    think=False).response


def test_alternating_requests_swap_models(server):
    reference: dict[str, str] = {}
    for model in ("one", "two", "one"):
        assert reference.setdefault(model, answer(server, model)) == answer(server, model)
        assert server.ps_names() == [f"{model}:latest"]
        assert len(server.runner_pids()) == 1
    assert reference["one"] != reference["two"]  # different weights, different greedy text

    results: dict[int, tuple[str, str]] = {}

    def run(i: int, model: str) -> None:
        results[i] = (model, answer(server, model))

    threads = [threading.Thread(target=run, args=(i, m))
               for i, m in enumerate(["two", "one", "two"])]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, len(server.runner_pids()))
        threads[0].join(0.02)
    for t in threads:
        t.join()
    assert len(results) == 3
    assert all(text == reference[model] for model, text in results.values())
    assert peak <= 1, "two runners were alive at once with MLXR_MAX_LOADED_MODELS=1"


def test_supervisor_kill_takes_runners_down(server):
    answer(server, "one")
    pids = server.runner_pids()
    assert pids
    kill9(server.proc.pid)
    server.proc.wait(5)
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=5)

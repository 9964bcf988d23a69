"""A runner sharded over 2 ranks (tensor parallel, mlx.distributed's ring backend on
loopback), started by a real `mlxr serve` from MLXR_HOSTFILE: greedy output is token-identical
to the single-process runner for a batch of 8 mixed-length requests; killing a rank mid-stream
gives the client an error line within 2 s, and the next request starts a new group."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import pytest

from tests.harness.server import serving, wait_for

pytestmark = pytest.mark.timeout(240)
PROMPTS = [("word " * (3 + 37 * i)) + f"end {i}" for i in range(8)]
LENGTHS = [6 + 4 * i for i in range(8)]


def ranks(server) -> list[dict]:
    with server.http() as http:
        return http.get("/api/ps").json()["models"][0]["ranks"]


def answers(server) -> list[str]:
    client = server.client()

    def one(i: int) -> str:
        return client.generate(model="m", prompt=PROMPTS[i], raw=True, options={
            "temperature": 0, "num_predict": LENGTHS[i]}).response

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


@pytest.fixture(scope="module")
def small_model(model_factory):
    return model_factory("small")  # 4 heads, 2 KV heads: shards over 2 ranks


@pytest.fixture(scope="module")
def single(tmp_path_factory, subprocess_env, small_model):
    yield from serving(tmp_path_factory.mktemp("single"), subprocess_env, {"m": small_model})


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, subprocess_env, small_model):
    tmp = tmp_path_factory.mktemp("sharded")
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    yield from serving(tmp, subprocess_env, {"m": small_model}, MLXR_HOSTFILE=str(hostfile))


def test_two_ranks_give_the_single_runners_tokens(single, sharded):
    want = answers(single)
    assert len(set(want)) > 1
    assert answers(sharded) == want
    shown = ranks(sharded)
    assert [r["rank"] for r in shown] == [0, 1]
    assert all(r["host"] == "localhost" and r["memory"] > 0 for r in shown)
    assert len(sharded.runner_pids()) == 2


def test_a_dead_rank_fails_the_stream_fast_and_the_group_restarts(sharded):
    sharded.client().generate(model="m", prompt="warm", options={"num_predict": 1})
    follower = ranks(sharded)[1]["pid"]
    stream = sharded.client().generate(model="m", prompt="go on", stream=True,
                                       options={"num_predict": 100_000})
    killed_at = None
    with pytest.raises(Exception) as failure:
        for i, _ in enumerate(stream):
            if i == 10:
                os.kill(follower, signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None and time.monotonic() - killed_at < 2.0
    assert "rank 1 of m:latest (on localhost) was killed by SIGKILL" in str(failure.value)
    assert wait_for(lambda: sharded.client().ps().models == [], timeout=10)
    reply = sharded.client().generate(model="m", prompt="again", options={"num_predict": 3})
    assert reply.eval_count == 3
    assert ranks(sharded)[1]["pid"] != follower

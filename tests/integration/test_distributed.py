"""Runners sharded over several ranks (mlx.distributed's ring backend), started by a real
`mlxr serve` from MLXR_HOSTFILE: greedy output is token-identical to the single-process
runner for a batch of 8 mixed-length requests, with tensor sharding on 2 and 4 ranks and
pipeline sharding on 2; killing a rank mid-stream gives the client an error line within 2 s,
and the next request starts a new group. The 4-rank group puts ranks 1-3 on stand-in hosts
(tests/harness/hosts.py: network namespaces joined by veth where the machine allows it),
started through the remote shell as ssh would start them."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import psutil
import pytest

from tests.harness.hosts import make_hosts
from tests.harness.server import serving, wait_for

pytestmark = pytest.mark.timeout(240)
# 8 prompts of 4 to 66 words, 4 to 18 tokens asked of each: the suite's time goes to the
# ranks, not to long prompts (each step crosses more ranks than this machine has cores).
SHORT = ([("word " * (3 + 9 * i)) + f"end {i}" for i in range(8)], [4 + 2 * i for i in range(8)])


def loaded(server, model: str) -> dict:
    """`model`'s entry in /api/ps."""
    with server.http() as http:
        return next(m for m in http.get("/api/ps").json()["models"]
                    if m["name"] == f"{model}:latest")


def ranks(server, model: str = "m") -> list[dict]:
    return loaded(server, model)["ranks"]


def sharding(server, model: str = "m") -> str:
    return loaded(server, model)["sharding"]


def answers(server, model: str = "m", work=SHORT) -> list[str]:
    """Greedy replies to 8 prompts of mixed lengths, sent at once (one batch)."""
    client = server.client()
    prompts, lengths = work

    def one(i: int) -> str:
        return client.generate(model=model, prompt=prompts[i], raw=True, options={
            "temperature": 0, "num_predict": lengths[i]}).response

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory):
    # m: the qwen3 architecture preset, 8 heads and 2 KV heads (tensor over 2, one KV head a
    # rank), with a 2,048-token tokenizer: 7 MB for each rank to load, not the 131 MB of the
    # 151,680-row "small", and greedy replies that differ more from prompt to prompt; bf: the
    # same in bfloat16, which every rank widens to float32 on the CPU (computed in bfloat16
    # instead, one of the 8 replies differs); q2: qwen2, which mlx-lm can pipeline; t4:
    # qwen3-kv4, the qwen3 preset with 4 KV heads (tensor over 4, one KV head a rank)
    from mlxr.supervisor.store.random_model import write_random_model

    bf16 = write_random_model(tmp_path_factory.mktemp("bf16") / "qwen3", preset="qwen3",
                              dtype="bfloat16")
    return {"m": model_factory("qwen3"), "q2": model_factory("qwen2"),
            "t4": model_factory("qwen3-kv4"), "bf": bf16}


@pytest.fixture(scope="module")
def single(tmp_path_factory, subprocess_env, models):
    yield from serving(tmp_path_factory.mktemp("single"), subprocess_env, models,
                       MLXR_MAX_LOADED_MODELS="4")


def group_server(tmp_path_factory, subprocess_env, models, ranks: int | list[dict], **env):
    tmp = tmp_path_factory.mktemp("group")
    hostfile = tmp / "hosts.json"
    entries = ranks if isinstance(ranks, list) else \
        [{"ssh": "localhost", "ips": ["127.0.0.1"]}] * ranks
    hostfile.write_text(json.dumps(entries))
    yield from serving(tmp, subprocess_env, models, MLXR_HOSTFILE=str(hostfile), **env)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, subprocess_env, models, model_factory):
    # 2 ranks that shard by pipeline unless a model's Modelfile says otherwise (MLXR_SHARDING:
    # q2 in the pipeline test, on this server rather than a third); m and bf ask for auto in
    # theirs (tensor: their heads divide among the ranks), which wins over the server's
    for server in group_server(tmp_path_factory, subprocess_env,
                               {"tiny": model_factory("tiny"), "q2": models["q2"]}, 2,
                               MLXR_SHARDING="pipeline"):
        with server.http() as http:
            for name in ("m", "bf"):
                made = http.post("/api/create", json={"model": name, "from": str(models[name]),
                                                      "stream": False,
                                                      "parameters": {"sharding": "auto"}})
                assert made.status_code == 200, made.text
        yield server


def weights(server, model: str) -> str:
    return loaded(server, model).get("weights")


def test_two_ranks_give_the_single_runners_tokens(single, sharded):
    want = answers(single)
    assert len(set(want)) > 1
    assert answers(sharded) == want
    assert sharding(sharded) == "tensor"
    shown = ranks(sharded)
    assert [r["rank"] for r in shown] == [0, 1]
    assert all(r["host"] == "localhost" and r["memory"] > 0 for r in shown)
    assert len(sharded.runner_pids()) == 2
    # Idle, the follower sleeps on its doorbell instead of spinning in a collective (MLX's
    # ring polls its sockets: a core per follower for as long as the model stays loaded).
    follower = psutil.Process(shown[1]["pid"])
    time.sleep(0.3)
    before = sum(follower.cpu_times()[:2])
    time.sleep(1.5)
    assert sum(follower.cpu_times()[:2]) - before < 0.3
    assert answers(sharded) == want  # and wakes for the next request


def test_ranks_widen_a_bfloat16_model_together_and_give_the_single_runners_tokens(
        single, sharded):
    want = answers(single, "bf")
    assert weights(single, "bf") == "float32 from bfloat16"
    assert answers(sharded, "bf") == want
    assert weights(sharded, "bf") == "float32 from bfloat16"
    with sharded.http() as http:  # back to one group for the tests after this one
        http.post("/api/generate", json={"model": "bf", "keep_alive": 0})


def test_pipeline_over_two_ranks_gives_the_single_runners_tokens(single, sharded):
    # q2's heads divide among 2 ranks (auto would take tensor): pipeline is the server's
    # MLXR_SHARDING
    want = answers(single, "q2", SHORT)
    assert answers(sharded, "q2", SHORT) == want
    assert sharding(sharded, "q2") == "pipeline"
    with sharded.http() as http:  # back to one group for the tests after this one
        http.post("/api/generate", json={"model": "q2", "keep_alive": 0})


def test_tensor_over_four_ranks_on_other_hosts_gives_the_single_runners_tokens(
        single, tmp_path_factory, subprocess_env, models):
    want = answers(single, "t4", SHORT)
    hosts = make_hosts(tmp_path_factory.mktemp("hosts"), 3)
    try:
        for server in group_server(tmp_path_factory, subprocess_env, {"t4": models["t4"]},
                                   hosts.entries, MLXR_REMOTE_SHELL=hosts.remote_shell):
            assert answers(server, "t4", SHORT) == want
            assert sharding(server, "t4") == "tensor"
            assert [(r["rank"], r["host"]) for r in ranks(server, "t4")] == \
                [(i, e["ssh"]) for i, e in enumerate(hosts.entries)]
            # each rank's memory as it reported it (every 2 s)
            assert wait_for(lambda: all(r["memory"] > 0 for r in ranks(server, "t4")),
                            timeout=5)
            if hosts.netns:  # the stand-ins really are other hosts: rank 1 is not here
                rank1 = psutil.Process(ranks(server, "t4")[1]["pid"])
                assert os.readlink(f"/proc/{rank1.pid}/ns/net") != os.readlink(
                    "/proc/self/ns/net")
    finally:
        hosts.close()


def test_an_unreachable_host_fails_the_load_clearly(tmp_path_factory, subprocess_env, models):
    entries = [{"ssh": "localhost"}, {"ssh": "no-such-host", "ips": ["192.0.2.1"]}]
    shell = tmp_path_factory.mktemp("shell") / "ssh"
    shell.write_text('#!/bin/sh\necho "ssh: Could not resolve hostname $1" >&2\nexit 255\n')
    shell.chmod(0o755)
    for server in group_server(tmp_path_factory, subprocess_env, {"m": models["m"]}, entries,
                               MLXR_REMOTE_SHELL=str(shell)):
        with server.http() as http:
            reply = http.post("/api/generate", json={"model": "m", "prompt": "hi",
                                                     "stream": False})
        assert reply.status_code == 500
        assert reply.json()["error"] == (f"cannot reach host no-such-host with '{shell}': "
                                         f"ssh: Could not resolve hostname no-such-host")
        assert server.runner_pids() == []


def test_a_model_that_cannot_be_sharded_is_a_clear_error(sharded):
    # tiny's 1 KV head does not divide among 2 ranks; its Modelfile asks for tensor sharding
    before = len(sharded.runner_pids())
    with sharded.http() as http:
        made = http.post("/api/create", json={"model": "tiny-tensor", "from": "tiny",
                                              "stream": False,
                                              "parameters": {"sharding": "tensor"}})
        assert made.status_code == 200, made.text
        reply = http.post("/api/generate", json={"model": "tiny-tensor", "prompt": "hi",
                                                 "stream": False})
    assert reply.status_code >= 400
    assert "cannot shard this qwen3 model over 2 ranks by tensor" in reply.json()["error"]
    assert wait_for(lambda: len(sharded.runner_pids()) <= before, timeout=5)


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
    # whichever comes first: the supervisor naming the dead rank, or rank 0's own collective
    # failing
    assert "rank 1 of m:latest (on localhost) was killed by SIGKILL" in str(failure.value) \
        or "connection to a peer was lost" in str(failure.value)
    assert wait_for(lambda: sharded.client().ps().models == [], timeout=10)
    reply = sharded.client().generate(model="m", prompt="again", options={"num_predict": 3})
    assert reply.eval_count == 3
    assert ranks(sharded)[1]["pid"] != follower


def test_the_modelfile_keeps_one_model_in_one_process(sharded):
    with sharded.http() as http:
        made = http.post("/api/create", json={"model": "solo", "from": "m", "stream": False,
                                              "parameters": {"distributed": False}})
        assert made.status_code == 200, made.text
        reply = http.post("/api/generate", json={"model": "solo", "prompt": "hi",
                                                 "stream": False, "options": {"num_predict": 2}})
        assert reply.status_code == 200, reply.text
        solo = next(m for m in http.get("/api/ps").json()["models"]
                    if m["name"] == "solo:latest")
        assert "ranks" not in solo and "sharding" not in solo
        http.post("/api/generate", json={"model": "solo", "keep_alive": 0})

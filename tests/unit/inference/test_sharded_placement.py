"""Memory planning for a distributed runner, through the real app and manager: a model too
large for this host alone loads sharded when the server has a hostfile, with this host
charged its ranks' shares; the Modelfile's `distributed` and `sharding` parameters choose per
model."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mlxr.shared.config import Settings
from mlxr.supervisor.app import make_app
from mlxr.supervisor.runners import memory
from tests.unit.inference.test_service import InProcessRunner, StubStore

MIB = 1 << 20
# 8 layers, 4 KV heads of 64, float32: 16 KiB of KV a token; a 32 MiB embedding
CONFIG = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
          "hidden_size": 512, "head_dim": 64, "vocab_size": 16384, "torch_dtype": "float32",
          "tie_word_embeddings": True}
WEIGHTS = 400 * MIB


@pytest.fixture
def setup(tmp_path):
    store = StubStore(tmp_path)
    specs = []

    def add(name: str, **params):
        store.add(name, params=params)
        folder = store.records[name].dir
        (folder / "config.json").write_text(json.dumps(CONFIG))
        with open(folder / "model.safetensors", "wb") as f:
            f.truncate(WEIGHTS)  # sparse: only its size is read

    def call(body: dict, hosts: int | None, available: int, remote: int = 0):
        settings = dataclasses.replace(Settings(), context_length=1024, num_parallel=4,
                                       memory_margin_bytes=0)
        if hosts:
            path = tmp_path / "hosts.json"
            path.write_text(json.dumps(
                [{"ssh": "localhost"}] * (hosts - remote)
                + [{"ssh": f"mac-{i}", "ips": [f"10.0.0.{i}"]} for i in range(remote)]))
            settings = dataclasses.replace(settings, hostfile=path)

        async def factory(spec):
            specs.append(spec)
            return InProcessRunner([])

        async def main():
            app = make_app(settings, store=store, runner_factory=factory,
                           available_memory=lambda: available)
            async with TestClient(TestServer(app)) as client:
                resp = await client.post("/api/generate", json={"stream": False, **body})
                return resp.status, await resp.json()
        return asyncio.run(main())

    return add, call, specs


def whole() -> int:
    kv = 16 * 1024 * 1024  # 1,024 tokens of 16 KiB: one context
    return int(WEIGHTS * memory.WEIGHT_OVERHEAD) + kv  # the least one process can work with


def test_a_model_too_large_for_this_host_loads_sharded(setup):
    add, call, specs = setup
    add("big")
    room = whole() * 7 // 10  # not enough for the whole model, enough for one rank of two
    status, body = call({"model": "big", "prompt": "hi"}, hosts=None, available=room)
    assert status == 507 and "requires more system memory" in body["error"]
    status, body = call({"model": "big", "prompt": "hi"}, hosts=2, remote=1, available=room)
    assert status == 200, body
    spec = specs[-1]
    assert [h.local for h in spec.hosts] == [True, False]
    assert spec.local_ranks == 1 and spec.sharding == "auto"
    # this host holds rank 0: the 32 MiB embedding, half the rest, and half of the KV (the
    # pool budget shrunk to fit, as for one process)
    rank_weights = 32 * MIB + (WEIGHTS - 32 * MIB) // 2
    assert spec.estimate_bytes <= room
    assert spec.estimate_bytes - spec.kv_cache_bytes == int(rank_weights
                                                            * memory.WEIGHT_OVERHEAD)
    assert spec.kv_cache_bytes >= spec.min_kv_bytes == 16 * MIB // 2


def test_ranks_on_this_host_are_each_charged_their_share(setup):
    add, call, specs = setup
    add("big")
    assert call({"model": "big", "prompt": "hi"}, hosts=4, remote=2, available=1 << 40)[0] \
        == 200
    two_local = specs[-1]
    assert two_local.local_ranks == 2
    one = memory.estimate(two_local.model_dir, 1024, 4, ranks=4, local_ranks=1)
    assert abs(two_local.estimate_bytes - 2 * one.total_bytes) <= 1  # int() of the overhead
    assert two_local.kv_cache_bytes == 2 * one.kv_bytes  # each local rank's pool: one share
    # all on one host, a sharded model takes more than one process would (the embedding
    # is whole on every rank)
    assert call({"model": "big", "prompt": "hi"}, hosts=4, available=1 << 40)[0] == 200
    assert specs[-1].estimate_bytes > memory.estimate(two_local.model_dir, 1024, 4).total_bytes


def test_the_modelfile_chooses_per_model(setup):
    add, call, specs = setup
    add("alone", distributed=False)
    add("tensor", sharding="tensor")
    add("wants", distributed=True)
    assert call({"model": "alone", "prompt": "hi"}, hosts=2, available=1 << 40)[0] == 200
    assert specs[-1].hosts is None and specs[-1].local_ranks == 1
    assert call({"model": "tensor", "prompt": "hi"}, hosts=2, available=1 << 40)[0] == 200
    assert specs[-1].sharding == "tensor" and len(specs[-1].hosts) == 2
    status, body = call({"model": "wants", "prompt": "hi"}, hosts=None, available=1 << 40)
    assert status == 400
    assert body["error"] == ('"wants:latest" is marked distributed (PARAMETER distributed '
                             'true) but the server has no hostfile: set MLXR_HOSTFILE')

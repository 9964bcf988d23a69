"""Out of memory in the runner, provoked deterministically with a small KV cache (the
runner's `kv_cache_bytes`): a prompt that can never fit is refused before it streams, a reply
that outgrows the cache alone ends with an error line, requests that fit only one at a time
all complete (preempted and recomputed), and the runner serves on."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.harness.runner_process import running
from tests.integration.test_runner import complete, greedy

BUDGET_TOKENS = 64


@pytest.fixture(scope="module")
def runner(tiny_model, subprocess_env):
    config = json.loads((tiny_model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    with running(tiny_model, subprocess_env, num_parallel=4, prefill_chunk=16,
                 context_length=1024, kv_cache_bytes=per_token * BUDGET_TOKENS) as url:
        yield url


async def lines(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[dict]]:
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, [json.loads(await resp.aread())]
        return 200, [json.loads(line) async for line in resp.aiter_lines()]


def test_a_prompt_that_can_never_fit_is_a_507_before_streaming(runner):
    resp = httpx.post(runner + "/v1/completions",
                      json={"tokens": list(range(10, 10 + BUDGET_TOKENS)), "options": greedy(4)})
    assert resp.status_code == 507
    body = resp.json()
    assert body["kind"] == "insufficient_memory"
    assert f"{BUDGET_TOKENS + 1} tokens do not fit" in body["error"]


def test_a_reply_that_outgrows_the_cache_ends_with_an_error_and_the_runner_serves_on(
        runner, reference):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            grown = await lines(client, runner, {"tokens": [11, 12, 13, 14],
                                                 "options": greedy(200)})
            after = await complete(client, runner, {"tokens": [21, 22, 23],
                                                    "options": greedy(8)})
            return grown, after

    (status, items), (tokens, _, final, _) = asyncio.run(main())
    assert status == 200
    *chunks, last = items
    assert last["error"]["kind"] == "insufficient_memory" and last["error"]["status"] == 507
    produced = [t for c in chunks for t in c.get("tokens", [])]
    # As far as the cache went: 64 positions hold the prompt and 60 outputs, and the 61st
    # output is sampled from the last of them.
    assert len(produced) == BUDGET_TOKENS - 3
    assert tokens == reference([21, 22, 23], 8) and final["done_reason"] == "length"
    assert httpx.get(runner + "/v1/status").json()["status"] == "ready"


def test_requests_that_fit_only_one_at_a_time_all_complete_as_alone(runner, reference):
    prompts = [[30 + i, 40 + i, 50 + i, 60 + i] for i in range(3)]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[
                complete(client, runner, {"tokens": p, "options": greedy(40)}) for p in prompts])

    results = asyncio.run(main())
    for prompt, (tokens, _, final, _) in zip(prompts, results):
        assert final["done_reason"] == "length"
        assert tokens == reference(prompt, 40)

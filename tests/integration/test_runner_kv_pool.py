"""The block pool in a real runner (runner/kv/pool.py, runner/kv/rows.py): every row of a
batch of mixed lengths gives mlx-lm's own tokens alone, whether it read a shared prefix by
reference, adopted a finished conversation's run, copied a partial block, or was preempted
and recomputed; and /v1/status reports the pool."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.harness.runner_process import running
from tests.integration.test_runner import complete, greedy

BLOCK = 64  # runner/kv/pool.py BLOCK_SIZE


def per_token_bytes(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def runner(tiny_model, subprocess_env):
    with running(tiny_model, subprocess_env, num_parallel=16, prefill_chunk=64,
                 context_length=4096) as url:
        yield url


@pytest.fixture(scope="module")
def small_pool(tiny_model, subprocess_env):
    """Six blocks: a few sequences at a time, so longer ones preempt the newest."""
    with running(tiny_model, subprocess_env, num_parallel=8, prefill_chunk=32,
                 context_length=1024,
                 kv_cache_bytes=per_token_bytes(tiny_model) * BLOCK * 6) as url:
        yield url


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


async def run_all(url: str, bodies: list[dict], delays: list[float] | None = None):
    async def one(body, delay):
        await asyncio.sleep(delay)
        return await complete(client, url, body)

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*[one(b, d) for b, d in
                                      zip(bodies, delays or [0.0] * len(bodies))])


def status(url: str) -> dict:
    return httpx.get(url + "/v1/status").json()


def test_rows_sharing_a_prefix_by_reference_give_mlx_lm_tokens_alone(runner, reference):
    rng = random.Random(3)
    system = ids(rng, 3 * BLOCK + 10)
    prompts = [system + ids(rng, rng.randint(1, 150)) for _ in range(6)]
    prompts += [ids(rng, rng.randint(5, 300)) for _ in range(4)]  # unrelated, mixed lengths
    lengths = [rng.randint(8, 40) for _ in prompts]
    bodies = [{"tokens": p, "options": greedy(n)} for p, n in zip(prompts, lengths)]
    # The first reads the system prompt; the rest arrive while it (and others) still run.
    results = asyncio.run(run_all(runner, bodies, [0.0] + [0.3] * (len(bodies) - 1)))
    for prompt, n, (tokens, _, final, _) in zip(prompts, lengths, results):
        assert tokens == reference(prompt, n)
    cached = [final["prompt_eval_cached_count"] for _, _, final, _ in results[1:6]]
    assert all(c >= 3 * BLOCK for c in cached), cached  # the system prompt's full blocks


def test_a_conversation_goes_on_in_its_own_run_and_a_divergent_turn_copies_a_partial_block(
        runner, reference):
    rng = random.Random(5)
    turn1 = ids(rng, 150)
    [(out1, _, final1, _)] = asyncio.run(run_all(runner, [{"tokens": turn1,
                                                           "options": greedy(20)}]))
    # Turn 2 resends turn 1 and its reply: everything the first computed is reused.
    turn2 = turn1 + out1 + ids(rng, 30)
    [(out2, _, final2, _)] = asyncio.run(run_all(runner, [{"tokens": turn2,
                                                           "options": greedy(20)}]))
    assert final2["prompt_eval_cached_count"] == len(turn1) + len(out1) - 1
    assert out2 == reference(turn2, 20)
    # A prompt that leaves turn 2's tokens inside a partial block: the matched part of the
    # block is copied, and turn 2's run keeps its own tokens for its next turn.
    branch = turn2[:len(turn1) + 5] + ids(rng, 20)
    [(out3, _, final3, _)] = asyncio.run(run_all(runner, [{"tokens": branch,
                                                           "options": greedy(12)}]))
    assert final3["prompt_eval_cached_count"] == len(turn1) + 5
    assert out3 == reference(branch, 12)
    turn3 = turn2 + out2 + ids(rng, 10)
    [(out4, _, final4, _)] = asyncio.run(run_all(runner, [{"tokens": turn3,
                                                           "options": greedy(12)}]))
    assert final4["prompt_eval_cached_count"] == len(turn2) + len(out2) - 1
    assert out4 == reference(turn3, 12)


def test_status_reports_the_pool_and_finished_rows_stay_cached(runner, tiny_model,
                                                               subprocess_env):
    # A fresh runner reports its pool's size before any request.
    with running(tiny_model, subprocess_env, context_length=1024) as fresh:
        s = status(fresh)
        assert s["kv_block_size"] == BLOCK and s["kv_blocks_total"] > 0
        assert s["kv_blocks_used"] == 0
        # what the supervisor charges for the pool: measured on the model, as config.json says
        assert s["kv_block_bytes"] == per_token_bytes(tiny_model) * BLOCK
    for _ in range(2):  # the second is served from the first's blocks
        asyncio.run(run_all(runner, [{"tokens": list(range(100, 300)), "options": greedy(4)}]))
    s = status(runner)
    assert s["kv_block_size"] == BLOCK and s["kv_blocks_total"] > 0
    assert s["active"] == 0
    # Nothing runs: every block in use is a cached one, kept for reuse.
    assert s["kv_blocks_used"] == s["kv_blocks_cached"] >= 200 // BLOCK
    assert s["kv_live_bytes"] == 0 < s["kv_bytes"]
    assert 0 < s["prefix_hit_rate"] < 1


def test_preempted_and_recomputed_rows_give_mlx_lm_tokens_alone(small_pool, reference):
    rng = random.Random(9)
    # Whether the requests meet in the pool so that one must give way depends on how their
    # arrivals fall between steps (with faster steps one round in CI had no preemption), so
    # rounds go on until one had some; every round's tokens must be mlx-lm's.
    for _ in range(4):
        prompts = [ids(rng, rng.randint(20, 140)) for _ in range(8)]
        lengths = [rng.randint(24, 56) for _ in prompts]
        bodies = [{"tokens": p, "options": greedy(n)} for p, n in zip(prompts, lengths)]
        results = asyncio.run(run_all(small_pool, bodies))
        for prompt, n, (tokens, _, final, _) in zip(prompts, lengths, results):
            assert final["done_reason"] == "length"
            assert tokens == reference(prompt, n)
        if status(small_pool)["preemptions"] > 0:
            break
    s = status(small_pool)
    assert s["kv_blocks_total"] == 6 and s["kv_blocks_used"] <= 6
    assert s["preemptions"] > 0

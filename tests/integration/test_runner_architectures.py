"""A real runner subprocess serving each architecture's random model (float32): streaming,
a batch of concurrent requests against mlx-lm's own generation of each prompt alone, the
prefix cache, and prompts longer than Gemma's sliding windows (64 tokens in these models)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import pytest

from mlxr.supervisor.store.random_model import ARCH_NAMES, write_random_model
from tests.harness.runner_process import running

WORDS = ("the quick brown fox jumps over a lazy dog while seven rivers run past old mountains "
         "and clouds drift above quiet towns near the sea").split()


@dataclass(slots=True)
class Served:
    arch: str
    url: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    reference: Callable[[list[int], int], list[int]]  # mlx-lm greedy, the prompt alone
    window: int | None


@pytest.fixture(scope="module", params=ARCH_NAMES)
def served(request, tmp_path_factory, subprocess_env):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    from mlxr.runner.architectures import fix_model

    arch = request.param
    path = write_random_model(tmp_path_factory.mktemp(arch), arch=arch)
    model, tokenizer, config = load(str(path), return_config=True)
    fix_model(model, config)  # what the runner serves (Gemma 2's sliding window)

    def reference(tokens: list[int], n: int) -> list[int]:
        steps = generate_step(mx.array(tokens), model, max_tokens=n, sampler=make_sampler(0.0))
        return [int(t) for t, _ in steps][:n]

    window = config.get("sliding_window") if arch.startswith("gemma") else None
    with running(Path(path), subprocess_env, num_parallel=8, prefill_chunk=32,
                 context_length=1024) as url:
        yield Served(arch, url, tokenizer.encode,
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True), reference, window)


async def complete(client: httpx.AsyncClient, url: str, body: dict):
    """Stream a completion: (tokens, text, final line, lines)."""
    tokens, text, final, lines = [], "", None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            item = json.loads(line)
            assert "error" not in item, item
            tokens += item.get("tokens", [])
            text += item.get("content", "")
            lines += 1
            final = item if item["done"] else final
    return tokens, text, final, lines


def greedy(n: int) -> dict:
    return {"temperature": 0, "num_predict": n}


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_a_streamed_completion(served):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await complete(client, served.url, {"prompt": "a story about the sea",
                                                       "options": greedy(10)})

    tokens, text, final, lines = asyncio.run(main())
    assert tokens == served.reference(served.encode("a story about the sea"), 10)
    assert text == served.decode(tokens) and lines > 2
    assert final["done_reason"] == "length" and final["eval_count"] == 10


def test_concurrent_requests_match_each_prompt_alone(served):
    rng = random.Random(11)
    prompts = [sentence(rng, rng.randint(2, 40)) for _ in range(7)] + [sentence(rng, 70)]
    lengths = [rng.randint(4, 14) for _ in prompts]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                complete(client, served.url, {"prompt": p, "options": greedy(n)})
                for p, n in zip(prompts, lengths)])

    results = asyncio.run(main())
    if served.window:
        assert len(served.encode(prompts[-1])) > 2 * served.window, "crosses the window"
    for prompt, n, (tokens, _, final, _) in zip(prompts, lengths, results):
        assert tokens == served.reference(served.encode(prompt), n), prompt
        assert final["eval_count"] == n
    assert len({tuple(r[0]) for r in results}) > 4, "outputs depend on the prompt"


def test_a_conversation_reuses_the_prefix_cache(served):
    """Every architecture serves a continued conversation from the prefix cache, Gemma 3's
    sliding-window layers included (runner/cache_state.py)."""
    system = sentence(random.Random(5), 70)

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            first = served.encode(system)
            a = await complete(client, served.url, {"tokens": first, "options": greedy(8)})
            turn = first + a[0] + served.encode(" and then what")[-4:]
            b = await complete(client, served.url, {"tokens": turn, "options": greedy(8)})
            return a, b, first, turn

    a, b, first, turn = asyncio.run(main())
    if served.window:
        assert len(first) > 2 * served.window
    assert a[0] == served.reference(first, 8)
    assert b[2]["prompt_eval_cached_count"] >= len(first)
    assert b[0] == served.reference(turn, 8)

"""A closed-loop load: `concurrency` workers send requests back to back until `requests` are
done. Each request has its own prompt (so no run is flattered by another's prefix cache)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from mlxr.supervisor.bench.metrics import RequestRecord, summarize
from mlxr.supervisor.bench.targets import Sampling

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river stone light "
         "garden window music paper story market system table").split()


def make_prompts(tokenizer, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """Prompts of about `prompt_tokens` tokens each, all different from the first word on."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"#{seed}-{i}:"] + [rng.choice(WORDS) for _ in range(prompt_tokens)]
        ids = tokenizer.encode(" ".join(words)).ids[:prompt_tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


async def run_load(target, prompts: list[str], concurrency: int, gen_tokens: int,
                   sampling: Sampling, timeout_s: float = 600) -> dict:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            record = RequestRecord(start_s=time.perf_counter())
            records.append(record)
            try:
                await target.stream(client, prompt, gen_tokens, sampling, record)
            except Exception as exc:  # a failed request is counted, not fatal
                record.error = f"{type(exc).__name__}: {exc}"
                record.end_s = time.perf_counter()

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - start
    summary = summarize(records, wall)
    summary["concurrency"] = concurrency
    errors = [r.error for r in records if r.error]
    if errors:
        summary["first_error"] = errors[0]
    return summary

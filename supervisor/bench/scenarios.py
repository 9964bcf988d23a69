"""Scenarios beyond the concurrency sweep: prefix-cache benefit, single-stream decode against
mlx_lm.generate (with the memory-bandwidth roofline), and how long running streams stall
while a long prompt is prefilled."""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from mlxr.supervisor.bench import peers
from mlxr.supervisor.bench.load import make_prompts
from mlxr.supervisor.bench.metrics import RequestRecord
from mlxr.supervisor.bench.targets import Sampling


def _fresh_seed() -> int:
    """Prompts no earlier run left in a server's prefix cache."""
    return random.randrange(1 << 30)


async def _one(target, client, prompt: str, gen_tokens: int,
               sampling: Sampling = Sampling()) -> RequestRecord:
    record = RequestRecord(start_s=time.perf_counter())
    await target.stream(client, prompt, gen_tokens, sampling, record)
    return record


async def prefix_cache(target, tokenizer, prefix_tokens: int = 1000, trials: int = 3) -> dict:
    """TTFT of a request whose 1,000-token prefix is cached (warm) against one whose is not."""
    cold, warm = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for trial in range(trials):
            prefix = make_prompts(tokenizer, 1, prefix_tokens, seed=_fresh_seed())[0]
            first = await _one(target, client, prefix + " first question?", 4)
            second = await _one(target, client, prefix + " another question here?", 4)
            cold.append(first.ttft_s)
            warm.append(second.ttft_s)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {"prefix_tokens": prefix_tokens, "cold_ttft_s": cold_s, "warm_ttft_s": warm_s,
            "warm_over_cold": warm_s / cold_s}


def measure_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth of this machine: the best of a few parallel sums over a large array,
    one slice per core (a single thread does not saturate memory; the runner uses them all)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = os.cpu_count() or 1
    data = np.ones(size_mb * (1 << 20) // 8, dtype=np.float64)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))  # numpy releases the GIL while summing
            best = min(best, time.perf_counter() - t)
    return data.nbytes / best / 1e9


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def mlx_lm_generate_tok_s(model_dir: Path, prompt: str, gen_tokens: int, blas_path: str) -> float:
    """mlx_lm.generate's own reported generation speed, in a fresh process with `blas_path`
    (our runner's library) preloaded."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model_dir), "--prompt",
         prompt, "--max-tokens", str(gen_tokens), "--temp", "0", "--ignore-chat-template"],
        env=peers.child_env(blas_path), capture_output=True, text=True, timeout=600)
    match = re.search(r"Generation:\s*\d+ tokens,\s*([\d.]+) tokens-per-sec", out.stdout)
    if not match:
        raise RuntimeError(f"could not read mlx_lm.generate's speed:\n{out.stdout}\n{out.stderr}")
    return float(match.group(1))


async def single_stream(target, tokenizer, model_dir: Path, blas_path: str,
                        gen_tokens: int = 256) -> dict:
    """Decode tokens/s of one greedy stream, against mlx_lm.generate and the roofline."""
    prompt = make_prompts(tokenizer, 1, 32, seed=60_000)[0]
    async with httpx.AsyncClient(timeout=600) as client:
        await _one(target, client, prompt, 16)  # warm up
        record = await _one(target, client, prompt + " again", gen_tokens)
    ours = (record.num_tokens - 1) / (record.end_s - record.token_times_s[0])
    peer = mlx_lm_generate_tok_s(model_dir, prompt, gen_tokens, blas_path)
    bandwidth = measure_bandwidth_gb_s()
    roofline = bandwidth * 1e9 / weight_bytes(model_dir)
    return {"ours_tok_s": ours, "mlx_lm_generate_tok_s": peer, "ratio": ours / peer,
            "bandwidth_gb_s": bandwidth, "roofline_tok_s": roofline,
            "fraction_of_roofline": ours / roofline}


async def prefill_stall(target, tokenizer, streams: int = 8, long_tokens: int = 2000,
                        gen_tokens: int = 160) -> dict:
    """While `streams` decode, a `long_tokens` prompt arrives: the longest gap the running
    streams see, in units of their median inter-token interval before it arrived. Then the
    control: the same streams again, watched for as long with no prompt arriving (the
    longest gap that the machine and the HTTP path give on their own)."""
    long_prompt = make_prompts(tokenizer, 1, long_tokens, seed=_fresh_seed())[0]
    out = await _stall_round(target, tokenizer, streams, gen_tokens, long_prompt, 0.0)
    out["prefill_s"] = out.pop("window_s")
    control = await _stall_round(target, tokenizer, streams, gen_tokens, None,
                                 out["prefill_s"])
    out.update(streams=streams, long_prompt_tokens=long_tokens,
               control_max_gap_in_itls=control["max_gap_in_itls"],
               control_largest_gaps_s=control["largest_gaps_s"])
    return out


async def _stall_round(target, tokenizer, streams: int, gen_tokens: int, prompt: str | None,
                       window_s: float) -> dict:
    """`streams` decoding; once each has 40 tokens, `prompt` (or, with None, `window_s` of
    waiting): the streams' gaps from then until half a second after its first token."""
    prompts = make_prompts(tokenizer, streams, 32, seed=_fresh_seed())
    async with httpx.AsyncClient(timeout=600) as client:
        records = [RequestRecord(start_s=time.perf_counter()) for _ in prompts]
        tasks = [asyncio.create_task(target.stream(client, p, gen_tokens, Sampling(), r))
                 for p, r in zip(prompts, records)]
        while min(r.num_tokens for r in records) < 40:
            await asyncio.sleep(0.01)
        arrival = time.perf_counter()
        if prompt is None:
            await asyncio.sleep(window_s)
            done = time.perf_counter()
        else:
            done = (await _one(target, client, prompt, 1)).token_times_s[0]
        await asyncio.gather(*tasks)
    before = [g for r in records for a, g in zip(r.token_times_s, r.itls_s()) if a < arrival]
    during = sorted(((g, a - arrival) for r in records
                     for a, g in zip(r.token_times_s[1:], r.itls_s())
                     if arrival <= a <= done + 0.5), reverse=True)
    base = statistics.median(before) if before else math.nan
    # No token in the window, or none apart before it (the streams' tokens came in one
    # burst): nothing was measured, which is NaN, not a perfect 0. (A stream whose text was
    # held reached the client all at once, and a control once read 0.)
    worst = during[0][0] if during else math.nan
    return {"window_s": done - arrival, "median_itl_before_s": base, "max_gap_during_s": worst,
            "max_gap_in_itls": worst / base if base > 0 else math.nan,
            # [gap, when it ended (s after the prompt arrived)]: where the stall comes from
            "largest_gaps_s": [[round(g, 4), round(at, 3)] for g, at in during[:3]]}

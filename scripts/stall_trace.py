"""The bench's prefill-stall scenario (supervisor/bench/scenarios.py `prefill_stall`) on a runner
of its own, printing also when the largest gaps fell: 8 streams decode, a 2,000-token prompt
arrives, and the streams' longest wait is reported in their intervals. Behind
docs/PERFORMANCE.md "The prefill stall (session 13)".

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/stall_trace.py [ROUNDS]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from mlxr.supervisor.bench import peers
from mlxr.supervisor.bench.cli import resolve_model
from mlxr.supervisor.bench.load import make_prompts
from mlxr.supervisor.bench.metrics import RequestRecord
from mlxr.supervisor.bench.scenarios import _fresh_seed, _one
from mlxr.supervisor.bench.targets import RunnerTarget, Sampling


async def one_round(target: RunnerTarget, tokenizer: Tokenizer) -> None:
    prompts = make_prompts(tokenizer, 8, 32, seed=_fresh_seed())
    long_prompt = make_prompts(tokenizer, 1, 2000, seed=_fresh_seed())[0]
    async with httpx.AsyncClient(timeout=600) as client:
        records = [RequestRecord(start_s=time.perf_counter()) for _ in prompts]
        tasks = [asyncio.create_task(target.stream(client, p, 160, Sampling(), r))
                 for p, r in zip(prompts, records)]
        while min(r.num_tokens for r in records) < 40:
            await asyncio.sleep(0.01)
        arrival = time.perf_counter()
        done = (await _one(target, client, long_prompt, 1)).token_times_s[0]
        await asyncio.gather(*tasks)
    before = [g for r in records for a, g in zip(r.token_times_s, r.itls_s()) if a < arrival]
    during = sorted(((g, a - arrival, i) for i, r in enumerate(records)
                     for a, g in zip(r.token_times_s[1:], r.itls_s())
                     if arrival <= a <= done + 0.5), reverse=True)
    base = statistics.median(before)
    gaps = ", ".join(f"{g * 1000:.0f} ms at {t:.2f} s" for g, t, _ in during[:3])
    print(f"interval {base * 1000:.1f} ms, prompt read in {done - arrival:.2f} s, "
          f"max gap {during[0][0] / base:.2f} intervals; largest: {gaps}", flush=True)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    model = resolve_model("small", Path.home() / ".cache" / "mlxr-bench")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    runner = peers.start_runner(model, Path(tempfile.mkdtemp()), num_parallel=16)
    try:
        for _ in range(rounds):
            asyncio.run(one_round(RunnerTarget("mlxr-runner", runner.url), tokenizer))
    finally:
        runner.stop()


if __name__ == "__main__":
    main()

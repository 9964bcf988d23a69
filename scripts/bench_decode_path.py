"""Which path a staggered batch's decode steps take, and what they cost (issue 19, session 23).

Runs the runner's own scheduler and model step in-process on a mixed workload: 60 greedy
requests, one every 10 steps, prompts log-uniform over 32-1,024 tokens (every other one behind
the same 150-token system prompt), replies of 16-200 tokens. Counts the decode steps whose
rows the numpy body took and those left to MLX's pass, and prints the decode-only steps'
median and p99. Run with the OpenBLAS the runner preloads (without it the numpy body finds no
`cblas_sgemm` and times another program):

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        .venv/bin/python scripts/bench_decode_path.py --model ~/.cache/mlxr-bench/random-small
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mlx_lm.utils import load

from mlxr.runner.kv.pool import BLOCK_SIZE
from mlxr.runner.kv.rows import RowBatch
from mlxr.runner.model_step import ModelStep
from mlxr.runner.request import Sequence
from mlxr.runner.sampling import Sampler
from mlxr.runner.scheduler import Scheduler, SchedulerConfig
from mlxr.shared.protocol import Options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    model, _ = load(args.model)
    step = ModelStep(model, 0, lambda t: "")
    sched = Scheduler(SchedulerConfig(), step.make_pool(8192, BLOCK_SIZE), admit=step.admit,
                      eos_token_ids=set())
    counts = {"numpy body": 0, "left to MLX": 0}
    host_rows = RowBatch.host_rows

    def counted(self, seqs, tokens):
        out = host_rows(self, seqs, tokens)
        counts["left to MLX" if out is None else "numpy body"] += 1
        return out

    RowBatch.host_rows = counted
    rng = random.Random(args.seed)
    system = [rng.randrange(2, 5000) for _ in range(150)]

    def add(i: int) -> None:
        opts = Options(temperature=0.0)
        prompt = [rng.randrange(2, 5000) for _ in range(int(2 ** rng.uniform(5, 10)))]
        seq = Sequence(i, (system if i % 2 else []) + prompt, opts,
                       max_new_tokens=rng.randint(16, 200), context_length=8192)
        seq.sampler = Sampler.from_options(opts, seq.context_length)
        sched.add(seq)

    steps, added, decode_s = 0, 0, []
    while added < args.requests or sched.has_work:
        if added < args.requests and steps % 10 == 0:
            add(added)
            added += 1
        plan = sched.schedule()
        start = time.perf_counter()
        result = step.run(plan)
        took = time.perf_counter() - start
        sched.observe(plan, took)
        sched.update(plan, result)
        steps += 1
        if plan.decode and not plan.prefills:
            decode_s.append(took)
    decode_s.sort()
    print(f"steps {steps}; decode steps with rows: {counts}")
    print(f"decode-only steps: median {1e3 * statistics.median(decode_s):.1f} ms, "
          f"p99 {1e3 * decode_s[int(0.99 * len(decode_s))]:.1f} ms")


if __name__ == "__main__":
    main()

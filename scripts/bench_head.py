"""The decode head: MLX's matmul (sgemm) on the weight as stored, on a transposed copy
(runner/transposed_head.py), and the runner's BLAS matrix-vector head for a few rows
(runner/host_head.py), the C row kernel's head (runner/row_kernel.py), alone and (for 1-3 rows)
as part of a whole greedy token.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \
        PYTHONPATH=. .venv/bin/python scripts/bench_head.py --model ~/.cache/mlxr-bench/random-small

Prints medians in milliseconds, and checks that both heads pick the same token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.host_head import MAX_ROWS, HostHead, cpu_head_weight
from mlxr.runner.row_kernel import RowKernel
from mlxr.runner.transposed_head import TransposedHead
from mlxr.runner.model_step import split_model
from mlxr.runner.sampling import argmax_rows
from mlxr.shared.blas import loaded_blas


def timed(fn, repeats: int = 40) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    print(f"blas: {loaded_blas().describe()}", flush=True)
    model, _ = load(args.model)
    split = split_model(model)
    host = HostHead.find(model, split.head, kernel=False)
    if host is None:
        raise SystemExit("no BLAS head for this model here (needs OpenBLAS and a float32 head)")
    kernel = RowKernel.load()
    if kernel is None:
        raise SystemExit("the row kernel was not built here (needs a C compiler)")
    native = HostHead(cpu_head_weight(model, split.head), None, kernel)
    transposed = TransposedHead(cpu_head_weight(model, split.head))
    print("| rows | MLX head ms | transposed head ms | BLAS head ms | C kernel head ms "
          "| greedy token, MLX head ms | greedy token, BLAS head ms |")
    print("|---|---|---|---|---|---|---|")
    for rows in (1, 2, 3, 4, 8, 16):
        caches = make_prompt_cache(model)
        model(mx.array([list(range(1, args.context + 1))]), cache=caches)
        cache = [type(c).merge([c] * rows) for c in caches]
        inputs = mx.array([[11]] * rows)
        hidden = mx.random.normal((rows, host.hidden))
        mx.eval(hidden)

        def token(head):
            def run():
                out = argmax_rows(head(split.body(inputs, cache=cache)[:, -1, :])).tolist()
                for c in cache:
                    c.trim(1)
                return out
            return run

        assert token(host)() == token(split.head)() == token(transposed)() == \
            token(native)(), "the heads disagree"
        tokens = f"{timed(token(split.head)):.2f} | {timed(token(host)):.2f}" \
            if rows <= MAX_ROWS + 1 else "- | -"
        print(f"| {rows} | {timed(lambda: mx.eval(split.head(hidden))):.2f} "
              f"| {timed(lambda: mx.eval(transposed(hidden))):.2f} "
              f"| {timed(lambda: host(hidden)):.2f} | {timed(lambda: native(hidden)):.2f} "
              f"| {tokens} |")


if __name__ == "__main__":
    main()

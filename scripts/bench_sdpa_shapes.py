"""What a new attention shape costs on this device: chunks of 16 queries over a growing
context, each timed at its first call and again, with the exact shapes (MLX's call, as the
padded batch's prefill makes it) and with runner/kv/bucketed_attention.py's shapes. On a CUDA
GPU a first call at a new shape builds a cuDNN graph (docs/PERFORMANCE.md, "On a GPU").

    PYTHONPATH=. python scripts/bench_sdpa_shapes.py [--chunks 40]

Prints figures; nothing is asserted."""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxr.runner.kv import bucketed_attention

HEADS, KV_HEADS, DIM, CHUNK = 16, 8, 128, 16  # Qwen3-0.6B's attention


def timed_ms(call) -> float:
    start = time.perf_counter()
    mx.eval(call())
    mx.synchronize()
    return (time.perf_counter() - start) * 1e3


def run(chunks: int, bucketed: bool) -> tuple[list[float], list[float]]:
    cache, firsts, repeats = KVCache(), [], []
    for _ in range(chunks):
        new = mx.random.normal((1, KV_HEADS, CHUNK, DIM)).astype(mx.bfloat16)
        keys, values = cache.update_and_fetch(new, new)
        q = mx.random.normal((1, HEADS, CHUNK, DIM)).astype(mx.bfloat16)
        mx.eval(keys, values, q)
        if bucketed:
            def call():
                return bucketed_attention.attend(q, cache, 0.1)
        else:
            def call():
                return mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1,
                                                            mask="causal")
        firsts.append(timed_ms(call))
        repeats.append(timed_ms(call))
    return firsts, repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=40)
    args = parser.parse_args()
    print("device:", mx.default_device())
    for label, bucketed in (("exact", False), ("bucketed", True)):
        firsts, repeats = run(args.chunks, bucketed)
        print(f"{label}: {args.chunks} chunks of {CHUNK} over {CHUNK}..{CHUNK * args.chunks} "
              f"positions: first call median {statistics.median(firsts):.2f} ms (sum "
              f"{sum(firsts):.0f} ms, max {max(firsts):.1f}), repeat median "
              f"{statistics.median(repeats):.2f} ms")


if __name__ == "__main__":
    main()

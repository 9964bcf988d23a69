"""Where a prefill chunk's attention goes on the CPU, deep in a long context: MLX's fused
attention against its parts (scores, softmax, values), MLX's `exp`, and a softmax whose exp is
a polynomial written in MLX ops (Cephes form: range reduction by ln 2, a degree-6 polynomial,
the power of two built in the float's exponent bits), plain and under `mx.compile`.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        .venv/bin/python scripts/bench_softmax.py [--queries 16] [--context 1816]

Shapes are the 30M model's (4 heads, 2 KV heads, head dim 48). Prints medians of repeated
calls (milliseconds) and the polynomial's largest error; nothing is asserted. The polynomial
is not in the runner: see docs/PERFORMANCE.md, "Where a long prompt's chunk goes"."""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
        1.6666665459e-1, 5.0000001201e-1)


def poly_exp(x: mx.array) -> mx.array:
    """exp(x) for x <= 0 (scores less their row's maximum)."""
    x = mx.maximum(x, -87.0)
    n = mx.floor(x * LOG2E + 0.5)
    r = x - n * LN2_HI - n * LN2_LO
    p = mx.array(POLY[0], dtype=x.dtype)
    for c in POLY[1:]:
        p = p * r + c
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)
    return (p * r * r + r + 1.0) * two_n


def poly_softmax(s: mx.array) -> mx.array:
    e = poly_exp(s - mx.max(s, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


def median_ms(fn, repeats: int = 30) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=16, help="the chunk's tokens")
    parser.add_argument("--context", type=int, default=1816, help="positions attended")
    args = parser.parse_args()
    heads, kv_heads, dim = 4, 2, 48
    q = mx.random.normal((1, heads, args.queries, dim))
    k = mx.random.normal((1, kv_heads, args.context, dim))
    v = mx.random.normal((1, kv_heads, args.context, dim))
    grouped = q.reshape(1, kv_heads, heads // kv_heads * args.queries, dim)
    scores = (grouped * 0.14) @ k.swapaxes(-1, -2)
    probs = mx.softmax(scores, axis=-1, precise=True)
    mx.eval(q, k, v, scores, probs)
    rows = [
        ("fused attention (causal)", lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.14, mask="causal")),
        ("  scores: q @ k^T", lambda: (grouped * 0.14) @ k.swapaxes(-1, -2)),
        ("  softmax (precise)", lambda: mx.softmax(scores, axis=-1, precise=True)),
        ("  probabilities @ v", lambda: probs @ v),
        ("exp alone", lambda: mx.exp(scores)),
        ("softmax, polynomial exp", lambda: poly_softmax(scores)),
        ("softmax, polynomial exp, compiled", lambda: compiled(scores)),
    ]
    compiled = mx.compile(poly_softmax)
    n = scores.size
    print(f"{args.queries} queries x {heads} heads over {args.context} positions "
          f"({n} scores)")
    for name, fn in rows:
        ms = median_ms(fn)
        print(f"{name:36s} {ms:7.3f} ms  {ms * 1e6 / n:6.1f} ns/score")
    want, got = np.array(probs), np.array(poly_softmax(scores))
    print(f"polynomial softmax: largest error {np.abs(want - got).max():.2e} "
          f"(relative {(np.abs(want - got) / np.maximum(want, 1e-30)).max():.2e})")


if __name__ == "__main__":
    main()

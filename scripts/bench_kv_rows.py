"""Micro-benchmarks behind docs/PERFORMANCE.md "The KV block pool": the decode step's body
over the block pool's rows against mlx-lm's padded batch cache, a prefill chunk deep in a long
context, and what one layer's attention for that chunk spends in softmax.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/bench_kv_rows.py [--rows 16] [--length 128]

Prints medians of repeated calls (milliseconds); nothing is asserted."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.kv import rows as kv_rows
from mlxr.runner.kv.pool import KVPool
from mlxr.supervisor.store.random_model import write_random_model


class _Seq:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id


def median_ms(fn, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def decode_step(model, rows: int, length: int) -> None:
    body, num_layers = model.model, len(model.layers)
    pool = KVPool(100_000)
    batch = kv_rows.RowBatch(num_layers, pool)
    seqs = [_Seq(i) for i in range(rows)]
    padded = []
    for seq in seqs:
        tokens = list(range(1 + seq.seq_id, 1 + seq.seq_id + length))
        batch.admit(seq, pool.admit(seq.seq_id, tokens, length + 256))
        body(mx.array([tokens]), cache=batch.prefill_cache(seq))
        batch.advance([seq], length)
        batch.join(seq)
        cache = make_prompt_cache(model)
        body(mx.array([tokens]), cache=cache)
        padded.append(cache)
    merged = [BatchKVCache.merge([c[layer] for c in padded]) for layer in range(num_layers)]
    mx.eval(batch.arrays(seqs), [a for c in merged for a in c.state])
    inputs = mx.array([[5]] * rows)

    def on_rows():  # lengths are not advanced: every call writes the same position
        hidden = body(inputs, cache=batch.decode_cache())
        mx.eval(hidden, batch.arrays(seqs))

    def on_padded():
        hidden = body(inputs, cache=merged)
        mx.eval(hidden, [a for c in merged for a in c.state])
        for c in merged:
            c.trim(1)

    print(f"decode step body, {rows} rows of {length}: rows {median_ms(on_rows):.1f} ms, "
          f"padded {median_ms(on_padded):.1f} ms")


def long_prefill(model, context: int, chunk: int) -> None:
    body, num_layers = model.model, len(model.layers)
    pool = KVPool(100_000)
    batch = kv_rows.RowBatch(num_layers, pool)
    seq = _Seq(0)
    tokens = [5 + i % 1000 for i in range(context + chunk)]
    batch.admit(seq, pool.admit(0, tokens, context + chunk + 64))
    body(mx.array([tokens[:context]]), cache=batch.prefill_cache(seq))
    batch.advance([seq], context)
    mx.eval(batch.arrays([seq]))

    def step():
        mx.eval(body(mx.array([tokens[context:context + chunk]]),
                     cache=batch.prefill_cache(seq)), batch.arrays([seq]))

    print(f"prefill chunk body, {chunk} tokens at position {context}: {median_ms(step):.1f} ms")


def softmax_share(model, context: int, chunk: int) -> None:
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    q = mx.random.normal((1, heads, chunk, dim))
    k = mx.random.normal((1, kv_heads, context + chunk, dim))
    v = mx.random.normal((1, kv_heads, context + chunk, dim))
    mx.eval(q, k, v)
    grouped = (q * dim ** -0.5).reshape(1, kv_heads, heads // kv_heads * chunk, dim)
    scores = grouped @ k.swapaxes(-1, -2)
    probs = mx.softmax(scores, axis=-1, precise=True)
    mx.eval(scores, probs)
    attention = median_ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(
        q, k, v, scale=dim ** -0.5, mask="causal")))
    softmax = median_ms(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)))
    exp = median_ms(lambda: mx.eval(mx.exp(scores)))
    matmul = median_ms(lambda: mx.eval(grouped @ k.swapaxes(-1, -2)))
    print(f"one layer's attention for it: {attention:.2f} ms; softmax {softmax:.2f} ms "
          f"(exp alone {exp:.2f} ms over {scores.size} scores), each matmul {matmul:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--context", type=int, default=1800)
    parser.add_argument("--chunk", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.preset
        write_random_model(model_dir, preset=args.preset)
        model, _ = load(str(model_dir))
    kv_rows.install(model)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, preset {args.preset}")
    decode_step(model, args.rows, args.length)
    long_prefill(model, args.context, args.chunk)
    softmax_share(model, args.context, args.chunk)


if __name__ == "__main__":
    main()

"""The model body's forward pass over the block pool's rows with MLX's attention against the
rows' numpy softmax (runner/kv/host_attention.py): prefill chunks deep in a long context, and
decode steps with long rows.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/bench_host_attention.py [--preset small]

Each case alternates the two ways three times and prints the middle of the three medians
(milliseconds); nothing is asserted. Behind docs/PERFORMANCE.md "Attention in numpy"."""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load

from bench_kv_rows import _Seq, median_ms  # this script's folder is on the path
from mlxr.runner.kv import rows as kv_rows
from mlxr.runner.kv.pool import KVPool
from mlxr.supervisor.store.random_model import write_random_model


def prefilled(model, lengths: list[int], host: bool, extra: int = 0, shared: int = 0):
    """A RowBatch holding one row per length, each prefilled in 512-token chunks; the first
    `shared` tokens are the same in every row (the later rows read them from the first)."""
    body = model.model
    pool = KVPool(100_000)
    batch = kv_rows.RowBatch(len(model.layers), pool, host_attention=host)
    seqs = [_Seq(i) for i in range(len(lengths))]
    for seq, n in zip(seqs, lengths):
        tokens = [5 + (7 * i + (seq.seq_id if i >= shared else 0)) % 1000
                  for i in range(n + extra)]
        cached = batch.admit(seq, pool.admit(seq.seq_id, tokens, n + extra + 64))
        for a in range(cached, n, 512):
            b = min(a + 512, n)
            body(mx.array([tokens[a:b]]), cache=batch.prefill_cache(seq))
            batch.advance([seq], b - a)
            mx.eval(batch.arrays([seq]))
            pool.commit(seq.seq_id, tokens, b)
        seq.tokens = tokens
    return batch, seqs


def chunk_case(model, context: int, chunk: int):
    def make(host: bool):
        batch, (seq,) = prefilled(model, [context], host, extra=chunk)
        inputs = mx.array([seq.tokens[context:context + chunk]])

        def step():  # the length is not advanced: every call writes the same positions
            mx.eval(model.model(inputs, cache=batch.prefill_cache(seq)), batch.arrays([seq]))
        return step
    return make


def decode_case(model, lengths: list[int], shared: int = 0):
    def make(host: bool):
        batch, seqs = prefilled(model, lengths, host, shared=shared)
        for seq in seqs:
            batch.join(seq)
        inputs = mx.array([[5]] * len(lengths))

        def step():
            mx.eval(model.model(inputs, cache=batch.decode_cache()), batch.arrays(seqs))
        return step
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load(str(write_random_model(Path(tmp) / args.preset, preset=args.preset)))
    kv_rows.install(model)
    rng = random.Random(1)
    cases = [
        ("prefill chunk of 16 at 1,800", chunk_case(model, 1800, 16)),
        ("prefill chunk of 16 at 7,800", chunk_case(model, 7800, 16)),
        ("prefill chunk of 64 at 1,800", chunk_case(model, 1800, 64)),
        ("prefill chunk of 128 at 256", chunk_case(model, 256, 128)),
        ("prefill chunk of 512 at 0", chunk_case(model, 0, 512)),
        ("decode, 1 row of 8,000", decode_case(model, [8000])),
        ("decode, 16 rows of 300-1,500", decode_case(
            model, [rng.randint(300, 1500) for _ in range(16)])),
        ("decode, 14 rows of 100 + 2 of 8,000", decode_case(model, [100] * 14 + [8000] * 2)),
        ("decode, 16 rows of 100-600", decode_case(
            model, [rng.randint(100, 600) for _ in range(16)])),
        ("decode, 16 rows of 1,100 sharing 1,000", decode_case(model, [1100] * 16, 1000)),
        ("decode, 16 rows of 400 sharing 300", decode_case(model, [400] * 16, 300)),
    ]
    print(f"mlx {mx.__version__}, device {mx.default_device()}, preset {args.preset}; "
          f"body milliseconds, MLX attention against numpy's softmax")
    for name, make in cases:
        steps = {host: make(host) for host in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):
            for host in (False, True):
                times[host].append(median_ms(steps[host], repeats=9))
        mlx_ms, host_ms = (sorted(times[h])[1] for h in (False, True))
        print(f"{name:38s} mlx {mlx_ms:7.2f}  numpy softmax {host_ms:7.2f}  "
              f"ratio {host_ms / mlx_ms:.2f}", flush=True)


if __name__ == "__main__":
    main()

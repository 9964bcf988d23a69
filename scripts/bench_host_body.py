"""A decode step's body over the block pool's rows in MLX against numpy's
(runner/host_body.py), for one and two rows of random models, and a whole greedy token (body,
BLAS head, argmax) each way.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/bench_host_body.py [--presets small,medium]

Each case alternates the two ways three times and prints the middle of the three medians
(milliseconds); nothing is asserted. Behind docs/PERFORMANCE.md "The decode body in numpy,
and bursts"."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load

from bench_kv_rows import _Seq, median_ms  # this script's folder is on the path
from mlxr.runner.host_body import HostBody
from mlxr.runner.host_head import HostHead
from mlxr.runner.kv import rows as kv_rows
from mlxr.runner.kv.pool import KVPool
from mlxr.runner.model_step import split_model
from mlxr.supervisor.store.random_model import write_random_model


def decode_batch(model, rows: int, length: int):
    """`rows` sequences of `length` prompt tokens prefilled over the rows and joined."""
    pool = KVPool(num_blocks=1024, block_size=64)
    batch = kv_rows.RowBatch(len(model.layers), pool)
    seqs = [_Seq(i) for i in range(rows)]
    for seq in seqs:
        prompt = [(7 * i + 3 * seq.seq_id) % 5000 + 2 for i in range(length)]
        batch.admit(seq, pool.admit(seq.seq_id, prompt, length + 64))
        model.model(mx.array([prompt]), cache=batch.prefill_cache(seq))
        batch.advance([seq], length)
        mx.eval(batch.arrays([seq]))
        batch.join(seq)
    return batch, seqs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model, _ = load(str(write_random_model(Path(tmp) / preset, preset=preset)))
        kv_rows.install(model)
        host = HostBody.find(model)
        split = split_model(model)
        head = HostHead.find(model, split.head)
        assert host is not None and head is not None, "needs a float32 model and OpenBLAS"
        for rows in (1, 2):
            batch, seqs = decode_batch(model, rows, args.context)
            tokens = [5] * rows
            # The position is not advanced: every call writes and reads the same one.
            ways = {
                "mlx": lambda: mx.eval(model.model(mx.array([[t] for t in tokens]),
                                                   cache=batch.decode_cache()),
                                       batch.arrays(seqs)),
                "numpy": lambda: host(batch.host_rows(seqs, tokens)),
                "mlx token": lambda: mx.argmax(head(model.model(
                    mx.array([[t] for t in tokens]), cache=batch.decode_cache())[:, -1]),
                    axis=-1).tolist(),
                "numpy token": lambda: mx.argmax(head.project(
                    host(batch.host_rows(seqs, tokens))), axis=-1).tolist(),
            }
            runs = {name: [] for name in ways}
            for _ in range(3):
                for name, fn in ways.items():
                    runs[name].append(median_ms(fn))
            mid = {k: sorted(v)[1] for k, v in runs.items()}
            print(f"{preset}, {rows} row(s) at {args.context}: body mlx {mid['mlx']:.1f} ms, "
                  f"numpy {mid['numpy']:.1f} ms; token mlx {mid['mlx token']:.1f} ms, "
                  f"numpy {mid['numpy token']:.1f} ms", flush=True)


if __name__ == "__main__":
    main()

"""A prefill chunk's forward pass over the block pool's rows with mlx-lm's SwiGLU against
numpy's (runner/host_swiglu.py), for random models of a few widths.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/bench_host_swiglu.py [--presets small,medium]

Each case alternates the two ways three times and prints the middle of the three medians
(milliseconds); nothing is asserted. Behind docs/PERFORMANCE.md "SwiGLU in numpy"."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load

from bench_kv_rows import _Seq, median_ms  # this script's folder is on the path
from mlxr.runner import host_swiglu
from mlxr.runner.kv import rows as kv_rows
from mlxr.runner.kv.pool import KVPool
from mlxr.supervisor.store.random_model import write_random_model


def chunk_ms(model, tokens: int, host: bool) -> float:
    """One chunk of `tokens` at the start of a row, the body only (as a chunk that is not a
    prompt's last), with numpy's attention where it pays, as the runner does."""
    pool = KVPool(num_blocks=1024, block_size=16)
    batch = kv_rows.RowBatch(len(model.layers), pool)
    seq = _Seq(0)
    prompt = [(7 * i + 3) % 5000 + 2 for i in range(tokens)]
    batch.admit(seq, pool.admit(0, prompt, tokens + 1))

    def run():
        with host_swiglu.active(host):
            mx.eval(model.model(mx.array([prompt]), cache=batch.prefill_cache(seq)))

    return median_ms(run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--tokens", default="128,512")
    args = parser.parse_args()
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model, _ = load(str(write_random_model(Path(tmp) / preset, preset=preset)))
        kv_rows.install(model)
        host_swiglu.install(model)
        width = model.args.intermediate_size
        for tokens in (int(t) for t in args.tokens.split(",")):
            runs = {"mlx": [], "numpy": []}
            for _ in range(3):
                for name, host in (("mlx", False), ("numpy", True)):
                    runs[name].append(chunk_ms(model, tokens, host))
            mid = {k: sorted(v)[1] for k, v in runs.items()}
            print(f"{preset} (MLP {width}), chunk of {tokens}: mlx {mid['mlx']:.1f} ms, "
                  f"numpy swiglu {mid['numpy']:.1f} ms ({mid['mlx'] / mid['numpy']:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()

"""How far the load-time probes' two routes differ on this device: the block pool's rows
against mlx-lm's own cache, body+head against the whole model, with a wrong route (one row's
logits for another's) for scale. These are the figures behind runner/logits_match.py's
tolerances. Also writes the qwen3-0.6b preset (bfloat16) into the benchmark's cache and
probes it. scripts/gpu_check.sh runs it on a GPU.

    python scripts/probe_differences.py
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.architectures import fix_model
from mlxr.runner.kv import rows
from mlxr.runner.model_step import split_model
from mlxr.supervisor.store.random_model import write_random_model


def difference(got: mx.array, want: mx.array) -> str:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (f"err {mx.abs(got - want).max().item():.3g} "
            f"scale {mx.abs(want).max().item():.3g}")


def matmul_error() -> float:
    """float32 matmul against float64: about 1e-7 on a CPU, 3e-4 where products use TF32."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((512, 512)).astype(np.float32) for _ in range(2))
    got = np.array(mx.array(a) @ mx.array(b))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def report(name: str, path: Path) -> None:
    model, _, config = load(str(path), return_config=True)
    fix_model(model, config)
    num_layers = len(make_prompt_cache(model))
    split = split_model(model)
    print(f"{name}: rows.probe={rows.probe(model, num_layers)} "
          f"split={split.body is not None}", flush=True)
    probe = mx.array([[1, 2, 3]])
    whole = model(probe, cache=make_prompt_cache(model))
    if split.body is not None:
        parts = split.logits(split.head(split.body(probe, cache=make_prompt_cache(model))))
        print("  split", difference(parts, whole), flush=True)
    names = ["prefill row 0", "prefill row 1", "decode, both rows"]
    pairs = rows.probe_pairs(model, num_layers)
    for name, (got, want) in zip(names, pairs):
        print(f"  {name}", difference(got, want), flush=True)
    # a wrong route, for scale: row 0's logits where row 1's belong
    print("  a wrong route (row 0's logits for row 1's)", difference(pairs[0][1], pairs[1][1]),
          flush=True)


def main() -> None:
    print("float32 matmul, largest relative error:", f"{matmul_error():.3g}", flush=True)
    tmp = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, tmp, True)  # the models: 100-300 MB
    for dtype in ("float32", "bfloat16"):
        for arch in ("qwen3", "llama", "granite"):
            report(f"{arch} {dtype}", write_random_model(tmp / f"{arch}-{dtype}", arch=arch,
                                                         dtype=dtype))
    big = Path.home() / ".cache" / "mlxr-bench" / "random-qwen3-0.6b-bfloat16"
    if not (big / "model.safetensors").exists():
        write_random_model(big, "qwen3-0.6b", dtype="bfloat16")
    report("qwen3-0.6b bfloat16", big)


if __name__ == "__main__":
    main()

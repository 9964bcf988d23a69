"""One linear layer's matmul on this machine's default device for each way a model's weights
can be held: float32, bfloat16, float16, MLX 8-bit and 4-bit (group 64), at 1 and 16 rows.
Behind runner/weights.py (widening to float32 on a CPU) and docs/PERFORMANCE.md "Float32
weights on a CPU".

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/bench_weights.py [--shape 1024x3072]

Prints the median milliseconds of each; nothing is asserted. The default shape is one of
Qwen3-0.6B's MLP projections (hidden 1024, intermediate 3072)."""

from __future__ import annotations

import argparse

import mlx.core as mx

from bench_kv_rows import median_ms  # this script's folder is on the path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1024x3072", help="IN x OUT of the layer")
    args = parser.parse_args()
    d_in, d_out = (int(v) for v in args.shape.split("x"))
    weight = mx.random.normal((d_out, d_in)) * 0.02
    print(f"device {mx.default_device()}, layer {d_in} -> {d_out}")
    for rows in (1, 16):
        x = mx.random.normal((rows, d_in))
        cases = {"float32": lambda: x @ weight.T}
        for dtype in (mx.bfloat16, mx.float16):
            w, xx = weight.astype(dtype), x.astype(dtype)
            cases[str(dtype).removeprefix("mlx.core.")] = lambda w=w, xx=xx: xx @ w.T
        for bits in (8, 4):
            q, s, b = mx.quantize(weight, group_size=64, bits=bits)
            cases[f"{bits}-bit"] = lambda q=q, s=s, b=b, bits=bits: mx.quantized_matmul(
                x, q, s, b, transpose=True, group_size=64, bits=bits)
        base = None
        for name, fn in cases.items():
            ms = median_ms(lambda fn=fn: mx.eval(fn()))
            base = base or ms
            print(f"rows {rows:2d}  {name:9s} {ms:8.2f} ms  {ms / base:5.1f}x float32")


if __name__ == "__main__":
    main()

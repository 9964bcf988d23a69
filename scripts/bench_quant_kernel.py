"""The quantized kernel's products (runner/quant_kernel.py) against the row kernel's on the
same weight in float32 (runner/row_kernel.py), at 1, 4 and 16 rows; and, with --model, the
154-odd body products of one decode token of a quantized model on one thread, split by the
kernel's workers. Behind docs/PERFORMANCE.md "Quantized weights as stored".

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) OPENBLAS_THREAD_TIMEOUT=4 \\
        PYTHONPATH=. .venv/bin/python scripts/bench_quant_kernel.py [--shape 512x151680] \\
        [--model ~/.cache/mlxr-bench/mlx-quantized/random-medium-8bit]

Prints the median milliseconds of each; nothing is asserted. The default shape is the medium preset's head (hidden 512, 151,680 tokens)."""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from bench_kv_rows import median_ms  # this script's folder is on the path
from mlxr.runner import quant_kernel
from mlxr.runner.quant_kernel import QuantizedWeight, QuantKernel
from mlxr.runner.row_kernel import RowKernel


def products(shape: str) -> None:
    d_in, d_out = (int(v) for v in shape.split("x"))
    rows_kernel, quant = RowKernel.load(), QuantKernel.load()
    linear = nn.Linear(d_in, d_out, bias=False)
    mx.eval(linear.parameters())
    dense = np.array(linear.weight)
    weights = {}
    for bits in (8, 4):
        layer = nn.QuantizedLinear.from_linear(linear, 64, bits)
        mx.eval(layer.parameters())
        weights[bits] = QuantizedWeight.of(layer)
    print(f"{d_in} -> {d_out}, vector width {quant.width}")
    for rows in (1, 4, 16):
        x = np.random.default_rng(rows).standard_normal((rows, d_in), dtype=np.float32)
        out = np.empty((rows, d_out), dtype=np.float32)
        wide = median_ms(lambda: rows_kernel.product(dense, x, out))
        line = f"{rows:2d} rows: float32 {wide:6.2f} ms"
        for bits, weight in weights.items():
            line += f"  {bits}-bit {median_ms(lambda: quant.product(weight, x, out)):6.2f} ms"
        print(line, flush=True)


def body(model_dir: str) -> None:
    from mlx_lm.utils import load

    from mlxr.runner.model_step import ModelStep
    from mlxr.runner.weights import widen_around_kernel

    model, _ = load(model_dir)
    widen_around_kernel(model)
    host = ModelStep(model, 0, lambda token: "").host_body
    # each layer's bound one-row products (runner/host_body.py), split by the kernel's workers
    bound = [getattr(layer, name) for layer in host.layers
             for name in ("q", "k", "v", "o", "gate", "up", "down")]
    split = [b.product for b in bound]
    quant = QuantKernel.load()
    every = quant_kernel.SPLIT_ELEMENTS
    quant_kernel.SPLIT_ELEMENTS = 1 << 40  # bound now: one thread each
    alone = [quant.one_row(b.weight) for b in bound]
    quant_kernel.SPLIT_ELEMENTS = every
    inputs = {b.weight.shape[1]: np.ones(b.weight.shape[1], dtype=np.float32) for b in bound}

    def token(products) -> None:
        for product in products:
            product(inputs[product.weight.shape[1]])

    print(f"{len(bound)} body products a token: one thread {median_ms(lambda: token(alone)):.2f}"
          f" ms, split by the kernel's workers {median_ms(lambda: token(split)):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="512x151680", help="IN x OUT of the weight")
    parser.add_argument("--model", help="a 4- or 8-bit MLX model directory")
    args = parser.parse_args()
    products(args.shape)
    if args.model:
        body(args.model)


if __name__ == "__main__":
    main()

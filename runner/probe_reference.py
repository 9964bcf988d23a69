"""The load-time probes' reference passes on a CPU, in a fraction of the time: while the
context is open, MLX's quantized layers compute their products through the quantized kernel.

Why: before a runner serves, its probes check each host path against the model's own forward
pass on a few tokens (runner/model_step.py's split, runner/kv/rows.py, host_head.py,
host_body.py, host_prefill.py). On a quantized model those passes went through MLX's
quantized CPU matmul, which reads and dequantizes the whole weight again for every row: the
0.6B Q4_K_M import took 34 s to load on the 2-core EPYC, 30 s of it those passes
(docs/PERFORMANCE.md, "A quantized model's load"), and the time grows with the model.

The kernel's products are tested against MLX's own (tests/mlx/test_quant_kernel.py, every
bit count, group size, row count and vector width), and each pass is still the model's own
modules around them (attention, norms, rope, the cache), so a probe still compares each host
path with the model: a host body that differs from the model is still refused inside
(tests/mlx/test_probe_reference.py).

Invariants: only exact `nn.QuantizedLinear` and `nn.QuantizedEmbedding` modules in a layout
the kernel takes, with float32 inputs, take this path (anything else, MLX's own); the
classes are restored when the context closes, also on an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr.runner.quant_kernel import QuantizedWeight, QuantKernel


@contextlib.contextmanager
def kernel_reference() -> Iterator[None]:
    """Quantized layers' products through the quantized kernel while open; MLX's own where
    the default device is not the CPU or the kernel does not load."""
    kernel = QuantKernel.load() if mx.default_device() == mx.cpu else None
    if kernel is None:
        yield
        return
    linear_call = nn.QuantizedLinear.__call__
    embedding_linear = nn.QuantizedEmbedding.as_linear

    def call(self, x):
        out = _product(kernel, self, x) if type(self) is nn.QuantizedLinear else None
        if out is None:
            return linear_call(self, x)
        return out + self["bias"] if "bias" in self else out

    def as_linear(self, x):
        out = _product(kernel, self, x) if type(self) is nn.QuantizedEmbedding else None
        return embedding_linear(self, x) if out is None else out

    nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear = call, as_linear
    try:
        yield
    finally:
        nn.QuantizedLinear.__call__ = linear_call
        nn.QuantizedEmbedding.as_linear = embedding_linear


def _product(kernel: QuantKernel, module, x: mx.array) -> mx.array | None:
    """x (..., in) @ the module's weight (out, in) transposed, through the kernel; None where
    this path does not take the module or x."""
    weight = QuantizedWeight.of(module)
    if weight is None or x.dtype != mx.float32:
        return None
    width, depth = weight.shape
    rows = np.array(x).reshape(-1, depth)
    out = np.empty((rows.shape[0], width), dtype=np.float32)
    kernel.product(weight, rows, out)
    return mx.array(out.reshape(*x.shape[:-1], width))

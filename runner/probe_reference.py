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

A mixture's stacked experts (mlx_lm's QuantizedSwitchLinear) take it too: MLX's CPU expert
product made a random Qwen3-30B-A3B-shaped file's first load 16 s, nearly all of it probes.

Invariants: only exact `nn.QuantizedLinear`, `nn.QuantizedEmbedding` and
`QuantizedSwitchLinear` modules in a layout the kernel takes, with float32 inputs, take this
path (anything else, MLX's own); the classes are restored when the context closes, also on an
exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr.runner.quant_kernel import QuantizedWeight, QuantKernel, takes_stacked


@contextlib.contextmanager
def kernel_reference() -> Iterator[None]:
    """Quantized layers' products through the quantized kernel while open; MLX's own where
    the default device is not the CPU or the kernel does not load."""
    kernel = QuantKernel.load() if mx.default_device() == mx.cpu else None
    if kernel is None:
        yield
        return
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    linear_call = nn.QuantizedLinear.__call__
    embedding_linear = nn.QuantizedEmbedding.as_linear
    experts_call = QuantizedSwitchLinear.__call__
    stacks: dict[int, list[QuantizedWeight] | None] = {}  # a module's experts, read once

    def call(self, x):
        out = _product(kernel, self, x) if type(self) is nn.QuantizedLinear else None
        if out is None:
            return linear_call(self, x)
        return out + self["bias"] if "bias" in self else out

    def as_linear(self, x):
        out = _product(kernel, self, x) if type(self) is nn.QuantizedEmbedding else None
        return embedding_linear(self, x) if out is None else out

    def experts(self, x, indices, sorted_indices=False):
        if type(self) is not QuantizedSwitchLinear or x.dtype != mx.float32 or \
                not takes_stacked(self):
            return experts_call(self, x, indices, sorted_indices)
        if id(self) not in stacks:
            stacks[id(self)] = QuantizedWeight.stacked(self)
        if stacks[id(self)] is None:
            return experts_call(self, x, indices, sorted_indices)
        out = expert_products(kernel, stacks[id(self)], x, indices)
        return out + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else out

    nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear = call, as_linear
    QuantizedSwitchLinear.__call__ = experts
    try:
        yield
    finally:
        nn.QuantizedLinear.__call__ = linear_call
        nn.QuantizedEmbedding.as_linear = embedding_linear
        QuantizedSwitchLinear.__call__ = experts_call


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


def expert_products(kernel: QuantKernel, weights: list[QuantizedWeight], x: mx.array,
                     indices: mx.array) -> mx.array:
    """MLX's gather_qmm(x, experts, rhs_indices=indices, transpose=True) through the kernel:
    for each index, x's matrix (m, in) at that place times the chosen expert's weight."""
    width, depth = weights[0].shape
    batch = np.broadcast_shapes(x.shape[:-2], indices.shape)
    m = x.shape[-2]
    xs = np.broadcast_to(np.array(x), batch + (m, depth)).reshape(-1, m, depth)
    ids = np.broadcast_to(np.array(indices), batch).reshape(-1)
    out = np.empty((ids.shape[0], m, width), dtype=np.float32)
    for e in np.unique(ids).tolist():
        at = np.nonzero(ids == e)[0]
        rows = np.ascontiguousarray(xs[at].reshape(-1, depth), dtype=np.float32)
        products = np.empty((rows.shape[0], width), dtype=np.float32)
        kernel.product(weights[e], rows, products)
        out[at] = products.reshape(at.shape[0], m, width)
    return mx.array(out.reshape(batch + (m, width)))

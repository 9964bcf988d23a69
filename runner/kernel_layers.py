"""Quantized layers on the quantized kernel while serving, for the architectures the numpy body
does not serve (Gemma 2, 3 and 4, Phi-3, mixtures' experts...): each 4- or 8-bit layer keeps
its packed values and computes its products in C (runner/quant_kernel.py), where MLX's own
quantized CPU product re-reads and dequantizes the whole weight for every row.

Why: before, such a model was widened to float32 when the body did not take it; a
Gemma 4-shaped Q8_0 file (445M parameters, 8 layers) then decoded at 3.5 tok/s from 1.7 GiB on
the 2-core Zen 3, where llama.cpp made 23 (docs/PERFORMANCE.md, "Gemma 4 on a CPU").

- Up to MAX_ROWS rows (decode steps, small batches): the kernel's product, one pass over the
  packed weight for every 16 rows.
- More rows (a prompt's chunk): the weight dequantized by the kernel (split over the cores)
  into one float32 scratch buffer shared by every layer, then numpy's BLAS product: float32's
  speed for the cost of writing one layer's float32 values. A layer of more than MAX_SCRATCH
  values (a large vocabulary's head) takes the kernel's passes of 16 rows instead.
- Only exact `nn.QuantizedLinear`, `nn.QuantizedEmbedding` (a tied head's `as_linear`) and
  mlx_lm's `QuantizedSwitchLinear` modules in a layout the kernel takes, with float32 scales,
  are changed (their class, in place); anything else keeps MLX's own product. Inputs of other
  dtypes are computed in float32 and given back in theirs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxr.runner.probe_reference import expert_products
from mlxr.runner.quant_kernel import QuantizedWeight, QuantKernel, takes_stacked

MAX_ROWS = 16  # one pass of the kernel takes 16 rows
# The most values a wide pass dequantizes at once (256 MB of float32): a larger layer (a head
# over Gemma's 262,144-token vocabulary is 2.7 GB wide) takes the kernel's passes instead.
MAX_SCRATCH = 1 << 26


class Host:
    """A layer's weight as the kernel reads it, and the scratch space its wide passes share."""

    def __init__(self, kernel: QuantKernel, weight: QuantizedWeight, scratch: "Scratch"):
        self.kernel, self.weight, self.scratch = kernel, weight, scratch

    def product(self, x: mx.array) -> mx.array:
        """x (..., in) @ weight.T as an MLX array of x's dtype."""
        width, depth = self.weight.shape
        out = self.numpy_product(np.asarray(x.astype(mx.float32)).reshape(-1, depth))
        return mx.array(out.reshape(*x.shape[:-1], width)).astype(x.dtype)

    def numpy_product(self, rows: np.ndarray) -> np.ndarray:
        """rows (n, in) float32 @ weight.T, float32 (n, out)."""
        width, depth = self.weight.shape
        if rows.shape[0] <= MAX_ROWS or width * depth > MAX_SCRATCH:
            out = np.empty((rows.shape[0], width), dtype=np.float32)
            self.kernel.product(self.weight, np.ascontiguousarray(rows), out)
            return out
        values = self.scratch.take(width, depth)
        self.kernel.dequantize(self.weight, values)
        return rows @ values.T


class Scratch:
    """One float32 buffer for the largest layer's values, grown on demand."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.float32)

    def take(self, width: int, depth: int) -> np.ndarray:
        if self._buffer.size < width * depth:
            self._buffer = np.empty(width * depth, dtype=np.float32)
        return self._buffer[:width * depth].reshape(width, depth)


class KernelLinear(nn.QuantizedLinear):
    host: Host

    def __call__(self, x):
        out = self.host.product(x)
        return out + self["bias"] if "bias" in self else out


class KernelEmbedding(nn.QuantizedEmbedding):
    host: Host

    def as_linear(self, x):
        return self.host.product(x)


def install(model, kernel: QuantKernel | None = None) -> int:
    """Put `model`'s quantized layers the kernel takes on it (on a CPU, where the kernel
    builds); returns how many layers it took."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    kernel = kernel or QuantKernel.load()
    if kernel is None:
        return 0
    scratch, taken = Scratch(), 0
    for _, module in model.named_modules():
        kind = type(module)
        if kind in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            weight = QuantizedWeight.of(module)
            if weight is not None:
                module.host = Host(kernel, weight, scratch)
                module.__class__ = KernelLinear if kind is nn.QuantizedLinear \
                    else KernelEmbedding
                taken += 1
        elif kind is QuantizedSwitchLinear and takes_stacked(module):
            experts = QuantizedWeight.stacked(module)
            if experts is not None:
                module.host = _Experts(kernel, experts)
                module.__class__ = KernelSwitchLinear
                taken += 1
    return taken


def serves(model) -> bool:
    """Whether `install` put any of `model`'s layers on the kernel."""
    return any(isinstance(m, (KernelLinear, KernelEmbedding, KernelSwitchLinear))
               for _, m in model.named_modules())


class _Experts:
    """A mixture's experts as the kernel reads them, one weight an expert."""

    def __init__(self, kernel: QuantKernel, weights: list[QuantizedWeight]):
        self.kernel, self.weights = kernel, weights


class KernelSwitchLinear(QuantizedSwitchLinear):
    """A mixture's stacked experts: each chosen expert's rows through the kernel."""

    host: _Experts

    def __call__(self, x, indices, sorted_indices=False):
        out = expert_products(self.host.kernel, self.host.weights, x.astype(mx.float32),
                               indices).astype(x.dtype)
        return out + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else out

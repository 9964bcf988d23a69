"""Quantized layers of 2, 3, 5 or 6 bits held in the quantized kernel's widths on a CPU: the
same values, scales and biases, each value in a 4-bit (from 2 or 3 bits) or an 8-bit (from 5
or 6) field.

Why: the quantized kernel (runner/quant_kernel.py) reads 4- and 8-bit weights only, and a
layer it does not take was widened to float32 at load (runner/weights.py), 32 bits a weight.
A GGUF Q5_K_M, Q5_0 or MXFP4 file imports with 5-bit layers, Q3_K with 5-bit, IQ4_XS with
6-bit (supervisor/store/gguf/quants.py), and MLX's own 3- and 6-bit models are common. Held
in 8 bits a 5-bit weight takes 10 bits with its float32 scale and bias, where float32 took
32; so a decode step reads a third of the bytes (docs/PERFORMANCE.md, "Other bit counts on
the kernel").

Exact: MLX dequantizes a weight as scale * q + bias in any width, so the same q, scale and bias
give the same floats bit for bit (tests/mlx/test_repack.py), and MLX's own forward pass reads
the repacked layer as it read the original.

MLX's layout (pinned by the kernel's tests too): each weight row is a little-endian stream of
`bits`-bit fields, element i in bits [i * bits, (i + 1) * bits); so every 8 elements fill
exactly `bits` bytes, which the kernel's `mlxr_quant_repack` reads as one 64-bit word (a
0.6B model's 197 layers in 0.75 s on the 2-core EPYC, most of it the new arrays' first
touch, where numpy took 1.36 s).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr.runner.quant_kernel import GROUPS, QuantKernel

WIDER = {2: 4, 3: 4, 5: 8, 6: 8}  # a bit count -> the kernel's width that holds it


def repackable(module) -> bool:
    """Is `module` an affine quantized layer (or a mixture's stacked experts) whose values the
    kernel takes once repacked?"""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    stacked = isinstance(module, QuantizedSwitchLinear)
    return (stacked or isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))) and \
        getattr(module, "mode", "affine") == "affine" and module.bits in WIDER and \
        module.group_size in GROUPS and module.weight.ndim == (3 if stacked else 2) and \
        module.weight.dtype == mx.uint32


def repack(module, kernel: QuantKernel) -> None:
    """Hold `module`'s values in the kernel's width, in place (`repackable` first), through
    the kernel's C `mlxr_quant_repack`."""
    wide = WIDER[module.bits]
    packed = np.asarray(module.weight).view(np.uint8)
    lead = packed.shape[:-1]  # (rows,), or a mixture's (experts, rows)
    held = kernel.repack(packed.reshape(-1, packed.shape[-1]), module.bits, wide)
    module.weight = mx.array(held.reshape(*lead, -1).view(np.uint32))
    module.bits = wide

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
exactly `bits` bytes, which `values` reads as one 64-bit word.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

WIDER = {2: 4, 3: 4, 5: 8, 6: 8}  # a bit count -> the kernel's width that holds it
GROUPS = (32, 64, 128)  # the group sizes the kernel takes
ROWS_AT_ONCE = 4096  # rows unpacked at a time: bounds the temporaries


def repackable(module) -> bool:
    """Is `module` an affine quantized layer whose values the kernel takes once repacked?"""
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and \
        getattr(module, "mode", "affine") == "affine" and module.bits in WIDER and \
        module.group_size in GROUPS and module.weight.ndim == 2 and \
        module.weight.dtype == mx.uint32


def repack(module) -> None:
    """Hold `module`'s values in the kernel's width, in place (`repackable` first)."""
    bits, wide = module.bits, WIDER[module.bits]
    packed = np.asarray(module.weight).view(np.uint8)
    rows = packed.shape[0]
    depth = packed.shape[1] * 8 // bits
    out = np.empty((rows, depth * wide // 8), dtype=np.uint8)
    for start in range(0, rows, ROWS_AT_ONCE):
        part = values(packed[start:start + ROWS_AT_ONCE], bits)
        out[start:start + len(part)] = part if wide == 8 else part[:, 0::2] | (part[:, 1::2] << 4)
    module.weight = mx.array(out.view(np.uint32))
    module.bits = wide


def values(packed: np.ndarray, bits: int) -> np.ndarray:
    """(rows, depth * bits / 8) uint8 of MLX's `bits`-bit layout -> (rows, depth) uint8."""
    rows = packed.shape[0]
    words = np.zeros((rows, packed.shape[1] // bits, 8), dtype=np.uint8)
    words[..., :bits] = packed.reshape(rows, -1, bits)
    words = words.view("<u8")[..., 0]  # eight elements a word
    out = np.empty((rows, words.shape[1], 8), dtype=np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for k in range(8):
        out[..., k] = (words >> np.uint64(bits * k)) & mask
    return out.reshape(rows, -1)

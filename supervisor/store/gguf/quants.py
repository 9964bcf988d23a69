"""One GGUF tensor, of any ggml type, as MLX weights; and writers of GGUF blocks for tests.

`to_mlx` turns the bytes gguf's reader gives for a tensor into an `MlxTensor`: a float32 array,
or MLX affine quantization (group size 32) as numpy arrays: a packed uint32 weight, float32
scales and biases, with `bits`. MLX dequantizes a group as w = scale * q + bias, q unsigned.
MXFP4 maps onto MLX's own "mxfp4" mode instead (`mode`): the same 4-bit E2M1 codes and e8m0
exponent bytes, no biases, 4.25 bits a weight.

Invariants:
- Float types (F32, F16, BF16) become float32 arrays of the logical shape; widening is exact.
- The exact types map each GGUF block onto MLX groups of 32 with no rounding anywhere:
  Q8_0 (8 bits), Q4_0, Q4_1, Q4_K (4), Q5_0, Q5_1, Q5_K (5). For them
  mx.dequantize(weight, scales, biases) equals gguf.quants.dequantize as float32 values
  (a zero weight may come back +0.0 where gguf gives -0.0, when a block's scale is negative).
  Why no rounding: every GGUF scale is a float16 (or a power of two) times a small integer, so
  scale * q needs at most 24 significant bits and is exact in float32; a signed q becomes
  q + offset with bias = -offset * scale, also exact; where GGUF adds a minimum (Q4_1, Q5_1,
  Q4_K, Q5_K) the one rounded operation is that addition, the same in both.
- MXFP4 is exact too: a block's value i is E2M1 code i (ggml's table of doubled E2M1 values,
  in the same code order) times 2^(e - 128) doubled back, which is MLX's mxfp4 value: code i
  times 2^(e - 127). Only the nibble order changes (ggml: values 0-15 in the low nibbles, 16-31
  in the high ones; MLX: element order).
- Q6_K (sub-blocks of 16 with their own scales: no exact MLX form) becomes 8 bits in groups
  of 32 with `exact=False`: each group's scale a code 0..63 times a factor per 256 values,
  its bias -128 times its scale (`_q6_k`), so the runner's kernel reads its scales as the
  byte codes a Q4_K weight's are (runner/quant_kernel.py `SuperScales`). On a 0.6B Q4_K_M
  file's Q6_K tensors the values move by 5.3e-3 of their RMS (mx.quantize's 8 bits: 4.7e-3),
  beside the 1.9e-2 that Q6_K itself moved them from the source weights.
- Every other type gguf can dequantize (Q2_K, Q3_K, the IQ and TQ types, NVFP4: their
  sub-blocks of 16 or non-linear grids have no exact MLX form) is dequantized with gguf and
  requantized with mx.quantize at `requantized_bits(type)`, with `exact=False`.
- Anything else (an unknown type number, Q8_K, integer types) raises UnsupportedTensorType.
- MLX's packing, found by quantizing with MLX and unpacking (tests pin it): each row of q is a
  little-endian bit stream, value i in bits [i * bits, (i + 1) * bits), stored as uint32 words.
  For 4 and 8 bits that is 8 or 4 values per word, lowest bits first; for 3, 5 and 6 bits every
  8 values fill `bits` bytes and values straddle word boundaries. This host is little-endian.

mlx is imported only where a tensor is requantized; everything else is numpy.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from mlxr.shared.errors import InvalidRequest, UnsupportedModel

GROUP_SIZE = 32
MLX_BITS = (3, 4, 5, 6, 8)
FLOAT_TYPES = ("F32", "F16", "BF16")
QK_K = 256  # values in a K-quant super-block

assert sys.byteorder == "little", "the packing below assumes a little-endian host"


class UnsupportedTensorType(UnsupportedModel):
    """A tensor type that gguf cannot dequantize (the message names it)."""


@dataclass(slots=True)
class MlxTensor:
    weight: np.ndarray                # float32 (logical shape), or uint32 (..., cols*bits//32)
    scales: np.ndarray | None = None  # float32 (..., cols // group_size)
    biases: np.ndarray | None = None  # float32 (..., cols // group_size)
    bits: int | None = None
    group_size: int | None = None
    exact: bool = True                # dequantizes to gguf's float32 values exactly
    mode: str = "affine"              # or "mxfp4": scales uint8 exponents, no biases


def describe_type(ggml_type: int) -> str:
    """The ggml name of a type number ("Q4_K"), or the number itself where gguf knows none."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


def to_mlx(ggml_type: int, data: np.ndarray, shape: tuple[int, ...], name: str = "", *,
           quantize: bool = True) -> MlxTensor:
    """A tensor as gguf's reader holds it (`data`; `shape` the logical numpy shape, reversed ne)
    as MLX weights. With quantize=False, for 1-D tensors and rows not a multiple of 32, the
    float32 values."""
    qtype = _supported_type(ggml_type, name)
    shape = tuple(int(n) for n in shape)
    if qtype.name in FLOAT_TYPES:
        return MlxTensor(weight=_floats(qtype, data, shape, name))
    blocks = _blocks(qtype, data, shape, name)
    if not quantize or len(shape) < 2 or shape[-1] % GROUP_SIZE:
        return MlxTensor(weight=_dequantize_gguf(qtype, blocks, shape))
    if qtype.name in EXACT:
        return _exact(qtype, blocks, shape)
    if qtype.name == "MXFP4":
        return _mxfp4(blocks, shape)
    if qtype.name == "Q6_K":
        return _q6_k(blocks, shape)
    return _requantize(qtype, blocks, shape)


def requantized_bits(ggml_type: int) -> int:
    """The MLX bits a quantized type converts to: its own for the exact types, else the fewest
    of MLX_BITS that are at least ceil(nominal bits per weight) + 1 (Q6_K -> 8, Q3_K -> 5)."""
    qtype = _supported_type(ggml_type)
    if qtype.name in FLOAT_TYPES:
        raise ValueError(f"{qtype.name} is a float type, not a quantized one")
    if qtype.name in EXACT:
        return EXACT[qtype.name][0]
    if qtype.name == "MXFP4":
        return 4
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    wanted = math.ceil(type_size * 8 / block_size) + 1
    return next((bits for bits in MLX_BITS if bits >= wanted), MLX_BITS[-1])


# --- type checks and raw data ---------------------------------------------------------------

def _supported_type(ggml_type: int, name: str = "") -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        qtype = None
    if qtype is None or not (qtype.name in FLOAT_TYPES or _gguf_dequantizes(qtype)):
        where = f' in "{name}"' if name else ""
        raise UnsupportedTensorType(
            f"unsupported GGUF tensor type {describe_type(ggml_type)}{where}")
    return qtype


@functools.cache
def _gguf_dequantizes(qtype: GGMLQuantizationType) -> bool:
    """Whether this gguf version has a dequantizer for the type (tried on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        gguf_quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _floats(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...],
            name: str) -> np.ndarray:
    data = np.asarray(data)
    if qtype.name == "BF16":  # bytes from the reader, or 16-bit words
        values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        dtype = np.float32 if qtype.name == "F32" else np.float16
        values = data.view(dtype) if data.dtype == np.uint8 else data
        values = values.astype(np.float32, copy=False)
    if values.size != math.prod(shape):
        raise InvalidRequest(f'GGUF tensor "{name}" holds {values.size} values, not the '
                             f"{math.prod(shape)} of shape {shape}")
    return values.reshape(shape)


def _blocks(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...],
            name: str) -> np.ndarray:
    """The raw bytes as (rows, blocks per row, bytes per block), rows = all leading dims."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(data).view(np.uint8)
    cols = shape[-1] if shape else 1
    if cols % block_size or raw.size * block_size != math.prod(shape) * type_size:
        raise InvalidRequest(f'GGUF tensor "{name}" of type {qtype.name} holds {raw.size} bytes, '
                             f"which do not fit shape {shape}")
    return raw.reshape(-1, cols // block_size, type_size)


def _dequantize_gguf(qtype: GGMLQuantizationType, blocks: np.ndarray,
                     shape: tuple[int, ...]) -> np.ndarray:
    rows = blocks.reshape(blocks.shape[0], -1)
    return gguf_quants.dequantize(rows, qtype).reshape(shape)


def _requantize(qtype: GGMLQuantizationType, blocks: np.ndarray,
                shape: tuple[int, ...]) -> MlxTensor:
    import mlx.core as mx

    bits = requantized_bits(qtype)
    values = mx.array(_dequantize_gguf(qtype, blocks, shape))
    weight, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
    return MlxTensor(weight=np.array(weight), scales=np.array(scales), biases=np.array(biases),
                     bits=bits, group_size=GROUP_SIZE, exact=False)


def _q6_k(blocks: np.ndarray, shape: tuple[int, ...]) -> MlxTensor:
    """Q6_K's values in 8 bits, groups of 32: group g of a super-block gets the smallest scale
    s = factor * code (code 0..63) with every value v / s in [-128, 127]; q = round(v / s) +
    128 and bias -128 * s. The factor is the super-block's largest needed scale over 63,
    rounded up to 11 significant bits, so factor * code is exact in float32 and that group's
    code is 63: the factor and codes come back exactly at load (`mlxr_quant_factored`)."""
    rows = len(blocks)
    q = np.empty((rows, blocks.shape[1] * QK_K), np.uint8)
    scales = np.empty((rows, blocks.shape[1] * QK_K // GROUP_SIZE), np.float32)
    for start in range(0, rows, _Q6_K_ROWS):  # a slice at a time: 3x faster than whole
        part = slice(start, start + _Q6_K_ROWS)
        values = _dequantize_gguf(GGMLQuantizationType.Q6_K, blocks[part], (-1, q.shape[1]))
        groups = values.reshape(len(values), -1, QK_K // GROUP_SIZE, GROUP_SIZE)
        need = np.maximum(groups.max(axis=-1) / 127, groups.min(axis=-1) / -128)
        factor = _round_up_11_bits(need.max(axis=-1) / 63)
        codes = np.clip(np.ceil(_divide(need, factor[..., None])), 0, 63)
        group_scales = (factor[..., None] * codes).astype(np.float32)  # exact: 11 bits times 6
        divisor = np.where(group_scales > 0, group_scales, np.float32(1))  # all-zero: q 128
        values = np.rint(groups / divisor[..., None], out=groups)
        np.clip(values + 128, 0, 255, out=values)
        q[part] = values.reshape(len(values), -1)
        scales[part] = group_scales.reshape(len(values), -1)
    lead = shape[:-1]
    return MlxTensor(weight=pack(q, 8).reshape(*lead, -1),
                     scales=scales.reshape(*lead, -1), biases=(-128 * scales).reshape(*lead, -1),
                     bits=8, group_size=GROUP_SIZE, exact=False)


_Q6_K_ROWS = 1024  # rows of a Q6_K tensor requantized at a time


def _round_up_11_bits(x: np.ndarray) -> np.ndarray:
    """Non-negative finite float32 -> the least float32 >= each with at most 11 significant
    bits (a float16's precision, without its range)."""
    words = np.ascontiguousarray(x, np.float32).view(np.uint32)
    low = np.uint32((1 << 13) - 1)  # the 13 low bits of a float32's 23-bit fraction
    return ((words + low) & ~low).view(np.float32)


# --- the exact mappings: blocks (rows, n, bytes) -> q uint8 (rows, cols), scales, biases ------

Groups = tuple[np.ndarray, np.ndarray, np.ndarray]


def _exact(qtype: GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, ...]) -> MlxTensor:
    bits, groups_of = EXACT[qtype.name]
    q, scales, biases = groups_of(blocks)
    lead = shape[:-1]
    return MlxTensor(weight=pack(q, bits).reshape(*lead, -1),
                     scales=scales.reshape(*lead, -1), biases=biases.reshape(*lead, -1),
                     bits=bits, group_size=GROUP_SIZE, exact=True)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at `offset` of each block, as float32 (rows, n, 1)."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes (..., k) -> (..., 2, k): all low nibbles, then all high ones (GGUF's order)."""
    return np.stack((packed & 0x0F, packed >> 4), axis=-2)


def _per_block(scale: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, n, 1) per 32-value block -> (rows, n) scales and biases."""
    return scale[..., 0], bias[..., 0]


def _q8_0(blocks: np.ndarray) -> Groups:
    d = _f16(blocks, 0)
    q = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> q + 128
    return q.reshape(len(blocks), -1), *_per_block(d, -128 * d)


def _q4_0(blocks: np.ndarray) -> Groups:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[..., 2:])
    return q.reshape(len(blocks), -1), *_per_block(d, -8 * d)


def _q4_1(blocks: np.ndarray) -> Groups:
    q = _nibbles(blocks[..., 4:])
    return q.reshape(len(blocks), -1), *_per_block(_f16(blocks, 0), _f16(blocks, 2))


def _five_bits(high: np.ndarray, quads: np.ndarray) -> np.ndarray:
    """32 high bits (4 bytes, little-endian, bit j for value j) over 16 bytes of nibbles."""
    top = np.unpackbits(high, axis=-1, bitorder="little")
    return _nibbles(quads).reshape(*quads.shape[:-1], 32) | (top << 4)


def _q5_0(blocks: np.ndarray) -> Groups:
    d = _f16(blocks, 0)
    q = _five_bits(blocks[..., 2:6], blocks[..., 6:])
    return q.reshape(len(blocks), -1), *_per_block(d, -16 * d)


def _q5_1(blocks: np.ndarray) -> Groups:
    q = _five_bits(blocks[..., 4:8], blocks[..., 8:])
    return q.reshape(len(blocks), -1), *_per_block(_f16(blocks, 0), _f16(blocks, 2))


def unpack_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, each (..., 8) uint8.
    Bytes 0-3 and 4-7 hold scales and mins 0-3 in their low 6 bits and the top 2 bits of
    scales and mins 4-7 above them; bytes 8-11 hold their low 4 bits (scale low, min high)."""
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((first & 0x3F, (low & 0x0F) | (first >> 6 << 4)), axis=-1)
    mins = np.concatenate((second & 0x3F, (low >> 4) | (second >> 6 << 4)), axis=-1)
    return scales, mins


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The inverse of unpack_k_scales: (..., 8) 6-bit scales and mins -> (..., 12) bytes."""
    first = (scales[..., :4] & 0x3F) | (scales[..., 4:] >> 4 << 6)
    second = (mins[..., :4] & 0x3F) | (mins[..., 4:] >> 4 << 6)
    low = (scales[..., 4:] & 0x0F) | (mins[..., 4:] << 4)
    return np.concatenate((first, second, low), axis=-1).astype(np.uint8)


def _k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K sub-block scales d * sc and biases -(dmin * m), each (rows, n * 8)."""
    sc, m = unpack_k_scales(blocks[..., 4:16])
    scales = _f16(blocks, 0) * sc.astype(np.float32)
    biases = -(_f16(blocks, 2) * m.astype(np.float32))
    return scales.reshape(len(blocks), -1), biases.reshape(len(blocks), -1)


def _k_nibbles(quads: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: each 32 bytes give 32 low nibbles, then 32 high ones."""
    return _nibbles(quads.reshape(*quads.shape[:-1], 4, 32)).reshape(*quads.shape[:-1], QK_K)


def _q4_k(blocks: np.ndarray) -> Groups:
    q = _k_nibbles(blocks[..., 16:])
    return q.reshape(len(blocks), -1), *_k_groups(blocks)


def _q5_k(blocks: np.ndarray) -> Groups:
    # Value 32 * s + l of a super-block takes bit s of high byte l as its fifth bit.
    bits = np.unpackbits(blocks[..., 16:48], axis=-1, bitorder="little")
    top = bits.reshape(*blocks.shape[:-1], 32, 8).swapaxes(-1, -2).reshape(*blocks.shape[:-1], QK_K)
    q = _k_nibbles(blocks[..., 48:]) | (top << 4)
    return q.reshape(len(blocks), -1), *_k_groups(blocks)


# E2M1 values, doubled, by code: ggml's table and MLX's mxfp4 codes alike.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _mxfp4(blocks: np.ndarray, shape: tuple[int, ...]) -> MlxTensor:
    """ggml blocks (exponent byte, 16 bytes of codes) -> MLX mxfp4 (codes in element order,
    the exponent bytes as scales)."""
    codes = _nibbles(blocks[..., 1:]).reshape(len(blocks), -1)
    lead = shape[:-1]
    return MlxTensor(weight=pack(codes, 4).reshape(*lead, -1),
                     scales=np.ascontiguousarray(blocks[..., 0]).reshape(*lead, -1),
                     bits=4, group_size=GROUP_SIZE, exact=True, mode="mxfp4")


EXACT: dict[str, tuple[int, Callable[[np.ndarray], Groups]]] = {
    "Q8_0": (8, _q8_0), "Q4_0": (4, _q4_0), "Q4_1": (4, _q4_1), "Q5_0": (5, _q5_0),
    "Q5_1": (5, _q5_1), "Q4_K": (4, _q4_k), "Q5_K": (5, _q5_k),
}


# --- MLX's packing ----------------------------------------------------------------------------

def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values below 2**bits, (..., cols) with cols % 32 == 0 -> MLX's uint32 words
    (..., cols * bits // 32): a little-endian bit stream per row."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    if bits == 8:
        return q.view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)).view(np.uint32)
    stream = np.zeros((*q.shape[:-1], q.shape[-1] // 8), np.uint64)  # 8 values a time
    for i in range(8):
        stream |= q[..., i::8].astype(np.uint64) << np.uint64(bits * i)
    packed = stream.view(np.uint8).reshape(*stream.shape, 8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(*q.shape[:-1], -1).view(np.uint32)


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of pack: MLX's uint32 words -> uint8 values (..., cols)."""
    packed = np.ascontiguousarray(weight, dtype=np.uint32).view(np.uint8)
    packed = packed.reshape(*packed.shape[:-1], -1, bits)
    padded = np.zeros((*packed.shape[:-1], 8), np.uint8)
    padded[..., :bits] = packed
    stream = padded.view(np.uint64)  # (..., cols // 8, 1)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    values = (stream >> shifts) & np.uint64((1 << bits) - 1)
    return values.astype(np.uint8).reshape(*weight.shape[:-1], -1)


def dequantize(tensor: MlxTensor) -> np.ndarray:
    """An MlxTensor's float32 values, computed in numpy as MLX does (scale * q + bias)."""
    if tensor.bits is None:
        return np.asarray(tensor.weight, np.float32)
    if tensor.mode == "mxfp4":
        codes = unpack(tensor.weight, 4)
        codes = codes.reshape(*codes.shape[:-1], -1, tensor.group_size)
        scale = np.ldexp(np.float32(1), tensor.scales.astype(np.int32) - 128)
        return (MXFP4_VALUES[codes] * scale[..., None]).reshape(*codes.shape[:-2], -1)
    q = unpack(tensor.weight, tensor.bits).astype(np.float32)
    q = q.reshape(*q.shape[:-1], -1, tensor.group_size)
    values = tensor.scales[..., None] * q + tensor.biases[..., None]
    return values.reshape(*q.shape[:-2], -1)


# --- writers of test data ---------------------------------------------------------------------

def random_blocks(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a type, uint8 (rows, bytes per row): random bytes with every scale
    field set to a finite value (float16 ones to small positive normals). Float types get
    standard normal values, as bytes."""
    qtype = _supported_type(ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{qtype.name} rows hold a multiple of {block_size} values, not {cols}")
    if qtype.name in FLOAT_TYPES:
        return _random_floats(qtype, rows, cols, rng)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    if qtype.name == "MXFP4":
        blocks[:, 0] = rng.integers(118, 130, len(blocks))  # scales 2^-10 .. 2^1
    elif qtype.name == "NVFP4":
        blocks[:, :4] = rng.integers(0x30, 0x48, (len(blocks), 4))  # ue4m3 scales 0.25 .. 0.94
    elif qtype.name == "IQ1_M":
        _set_iq1_m_scale(blocks, _random_f16(rng, len(blocks)))
    elif qtype.name in F16_FIELDS:
        for offset in F16_FIELDS[qtype.name]:
            scales = _random_f16(rng, len(blocks))
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    else:
        raise ValueError(f"no random block writer for {qtype.name}")
    return blocks.reshape(rows, -1)


# Byte offsets of each block's float16 scales (d, and dmin or m where there is one).
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}


def _random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(2.0 ** -12, 2.0 ** -6, n).astype(np.float16)


def _set_iq1_m_scale(blocks: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M keeps its float16 scale in the top nibbles of its four 16-bit sub-scale words."""
    words = np.ascontiguousarray(blocks[:, 48:56]).view(np.uint16)
    nibbles = d.view(np.uint16)[:, None] >> (np.arange(4, dtype=np.uint16) * 4) & 0x0F
    words = (words & 0x0FFF) | (nibbles << 12)
    blocks[:, 48:56] = words.view(np.uint8)


def _random_floats(qtype: GGMLQuantizationType, rows: int, cols: int,
                   rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal((rows, cols), dtype=np.float32)
    if qtype.name == "F16":
        values = values.astype(np.float16)
    elif qtype.name == "BF16":
        values = (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.view(np.uint8).reshape(rows, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Float32 (rows, cols), cols % 256 == 0 -> Q4_K blocks, uint8 (rows, cols // 256 * 144).
    A plain min/max quantizer: per 32 values a step (max - min) / 15 and a min clamped to <= 0,
    both as 6-bit multiples of the super-block's float16 d and dmin."""
    sub = _super_blocks(x).reshape(len(x), -1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) - low) / 15
    d, sc = _scale_multiples(step, 63)
    dmin, m = _scale_multiples(-low, 63)
    scale = (d[..., None] * sc)[..., None]
    offset = (dmin[..., None] * m)[..., None]
    q = np.clip(np.rint(_divide(sub + offset, scale)), 0, 15).astype(np.uint8)
    quads = q.reshape(*q.shape[:-2], 4, 2, 32)
    quads = quads[..., 0, :] | (quads[..., 1, :] << 4)
    return _concat(d, dmin, pack_k_scales(sc, m), quads)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Float32 (rows, cols), cols % 256 == 0 -> Q6_K blocks, uint8 (rows, cols // 256 * 210).
    Per 16 values a symmetric step max|x| / 31 held as an int8 multiple (0..127) of the
    super-block's float16 d; values q - 32 with q 6 bits."""
    sub = _super_blocks(x).reshape(len(x), -1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31
    d, sc = _scale_multiples(step, 127)
    q = np.clip(np.rint(_divide(sub, (d[..., None] * sc)[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(*q.shape[:-2], QK_K)
    # Low nibbles: value 128h + 64n + l in nibble n of byte 64h + l. High 2 bits: value
    # 128h + 32s + l in bits 2s of byte 32h + l.
    low = (q & 0x0F).reshape(*q.shape[:-1], 2, 2, 64)
    low = low[..., 0, :] | (low[..., 1, :] << 4)
    high = (q >> 4).reshape(*q.shape[:-1], 2, 4, 32) << (np.arange(4, dtype=np.uint8) * 2)[:, None]
    high = np.bitwise_or.reduce(high, axis=-2)
    return _concat(low, high, sc.astype(np.int8).view(np.uint8), d)


def _super_blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"expected (rows, cols) with cols a multiple of {QK_K}, got {x.shape}")
    return x.reshape(len(x), -1, QK_K)


def _scale_multiples(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative (rows, n, k) -> a super-scale (rows, n), float32 holding a float16 value,
    and integer multiples of it (rows, n, k) in 0..top that come nearest each value."""
    d = (values.max(axis=-1) / top).astype(np.float16).astype(np.float32)
    multiples = np.clip(np.rint(_divide(values, d[..., None])), 0, top).astype(np.uint8)
    return d, multiples


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, with 0 where b is 0."""
    b = np.broadcast_to(b, np.broadcast_shapes(a.shape, b.shape))
    return np.divide(a, b, out=np.zeros(b.shape, np.float32), where=b != 0)


def _concat(*fields: np.ndarray) -> np.ndarray:
    """Per-block fields, each (rows, n, k) bytes or (rows, n) float32 stored as float16 ->
    (rows, n * sum(k)) bytes."""
    parts = [f.astype(np.float16).view(np.uint8).reshape(*f.shape, 2) if f.dtype == np.float32
             else f.reshape(*f.shape[:2], -1) for f in fields]
    return np.concatenate(parts, axis=-1).reshape(len(parts[0]), -1)

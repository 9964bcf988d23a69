"""A quantized model's products on a CPU with the weights as stored: a few rows times an MLX
affine 4- or 8-bit weight through a small C kernel (shared/assets/quant_kernel.c) that reads
the packed weight once for up to 16 rows.

Why: a decode step on a CPU is a read of every weight, so its time is the weights' bytes. The
runner used to widen a quantized model to float32 (runner/weights.py), 4x the bytes of an
8-bit weight and 8x a 4-bit one, because MLX's own quantized CPU matmul is slower still. On
the 2-core Zen 4 EPYC a 151,680 x 512 head takes 13.0 ms for one row in float32 (the row
kernel), 3.1 ms 8-bit and 3.1 ms 4-bit here; at 16 rows all three take 14-16 ms
(docs/PERFORMANCE.md, "Quantized weights as stored").

`QuantizedWeight.of` reads a QuantizedLinear or QuantizedEmbedding whose layout the kernel
takes (affine, 4 or 8 bits, group 32, 64 or 128, float32 scales); the runner's host body,
prefill and head (runner/host_body.py, host_prefill.py, host_head.py) call `QuantKernel.product`
for it. Nothing else changes: MLX's forward pass still reads the same arrays.

A GGUF Q4_K weight comes in (supervisor/store/gguf/quants.py) with each group's scale and bias
a float32 factor per 256 weights times a 6-bit code. As MLX's float32 scales and biases those
are 2 of a weight's 6 bits. `QuantKernel.with_supers` finds the factors and codes again
(where every scale and bias is rebuilt exactly) and one row's product then reads a byte a
code and the factors: 4.75 bits a weight, 21% fewer bytes, the same floats (`SuperScales`).
The same holds for 8 bits: a Q5_K weight (held in 8-bit fields, runner/repack.py) and a Q6_K
one (imported with scales of that form) are read at 8.5 bits a weight instead of 10. A Q8_0,
Q4_0 or Q5_0 weight's biases are a fixed multiple of its scales (-128, -8, -16: `offset`):
one row's product then reads the scales alone, 9 bits a weight instead of 10 (5 for Q4_0).
A decode step streams every weight once, at what one core's loads sustain (about 12 GB/s
here), so bytes are time. The float32 arrays stay for everything else.

Invariants: `product` writes every element of its (rows, out) output; the rows go in passes of
16, each one read of the weight; a large weight's rows are split across the cores by the C
library's own workers, for one calling thread at a time (another caller meanwhile runs on
its own thread alone).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxr.runner import host_parallel
from mlxr.shared import native

BITS = (4, 8)
GROUPS = (32, 64, 128)
MAX_LANES = 16  # rows one pass over the weight serves
# Up to this many rows the kernel multiplies along weight rows, x as (rows, in); more, a tile at
# a time, x as (in, rows). 4 rows times a 151,936 x 1,024 4-bit head: 14.5-18.7 ms against
# 22.8-23.8 tiled; 8 rows: 32-37 against 24.
DOT_LANES = 4
TILE = 8  # weight rows the kernel takes at a time: ranges start on a multiple
ROW4_BLOCK = 128  # one row times a 4-bit weight of a depth that is a multiple: another order
SPLIT_ELEMENTS = 1 << 17  # smaller weights are one thread's work (a hand-off costs more)
SUPER_GROUPS = 8  # groups of 32 in a super-block: a Q4_K block's 256 weights
_FUNCTIONS = ["mlxr_quant_rows_parts", "mlxr_quant_width", "mlxr_quant_use_width",
              "mlxr_quant_dequantize", "mlxr_parts", "mlxr_quant_super_parts",
              "mlxr_quant_factored", "mlxr_quant_repack", "mlxr_quant_many"]
ITEM_FIELDS = 11  # `QuantKernel.item`'s fields (shared/assets/quant_kernel.c `many_item`)
ITEM_X, ITEM_OUT = 3, 4  # the fields of an item's row and output addresses


@dataclass(frozen=True, slots=True)
class SuperScales:
    """A 4- or 8-bit, group-32 weight's scales and biases as factors per super-block of
    SUPER_GROUPS groups times byte codes: group g's scale is factors[:, g // 8] * codes[:, g],
    its bias factors[:, supers + g // 8] * codes[:, groups + g], each product exactly the
    float32 scale or bias (shared/assets/quant_kernel.c `mlxr_quant_super_parts`)."""

    codes: np.ndarray  # uint8 (out, 2 * groups): a row's scale codes, then its bias codes
    factors: np.ndarray  # float32 (out, 2 * supers): a row's scale factors, then its bias ones


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An MLX affine-quantized (out, in) weight as numpy views of its arrays."""

    q: np.ndarray  # uint8 (out, in * bits // 8): the packed values, lowest bits first
    scales: np.ndarray  # float32 (out, in // group)
    biases: np.ndarray  # float32 (out, in // group)
    bits: int
    group: int
    keep: tuple  # the MLX arrays the views point into
    supers: SuperScales | None = None  # the same scales and biases in super-blocks, if found
    offset: int | None = None  # biases == -offset * scales exactly, if found

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    @classmethod
    def of(cls, module) -> "QuantizedWeight | None":
        """The weight of an MLX QuantizedLinear or QuantizedEmbedding the kernel takes, else
        None (another mode, bit count or group size, or scales not float32)."""
        if not takes(module):
            return None
        return cls._of_arrays(module)

    @classmethod
    def stacked(cls, module) -> "list[QuantizedWeight] | None":
        """One weight an expert, views into a QuantizedSwitchLinear's stacked arrays
        (`takes_stacked`), else None (scales not float32)."""
        if not takes_stacked(module):
            return None
        whole = cls._of_arrays(module)
        if whole is None:
            return None
        return [cls(whole.q[e], whole.scales[e], whole.biases[e], whole.bits, whole.group,
                    whole.keep) for e in range(whole.q.shape[0])]

    @classmethod
    def _of_arrays(cls, module) -> "QuantizedWeight | None":
        """A weight as stored in `module`'s arrays (2-D, or 3-D for stacked experts)."""
        import mlx.core as mx

        weight, scales, biases = module.weight, module.scales, module.get("biases")
        if not isinstance(biases, mx.array) or weight.dtype != mx.uint32 or \
                scales.dtype != mx.float32 or biases.dtype != mx.float32:
            return None
        bits, group = module.bits, module.group_size
        mx.eval(weight, scales, biases)
        q = np.asarray(weight).view(np.uint8)
        s, b = np.asarray(scales), np.asarray(biases)
        if q.shape[-1] * 8 // bits != s.shape[-1] * group or not all(
                a.flags.c_contiguous for a in (q, s, b)):
            return None
        return cls(q, s, b, bits, group, (weight, scales, biases))

    def __getitem__(self, ids) -> np.ndarray:
        """Rows `ids` (an int or an integer array) dequantized to float32, as
        `mx.dequantize` gives them: an embedding lookup."""
        q, scales, biases = self.q[ids], self.scales[ids], self.biases[ids]
        if self.bits == 4:
            q = np.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
        values = q.astype(np.float32).reshape(*scales.shape, self.group)
        values *= scales[..., None]
        values += biases[..., None]
        return values.reshape(*q.shape[:-1], -1)


def takes(module) -> bool:
    """Is `module` a quantized layer whose layout the kernel takes (its scales' dtype aside)?"""
    import mlx.nn as nn

    if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return False
    return getattr(module, "mode", "affine") == "affine" and module.bits in BITS and \
        module.group_size in GROUPS and module.weight.ndim == 2


def takes_stacked(module) -> bool:
    """Is `module` a mixture's stacked experts (mlx_lm's QuantizedSwitchLinear) whose layout
    the kernel takes an expert at a time (its scales' dtype aside)?"""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return isinstance(module, QuantizedSwitchLinear) and \
        getattr(module, "mode", "affine") == "affine" and module.bits in BITS and \
        module.group_size in GROUPS and module.weight.ndim == 3


def kernel_layout(x: np.ndarray, bits: int, lanes: int) -> np.ndarray:
    """Rows x (b, in), b <= lanes, as the kernel reads them: padded with zero rows to
    `lanes`; for 4 bits in `one_row_order` (several rows: each 32-position block as its 16
    even positions, then its 16 odd ones); (lanes, in) for up to DOT_LANES lanes, else
    transposed, (in, lanes)."""
    b, depth = x.shape
    order = one_row_order(bits, depth) if lanes == 1 else _EVEN_ODD if bits == 4 else None
    if order is not None:
        x = x.reshape(b, *order[1]).transpose(0, 1, 3, 2).reshape(b, depth)
    if b == lanes <= DOT_LANES:  # the rows as they are (a decode step's 150-200 products)
        return np.ascontiguousarray(x, dtype=np.float32)
    if lanes <= DOT_LANES:
        out = np.zeros((lanes, depth), dtype=np.float32)
        out[:b] = x
    else:
        out = np.zeros((depth, lanes), dtype=np.float32)
        out[:, :b] = x.T
    return out


def one_row_order(bits: int, depth: int) -> tuple[tuple, tuple] | None:
    """How one row x (depth,) goes into the kernel's order (shared/assets/quant_kernel.c):
    shapes (into, source) such that x.reshape(source).transpose(0, 2, 1), copied into the
    row's buffer reshaped to `into`, is that order; None for 8 bits (x as it is). 4 bits with a
    depth that is a multiple of ROW4_BLOCK: each block of 128 transposed from (16, 8) to
    (8, 16) (QROW4); other depths: _EVEN_ODD, the order of several rows."""
    if bits != 4:
        return None
    return _BLOCKS if depth % ROW4_BLOCK == 0 else _EVEN_ODD


def into_row_order(into: np.ndarray, rows: np.ndarray, order: tuple | None) -> None:
    """Rows (n, depth) copied into `into` (n rows of depth), each in a one-row product's
    `order` (`one_row_order`): several one-row products' rows at once (`QuantKernel.many`)."""
    n = rows.shape[0]
    if order is None:
        np.copyto(into.reshape(rows.shape), rows)
    else:
        np.copyto(into.reshape(n, *order[0]), rows.reshape(n, *order[1]).transpose(0, 1, 3, 2))


_BLOCKS = ((-1, 8, 16), (-1, 16, 8))  # each 128 positions as (16, 8) transposed
_EVEN_ODD = ((-1, 2, 16), (-1, 16, 2))  # each 32 positions: the 16 even ones, then the odd


def parts_for(weight: QuantizedWeight) -> int:
    """Ranges a product with `weight` is split into: the cores, from SPLIT_ELEMENTS on."""
    width, depth = weight.shape
    return host_parallel.workers() if width * depth >= SPLIT_ELEMENTS else 1


def lanes_for(rows: int) -> int:
    return 1 if rows == 1 else 2 if rows == 2 else 4 if rows <= 4 else 8 if rows <= 8 else 16


class QuantKernel:
    def __init__(self, fn, width: int, dequantize, use_width, parts=None, super_parts=None,
                 factored=None, repack=None, many=None):
        self.rows_parts = fn  # mlxr_quant_rows_parts (also runner/decode_row.py's products)
        self.super_parts = super_parts  # mlxr_quant_super_parts: one row, `SuperScales`
        self._factored = factored  # mlxr_quant_factored: finds `SuperScales`
        self._repack = repack  # mlxr_quant_repack: runner/repack.py's wider fields
        self._many = many  # mlxr_quant_many: several one-row products in one call
        self._dequantize = dequantize
        self._use_width = use_width
        self.width = width  # floats a vector on this CPU: 16, 8 or 4
        # mlxr_parts(job, args, n, parts): another library's job over [0, n) on this
        # library's workers (runner/kv/attend_kernel.py)
        self.parts = parts

    def use_width(self, want: int) -> int:
        """Use the widest copy of the kernel of at most `want` floats a vector that this CPU
        runs (16: AVX-512, 8: AVX2, 4: any); returns the width now in use. For the tests."""
        self.width = self._use_width(want)
        return self.width

    @classmethod
    @functools.lru_cache(maxsize=1)
    def load(cls, cache_dir: Path | None = None) -> "QuantKernel | None":
        """The kernel, built into `cache_dir` (default: the settings' cache directory) if
        need be; None where it cannot be built or loaded (logged)."""
        found = native.built_functions(native.quant_kernel_library, cache_dir, _FUNCTIONS,
                                       "quantized kernel")
        return None if found is None else cls._of(*found)

    @classmethod
    def from_library(cls, path: Path) -> "QuantKernel | None":
        """The kernel in the built library `path`; None where it does not load (logged)."""
        found = native.library_functions(path, _FUNCTIONS, "quantized kernel")
        return None if found is None else cls._of(*found)

    @classmethod
    def _of(cls, fn, width, use_width, dequantize, parts, super_parts, factored,
            repack, many) -> "QuantKernel":
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_long,
                       ctypes.c_long, ctypes.c_int, ctypes.c_float]
        width.restype = use_width.restype = ctypes.c_int
        use_width.argtypes = [ctypes.c_int]
        dequantize.restype = ctypes.c_int
        dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_long, ctypes.c_long]
        parts.restype = None
        parts.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
        super_parts.restype = ctypes.c_int
        super_parts.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                                ctypes.c_long, ctypes.c_long, ctypes.c_int]
        factored.restype = ctypes.c_int
        factored.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int]
        repack.restype = ctypes.c_int
        repack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        many.restype = ctypes.c_int
        many.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        return cls(fn, width(), dequantize, use_width, parts, super_parts, factored, repack,
                   many)

    def dequantize(self, weight: QuantizedWeight, out: np.ndarray) -> None:
        """out (out, in), C-contiguous float32 = the weight's values, as `mx.dequantize`
        gives them; split across the cores."""
        (width, depth), fn = weight.shape, self._dequantize
        q, s, z = weight.q.ctypes.data, weight.scales.ctypes.data, weight.biases.ctypes.data
        o, bits, group = out.ctypes.data, weight.bits, weight.group

        def part(a: int, e: int) -> None:
            if fn(q, bits, depth, group, s, z, o, a, e) != 0:
                raise ValueError("quantized kernel refused its arguments")

        host_parallel.for_rows(width, width * depth, part)

    def product(self, weight: QuantizedWeight, rows: np.ndarray, out: np.ndarray) -> None:
        """out (B, out) = rows (B, in) @ dequantize(weight).T, for float32 rows; out
        C-contiguous float32. One pass over the weight for every 16 rows where a vector
        holds 16 floats (AVX-512), every 8 elsewhere: with 8-float vectors the 16-lane pass
        ran 10x slower than the 8-lane one (2,304 x 768, 8-bit: 6.3 ms at 12 rows against
        0.6 at 8 on the 2-core Zen 3), so two passes of 8 are 6x faster."""
        step = MAX_LANES if self.width >= MAX_LANES else 8
        for start in range(0, rows.shape[0], step):
            block = rows[start:start + step]
            self._pass(weight, block, out[start:start + block.shape[0]])

    def with_supers(self, weight: QuantizedWeight) -> QuantizedWeight:
        """`weight` (4 or 8 bits) with its scales and biases as super-blocks where each one
        is a float32 factor per super-block times a code in 0..63, exactly (a GGUF Q4_K,
        Q5_K or Q6_K import's are), else `weight` (C `mlxr_quant_factored`, split across the
        cores)."""
        if weight.group != 32 or weight.supers is not None or \
                weight.scales.shape[1] % SUPER_GROUPS:
            return weight
        found = [self._super_blocks(values) for values in (weight.scales, weight.biases)]
        if None in found:
            return weight
        (scale_factors, scale_codes), (bias_factors, bias_codes) = found
        return dataclasses.replace(weight, supers=SuperScales(
            np.concatenate((scale_codes, bias_codes), axis=1),
            np.concatenate((scale_factors, bias_factors), axis=1)))

    def compact(self, weight: QuantizedWeight) -> QuantizedWeight:
        """`weight` in the fewest bytes one row's product reads: its scales and biases as
        super-blocks (`with_supers`), else its biases as a multiple of its scales
        (`with_offset`), else as it is."""
        found = self.with_supers(weight)
        return found if found.supers is not None else with_offset(weight)

    def _super_blocks(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(out, groups) float32 -> factors (out, supers) and codes (out, groups) uint8 with
        codes * factors == values exactly, or None where some super-block has none."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        out, groups = values.shape
        factors = np.empty((out, groups // SUPER_GROUPS), dtype=np.float32)
        codes = np.empty((out, groups), dtype=np.uint8)
        if self._factored(values.ctypes.data, factors.size, factors.ctypes.data,
                          codes.ctypes.data, host_parallel.workers()) != 0:
            return None
        return factors, codes

    def repack(self, packed: np.ndarray, bits: int, wide: int) -> np.ndarray:
        """(rows, depth * bits / 8) uint8 of MLX's `bits`-bit layout (2, 3, 5 or 6) -> the
        same values in `wide`-bit fields (4 or 8), (rows, depth * wide / 8) uint8; split
        across the cores."""
        packed = np.ascontiguousarray(packed)
        rows, depth = packed.shape[0], packed.shape[1] * 8 // bits
        out = np.empty((rows, depth * wide // 8), dtype=np.uint8)
        if self._repack(packed.ctypes.data, bits, rows, depth, out.ctypes.data, wide,
                        host_parallel.workers()) != 0:
            raise ValueError(f"cannot repack {bits} bits into {wide}")
        return out

    def item(self, weight: QuantizedWeight) -> np.ndarray:
        """`many`'s description of one row's product with `weight` as `one_row` makes it
        (ITEM_FIELDS int64; its row's and output's addresses, ITEM_X and ITEM_OUT, left 0).
        The caller keeps `weight` alive while the item is used."""
        width, depth = weight.shape
        if weight.supers is not None:
            return np.array([weight.q.ctypes.data, weight.supers.codes.ctypes.data,
                             weight.supers.factors.ctypes.data, 0, 0, depth, width,
                             weight.bits, weight.group, 1, 1], dtype=np.int64)
        biases, zmul = _biases(weight)
        return np.array([weight.q.ctypes.data, weight.scales.ctypes.data, biases.ctypes.data,
                         0, 0, depth, width, weight.bits, weight.group, 0, int(zmul)],
                        dtype=np.int64)

    def many(self, items: np.ndarray) -> None:
        """The one-row products `items` (n, ITEM_FIELDS) int64 describe (`item`, with each
        row's and output's addresses filled in), in one call split across the cores: each
        row in the order `one_row_order` gives its weight."""
        if self._many(items.ctypes.data, items.shape[0], host_parallel.workers()) != 0:
            raise ValueError("quantized kernel refused its arguments")

    def one_row(self, weight: QuantizedWeight) -> "OneRow":
        """One row's products with `weight`, its addresses read once (`OneRow`)."""
        return OneRow(self, weight)

    def _pass(self, weight: QuantizedWeight, block: np.ndarray, out: np.ndarray) -> None:
        (width, depth), b = weight.shape, block.shape[0]
        lanes = lanes_for(b)
        x = kernel_layout(block, weight.bits, lanes)
        if b == 1 and weight.supers is not None:
            supers = weight.supers
            if self.super_parts(weight.q.ctypes.data, weight.bits, depth,
                                supers.codes.ctypes.data,
                                supers.factors.ctypes.data, x.ctypes.data, out.ctypes.data,
                                width, 0, width, parts_for(weight)) != 0:
                raise ValueError("quantized kernel refused its arguments")
            return
        fn, bits, group = self.rows_parts, weight.bits, weight.group
        biases, zmul = _biases(weight) if b == 1 else (weight.biases, 1.0)
        if fn(weight.q.ctypes.data, bits, depth, group, weight.scales.ctypes.data,
              biases.ctypes.data, x.ctypes.data, lanes, out.ctypes.data, width, b, 0,
              width, parts_for(weight), zmul) != 0:
            raise ValueError("quantized kernel refused its arguments")


class OneRow:
    """A decode step's product of one row with one weight, bound once: the weight's, the
    row's and the output's addresses are read when it is made (each numpy address costs
    about 2 us, and a decode step of the 0.6B model makes 196 products), and the row is
    copied into its own buffer in the kernel's order. Invariant: each call returns the same
    output buffer, which the next call overwrites."""

    def __init__(self, kernel: QuantKernel, weight: QuantizedWeight):
        width, depth = weight.shape
        self.weight = weight  # keeps the arrays the addresses point into
        self.out = np.empty(width, dtype=np.float32)
        self._row = np.empty(depth, dtype=np.float32)
        self._order = one_row_order(weight.bits, depth)
        self._into = self._row if self._order is None else self._row.reshape(self._order[0])
        supers = weight.supers
        if supers is None:
            biases, zmul = _biases(weight)
            self._fn = kernel.rows_parts
            self._args = (weight.q.ctypes.data, weight.bits, depth, weight.group,
                          weight.scales.ctypes.data, biases.ctypes.data,
                          self._row.ctypes.data, 1, self.out.ctypes.data, width, 1, 0, width,
                          parts_for(weight), zmul)
        else:
            self._fn = kernel.super_parts
            self._args = (weight.q.ctypes.data, weight.bits, depth, supers.codes.ctypes.data,
                          supers.factors.ctypes.data, self._row.ctypes.data,
                          self.out.ctypes.data, width, 0, width, parts_for(weight))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """weight @ x for one float32 row x (in,): the (out,) buffer."""
        if self._order is None:
            np.copyto(self._row, x)
        else:
            np.copyto(self._into, x.reshape(self._order[1]).transpose(0, 2, 1))
        if self._fn(*self._args) != 0:
            raise ValueError("quantized kernel refused its arguments")
        return self.out


def with_offset(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` with `offset` set where every bias is -offset times its group's scale exactly,
    for one integer offset (a GGUF Q8_0 import's 128, Q4_0's 8, Q5_0's 16), else `weight`."""
    if weight.offset is not None or not np.isfinite(weight.scales).all():
        return weight
    nonzero = np.flatnonzero(weight.scales)
    if not nonzero.size:
        return weight
    first = nonzero[0]
    ratio = -weight.biases.flat[first] / weight.scales.flat[first]
    if not (1 <= ratio <= 255 and ratio == int(ratio)):
        return weight
    offset = int(ratio)
    if not np.array_equal(weight.biases, weight.scales * np.float32(-offset)):
        return weight
    return dataclasses.replace(weight, offset=offset)


def _biases(weight: QuantizedWeight) -> tuple[np.ndarray, float]:
    """The biases one row's product reads, and the factor it reads them by: the scales and
    -offset where the biases are that multiple of them, else the biases and 1."""
    if weight.offset is None:
        return weight.biases, 1.0
    return weight.scales, float(-weight.offset)

"""One row's decode step through all of the body's layers in one C call
(shared/assets/attend_kernel.c `mlxr_decode_row`), for the numpy body's row-by-row path
(runner/host_body.py `_row`).

Around its seven products a layer of the numpy body made some 40 numpy calls (norms, RoPE,
the key and value writes, the attention call, SwiGLU, residual adds), each a few
microseconds of interpreter and dispatch. On a 0.6B model's 28 layers that was 5-6 ms of a
20 ms body, where the products alone took 15 (docs/PERFORMANCE.md, "One row's step in one C
call"). The C side runs the same arithmetic: the products through the same kernels (the
quantized kernel's `mlxr_quant_rows_parts`, or `mlxr_quant_super_parts` for a weight with
`SuperScales`; OpenBLAS's `cblas_sgemv` for float32 weights; each handed in as a function
pointer), the attention through `mlxr_attend_position`.

`DecodeRow.bind` answers None (and the body keeps its numpy path) unless every linear is
bound for one of those two kernels, the RoPE has tables (`RopeTables`), and the attention
kernel is built. `__call__` answers None for a row whose pieces the attention kernel does
not read; the body then takes its numpy path for that row.

Invariants: the model table holds the addresses of the body's weights and of this object's
buffers, so both are kept alive here; one call at a time (the buffers are shared).
"""

from __future__ import annotations

import logging

import numpy as np

from mlxr.runner import host_parallel
from mlxr.runner.kv.attend_kernel import POOL_FLOATS, AttendKernel, address, piece_table
from mlxr.runner.quant_kernel import QuantKernel, QuantizedWeight, parts_for

# The C side's slots (attend_kernel.c): the model's header, a linear, a layer, a layer's context.
M_HEADER = 16
LIN_SLOTS = 10
KIND_QUANT, KIND_FLOAT, KIND_SUPER, KIND_OFFSET = 1, 2, 3, 4
Y_LINEARS = 9
L_STRIDE = Y_LINEARS + 7 * LIN_SLOTS
C_SLOTS = 7
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")  # the C side's order
LAYOUT = (M_HEADER, LIN_SLOTS, Y_LINEARS, L_STRIDE, C_SLOTS)  # as mlxr_decode_layout gives it

log = logging.getLogger("mlxr.runner")


def _bits(value: float) -> int:
    """A double as the int64 slot the C side reads it from."""
    return int(np.array([value], dtype=np.float64).view(np.int64)[0])


class DecodeRow:
    def __init__(self, fn, model: np.ndarray, keep: list, embed, rope, hidden: int,
                 heads: int, kv_heads: int, dim: int):
        self._fn = fn
        self._model = model
        self._keep = keep  # the arrays the model table points into
        self._embed = embed
        self._rope = rope
        self._kv_heads, self._dim, self._heads = kv_heads, dim, heads
        self._h = np.empty(hidden, dtype=np.float32)
        self._out = np.empty(hidden, dtype=np.float32)
        self._scores = np.empty(0, dtype=np.float32)

    @classmethod
    def bind(cls, body, sgemv, quant: QuantKernel | None,
             attend: AttendKernel | None) -> "DecodeRow | None":
        """The step for `body` (a HostBody whose linears are bound), or None where it does
        not apply. `sgemv`: the OpenBLAS `cblas_sgemv` the body's float32 products use."""
        if attend is None or attend.decode is None or body.rope_tables is None or \
                any(layer.experts is not None for layer in body.layers):  # (a dense MLP's)
            return None
        if attend.decode_layout != LAYOUT:
            log.warning("the decode kernel's table (%s) is not this code's (%s); decoding "
                        "rows in numpy", attend.decode_layout, LAYOUT)
            return None
        layers, dim = body.layers, body.head_dim
        first = layers[0]
        if any((layer.heads, layer.kv_heads) != (first.heads, first.kv_heads)
               for layer in layers) or dim % 8 or first.heads % first.kv_heads:
            return None
        hidden = body.norm[0].shape[0]
        inter = 0
        keep: list = []
        slots: list[int] = []
        for layer in layers:
            norms = [layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm]
            for norm in norms:
                slots += [0, 0] if norm is None else [_keep(keep, norm[0]), _bits(norm[1])]
            slots.append(_bits(layer.scale))
            for name in LINEARS:
                linear = _linear_slots(getattr(layer, name), keep, sgemv, quant)
                if linear is None:
                    return None
                slots += linear
            inter = inter or slots[-3 * LIN_SLOTS + 6]  # the gate's rows
            if slots[-2 * LIN_SLOTS + 6] != inter:  # the up's
                return None
        partner = np.ascontiguousarray(body.rope_tables.partner, dtype=np.int32)
        widest = max(hidden, inter, first.heads * dim)
        scratch = np.empty(2 * widest + 2 * first.heads * dim + 2 * first.kv_heads * dim
                           + hidden + 2 * inter + dim, dtype=np.float32)
        header = [len(layers), hidden, first.heads, first.kv_heads, dim, inter,
                  address(quant.rows_parts) if quant is not None else 0,
                  address(sgemv) if sgemv is not None else 0,
                  address(quant.parts) if quant is not None else 0,
                  host_parallel.workers(), POOL_FLOATS, _keep(keep, partner),
                  _keep(keep, body.norm[0]), _bits(body.norm[1]), _keep(keep, scratch),
                  address(quant.super_parts) if quant is not None else 0]
        assert len(header) == M_HEADER and len(slots) == L_STRIDE * len(layers)
        model = np.array(header + slots, dtype=np.int64)
        return cls(attend.decode, model, keep, body.embed, body.rope_tables, hidden,
                   first.heads, first.kv_heads, dim)

    def __call__(self, row) -> np.ndarray | None:
        """The row's hidden state after the final norm (hidden,), its keys and values written
        into its last pieces; None where a piece is not laid out as the kernel reads it."""
        kv_heads, dim = self._kv_heads, self._dim
        context: list[int] = []
        tables: list[int] = []
        widest = 0
        for keys, values in zip(row.keys, row.values):
            entries = piece_table(keys, values, kv_heads, dim)
            if entries is None:
                return None
            pieces = len(keys)
            positions = sum(entries[2 * pieces:3 * pieces])
            widest = max(widest, positions)
            last = entries[3 * pieces - 1] - 1  # the last piece's last position
            context += [len(tables), pieces, positions,
                        entries[pieces - 1] + 4 * dim * last,
                        entries[2 * pieces - 1] + 4 * dim * last,
                        entries[4 * pieces - 1], entries[5 * pieces - 1]]
            tables += entries
        args = np.array(context + tables, dtype=np.int64)
        args[0:len(context):C_SLOTS] = args.ctypes.data + 8 * (
            len(context) + args[0:len(context):C_SLOTS])
        if self._scores.size < self._heads * widest:
            self._scores = np.empty(2 * self._heads * widest, dtype=np.float32)
        np.copyto(self._h, self._embed[row.token])
        diag, off = self._rope.tables(row.position, 1)
        if self._fn(self._model.ctypes.data, self._h.ctypes.data, diag.ctypes.data,
                    off.ctypes.data, args.ctypes.data, self._scores.ctypes.data,
                    self._out.ctypes.data) != 0:
            raise ValueError("decode kernel refused its arguments")
        return self._out.copy()


def _keep(keep: list, array: np.ndarray) -> int:
    """The address of a C-contiguous float32 or int32 array, kept alive in `keep`."""
    array = np.ascontiguousarray(array)
    keep.append(array)
    return array.ctypes.data


def _linear_slots(linear, keep: list, sgemv, quant: QuantKernel | None) -> list[int] | None:
    """A bound linear (host_body `_QuantBound` or `_Bound`) as the C side's slots, or None
    where it is bound for neither kernel."""
    weight, bias = getattr(linear, "weight", None), getattr(linear, "bias", None)
    bias_at = 0 if bias is None else _keep(keep, bias)
    if isinstance(weight, QuantizedWeight) and quant is not None and weight.supers is not None:
        rows, depth = weight.shape
        return [KIND_SUPER, _keep(keep, weight.q), _keep(keep, weight.supers.codes),
                _keep(keep, weight.supers.factors), weight.bits, weight.group, rows, depth,
                bias_at, parts_for(weight)]
    if isinstance(weight, QuantizedWeight) and quant is not None and weight.offset is not None:
        rows, depth = weight.shape  # biases -offset times the scales: not read
        return [KIND_OFFSET, _keep(keep, weight.q), _keep(keep, weight.scales), weight.offset,
                weight.bits, weight.group, rows, depth, bias_at, parts_for(weight)]
    if isinstance(weight, QuantizedWeight) and quant is not None:
        rows, depth = weight.shape
        return [KIND_QUANT, _keep(keep, weight.q), _keep(keep, weight.scales),
                _keep(keep, weight.biases), weight.bits, weight.group, rows, depth, bias_at,
                parts_for(weight)]
    if isinstance(weight, np.ndarray) and hasattr(linear, "address") and sgemv is not None \
            and weight.dtype == np.float32 and weight.flags.c_contiguous:
        rows, depth = weight.shape
        keep.append(weight)
        return [KIND_FLOAT, linear.address, 0, 0, 0, 0, rows, depth, bias_at, 0]
    return None


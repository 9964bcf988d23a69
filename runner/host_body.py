"""A decode step's body in numpy, for the rows of a float32 Llama-family model on a CPU.

A decode step of one row is a few hundred operations on vectors of a few hundred floats. MLX's
CPU dispatch costs tens of microseconds an operation (a 1 x 192 by 192 x 768 product: about
150 us, as an sgemm; numpy's matrix-vector product: about 40 us), so the 30M model's body took
about 4.6 ms a token where numpy takes about 1.3 ms (docs/PERFORMANCE.md, "The decode body in
numpy, and bursts"). One or two rows go row by row: each row's whole step in one C call where
it applies (runner/decode_row.py; a 0.6B model's body 20 -> 16 ms), else in numpy with
`sgemv` products; more go through `batch`, one
`sgemm` a product over all of them (14 rows: 4.1 ms against MLX's 9.3; "Decode rows in numpy,
batched"). The body's keys and values stay in the block pool's MLX arrays: the row's new
position is written through a numpy view of them, and attention reads them in place.

Used only when all of these hold, else `HostBody.find` returns None and nothing changes:
- the default device is the CPU and every weight the body reads is a float32 array;
- the model has the shape this code computes (`_Layer.of`): embeddings; layers of RMS norm,
  attention with q/k/v/o projections (biases and per-head q/k RMS norms allowed) and one RoPE
  that is the same in every layer, RMS norm, gated MLP or mlx_lm's mixture of gated experts
  (runner/host_moe.py); a final RMS norm;
- on a probe, its hidden states match the model's own decode step (`matches`), which catches
  what the shape does not say (another activation, a scaled embedding, a norm's offset).

Invariants: the row's arrays are evaluated and large enough for the new position (the caller,
runner/kv/rows.py `RowBatch.host_rows`, checks); nothing else writes that position.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxr.runner import probe_verdicts
from mlxr.runner.decode_row import DecodeRow
from mlxr.runner.host_head import NO_TRANS, ROW_MAJOR, openblas_sgemm, openblas_sgemv
from mlxr.runner.host_moe import Experts
from mlxr.runner.host_ops import Gemm, RopeTables
from mlxr.runner.host_swiglu import silu_times
from mlxr.runner.kv.attend_kernel import AttendKernel
from mlxr.runner.kv.host_attention import attend_position
from mlxr.runner.quant_kernel import OneRow, QuantKernel, QuantizedWeight
from mlxr.runner.row_kernel import RowKernel

log = logging.getLogger("mlxr.runner")

MAX_ROWS = 2  # row by row (sgemv) up to here; more rows go through `batch` (sgemm)
BATCH_MAX_ROWS = 64  # measured up to 16 rows (the default max_running); more take MLX's pass
_ROPE_BLOCK = 32  # positions whose rotation matrices one MLX call makes


@dataclass(slots=True)
class HostRow:
    """One row's context in numpy, per layer: `keys[layer]` and `values[layer]` are pieces
    (kv_heads, n, dim) in position order covering [0, position]; the last piece's last
    position is where this step's keys and values are written."""

    token: int
    position: int
    keys: list[list[np.ndarray]]
    values: list[list[np.ndarray]]


def _array(a) -> np.ndarray | None:
    return np.asarray(a) if isinstance(a, mx.array) and a.dtype == mx.float32 else None


def _linear(module) -> tuple[np.ndarray | QuantizedWeight, np.ndarray | None] | None:
    """A plain float32 Linear's (weight, bias), or a quantized one's the quantized kernel
    takes (runner/quant_kernel.py), else None."""
    if type(module) is nn.QuantizedLinear:
        weight = QuantizedWeight.of(module)
    elif type(module) is nn.Linear:
        weight = _array(module.weight)
    else:
        return None
    bias = _array(module["bias"]) if "bias" in module else None
    if weight is None or ("bias" in module and bias is None):
        return None
    return weight, bias


def _norm(module) -> tuple[np.ndarray, float] | None:
    if type(module) is not nn.RMSNorm:
        return None
    weight = _array(module.weight)
    return None if weight is None else (weight, float(module.eps))


@dataclass(slots=True)
class _Layer:
    attn_norm: tuple
    q: tuple
    k: tuple
    v: tuple
    o: tuple
    q_norm: tuple | None
    k_norm: tuple | None
    heads: int
    kv_heads: int
    scale: float
    mlp_norm: tuple
    gate: tuple | None  # the gated MLP's; None where the layer has experts
    up: tuple | None
    down: tuple | None
    experts: Experts | None = None

    LINEARS = ("q", "k", "v", "o", "gate", "up", "down")

    def linears(self) -> list[tuple]:
        """Every (weight, bias) linear the layer reads, its experts' included."""
        own = [getattr(self, name) for name in self.LINEARS if getattr(self, name) is not None]
        if self.experts is None:
            return own
        e = self.experts
        return own + [e.router] + e.gate + e.up + e.down

    def mlp_rows(self, x: np.ndarray, gemm: Gemm) -> np.ndarray:
        """The MLP's output for rows x (n, hidden)."""
        if self.experts is not None:
            return self.experts.rows(x, gemm)
        return gemm.linear(silu_times(gemm.linear(x, self.gate), gemm.linear(x, self.up)),
                           self.down)

    @classmethod
    def of(cls, layer) -> "_Layer | None":
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return None
        parts = dict(
            attn_norm=_norm(getattr(layer, "input_layernorm", None)),
            mlp_norm=_norm(getattr(layer, "post_attention_layernorm", None)),
            **{name: _linear(getattr(attn, f"{name}_proj", None)) for name in "qkvo"})
        if hasattr(mlp, "switch_mlp"):  # a mixture of experts
            parts["experts"] = Experts.of(mlp, _linear(getattr(mlp, "gate", None)))
        else:
            parts.update({name: _linear(getattr(mlp, f"{name}_proj", None))
                          for name in ("gate", "up", "down")})
        if any(p is None for p in parts.values()):
            return None
        if "experts" in parts:
            parts.update(gate=None, up=None, down=None)
        norms = {}
        for name in ("q_norm", "k_norm"):
            module = getattr(attn, name, None)
            norms[name] = None if module is None else _norm(module)
            if module is not None and norms[name] is None:
                return None
        heads, kv_heads = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
        scale = getattr(attn, "scale", None)
        if not (isinstance(heads, int) and isinstance(kv_heads, int) and scale):
            return None
        return cls(heads=heads, kv_heads=kv_heads, scale=float(scale), **parts, **norms)


def rms_norm(x: np.ndarray, norm: tuple) -> np.ndarray:
    """RMS norm over the last axis: a vector's mean square as one dot product (np.mean's
    Python-level wrapper cost 16 us of a 20 us norm, 17 norms a token on the 30M model)."""
    weight, eps = norm
    if x.ndim == 1:
        return x * np.float32(1.0 / math.sqrt(float(x @ x) / x.shape[0] + eps)) * weight
    mean_square = np.add.reduce(x * x, axis=-1, keepdims=True)
    mean_square /= x.shape[-1]
    mean_square += eps
    return x * (1.0 / np.sqrt(mean_square)) * weight


@dataclass(slots=True)
class _Bound:
    """A linear layer bound for `cblas_sgemv`: its weight's address, and an output buffer
    (and its address) that every product of this layer writes."""

    weight: np.ndarray
    bias: np.ndarray | None
    address: int
    out: np.ndarray
    out_address: int


@dataclass(frozen=True, slots=True)
class _QuantBound:
    """A quantized linear layer bound for one row's products (`QuantKernel.one_row`), which
    write one output buffer."""

    weight: QuantizedWeight
    bias: np.ndarray | None
    product: OneRow


class _Products:
    """Matrix-vector products through the OpenBLAS the runner preloaded (runner/host_head.py
    uses the same), else numpy's. One BLAS for the body and the head: numpy's own OpenBLAS
    keeps its threads spinning after each product, and beside the head's threads that made
    the 147M model's token 1.6x slower than the body and head timed apart.

    A product costs the BLAS call (about 2.4 us for a tiny matrix) plus the arguments' numpy
    addresses (2.2 us each); a token has 7 products a layer. So a layer is bound once
    (`bind`): its weight's address is kept, its products write its own output buffer, and
    the input is copied into a buffer of its width whose address is kept too (13 -> 4 us a
    product). Invariant: a product without bias returns that layer's buffer, which its next
    product overwrites; the body uses each result (a new array) before that."""

    def __init__(self, sgemv, quant: QuantKernel | None = None):
        self.sgemv = sgemv
        self._quant = quant  # for quantized weights
        self._inputs: dict[int, tuple[np.ndarray, int]] = {}

    def bind(self, linear: tuple) -> tuple | _Bound | _QuantBound:
        weight, bias = linear
        if isinstance(weight, QuantizedWeight):
            weight = self._quant.compact(weight)  # a GGUF import's: fewer bytes a step
            return _QuantBound(weight, bias, self._quant.one_row(weight))
        if self.sgemv is None or not weight.flags.c_contiguous:
            return linear
        rows, cols = weight.shape
        if cols not in self._inputs:
            buffer = np.empty(cols, dtype=np.float32)
            self._inputs[cols] = (buffer, buffer.ctypes.data)
        out = np.empty(rows, dtype=np.float32)
        return _Bound(weight, bias, weight.ctypes.data, out, out.ctypes.data)

    def __call__(self, x: np.ndarray, linear: tuple | _Bound | _QuantBound) -> np.ndarray:
        if isinstance(linear, _QuantBound):
            out = linear.product(x)
            return out if linear.bias is None else out + linear.bias
        if not isinstance(linear, _Bound):
            weight, bias = linear
            out = weight @ x
            return out if bias is None else out + bias
        rows, cols = linear.weight.shape
        buffer, address = self._inputs[cols]
        np.copyto(buffer, x)
        self.sgemv(ROW_MAJOR, NO_TRANS, rows, cols, 1.0, linear.address, cols, address, 1,
                    0.0, linear.out_address, 1)
        return linear.out if linear.bias is None else linear.out + linear.bias


class _Rotations:
    """RoPE as a matrix per position, made by the model's own rope module: any RoPE variant
    rotates a head's vector linearly, so rotating the identity gives the matrix. Made
    `_ROPE_BLOCK` positions per MLX call, the last few blocks kept."""

    def __init__(self, rope, head_dim: int):
        self.rope = rope
        self.head_dim = head_dim
        self._blocks: dict[int, np.ndarray] = {}

    def make(self, start: int, count: int) -> np.ndarray:
        """(count, dim, dim): position p's matrix M, with rope(x) = x @ M."""
        d = self.head_dim
        eye = mx.broadcast_to(mx.eye(d)[:, None, None, :], (d, 1, count, d))
        rotated = self.rope(eye, offset=start)  # (d, 1, count, d): row j is e_j rotated
        return np.array(rotated[:, 0].transpose(1, 0, 2))

    def __call__(self, position: int) -> np.ndarray:
        block = position // _ROPE_BLOCK
        table = self._blocks.get(block)
        if table is None:
            if len(self._blocks) >= 4:  # two rows need at most two blocks at a time
                self._blocks.pop(next(iter(self._blocks)))
            table = self._blocks[block] = self.make(block * _ROPE_BLOCK, _ROPE_BLOCK)
        return table[position - block * _ROPE_BLOCK]


class HostBody:
    def __init__(self, embed: np.ndarray | QuantizedWeight, layers: list[_Layer], norm: tuple,
                 rotations: _Rotations, weights: list[mx.array], library: str | None = None,
                 kernel: RowKernel | None = None, quant: QuantKernel | None = None,
                 attend: AttendKernel | None = None):
        self._weights = weights  # keep the buffers the numpy views point into alive
        self.embed = embed  # rows by token id (a QuantizedWeight dequantizes them)
        self.quantized = quant is not None  # some weights are read by the quantized kernel
        self._project = _Products(openblas_sgemv(library), quant)
        bind = self._project.bind
        self.layers = [dataclasses.replace(
            layer, experts=None if layer.experts is None else layer.experts.bind(bind),
            **{name: bind(getattr(layer, name)) for name in _Layer.LINEARS
               if getattr(layer, name) is not None})
            for layer in layers]
        self.norm = norm
        self.rotations = rotations
        self.head_dim = layers[0].q[0].shape[0] // layers[0].heads
        self.gemm = Gemm(openblas_sgemm(library), kernel, quant)
        self.attend_kernel = attend  # one position's attention in C, else numpy's
        try:  # per-position tables for many rows (and prefill chunks), where the rope allows
            self.rope_tables: RopeTables | None = RopeTables(rotations)
        except ValueError as exc:
            log.info("numpy rope tables do not apply (%s)", exc)
            self.rope_tables = None
        # one row's whole step in one C call, where it applies (else `_row` in numpy)
        self.decode_row = DecodeRow.bind(self, self._project.sgemv,
                                         quant or (QuantKernel.load() if attend else None),
                                         attend)

    @classmethod
    def find(cls, model, library: str | None = None,
             kernel: RowKernel | None = None) -> "HostBody | None":
        """A host body for `model`'s decode steps, or None where it does not apply.
        `library`: an OpenBLAS to load when none is preloaded (tests). `kernel`: the row
        kernel for batched rows' products (runner/row_kernel.py), where the head uses it."""
        if mx.default_device() != mx.cpu:
            return None
        body = getattr(model, "model", None)
        embed = getattr(body, "embed_tokens", None)
        layers = getattr(body, "layers", None)
        if type(embed) not in (nn.Embedding, nn.QuantizedEmbedding) or not layers:
            return None
        weights = [a for _, a in tree_flatten(model.parameters())]
        mx.eval(weights)
        table = _array(embed.weight) if type(embed) is nn.Embedding else \
            QuantizedWeight.of(embed)
        parsed = [_Layer.of(layer) for layer in layers]
        norm = _norm(getattr(body, "norm", None))
        if table is None or norm is None or any(p is None for p in parsed):
            return None
        kernel = kernel if isinstance(kernel, RowKernel) else None  # not the head's quantized one
        quant = None
        if isinstance(table, QuantizedWeight) or any(
                isinstance(linear[0], QuantizedWeight) for p in parsed for linear in p.linears()):
            quant = QuantKernel.load()
            if quant is None:
                return None
        head_dim = parsed[0].q[0].shape[0] // parsed[0].heads
        ropes = [getattr(layer.self_attn, "rope", None) for layer in layers]
        if any(r is None for r in ropes):
            return None
        rotations = _Rotations(ropes[0], head_dim)
        try:
            for rope in ropes[1:]:  # one RoPE for all layers (else: not this code's shape)
                other = _Rotations(rope, head_dim)
                for at in (1, 4099):
                    if not np.array_equal(other.make(at, 1), rotations.make(at, 1)):
                        return None
            host = cls(table, parsed, norm, rotations, weights, library, kernel, quant,
                       AttendKernel.load())
            return host if probe_verdicts.decide(
                "host_body" if kernel is None else "host_body+kernel",
                lambda: host.matches(model)) else None
        except Exception as exc:  # a rope or layer this code does not read
            log.info("decode body in numpy does not apply (%s)", exc)
            return None

    def matches(self, model) -> bool:
        """Do this body's hidden states for a decode step equal the model's own, on a short
        prompt with mlx-lm's cache?"""
        prompt, token = [3, 1, 4, 1, 5, 9, 2], 6
        cache = make_prompt_cache(model)
        model.model(mx.array([prompt]), cache=cache)
        expected = model.model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(expected)
        n = len(prompt) + 1
        keys = [[np.array(c.keys[0, :, :n])] for c in cache]
        values = [[np.array(c.values[0, :, :n])] for c in cache]
        for piece in keys + values:  # the slot this step writes
            piece[0][:, -1] = np.nan
        got = self([HostRow(token, len(prompt), keys, values)])[0]
        if np.allclose(got, np.array(expected), rtol=1e-4, atol=1e-4):
            return True
        log.info("the numpy decode body does not match the model's; not using it")
        return False

    def __call__(self, rows: list[HostRow]) -> np.ndarray:
        """Hidden states (rows, hidden) after the final norm, one decode position per row,
        each row's keys and values written into its last pieces."""
        return np.stack([self._row(row) for row in rows])

    def batch(self, rows: list[HostRow]) -> np.ndarray:
        """`self(rows)` for many rows at once: each layer's products as one `sgemm` over the
        rows, RoPE from one table call, attention row by row. Only where `rope_tables` is
        not None. On the 30M model, 14 rows: 4.1 ms, against 6.8 ms row by row and 9.3 ms
        for MLX's pass (docs/PERFORMANCE.md, "Decode rows in numpy, batched"). Attention is
        one C call a layer for all rows where the kernel takes them (`AttendKernel.rows`),
        else row by row."""
        gemm, rope, d = self.gemm, self.rope_tables, self.head_dim
        n = len(rows)
        diag, off = rope.tables_at([row.position for row in rows])
        h = self.embed[np.array([row.token for row in rows])]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm)
            q = gemm.linear(x, layer.q).reshape(n, layer.heads, d)
            k = gemm.linear(x, layer.k).reshape(n, layer.kv_heads, d)
            v = gemm.linear(x, layer.v).reshape(n, layer.kv_heads, d)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm)
            if layer.k_norm is not None:
                k = rms_norm(k, layer.k_norm)
            q = rope.apply(q, diag, off)
            q *= layer.scale
            k = rope.apply(k, diag, off)
            group = layer.heads // layer.kv_heads
            for j, row in enumerate(rows):
                row.keys[i][-1][:, -1] = k[j]
                row.values[i][-1][:, -1] = v[j]
            attended = None if self.attend_kernel is None else self.attend_kernel.rows(
                q, [row.keys[i] for row in rows], [row.values[i] for row in rows], group)
            if attended is None:
                attended = np.empty((n, layer.heads * d), dtype=np.float32)
                for j, row in enumerate(rows):
                    attended[j] = self._attend(q[j], row.keys[i], row.values[i],
                                               group).reshape(-1)
            h = h + gemm.linear(attended, layer.o)
            h = h + layer.mlp_rows(rms_norm(h, layer.mlp_norm), gemm)
        return rms_norm(h, self.norm)

    def _attend(self, q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                group: int) -> np.ndarray:
        """One position's attention (runner/kv/host_attention.py `attend_position`): in C
        where the kernel is built and takes the pieces, else in numpy."""
        if self.attend_kernel is not None:
            out = self.attend_kernel(q, keys, values, group)
            if out is not None:
                return out
        return attend_position(q, keys, values, group, self.gemm)

    def _row(self, row: HostRow) -> np.ndarray:
        if self.decode_row is not None:
            out = self.decode_row(row)
            if out is not None:
                return out
        d = self.head_dim
        rotate = self.rotations(row.position)
        h = self.embed[row.token]  # a view: the steps below make new arrays
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm)
            q = self._project(x, layer.q).reshape(layer.heads, d)
            k = self._project(x, layer.k).reshape(layer.kv_heads, d)
            v = self._project(x, layer.v).reshape(layer.kv_heads, d)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm)
            if layer.k_norm is not None:
                k = rms_norm(k, layer.k_norm)
            q, k = q @ rotate, k @ rotate
            keys, values = row.keys[i], row.values[i]
            keys[-1][:, -1] = k
            values[-1][:, -1] = v
            attended = self._attend(q * layer.scale, keys, values,
                                    layer.heads // layer.kv_heads)
            h = h + self._project(attended.reshape(-1), layer.o)
            x = rms_norm(h, layer.mlp_norm)
            if layer.experts is not None:
                h = h + layer.experts.row(x, self._project)
                continue
            mixed = silu_times(self._project(x, layer.gate), self._project(x, layer.up))
            h = h + self._project(mixed, layer.down)
        return rms_norm(h, self.norm)


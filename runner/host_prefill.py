"""A prefill chunk's body in numpy, for one row of a float32 Llama-family model on a CPU: the
model runner/host_body.py reads for decode steps, here over many positions at once.

MLX builds a chunk's forward pass as some 25 operations a layer, each dispatched to its CPU
stream, and attention in numpy (runner/kv/host_attention.py) makes every layer a round trip
between the two. For the short chunks that a long prompt is read in beside running streams,
and for a short prompt's one chunk, that overhead is most of the chunk's time. Here the
products are `cblas_sgemm` calls into the OpenBLAS MLX itself uses (one BLAS in the process,
as for the host head and body), and everything between them is numpy, with the softmax and
SwiGLU split across the cores (runner/host_parallel.py). Measured in docs/PERFORMANCE.md
("Prefill chunks in numpy").

The chunk's keys and values are written straight into the row's MLX arrays through numpy
views (runner/kv/rows.py `RowBatch.host_chunk` makes room and evaluates them first). In the
last layer only the last position's query, attention and MLP are computed: nothing reads the
others.

Invariants: the pieces cover [0, start + n) in position order and the last piece ends with the
chunk's n positions; nothing else writes those positions during the call. Used only where
`HostBody.find` applies and `HostPrefill.matches` agrees with the model's own forward pass.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from mlxr.runner import host_parallel
from mlxr.runner.host_body import HostBody, rms_norm
from mlxr.runner.host_head import NO_TRANS, ROW_MAJOR, TRANS, openblas_sgemm
from mlxr.runner.host_swiglu import silu_times
from mlxr.runner.kv.host_attention import future_mask

log = logging.getLogger("mlxr.runner")

MAX_TOKENS = 1024  # longer chunks take MLX's pass


class _Gemm:
    """Row-major single-precision products through `cblas_sgemm`, else numpy's matmul."""

    def __init__(self, sgemm):
        self._sgemm = sgemm

    def linear(self, x: np.ndarray, linear) -> np.ndarray:
        """x (n, in) times the transpose of a Linear's weight (out, in), plus its bias."""
        weight, bias = (linear.weight, linear.bias) if hasattr(linear, "weight") else linear
        if self._sgemm is None or not weight.flags.c_contiguous:
            out = x @ weight.T
        else:
            x = np.ascontiguousarray(x)
            n, k = x.shape
            rows = weight.shape[0]
            out = np.empty((n, rows), dtype=np.float32)
            self._sgemm(ROW_MAJOR, NO_TRANS, TRANS, n, rows, k, 1.0, x.ctypes.data, k,
                        weight.ctypes.data, k, 0.0, out.ctypes.data, rows)
        if bias is not None:
            out += bias
        return out

    def product(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool,
                alpha: float = 1.0, accumulate: bool = False) -> None:
        """out (m, n) = alpha * a (m, k) @ b (k, n), or b's transpose (n, k), plus out when
        `accumulate`. Every argument is a 2-D view whose rows are contiguous."""
        if self._sgemm is None or not all(_rows_contiguous(m) for m in (a, b, out)):
            result = alpha * (a @ (b.T if transpose_b else b))
            if accumulate:
                out += result
            else:
                out[...] = result
            return
        m, k = a.shape
        n = b.shape[0] if transpose_b else b.shape[1]
        self._sgemm(ROW_MAJOR, NO_TRANS, TRANS if transpose_b else NO_TRANS, m, n, k, alpha,
                    a.ctypes.data, a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4,
                    1.0 if accumulate else 0.0, out.ctypes.data, out.strides[0] // 4)


def _rows_contiguous(a: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.ndim == 2 and a.strides[1] == 4 and \
        a.strides[0] % 4 == 0 and a.strides[0] >= 4 * a.shape[1]


class _Rope:
    """A RoPE over many positions as two tables: any RoPE rotates pairs of a head's
    coordinates (or leaves one alone), so out[j] = x[j] * diag[p, j] + x[partner[j]] *
    off[p, j]. The pairing is read from the rotation matrices the model's own rope gives
    (runner/host_body.py `_Rotations`), and the tables from rotating two vectors (one
    coordinate of each pair set) at every position of the chunk: one small MLX call."""

    def __init__(self, rotations):
        self.rope = rotations.rope
        d = rotations.head_dim
        nonzero = (rotations.make(7, 1)[0] != 0) | (rotations.make(1001, 1)[0] != 0)
        partner = np.arange(d)
        for j in range(d):
            others = [i for i in np.flatnonzero(nonzero[:, j]) if i != j]
            if len(others) > 1:
                raise ValueError("a rope that mixes more than pairs of coordinates")
            if others:
                partner[j] = others[0]
        if not np.array_equal(partner[partner], np.arange(d)):
            raise ValueError("a rope whose pairs are not symmetric")
        self.partner = partner
        self.first = partner >= np.arange(d)  # one coordinate of each pair, and the lone ones
        self.lone = partner == np.arange(d)
        self._probe = mx.array(np.stack([self.first, ~self.first]).astype(np.float32))

    def tables(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(diag, off), each (count, d), for positions start .. start + count - 1."""
        d = self.partner.shape[0]
        rotated = np.array(self.rope(
            mx.broadcast_to(self._probe[:, None, None, :], (2, 1, count, d)),
            offset=start)[:, 0])  # (2, count, d)
        by_first, by_second = rotated[0], rotated[1]
        diag = np.where(self.first, by_first, by_second)
        off = np.where(self.lone, 0.0, np.where(self.first, by_second, by_first))
        return diag.astype(np.float32), off.astype(np.float32)

    def apply(self, x: np.ndarray, diag: np.ndarray, off: np.ndarray) -> np.ndarray:
        """x (n, heads, d) rotated at the tables' positions."""
        out = x * diag[:, None, :]
        out += x[..., self.partner] * off[:, None, :]
        return out


class HostPrefill:
    def __init__(self, body: HostBody, library: str | None = None):
        self.body = body
        self.rope = _Rope(body.rotations)
        self._gemm = _Gemm(openblas_sgemm(library))

    @classmethod
    def find(cls, model, body: HostBody | None, library: str | None = None) -> \
            "HostPrefill | None":
        """A numpy prefill body for `model` where its numpy decode body applies and a probe
        chunk gives the model's own hidden state; else None."""
        if body is None:
            return None
        try:
            host = cls(body, library)
            return host if host.matches(model) else None
        except Exception as exc:  # a rope or layer this code does not read
            log.info("prefill body in numpy does not apply (%s)", exc)
            return None

    def matches(self, model) -> bool:
        """Does a chunk after a cached prefix give the model's own last hidden state, and
        write its keys and values?"""
        from mlx_lm.models.cache import make_prompt_cache

        prompt, chunk = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9]
        cache = make_prompt_cache(model)
        model.model(mx.array([prompt]), cache=cache)
        expected = model.model(mx.array([chunk]), cache=cache)[0, -1]
        mx.eval(expected)
        n = len(prompt) + len(chunk)
        keys = [[np.array(c.keys[0, :, :n])] for c in cache]
        values = [[np.array(c.values[0, :, :n])] for c in cache]
        want_k, want_v = [k[0].copy() for k in keys], [v[0].copy() for v in values]
        for piece in keys + values:  # the positions this chunk writes
            piece[0][:, len(prompt):] = np.nan
        got = self(chunk, len(prompt), keys, values)
        if np.allclose(got, np.array(expected), rtol=1e-4, atol=1e-4) and all(
                np.allclose(a[0], b, rtol=1e-4, atol=1e-4)
                for a, b in zip(keys + values, want_k + want_v)):
            return True
        log.info("the numpy prefill body does not match the model's; not using it")
        return False

    def __call__(self, tokens: list[int], start: int, keys: list[list[np.ndarray]],
                 values: list[list[np.ndarray]]) -> np.ndarray:
        """The chunk's last hidden state (hidden,) after the final norm; writes the chunk's
        keys and values (positions start .. start + n - 1) into each layer's last pieces."""
        body, gemm = self.body, self._gemm
        n, d = len(tokens), body.head_dim
        diag, off = self.rope.tables(start, n)
        h = body.embed[np.asarray(tokens)]
        last = len(body.layers) - 1
        for i, layer in enumerate(body.layers):
            x = rms_norm(h, layer.attn_norm)
            k = gemm.linear(x, layer.k).reshape(n, layer.kv_heads, d)
            v = gemm.linear(x, layer.v).reshape(n, layer.kv_heads, d)
            if i == last:  # only the last position goes on from here
                x, h = x[-1:], h[-1:]
            q = gemm.linear(x, layer.q).reshape(x.shape[0], layer.heads, d)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm)
            if layer.k_norm is not None:
                k = rms_norm(k, layer.k_norm)
            q = self.rope.apply(q, diag[-q.shape[0]:], off[-q.shape[0]:])
            k = self.rope.apply(k, diag, off)
            keys[i][-1][:, -n:] = k.transpose(1, 0, 2)
            values[i][-1][:, -n:] = v.transpose(1, 0, 2)
            attended = self._attend(q, keys[i], values[i], layer.scale, n)
            h = h + gemm.linear(attended, layer.o)
            x = rms_norm(h, layer.mlp_norm)
            h = h + gemm.linear(silu_times(gemm.linear(x, layer.gate),
                                           gemm.linear(x, layer.up)), layer.down)
        return rms_norm(h[-1], body.norm)

    def _attend(self, q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                scale: float, n: int) -> np.ndarray:
        """Causal attention of queries q (m, heads, d), the last m of the chunk's n new
        positions, over the pieces (kv_heads, positions, d); returns (m, heads * d)."""
        gemm = self._gemm
        m, heads, d = q.shape
        kv_heads = keys[0].shape[0]
        group = heads // kv_heads
        positions = sum(k.shape[1] for k in keys)
        # head h reads key head h // group: (kv_heads, group, m, d), rows contiguous
        grouped = np.ascontiguousarray(q.reshape(m, kv_heads, group, d).transpose(1, 2, 0, 3))
        grid = np.empty((kv_heads, group, m, positions), dtype=np.float32)
        for h in range(kv_heads):
            rows, at = grouped[h].reshape(group * m, d), 0
            scores = grid[h].reshape(group * m, positions)
            for k in keys:
                gemm.product(rows, k[h], scores[:, at:at + k.shape[1]], transpose_b=True,
                             alpha=scale)
                at += k.shape[1]
        future = future_mask(n)[n - m:] if m > 1 else None  # query i sits at chunk index n - m + i

        def softmax(a: int, b: int) -> None:  # queries a..b, in place
            part = grid[:, :, a:b]
            if future is not None:
                np.copyto(part[..., positions - n:], -np.inf, where=future[a:b])
            part -= part.max(axis=-1, keepdims=True)
            np.exp(part, out=part)
            part /= part.sum(axis=-1, keepdims=True)

        host_parallel.for_rows(m, grid.size, softmax)
        out = np.empty((kv_heads, group * m, d), dtype=np.float32)
        for h in range(kv_heads):
            probs, at = grid[h].reshape(group * m, positions), 0
            for j, v in enumerate(values):
                gemm.product(probs[:, at:at + v.shape[1]], v[h], out[h], transpose_b=False,
                             accumulate=j > 0)
                at += v.shape[1]
        # (kv_heads, group, m, d) -> (m, heads * d), head h = kv head h // group
        return out.reshape(kv_heads, group, m, d).transpose(2, 0, 1, 3).reshape(m, heads * d)

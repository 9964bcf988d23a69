"""A prefill chunk's body in numpy, for one row of a float32 Llama-family model on a CPU: the
model runner/host_body.py reads for decode steps, here over many positions at once.

MLX builds a chunk's forward pass as some 25 operations a layer, each dispatched to its CPU
stream, and attention in numpy (runner/kv/host_attention.py) makes every layer a round trip
between the two. For the short chunks that a long prompt is read in beside running streams,
and for a short prompt's one chunk, that overhead is most of the chunk's time. Here the
products are `cblas_sgemm` calls into the OpenBLAS MLX itself uses (one BLAS in the process,
as for the host head and body), and everything between them is numpy, with the softmax and
SwiGLU split across the cores (runner/host_parallel.py). Attention goes a key head and a
block of queries at a time, its softmax in the attention kernel's C where it is built.
Measured in docs/PERFORMANCE.md ("Prefill chunks in numpy", "A long prompt's attention in
tiles").

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
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxr.runner import probe_verdicts
from mlxr.runner.host_body import HostBody, rms_norm
from mlxr.runner.kv.host_attention import future_mask, softmax_rows

log = logging.getLogger("mlxr.runner")

MAX_TOKENS = 1024  # longer chunks take MLX's pass
GROUP_TOKENS = 4096  # several chunks' positions in one pass (`chunks`), at most
# Scores attention holds at a time (`_attend`): 4 MB, so a block's softmax and its product with
# the values read them from the caches (all heads' scores of a 512-token chunk at 4,096
# positions were 134 MB, read from memory 5 times).
TILE_SCORES = 1 << 20


@dataclass(slots=True)
class Chunk:
    """A row's chunk: its tokens at positions start.., and its context's pieces per layer,
    as `HostPrefill.__call__` takes them."""

    tokens: list[int]
    start: int
    keys: list[list[np.ndarray]]
    values: list[list[np.ndarray]]


class HostPrefill:
    def __init__(self, body: HostBody):
        if body.rope_tables is None:
            raise ValueError("no rope tables for this model's rope")
        self.body = body
        self.rope = body.rope_tables
        self._gemm = body.gemm

    @classmethod
    def find(cls, model, body: HostBody | None) -> "HostPrefill | None":
        """A numpy prefill body for `model` where its numpy decode body applies and a probe
        chunk gives the model's own hidden state; else None."""
        if body is None:
            return None
        try:
            host = cls(body)
            return host if probe_verdicts.decide("host_prefill", lambda: host.matches(model)) \
                else None
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
                 values: list[list[np.ndarray]], every: bool = False) -> np.ndarray:
        """The chunk's last hidden state (hidden,) after the final norm (`every`: all its
        positions', (n, hidden)); writes the chunk's keys and values (positions start ..
        start + n - 1) into each layer's last pieces."""
        out = self.chunks([Chunk(tokens, start, keys, values)], every)
        return out if every else out[0]

    def chunks(self, chunks: list["Chunk"], every: bool = False) -> np.ndarray:
        """Several rows' chunks in one pass: each layer's products over all their positions
        at once (a quantized weight is then dequantized once for all of them, not once a
        chunk), attention chunk by chunk over its own row. Each chunk's last hidden state
        after the final norm, (chunks, hidden) (`every`: all positions', (total, hidden));
        writes each chunk's keys and values as `__call__` does."""
        body, gemm = self.body, self._gemm
        d = body.head_dim
        counts = [len(c.tokens) for c in chunks]
        bounds = np.cumsum([0] + counts)
        ends = bounds[1:] - 1  # each chunk's last row
        tables = [self.rope.tables(c.start, n) for c, n in zip(chunks, counts)]
        diag, off = (tables[0] if len(chunks) == 1 else
                     [np.concatenate(t) for t in zip(*tables)])
        h = body.embed[np.concatenate([np.asarray(c.tokens) for c in chunks])]
        total, last = int(bounds[-1]), len(body.layers) - 1
        for i, layer in enumerate(body.layers):
            x = rms_norm(h, layer.attn_norm)
            k = gemm.linear(x, layer.k).reshape(total, layer.kv_heads, d)
            v = gemm.linear(x, layer.v).reshape(total, layer.kv_heads, d)
            if layer.k_norm is not None:
                k = rms_norm(k, layer.k_norm)
            k = self.rope.apply(k, diag, off)
            final = i == last and not every  # only each chunk's last position goes on
            if final:
                x, h = x[ends], h[ends]
            q = gemm.linear(x, layer.q).reshape(x.shape[0], layer.heads, d)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm)
            q = self.rope.apply(q, diag[ends], off[ends]) if final else \
                self.rope.apply(q, diag, off)
            attended = []
            for j, (c, n) in enumerate(zip(chunks, counts)):
                a, b = bounds[j], bounds[j + 1]
                c.keys[i][-1][:, -n:] = k[a:b].transpose(1, 0, 2)
                c.values[i][-1][:, -n:] = v[a:b].transpose(1, 0, 2)
                attended.append(self._attend(q[j:j + 1] if final else q[a:b], c.keys[i],
                                             c.values[i], layer.scale, n))
            attended = attended[0] if len(attended) == 1 else np.concatenate(attended)
            h = h + gemm.linear(attended, layer.o)
            h = h + layer.mlp_rows(rms_norm(h, layer.mlp_norm), gemm)
        return rms_norm(h, body.norm)

    def hidden_states(self, tokens: list[int], chunk: int) -> np.ndarray:
        """Every position's last hidden state (n, hidden) after the final norm, for a prompt
        read from scratch in chunks of `chunk` tokens into keys and values of its own: an
        embedding (runner/embed/embeddings.py `LMEmbedder`)."""
        n, layers, d = len(tokens), self.body.layers, self.body.head_dim
        keys = [np.empty((layer.kv_heads, n, d), dtype=np.float32) for layer in layers]
        values = [np.empty_like(k) for k in keys]
        return np.concatenate([
            self(tokens[s:s + chunk], s, [[k[:, :s + chunk]] for k in keys],
                 [[v[:, :s + chunk]] for v in values], every=True)
            for s in range(0, n, chunk)])

    def _attend(self, q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                scale: float, n: int) -> np.ndarray:
        """Causal attention of queries q (m, heads, d), the last m of the chunk's n new
        positions, over the pieces (kv_heads, positions, d); returns (m, heads * d).

        A key head and a block of queries at a time (`TILE_SCORES`): its scores, their
        softmax (the attention kernel's, else numpy's) and their product with the values
        while the scores are in the caches, and only over the positions the block's last
        query sees."""
        gemm, kernel = self._gemm, self.body.attend_kernel
        m, heads, d = q.shape
        kv_heads = keys[0].shape[0]
        group = heads // kv_heads
        positions = sum(k.shape[1] for k in keys)
        # head h reads key head h // group: (kv_heads, group, m, d)
        grouped = q.reshape(m, kv_heads, group, d).transpose(1, 2, 0, 3)
        future = future_mask(n)[n - m:] if m > 1 else None
        block = max(1, min(m, TILE_SCORES // (group * positions)))
        scores_buffer = np.empty(group * block * positions, dtype=np.float32)
        out = np.empty((kv_heads, group, m, d), dtype=np.float32)
        for a in range(0, m, block):
            b = min(m, a + block)
            seen = positions - m + b  # query i (of m) sees the first positions - m + i + 1
            tile = scores_buffer[:group * (b - a) * seen].reshape(1, group, b - a, seen)
            scores = tile.reshape(group * (b - a), seen)
            mask = None if future is None else future[a:b, :n - m + b]
            for h in range(kv_heads):
                rows = np.ascontiguousarray(grouped[h, :, a:b]).reshape(group * (b - a), d)
                at = 0
                for k in keys:
                    width = min(k.shape[1], seen - at)
                    if width <= 0:
                        break
                    gemm.product(rows, k[h, :width], scores[:, at:at + width],
                                 transpose_b=True, alpha=scale)
                    at += width
                if kernel is None:
                    softmax_rows(tile, mask)
                else:  # query i of the block sees seen - (b - a) + i + 1 positions
                    kernel.softmax_rows(scores, seen - (b - a) + 1 if m > 1 else seen, b - a)
                attended, at = np.empty((group * (b - a), d), dtype=np.float32), 0
                for j, v in enumerate(values):
                    width = min(v.shape[1], seen - at)
                    if width <= 0:
                        break
                    gemm.product(scores[:, at:at + width], v[h, :width], attended,
                                 transpose_b=False, accumulate=j > 0)
                    at += width
                out[h, :, a:b] = attended.reshape(group, b - a, d)
        # (kv_heads, group, m, d) -> (m, heads * d), head h = kv head h // group
        return out.reshape(kv_heads, group, m, d).transpose(2, 0, 1, 3).reshape(m, heads * d)

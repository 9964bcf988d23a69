"""One row's attention with its softmax in numpy, for float32 rows on a CPU.

MLX's CPU softmax is its `exp`, at 15-25 ns an element on the 2-core EPYC; numpy's runs at
about 7 ns. The two matrix products stay MLX's. Measured on the 30M model's body
(scripts/bench_host_attention.py, docs/PERFORMANCE.md "Attention in numpy"):
- a 16-token prefill chunk at position 1,800: 25.4 against 12.1 ms;
- at 7,800: 62.8 against 27.0 ms;
- a decode step of 14 short rows and 2 of 8,000 positions: 38.6 against 24.6 ms.
The outputs differ from MLX's by about 1e-7 (float32 rounding in another order). The
softmax's queries are split across the cores (runner/host_parallel.py), and the causal mask is
a masked copy, not boolean indexing (which cost more than the softmax itself).

The price is a synchronisation point: `np.asarray` evaluates the layer's scores, so the
forward pass is computed as it is built. The caller therefore uses it only where the scores
are many (`worth_it`), and does not run a decode step ahead when a row used it
(runner/kv/rows.py).

Used only when the default device is the CPU and the keys are float32. For bfloat16 or float16
caches a float32 copy of the keys and values would cost more than the softmax saves, and GPUs
have their own fused kernel. `MLXR_HOST_ATTENTION=0` (Settings.host_attention) turns it off."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from mlxr.runner import host_parallel

# Below this many scores (queries x heads x positions) per call, MLX's own attention: inside
# a forward pass it costs less than the synchronisation (see `worth_it`).
MIN_SCORES = 2_048


def future_mask(n: int) -> np.ndarray:
    """(n, n) True above the diagonal: the positions after each query's own. A masked copy
    writes -inf there about 8 times faster than boolean indexing (0.27 against 2.3 ms for
    512 queries over 2 x 2 heads). The top-left corner of a larger such mask is this one, so
    one mask of each power of two serves every chunk length up to it."""
    size = max(256, 1 << (n - 1).bit_length())
    return _upper(size)[:n, :n] if size <= 4096 else np.triu(np.ones((n, n), dtype=bool), 1)


@functools.lru_cache(maxsize=2)
def _upper(size: int) -> np.ndarray:
    return np.triu(np.ones((size, size), dtype=bool), 1)


def softmax_rows(grid: np.ndarray, future: np.ndarray | None) -> None:
    """Softmax in place over the last axis of scores (kv_heads, group, queries, positions),
    the queries split across the cores. `future` (queries, n), where the queries are among
    the last n positions: True where a query must not see one of those n (it gets -inf)."""
    queries, positions = grid.shape[2], grid.shape[3]

    def softmax(a: int, b: int) -> None:  # queries a..b
        part = grid[:, :, a:b]
        if future is not None:
            np.copyto(part[..., positions - future.shape[1]:], -np.inf, where=future[a:b])
        part -= part.max(axis=-1, keepdims=True)
        np.exp(part, out=part)
        part /= part.sum(axis=-1, keepdims=True)

    host_parallel.for_rows(queries, grid.size, softmax)


def worth_it(scores: int, dtype) -> bool:
    """Should a call with this many scores (queries x heads x positions) over keys of
    `dtype` come here?"""
    return scores >= MIN_SCORES and dtype == mx.float32 and mx.default_device() == mx.cpu


def attend(queries: mx.array, keys: mx.array | list[mx.array],
           values: mx.array | list[mx.array], scale: float, causal: bool) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
    mask="causal" if causal else None)` for one row: queries (1, heads, n, dim), keys and values
    (1, kv_heads, positions, dim), the queries being the last n positions. Grouped queries
    share a key head as MLX's do: head h reads key head h // (heads // kv_heads).

    `keys` and `values` may also be lists of consecutive pieces of the context (a row's shared
    prefix segments, then its own run; the last piece holds the n query positions). Each piece
    gets its own products, and only the scores are joined: a row reading a shared prefix is
    not copied into one array at every layer of every step.

    The two products stay MLX's (one BLAS in the process: a second OpenBLAS's threads, numpy's,
    spinning beside MLX's made the step slower, not faster); only the softmax is numpy's."""
    keys = keys if isinstance(keys, list) else [keys]
    values = values if isinstance(values, list) else [values]
    _, heads, n, dim = queries.shape
    kv_heads = keys[0].shape[1]
    group = heads // kv_heads
    q = (queries * scale).reshape(1, kv_heads, group * n, dim)
    parts = [q @ k.swapaxes(-1, -2) for k in keys]
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    positions = scores.shape[-1]
    # Evaluates the scores; the view writes into their buffer, which nothing else holds.
    grid = np.asarray(scores).reshape(kv_heads, group, n, positions)
    softmax_rows(grid, future_mask(n) if causal and n > 1 else None)
    probs = mx.array(grid.reshape(1, kv_heads, group * n, positions))
    if len(values) == 1:
        out = probs @ values[0]
    else:
        out, at = None, 0
        for v in values:
            part = probs[..., at:at + v.shape[2]] @ v
            out = part if out is None else out + part
            at += v.shape[2]
    return out.reshape(1, heads, n, values[0].shape[-1])


# From this many positions a decode row's products go through the OpenBLAS MLX uses (`gemm`):
# numpy's own OpenBLAS threads them, and its pool's threads then spin beside MLX's (a
# 15-row step with one row at 8,000 positions took 100-110 ms instead of about 30).
GEMM_POSITIONS = 512


def attend_position(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                    group: int, gemm=None) -> np.ndarray:
    """One query position's attention in numpy: q (heads, dim), already scaled; keys and
    values pieces (kv_heads, n, dim) in position order. Head h reads key head h // group.
    Returns (heads, dim). `gemm` (runner/host_ops.py `Gemm`): the products for long
    contexts."""
    kv_heads, dim = keys[0].shape[0], q.shape[-1]
    q = q.reshape(kv_heads, group, dim)
    positions = sum(k.shape[1] for k in keys)
    if gemm is not None and positions >= GEMM_POSITIONS:
        return _attend_position_gemm(np.ascontiguousarray(q), keys, values, positions, gemm)
    parts = [q @ k.transpose(0, 2, 1) for k in keys]  # (kv_heads, group, n)
    scores = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out, at = None, 0
    for v in values:
        part = scores[..., at:at + v.shape[1]] @ v
        out = part if out is None else out + part
        at += v.shape[1]
    return out.reshape(kv_heads * group, dim)


def _attend_position_gemm(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                          positions: int, gemm) -> np.ndarray:
    kv_heads, group, dim = q.shape
    scores = np.empty((kv_heads, group, positions), dtype=np.float32)
    for h in range(kv_heads):
        at = 0
        for k in keys:
            gemm.product(q[h], k[h], scores[h][:, at:at + k.shape[1]], transpose_b=True)
            at += k.shape[1]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.empty((kv_heads, group, dim), dtype=np.float32)
    for h in range(kv_heads):
        at = 0
        for j, v in enumerate(values):
            gemm.product(scores[h][:, at:at + v.shape[1]], v[h], out[h], transpose_b=False,
                         accumulate=j > 0)
            at += v.shape[1]
    return out.reshape(kv_heads * group, dim)

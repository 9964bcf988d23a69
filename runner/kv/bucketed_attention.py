"""Prefill attention on a CUDA GPU in a bounded set of shapes.

On a CUDA GPU, MLX runs a 16-bit attention call with more than one query through cuDNN, and
builds a cuDNN graph for every new combination of shapes and strides (query, keys, values,
mask), keeping up to `MLX_CUDA_SDPA_CACHE_SIZE` of them. A prompt read in chunks attends over
a longer context at every chunk, so every chunk is a new graph. On an H200, 40 chunks of 16
queries over 16-640 positions took 49 ms each at their first call (the build) and 0.25 ms
when repeated.

Here a chunk on a single-sequence cache (mlx-lm's `KVCache`: the padded batch's prefills)
attends over the cache's buffer up to the next multiple of `BUCKET` positions, with an
additive mask that hides the positions past each query's own, and its queries are padded to
the next power of two (at least `MIN_QUERIES`); the padded queries' outputs are dropped. So
a chunk's shapes take a few values per 256 positions of context: the same 40 chunks took
0.29 ms each at their first call.

Off by default (Settings.attention_buckets): through the runner it read a 2,000-token prompt
beside 8 streams in 6.8 s against 11.4 s, but with one pause of 3.3 s near the end, which is
not explained yet (docs/PERFORMANCE.md, "On a GPU", session 22).

Invariants:
- The result is the attention of the `L` real queries over the first `offset` positions,
  causally (query i sees positions up to `offset - L + i`); the buffer past `offset` is never
  read unmasked.
- Padded query rows see what the last real query sees, so no row of the mask is all -inf.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

BUCKET = 256
MIN_QUERIES = 16
CUDNN_DTYPES = (mx.float16, mx.bfloat16)  # what MLX sends to cuDNN


def wanted() -> bool:
    """Is this a CUDA GPU, where cuDNN graphs are built per shape?"""
    return mx.default_device() != mx.cpu and mx.cuda.is_available()


def applies(queries: mx.array, cache, mask) -> bool:
    """A multi-query causal call on a single-sequence cache whose buffer it can read."""
    return (type(cache) is KVCache and cache.keys is not None and queries.shape[2] > 1
            and queries.shape[0] == 1 and isinstance(mask, str) and mask == "causal"
            and queries.dtype in CUDNN_DTYPES)


def padded_shape(num_queries: int, length: int, capacity: int) -> tuple[int, int]:
    """(queries, positions) the call is made with: the queries rounded up to a power of two
    (at least MIN_QUERIES), the positions to a multiple of BUCKET within the buffer."""
    queries = max(MIN_QUERIES, 1 << (num_queries - 1).bit_length())
    positions = min(-(-length // BUCKET) * BUCKET, capacity)
    return queries, positions


def attend(queries: mx.array, cache: KVCache, scale: float) -> mx.array:
    """The causal attention of `queries` (1, heads, L, dim), the newest L positions of
    `cache`, over the cache's first `cache.offset` positions."""
    n, length = queries.shape[2], cache.offset
    padded_n, positions = padded_shape(n, length, cache.keys.shape[2])
    keys = cache.keys[..., :positions, :]
    values = cache.values[..., :positions, :]
    if padded_n > n:
        queries = mx.pad(queries, [(0, 0), (0, 0), (0, padded_n - n), (0, 0)])
    # Query i (padded ones as the last real one) sees positions up to length - n + i.
    last = length - n + mx.minimum(mx.arange(padded_n), n - 1)
    visible = mx.arange(positions)[None, :] <= last[:, None]
    bias = mx.where(visible, mx.array(0, queries.dtype), mx.array(-mx.inf, queries.dtype))
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=bias)
    return out[:, :, :n] if padded_n > n else out

"""One layer's KV state as the prefix cache keeps it, for plain and sliding-window layers.

A plain layer (mlx_lm's KVCache) keeps every position, so its state serves any shorter prefix.
A sliding-window layer (RotatingKVCache: Gemma 3's local layers) keeps only the last positions
of what it has seen, so a state made at length n serves a prefix of length m only when it still
holds everything the layer needs at m: all positions from 0 (nothing evicted yet), or the
window's last max_size - 1 positions before m (position m itself completes the window). In
practice that is the continuation of a conversation (m = n) and the same prompt sent again
(m = n - 1, one token left to compute), whatever the size of the prompt's last chunk.

Invariants:
- `state.keys[..., i, :]` is position `state.start + i`, in order, and the last is position
  `length - 1` for the `length` the state was taken at (a position a decode step ran ahead
  to is cut off).
- `restore(cache, state, m)` leaves `cache` exactly as if it had computed positions 0..m-1
  itself, as far as any later step can see.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache


@dataclass(slots=True)
class LayerState:
    keys: mx.array
    values: mx.array
    start: int = 0  # the position of the first key (> 0: a sliding layer evicted earlier ones)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def cacheable(cache) -> bool:
    """Whether this layer's cache can be kept and restored (exactly these two types)."""
    return type(cache) is KVCache or (type(cache) is RotatingKVCache and cache.keep == 0)


def take(cache, length: int) -> LayerState:
    """The state of a single-sequence cache for its first `length` positions (its offset may
    be ahead by a decode step run ahead)."""
    if type(cache) is KVCache:
        return LayerState(mx.contiguous(cache.keys[..., :length, :]),
                          mx.contiguous(cache.values[..., :length, :]))
    keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    end = keys.shape[2] - (cache.offset - length)
    return LayerState(mx.contiguous(keys[..., :end, :]), mx.contiguous(values[..., :end, :]),
                      length - end)


def restorable(cache, state: LayerState, length: int) -> bool:
    if type(cache) is KVCache:
        return True
    return state.start == 0 or length - state.start >= cache.max_size - 1


def restore(cache, state: LayerState, length: int) -> None:
    """Seed an empty cache with the state's first `length` positions (`restorable` holds)."""
    n = length - state.start
    keys, values = state.keys[..., :n, :], state.values[..., :n, :]
    if type(cache) is RotatingKVCache and state.start > 0 and n < cache.max_size:
        # A full window less one: one slot more, before the oldest, which the next write
        # takes (a single position overwrites the oldest slot; a chunk trims it first), so
        # mlx_lm's cache never sees a window it did not fill itself.
        keys = mx.concatenate([keys[..., :1, :], keys], axis=2)
        values = mx.concatenate([values[..., :1, :], values], axis=2)
        n += 1
    cache.keys, cache.values = keys, values
    cache.offset = length
    if type(cache) is RotatingKVCache:
        cache._idx = n

"""The model step's cache for models the row path does not fit (runner/kv/rows.py `probe`:
sliding-window layers, state-space layers, attention sinks): mlx-lm's left-padded batch
caches, one single-sequence cache per prefilling sequence, and the copy-based prefix cache.

Invariants:
- `self.rows[i]` is the sequence in row i of every layer's batch cache.
- A prefilling sequence has its own single-sequence cache in `self.prefills` until its last
  chunk runs; then that cache is merged into the batch cache (`join`).
- The prefix cache receives a sequence's KV state when its prompt is done and when it leaves
  the batch, for exactly the tokens that state covers (runner/kv/cache_state.py: sliding-window
  layers keep their last positions only, and serve the prefixes they still cover).
- The pool (runner/kv/pool.py, without sharing) does the block accounting; this class keeps
  the arrays, which hold the padding too.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxr.runner.kv import cache_state
from mlxr.runner.kv.batch_cache import append_row
from mlxr.runner.kv.prefix_cache import PrefixCache


class PaddedBatch:
    def __init__(self, model, prefix_cache: PrefixCache | None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.rows: list = []
        self.batch: list[Any] | None = None
        self.prefills: dict[int, list[Any]] = {}
        self._layers = make_prompt_cache(model)  # (read for each layer's kind and window)
        self.supports_prefix = all(cache_state.cacheable(c) for c in self._layers)

    def admit(self, seq, admission) -> int:
        """Give a newly admitted sequence its cache, seeded from the longest cached prefix."""
        caches = make_prompt_cache(self.model)
        reused = 0
        if self.prefix_cache is not None and self.supports_prefix:
            hit = self.prefix_cache.lookup(seq.cache_tokens, self._serves)
            if hit is not None:
                reused = hit.length
                for cache, state in zip(caches, hit.entry.payload):
                    cache_state.restore(cache, state, reused)
        self.prefills[seq.seq_id] = caches
        return reused

    def prefill_cache(self, seq) -> list[Any]:
        return self.prefills[seq.seq_id]

    def decode_cache(self) -> list[Any]:
        return self.batch

    def advance(self, seqs, num: int) -> None:
        pass  # mlx-lm's caches count their own offsets

    def join(self, seq) -> None:
        caches = self.prefills.pop(seq.seq_id)
        if self.supports_prefix and self.prefix_cache is not None:
            # (the whole prompt: the scheduler counts the last chunk after this step)
            self._store(caches, seq, caches[0].offset)
        if self.batch is None:
            self.batch = [type(c).merge([c]) for c in caches]
        else:
            for batch, new in zip(self.batch, caches):
                if isinstance(batch, BatchKVCache) and type(new) is KVCache:
                    append_row(batch, new)
                else:
                    batch.extend(type(new).merge([new]))
        self.rows.append(seq)

    def untake(self) -> None:
        if self.batch:
            for cache in self.batch:
                cache.trim(1)

    def can_run_ahead(self) -> bool:
        return all(c.is_trimmable() for c in self.batch)

    def release(self, seqs) -> None:
        drop: list[int] = []
        for seq in seqs:
            if seq.seq_id in self.prefills:
                del self.prefills[seq.seq_id]
                continue
            index = next((i for i, s in enumerate(self.rows) if s is seq), None)
            if index is None:
                continue
            if self.supports_prefix and self.prefix_cache is not None and self.batch:
                self._store([c.extract(index) for c in self.batch], seq)
            drop.append(index)
        if not drop:
            return
        keep = [i for i in range(len(self.rows)) if i not in set(drop)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.batch = None
        else:
            for cache in self.batch:
                cache.filter(mx.array(keep, dtype=mx.int32))

    def arrays(self, seqs) -> list[mx.array]:
        caches = [c for s in seqs for c in self.prefills.get(s.seq_id, [])]
        if self.batch and any(s in self.rows for s in seqs):
            caches += self.batch
        return [a for c in caches for a in c.state if isinstance(a, mx.array)]

    def kv_bytes(self) -> int:
        return self.live_bytes() + (self.prefix_cache.nbytes if self.prefix_cache else 0)

    def live_bytes(self) -> int:
        """The batch cache (padding included) and the prefilling caches."""
        total = sum(c.nbytes for c in self.batch) if self.batch else 0
        return total + sum(c.nbytes for caches in self.prefills.values() for c in caches)

    def reset(self) -> None:
        self.rows, self.batch, self.prefills = [], None, {}

    def _store(self, caches: list[Any], seq, length: int | None = None) -> None:
        length = seq.num_computed if length is None else length
        if length <= 0:
            return
        payload = [cache_state.take(c, length) for c in caches]
        mx.eval([(state.keys, state.values) for state in payload])
        nbytes = sum(state.nbytes for state in payload)
        self.prefix_cache.store(seq.cache_tokens[:length], payload, nbytes, self._serves)

    def _serves(self, payload: list, length: int) -> bool:
        """Whether a state (one per layer) holds what the first `length` positions need: a
        sliding-window layer's keeps only its last positions (a prompt's state serves the
        prompt sent again; the state at the end of its reply no longer does)."""
        return all(cache_state.restorable(c, state, length)
                   for c, state in zip(self._layers, payload))

"""Prefix KV cache across requests. Imports no mlx: payloads are opaque, with a byte size.

Invariants:
- Each entry holds the KV state of exactly `len(entry.tokens)` tokens (all layers).
- No entry's tokens are a prefix of another entry's tokens that can serve them: storing a
  longer sequence drops the shorter ones it extends, and storing a prefix of an existing entry
  only refreshes it, where `serves(payload, length)` says the longer state holds what that
  length needs (always, by default; a sliding-window layer's state may have dropped it).
- `lookup` returns the longest match that `serves` allows.
- Total payload bytes stay within `max_bytes`, evicting least recently used entries first.
- `lookup` never returns a match covering the whole query: at least one token is left to
  compute, so a prompt equal to a cached prompt plus its output still produces logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# Whether a payload (the state of its entry's tokens) can seed a cache for its first `length`.
Serves = Callable[[Any, int], bool]


def _always(payload: Any, length: int) -> bool:
    return True


@dataclass(slots=True)
class Entry:
    tokens: np.ndarray
    payload: Any
    nbytes: int
    last_used: int = 0


@dataclass(slots=True)
class Hit:
    entry: Entry
    length: int  # tokens of the entry to reuse


@dataclass(slots=True)
class PrefixCache:
    max_bytes: int
    min_tokens: int = 16  # shorter matches are not worth a copy
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0
    _clock: itertools.count = field(default_factory=itertools.count)

    def lookup(self, tokens: list[int], serves: Serves = _always) -> Hit | None:
        if not self.entries or len(tokens) < 2:
            return None
        query = np.asarray(tokens, dtype=np.int64)  # int64: image keys are negative 60-bit
        best: Hit | None = None
        for entry in self.entries:
            n = min(len(entry.tokens), len(query) - 1)
            if n <= (best.length if best else 0):
                continue
            diff = np.flatnonzero(entry.tokens[:n] != query[:n])
            length = int(diff[0]) if diff.size else n
            if length > (best.length if best else 0) and serves(entry.payload, length):
                best = Hit(entry, length)
        if best is None or best.length < self.min_tokens:
            return None
        best.entry.last_used = next(self._clock)
        return best

    def store(self, tokens: list[int], payload: Any, nbytes: int,
              serves: Serves = _always) -> bool:
        """Keep `payload` as the KV state of `tokens`; returns whether it was kept."""
        if len(tokens) < self.min_tokens or nbytes > self.max_bytes:
            return False
        new = np.asarray(tokens, dtype=np.int64)  # int64: image keys are negative 60-bit
        keep: list[Entry] = []
        for entry in self.entries:
            n = len(entry.tokens)
            if n >= len(new) and np.array_equal(entry.tokens[: len(new)], new) \
                    and serves(entry.payload, len(new)):
                entry.last_used = next(self._clock)  # already covered
                return False
            if n < len(new) and np.array_equal(new[:n], entry.tokens) and serves(payload, n):
                self.nbytes -= entry.nbytes  # the new entry extends it
                continue
            keep.append(entry)
        keep.append(Entry(new, payload, nbytes, next(self._clock)))
        self.entries = keep
        self.nbytes += nbytes
        self._evict()
        return True

    def _evict(self) -> None:
        if self.nbytes <= self.max_bytes:
            return
        self.entries.sort(key=lambda e: e.last_used)
        while self.entries and self.nbytes > self.max_bytes:
            self.nbytes -= self.entries.pop(0).nbytes

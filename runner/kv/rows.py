"""The batch as rows over the block pool's runs: each sequence's keys and values live in
contiguous per-layer arrays (one per run, runner/kv/pool.py), and each row attends over its own
positions only, with `mx.fast.scaled_dot_product_attention`: no padding kept in memory, no
gather of scattered blocks (docs/PERFORMANCE.md, "Attention over block tables"). At decode,
short rows of similar length are attended together in one call over a padded copy made for
that call (`_DecodePlan`): on the CPU one more attention call costs more than copying a few
hundred KiB, and it keeps a batch of equal short rows as fast as mlx-lm's padded cache.

mlx-lm's attention modules call `cache.update_and_fetch` and then the module-level
`scaled_dot_product_attention(queries, keys, values, cache=cache, ...)`. `install` points that
name, in every model module that imported it from mlx_lm's base, at a function that hands a
`RowsLayer` cache to its own `attend` and passes every other cache to the original: models
serve unchanged. `probe` checks on a tiny batch of rows that this path gives the logits of
mlx-lm's own single-sequence cache, so an architecture it does not fit (a sliding window, a
state-space layer, attention sinks) keeps the padded batch instead.

Invariants:
- `Row.length` positions of the row's context are written: `shared` segments (other runs,
  read only) below `run.start`, its own run from `run.start` to `length`. A forward pass
  writes positions `length ..` of every row in every layer before any row of that layer
  attends, then the model step advances `length`.
- A run's arrays cover at least the positions written to it; they grow to the pool's capacity
  for the run (whole blocks) when a write needs more.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxr.runner.host_body import HostRow
from mlxr.runner.kv import bucketed_attention, host_attention
from mlxr.runner.kv.pool import Run, Segment
from mlxr.runner.logits_match import logits_match


class Unsupported(Exception):
    """A model asks the rows for something they do not do (a sliding window's mask,
    attention sinks): `probe` fails and the model runs on the padded batch."""


@dataclass(slots=True)
class RunArrays:
    keys: list  # per layer: (1, kv_heads, capacity, dim) or None before the first write
    values: list

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)


@dataclass(slots=True)
class Row:
    shared: list[Segment]
    run: Run
    length: int


class RunStore:
    """The arrays of every run, by run id."""

    def __init__(self, num_layers: int, block_size: int, host_attention: bool = True):
        self.num_layers = num_layers
        self.block_size = block_size
        self.host_attention = host_attention  # may rows be attended in numpy
        self.arrays: dict[int, RunArrays] = {}

    def get(self, run: Run) -> RunArrays:
        arrays = self.arrays.get(run.run_id)
        if arrays is None:
            arrays = self.arrays[run.run_id] = RunArrays([None] * self.num_layers,
                                                         [None] * self.num_layers)
        return arrays

    def drop(self, run_ids) -> None:
        for run_id in run_ids:
            self.arrays.pop(run_id, None)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def write(self, run: Run, layer: int, position: int, keys: mx.array,
              values: mx.array) -> None:
        at = position - run.start
        end = at + keys.shape[2]
        self.reserve(run, layer, end, keys.shape[1], keys.shape[3], keys.dtype)
        arrays = self.arrays[run.run_id]
        old_k, old_v = arrays.keys[layer], arrays.values[layer]
        old_k[..., at:end, :] = keys
        old_v[..., at:end, :] = values
        arrays.keys[layer], arrays.values[layer] = old_k, old_v

    def reserve(self, run: Run, layer: int, end: int, kv_heads: int, dim: int,
                dtype) -> bool:
        """Grow the run's arrays for `layer` to hold its positions [0, end) from run.start
        (to the pool's capacity for the run, in whole blocks); False when they already did."""
        arrays = self.get(run)
        old_k, old_v = arrays.keys[layer], arrays.values[layer]
        have = 0 if old_k is None else old_k.shape[2]
        if end <= have:
            return False
        bs = self.block_size
        want = max(run.capacity * bs, -(-end // bs) * bs)
        shape = (1, kv_heads, want - have, dim)
        pad_k, pad_v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        arrays.keys[layer] = pad_k if old_k is None else mx.concatenate([old_k, pad_k], axis=2)
        arrays.values[layer] = pad_v if old_v is None else \
            mx.concatenate([old_v, pad_v], axis=2)
        return True

    def padded(self, run: Run, layer: int, width: int) -> tuple[mx.array, mx.array]:
        """The run's first `width` positions from its start (positions past what it wrote
        are zeros or stale: the caller masks them)."""
        keys, values = self.arrays[run.run_id].keys[layer], self.arrays[run.run_id].values[layer]
        have = keys.shape[2]
        if have >= width:
            return keys[..., :width, :], values[..., :width, :]
        pad = [(0, 0), (0, 0), (0, width - have), (0, 0)]
        return mx.pad(keys, pad), mx.pad(values, pad)

    def context(self, row_shared: list[Segment], run: Run, layer: int,
                length: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions [0, length): one slice when the row has no shared
        segments, else the segments joined (a copy for this call only)."""
        parts_k, parts_v = self.pieces(row_shared, run, layer, length)
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def dtype(self, run: Run, layer: int):
        """The dtype of a written run's keys."""
        return self.arrays[run.run_id].keys[layer].dtype

    def pieces(self, row_shared: list[Segment], run: Run, layer: int,
               length: int) -> tuple[list[mx.array], list[mx.array]]:
        """Keys and values of positions [0, length) as slices, in order: each shared
        segment's, then the row's own run's (when it has any)."""
        parts_k, parts_v = [], []
        for seg in row_shared:
            arrays = self.arrays[seg.run.run_id]
            a, b = seg.start - seg.run.start, seg.end - seg.run.start
            parts_k.append(arrays.keys[layer][..., a:b, :])
            parts_v.append(arrays.values[layer][..., a:b, :])
        arrays = self.arrays[run.run_id]
        own = length - run.start
        if own > 0 or not parts_k:
            parts_k.append(arrays.keys[layer][..., :own, :])
            parts_v.append(arrays.values[layer][..., :own, :])
        return parts_k, parts_v


# A decode row whose keys and values (one layer) take at most this many bytes is attended
# in a padded group with rows of similar length: copying it into the group costs less than
# one more attention call (about 60-120 us each on the 2-core EPYC; docs/PERFORMANCE.md).
GROUP_ROW_BYTES = 256 << 10
GROUP_PADDING = 0.25  # a group's padding stays within this fraction of its positions


@dataclass(slots=True)
class _Group:
    rows: list[int]  # indices into the step's rows
    width: int  # positions attended: the longest row's
    index: mx.array  # `rows` as an array, to pick their queries
    mask: mx.array | None  # (rows, 1, 1, width): which positions each row has


class _DecodePlan:
    """How a decode step's rows are attended, the same in every layer: padded groups of short
    rows of similar length, and single rows (long ones, and those with shared segments)."""

    def __init__(self, store: RunStore, rows: list[Row]):
        self.groups: list[_Group] = []
        self.singles: list[int] = []
        self.order: mx.array | None = None  # output row i is concatenated row order[i]
        first = store.arrays[rows[0].run.run_id].keys[0] if rows else None
        per_position = 0 if first is None else \
            2 * first.shape[1] * first.shape[3] * first.dtype.size
        lengths = [r.length + 1 for r in rows]
        short = sorted((i for i, r in enumerate(rows)
                        if not r.shared and 0 < per_position * lengths[i] <= GROUP_ROW_BYTES),
                       key=lambda i: -lengths[i])
        grouped: set[int] = set()
        while short:
            width, members, used = lengths[short[0]], [], 0
            for i in short:
                if (width - lengths[i]) + used > GROUP_PADDING * width * (len(members) + 1):
                    break
                members.append(i)
                used += width - lengths[i]
            short = short[len(members):]
            if len(members) == 1:
                continue
            grouped.update(members)
            mask = None
            if used:
                have = mx.array([lengths[i] for i in members], dtype=mx.int32)
                mask = mx.arange(width, dtype=mx.int32)[None, None, None, :] < \
                    have[:, None, None, None]
            self.groups.append(_Group(members, width, mx.array(members, dtype=mx.int32), mask))
        self.singles = [i for i in range(len(rows)) if i not in grouped]
        placed = [i for g in self.groups for i in g.rows] + self.singles
        if placed != list(range(len(rows))):
            inverse = [0] * len(rows)
            for at, i in enumerate(placed):
                inverse[i] = at
            self.order = mx.array(inverse, dtype=mx.int32)


@dataclass(slots=True)
class _Forward:
    """What the layers of one forward pass share."""
    plan: _DecodePlan | None = None  # made by the first layer that attends a decode step
    host: bool = False  # a row was attended in numpy: the pass was computed as it was built


class RowsLayer:
    """One layer's cache for one forward pass over `rows`, each adding `num_new` positions
    (a prefill chunk: one row; a decode step: every running row, one position each), or,
    with `counts`, several rows' prefill chunks in one pass: row i adds counts[i] positions,
    its input padded on the right to the longest chunk (the padding is neither written nor
    attended)."""

    def __init__(self, store: RunStore, layer: int, rows: list[Row], forward: _Forward,
                 offset, counts: list[int] | None = None):
        self.store = store
        self.layer = layer
        self.rows = rows
        self.offset = offset  # where each row's new positions start (RoPE reads it)
        self.counts = counts
        self._num_new = 0
        self._forward = forward

    # mlx-lm's pipeline-parallel forward ties its send to the last layer's cache
    # (`cache[-1].keys = mx.depends(cache[-1].keys, h)`) so that evaluating the cache sends.
    # The model step evaluates the forward's output, which holds the send (and the gather
    # after it), so the tie is not needed here: `keys` is a stand-in.
    @property
    def keys(self) -> mx.array:
        return mx.array(0)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        pass

    def make_mask(self, num_new: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise Unsupported("sliding windows use the padded batch")
        return None  # attend() masks for itself

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._num_new = keys.shape[2]
        if self.counts is not None:
            for i, (row, n) in enumerate(zip(self.rows, self.counts)):
                self.store.write(row.run, self.layer, row.length, keys[i:i + 1, :, :n],
                                 values[i:i + 1, :, :n])
        elif len(self.rows) == 1:
            row = self.rows[0]
            self.store.write(row.run, self.layer, row.length, keys, values)
        else:
            parts = zip(mx.split(keys, len(self.rows)), mx.split(values, len(self.rows)))
            for row, (k, v) in zip(self.rows, parts):
                self.store.write(row.run, self.layer, row.length, k, v)
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        n = self._num_new
        if self.counts is not None:
            outs = []
            for i, (row, count) in enumerate(zip(self.rows, self.counts)):
                out = self._attend_one(queries[i:i + 1, :, :count], row, count, scale)
                if count < n:
                    out = mx.pad(out, [(0, 0), (0, 0), (0, n - count), (0, 0)])
                outs.append(out)
            return mx.concatenate(outs, axis=0)
        if len(self.rows) == 1:
            return self._attend_one(queries, self.rows[0], n, scale)
        if self._forward.plan is None:
            self._forward.plan = _DecodePlan(self.store, self.rows)
        plan = self._forward.plan
        outs = []
        for group in plan.groups:
            ks, vs = [], []
            for i in group.rows:
                k, v = self.store.padded(self.rows[i].run, self.layer, group.width)
                ks.append(k)
                vs.append(v)
            outs.append(mx.fast.scaled_dot_product_attention(
                queries[group.index], mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0),
                scale=scale, mask=group.mask))
        for i in plan.singles:
            outs.append(self._attend_one(queries[i:i + 1], self.rows[i], 1, scale))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return out if plan.order is None else out[plan.order]

    def _attend_one(self, queries: mx.array, row: Row, n: int, scale: float) -> mx.array:
        """One row's attention over its context, its `n` newest positions querying: with
        numpy's softmax where that pays (runner/kv/host_attention.py), which reads a shared
        prefix in place; else MLX's, over the context joined into one array."""
        length = row.length + n
        if self.store.host_attention and host_attention.worth_it(
                n * queries.shape[1] * length, self.store.dtype(row.run, self.layer)):
            self._forward.host = True
            ks, vs = self.store.pieces(row.shared, row.run, self.layer, length)
            return host_attention.attend(queries, ks, vs, scale, n > 1)
        k, v = self.store.context(row.shared, row.run, self.layer, length)
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask="causal" if n > 1 else None)

    @property
    def state(self):
        return ()

    def is_trimmable(self) -> bool:
        return True


def make_layers(store: RunStore, rows: list[Row], forward: _Forward | None = None,
                counts: list[int] | None = None) -> list[RowsLayer]:
    forward = _Forward() if forward is None else forward
    offset = rows[0].length if len(rows) == 1 else \
        mx.array([r.length for r in rows], dtype=mx.int32)
    return [RowsLayer(store, layer, rows, forward, offset, counts)
            for layer in range(store.num_layers)]


# -- routing mlx-lm's attention ---------------------------------------------------------
_original = None
_buckets = False  # prefill chunks on single-sequence caches in bucketed shapes (CUDA)


def _attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, RowsLayer):
        if sinks is not None:
            raise Unsupported("attention sinks use the padded batch")
        return cache.attend(queries, scale)
    if _buckets and sinks is None and bucketed_attention.applies(queries, cache, mask):
        return bucketed_attention.attend(queries, cache, scale)
    return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model, buckets: bool = False) -> None:
    """Route the attention of `model`'s modules through `_attention` (idempotent);
    `buckets`: also give prefill chunks on single-sequence caches bucketed shapes
    (runner/kv/bucketed_attention.py)."""
    global _original, _buckets
    from mlx_lm.models import base

    _buckets = _buckets or buckets
    if _original is None:
        _original = base.scaled_dot_product_attention
    for module in {type(m).__module__ for m in model.modules()} | {base.__name__}:
        mod = sys.modules.get(module)
        if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is _original:
            mod.scaled_dot_product_attention = _attention


class RowBatch:
    """The model step's cache for models whose layers all take `RowsLayer` (see `probe`):
    every sequence's context in the pool's runs, read by reference where shared."""

    def __init__(self, num_layers: int, pool, host_attention: bool = True):
        self.pool = pool
        self.store = RunStore(num_layers, pool.block_size, host_attention)
        self.rows: list = []  # the decoding sequences, in batch order
        self._rows: dict[int, Row] = {}  # seq id -> Row, prefilling and decoding
        self._decode = _Forward()  # the last decode pass's

    def admit(self, seq, admission) -> int:
        copy = admission.copy
        if copy is not None:  # the matched part of another run's partial block
            src = self.store.arrays[copy.run.run_id]
            a, b = copy.start - copy.run.start, copy.end - copy.run.start
            for layer in range(self.store.num_layers):
                self.store.write(admission.run, layer, copy.start,
                                 src.keys[layer][..., a:b, :], src.values[layer][..., a:b, :])
        self._rows[seq.seq_id] = Row(admission.shared, admission.run, admission.cached)
        return admission.cached

    def prefill_cache(self, seq) -> list[RowsLayer]:
        return make_layers(self.store, [self._rows[seq.seq_id]])

    def prefill_group_cache(self, seqs, counts: list[int]) -> list[RowsLayer]:
        """One forward pass's cache for several sequences' prefill chunks (`counts`
        positions each, the input padded on the right to the longest)."""
        return make_layers(self.store, [self._rows[s.seq_id] for s in seqs], counts=counts)

    def decode_cache(self) -> list[RowsLayer]:
        self._decode = _Forward()
        return make_layers(self.store, [self._rows[s.seq_id] for s in self.rows], self._decode)

    def host_rows(self, seqs, tokens: list[int]) -> list[HostRow] | None:
        """numpy views of each sequence's context for one decode position (`tokens`: their
        inputs), for runner/host_body.py to write and attend in place. Where the pool gave a
        row's run a block its arrays do not cover yet, they grow first: left to the MLX pass,
        every such growth made a whole decode step take MLX's path, 2.5x as long
        (docs/PERFORMANCE.md, session 23). None when a row has no arrays yet or its run no
        block for the position (the MLX pass writes it as before). The arrays were evaluated
        at the end of the last step, and nothing else writes a row's new position."""
        store, out = self.store, []
        for seq, token in zip(seqs, tokens):
            row = self._rows[seq.seq_id]
            arrays = store.arrays.get(row.run.run_id)
            at = row.length - row.run.start
            if at < 0 or at >= row.run.capacity * store.block_size or arrays is None or \
                    any(k is None for k in arrays.keys + arrays.values):
                return None
            if any(k.shape[2] <= at for k in arrays.keys + arrays.values):
                first = arrays.keys[0]
                self._make_room(row, at + 1, first.shape[1], first.shape[3], first.dtype)
            out.append(HostRow(token, row.length, *self._views(row, at + 1)))
        return out

    def host_chunk(self, seq, count: int, kv_heads: int, dim: int) -> \
            tuple[list[list[np.ndarray]], list[list[np.ndarray]]] | None:
        """numpy views of a prefilling sequence's context per layer, covering its next
        `count` positions too (keys and values pieces, as `HostRow`'s), for
        runner/host_prefill.py to write and attend in place; the row's arrays grow first
        where they must (and are evaluated). None for a row that starts below its run. The
        arrays are float32: the numpy bodies serve float32 models only."""
        row = self._rows[seq.seq_id]
        at = row.length - row.run.start
        if at < 0:
            return None
        self._make_room(row, at + count, kv_heads, dim, mx.float32)
        return self._views(row, at + count)

    def _make_room(self, row: Row, end: int, kv_heads: int, dim: int, dtype) -> None:
        """Grow the row's arrays in every layer to hold its run's positions [0, end), and
        evaluate them where they grew (numpy reads them next)."""
        store = self.store
        grown = [store.reserve(row.run, layer, end, kv_heads, dim, dtype)
                 for layer in range(store.num_layers)]
        if any(grown):
            arrays = store.arrays[row.run.run_id]
            mx.eval(arrays.keys + arrays.values)

    def _views(self, row: Row, own: int) -> tuple[list[list[np.ndarray]],
                                                  list[list[np.ndarray]]]:
        """Per layer, numpy views of the row's shared segments, then of its own run's first
        `own` positions: its keys' pieces and its values' pieces."""
        store = self.store
        arrays = store.arrays[row.run.run_id]
        keys, values = [], []
        for layer in range(store.num_layers):
            ks, vs = [], []
            for seg in row.shared:
                src = store.arrays[seg.run.run_id]
                a, b = seg.start - seg.run.start, seg.end - seg.run.start
                ks.append(np.asarray(src.keys[layer])[0, :, a:b])
                vs.append(np.asarray(src.values[layer])[0, :, a:b])
            ks.append(np.asarray(arrays.keys[layer])[0, :, :own])
            vs.append(np.asarray(arrays.values[layer])[0, :, :own])
            keys.append(ks)
            values.append(vs)
        return keys, values

    def advance(self, seqs, num: int) -> None:
        """The forward pass just built wrote `num` positions of each of `seqs`."""
        for seq in seqs:
            self._rows[seq.seq_id].length += num

    def join(self, seq) -> None:
        self.rows.append(seq)

    def untake(self) -> None:
        """Forget the position a decode step run ahead wrote for every row."""
        self.advance(self.rows, -1)

    def can_run_ahead(self) -> bool:
        """Only within each row's reserved blocks: the pool's accounting stays exact. Not
        when the last decode pass attended a row in numpy: building the next pass would
        compute it then and there, holding up this step's tokens."""
        if self._decode.host:
            return False
        bs = self.pool.block_size
        return all(self._rows[s.seq_id].length < self._rows[s.seq_id].run.end(bs)
                   for s in self.rows)

    def release(self, seqs) -> None:
        gone = {s.seq_id for s in seqs}
        for seq_id in gone:
            self._rows.pop(seq_id, None)
        self.rows = [s for s in self.rows if s.seq_id not in gone]
        self.store.drop(self.pool.drain_freed())

    def arrays(self, seqs) -> list[mx.array]:
        out = []
        for seq in seqs:
            arrays = self.store.arrays.get(self._rows[seq.seq_id].run.run_id)
            if arrays is not None:
                out += [a for a in arrays.keys + arrays.values if a is not None]
        return out

    def kv_bytes(self) -> int:
        return self.store.nbytes()

    def live_bytes(self) -> int:
        """Bytes of the runs that sequences in flight write or read (not the cached ones)."""
        runs = {r.run.run_id for r in self._rows.values()}
        runs |= {seg.run.run_id for r in self._rows.values() for seg in r.shared}
        arrays = self.store.arrays
        return sum(arrays[i].nbytes for i in runs if i in arrays)

    def reset(self) -> None:
        self.rows, self._rows = [], {}
        self.store.arrays = {}


def probe(model, num_layers: int) -> bool:
    """Does this model, with its attention routed here, give mlx-lm's own logits for two
    rows of different lengths, prefilled alone and decoded together?"""
    try:
        return all(logits_match(got, want) for got, want in probe_pairs(model, num_layers))
    except Exception:
        return False


def probe_pairs(model, num_layers: int) -> list[tuple[mx.array, mx.array]]:
    """The probe's logits, each beside mlx-lm's own: each row's last prefill position, then
    both rows' decode step (scripts/probe_differences.py prints how far apart they are)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxr.runner.kv.pool import KVPool

    install(model)
    pool = KVPool(num_blocks=8, block_size=16)
    batch = RowBatch(num_layers, pool)
    pairs, firsts, expected = [], [], []
    # Each forward pass is evaluated alone: on a distributed runner's ranks a pass holds
    # collectives, which every rank must reach in the same order.
    for i, tokens in enumerate([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]):
        ref = make_prompt_cache(model)
        last = model(mx.array([tokens]), cache=ref)[:, -1, :]
        mx.eval(last)
        nxt = mx.argmax(last, axis=-1)
        expected.append(model(nxt[:, None], cache=ref)[:, -1, :])
        mx.eval(expected[-1])
        seq = _ProbeSeq(i)
        batch.admit(seq, pool.admit(i, tokens, len(tokens) + 1))
        got = model(mx.array([tokens]), cache=batch.prefill_cache(seq))[:, -1, :]
        mx.eval(got)
        batch.advance([seq], len(tokens))
        batch.join(seq)
        pairs.append((got, last))
        firsts.append(nxt)
    logits = model(mx.concatenate(firsts)[:, None], cache=batch.decode_cache())[:, -1, :]
    mx.eval(logits)
    return pairs + [(logits, mx.concatenate(expected))]


@dataclass(slots=True)
class _ProbeSeq:
    seq_id: int

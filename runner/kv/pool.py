"""Block accounting for the KV cache: admission, growth, preemption, prefix sharing. No mlx.

Storage is counted in blocks of `block_size` positions. A sequence's context positions are
held in *runs*: a run is one contiguous storage (per layer, kept by the model step) for the
positions `[start, start + capacity * block_size)`, written by one sequence, its owner. A
sequence reads its context as a list of segments: a shared prefix read by reference from
other runs, then its own run. So a decode row attends over one or a few contiguous arrays,
never a gather of scattered blocks (docs/PERFORMANCE.md, "Attention over block tables").

Prefix sharing (as vLLM's automatic prefix caching): each full, computed block of a run is
registered under its tokens and the chain id of the block before it (the key holds the tokens,
not a hash of them, so a match is exact). A new
sequence walks its prompt's blocks through that table and reads every matched block by
reference (its run gains a reader). It writes into a new run of its own from the first
unmatched block (the partial last block is recomputed, never copied), except when the last
matched run has no owner and nobody reads past the matched point: then the sequence *adopts*
that run and writes on in place, matching the run's tokens into the partial block too. That
is a multi-turn chat's case, and it keeps the row one contiguous array.

Invariants:
- `used_blocks` is the sum of the capacities of the runs that exist; it never exceeds
  `num_blocks`. A run exists while it has an owner, a reader, or a registered block.
- A run whose owner is gone and that nobody reads is *cached*: it may be evicted whole, least
  recently used first, when room is needed; eviction unregisters its blocks and reports the
  run in `drain_freed()` so the model step drops its arrays.
- A registered block's positions are never written again: an adopting sequence first
  unregisters the blocks at and after the point where it writes.
- A reader of a run reads only positions below its segment's end; a run is adopted only
  when every reader's end is at or before the adoption point.
- `admit` and `reserve` either succeed, or change nothing and return None / False.
- `admit` leaves at least one token of the prompt to compute.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

ROOT_HASH = 0
# 64 positions: no block size was measurably faster, and 64 wastes 2.5% of the memory of a
# mixed batch where 256 wastes 17% (docs/PERFORMANCE.md, "Attention over block tables").
BLOCK_SIZE = 64


@dataclass(eq=False, slots=True)
class Run:
    run_id: int
    start: int  # first position, a multiple of the block size
    capacity: int  # blocks
    parent_hash: int  # the chain id of the block before `start` (ROOT_HASH at 0)
    owner: int | None
    tokens: list[int] = field(default_factory=list)  # the tokens at start, start+1, ...
    hashes: list[int] = field(default_factory=list)  # chain ids of its first, full blocks
    keys: list[tuple] = field(default_factory=list)  # their registry keys
    readers: dict[int, int] = field(default_factory=dict)  # seq id -> end position read
    last_used: int = 0
    tail_key: int | None = None  # its key in KVPool.tails

    def end(self, block_size: int) -> int:
        return self.start + self.capacity * block_size


@dataclass(slots=True)
class Segment:
    """Positions [start, end) of a sequence's context, held in `run`."""

    run: Run
    start: int
    end: int


@dataclass(slots=True)
class Admission:
    """Where an admitted sequence's context lives: `shared` segments read by reference, then
    `run`, its own, from `run.start`. `cached` positions are already computed; those past
    the shared segments are in the run already (`adopted`), or are to be copied into it from
    `copy` (the matched part of another run's partial block)."""

    cached: int
    shared: list[Segment]
    run: Run
    adopted: bool
    copy: Segment | None = None


@dataclass(slots=True)
class _Table:
    shared: list[Segment]
    run: Run


class KVPool:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, share: bool = True,
                 growth: float = 0.125):
        """`share`: register blocks and reuse them across sequences (False: every sequence
        writes its whole context into a run of its own). `growth`: a run that must grow takes
        this fraction of its capacity more, so long rows are reallocated rarely."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.share = share
        self.growth = growth
        self.used_blocks = 0
        self.runs: dict[int, Run] = {}
        self.tables: dict[int, _Table] = {}
        # (parent chain id, the block's tokens) -> (run, block index in run, chain id). The
        # key holds the tokens themselves, so two different prefixes never share an entry:
        # a chain id names one exact prefix, and no hash collision can serve another's keys.
        self.registry: dict[tuple, tuple[Run, int, int]] = {}
        # chain id at the end of a run's registered blocks -> the runs whose tails start there
        # (a dict as an ordered set: ties break the same way in every process)
        self.tails: dict[int, dict[Run, None]] = {}
        self._chain_ids = itertools.count(ROOT_HASH + 1)
        self._freed: list[int] = []
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)
        self.hits = 0  # positions served from cache, over all admissions
        self.queried = 0  # prompt positions looked up, over all admissions

    # -- figures -------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks of runs that only the cache holds (evictable)."""
        return sum(r.capacity for r in self.runs.values() if self._evictable(r))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Could a sequence of this many positions ever be held (the pool all its own)?"""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def table(self, seq_id: int) -> _Table:
        return self.tables[seq_id]

    def reset(self) -> None:
        """Forget everything (the model step lost its arrays after a failed step)."""
        self._freed += list(self.runs)
        self.runs, self.tables, self.registry, self.tails = {}, {}, {}, {}
        self.used_blocks = 0

    def drain_freed(self) -> list[int]:
        """Run ids whose storage is gone since the last call (their arrays can go)."""
        freed, self._freed = self._freed, []
        return freed

    # -- sequences -----------------------------------------------------------------------
    def cached_length(self, tokens: list[int]) -> int:
        """How many positions of `tokens` a sequence admitted now would find cached (nothing
        changes)."""
        return self._match(tokens)[1] if self.share else 0

    def admit(self, seq_id: int, tokens: list[int], reserve: int) -> Admission | None:
        """Place a new sequence whose context is `tokens`, with room for `reserve` positions
        (at least len(tokens)). None, changing nothing, when there is no room."""
        assert seq_id not in self.tables, "admitted twice"
        shared, cached, adopt, parent, copy = self._match(tokens) if self.share else \
            ([], 0, None, ROOT_HASH, None)
        now = next(self._clock)
        if adopt is not None:
            need = max(self.blocks_for(reserve - adopt.start) - adopt.capacity, 0)
            if not self._make_room(need, keep={adopt, *(s.run for s in shared)}):
                return None
            self._truncate(adopt, cached)
            adopt.owner = seq_id
            self._grow(adopt, need)
            run = adopt
        else:
            start = shared[-1].end if shared else 0
            need = self.blocks_for(reserve - start)
            keep = {s.run for s in shared} | ({copy.run} if copy else set())
            if not self._make_room(need, keep=keep):
                return None
            run = Run(next(self._ids), start, 0, parent, seq_id)
            self._grow(run, need)
            self.runs[run.run_id] = run
            if self.share:
                self._retail(run)
        for seg in shared:
            seg.run.readers[seq_id] = seg.end
            seg.run.last_used = now
        run.last_used = now
        self.tables[seq_id] = _Table(shared, run)
        self.hits += cached
        self.queried += len(tokens)
        return Admission(cached, list(shared), run, adopt is not None, copy)

    def reserve(self, seq_id: int, positions: int) -> bool:
        """Room for `positions` positions of the sequence's context; False, changing nothing,
        when the pool cannot give it (the caller preempts)."""
        run = self.tables[seq_id].run
        need = self.blocks_for(positions - run.start) - run.capacity
        if need <= 0:
            return True
        extra = max(int(run.capacity * self.growth), 0)
        if self._make_room(need + extra, keep={run}):
            self._grow(run, need + extra)
            return True
        if extra and self._make_room(need, keep={run}):
            self._grow(run, need)
            return True
        return False

    def commit(self, seq_id: int, tokens: list[int], computed: int) -> None:
        """`tokens[:computed]` are in the cache: register the run's newly full blocks."""
        run = self.tables[seq_id].run
        del run.tokens[max(computed - run.start, 0):]
        run.tokens.extend(tokens[run.start + len(run.tokens):computed])
        run.last_used = next(self._clock)
        if not self.share:
            return
        bs = self.block_size
        while (len(run.hashes) + 1) * bs <= len(run.tokens) and \
                len(run.hashes) < run.capacity:
            i = len(run.hashes)
            parent = run.hashes[i - 1] if i else run.parent_hash
            key = (parent, tuple(run.tokens[i * bs:(i + 1) * bs]))
            entry = self.registry.get(key)
            if entry is None:  # else a duplicate of a registered block: same chain id
                entry = self.registry[key] = (run, i, next(self._chain_ids))
            run.hashes.append(entry[2])
            run.keys.append(key)
        self._retail(run)

    def release(self, seq_id: int, tokens: list[int], computed: int) -> None:
        """The sequence leaves (finished, or preempted to recompute): register what it
        computed, stop reading its segments and give up its run, which stays cached while it
        has registered blocks. A sequence the pool no longer holds (after `reset`) is
        ignored."""
        if seq_id not in self.tables:
            return
        self.commit(seq_id, tokens, computed)
        table = self.tables.pop(seq_id)
        now = next(self._clock)
        for seg in table.shared:
            seg.run.readers.pop(seq_id, None)
            seg.run.last_used = now
            self._drop_if_dead(seg.run)
        run = table.run
        run.owner = None
        run.last_used = now
        self._drop_if_dead(run)

    # -- internals -----------------------------------------------------------------------
    def _match(self, tokens: list[int]):
        """The longest cached prefix of `tokens` (leaving one token to compute): the segments
        to read, the positions covered, the run to adopt (or None), the chain id at the end
        of the matched full blocks (a new run's parent), and the segment to copy into a new
        run (or None)."""
        bs = self.block_size
        limit = len(tokens) - 1
        shared: list[Segment] = []
        h = ROOT_HASH
        pos = 0
        while pos + bs <= limit:
            found = self.registry.get((h, tuple(tokens[pos:pos + bs])))
            if found is None:
                break
            run, _, nxt = found
            if shared and shared[-1].run is run and shared[-1].end == pos:
                shared[-1].end = pos + bs
            else:
                shared.append(Segment(run, pos, pos + bs))
            h, pos = nxt, pos + bs
        # Past the full blocks: the longest match into a run whose chain reaches `pos` (the
        # run of the last matched block, or one whose registered blocks end there). A cached
        # run that the match covers to its last token is adopted (written on in place);
        # otherwise the matched part of its partial block is copied into the new run.
        candidates = list(self.tails.get(h, ()))
        if shared:
            candidates.append(shared[-1].run)
        best, best_key = None, (pos, False)
        for run in candidates:
            if run.start > pos:
                continue
            offset, more = pos - run.start, 0
            while pos + more < limit and offset + more < len(run.tokens) and \
                    run.tokens[offset + more] == tokens[pos + more]:
                more += 1
            key = (pos + more, self._adoptable(run, pos + more))
            if key > best_key:
                best, best_key = run, key
        if best is None:
            return shared, pos, None, h, None
        best_end = best_key[0]
        if self._adoptable(best, best_end):  # read [0, best.start) from the segments
            shared = [Segment(s.run, s.start, min(s.end, best.start))
                      for s in shared if s.start < best.start]
            return shared, best_end, best, h, None
        return shared, best_end, None, h, Segment(best, pos, best_end)

    def _adoptable(self, run: Run, end: int) -> bool:
        return run.owner is None and end == run.start + len(run.tokens) and \
            all(r_end <= end for r_end in run.readers.values())

    def _truncate(self, run: Run, position: int) -> None:
        """Unregister the run's blocks at and after `position` and forget its tokens there."""
        keep = max(position - run.start, 0)
        del run.tokens[keep:]
        while len(run.hashes) * self.block_size > keep:
            run.hashes.pop()
            key = run.keys.pop()
            if self.registry.get(key, (None,))[0] is run:
                del self.registry[key]
        self._retail(run)

    def _retail(self, run: Run, gone: bool = False) -> None:
        """File the run under the chain id where its registered blocks end."""
        if not self.share:
            return
        key = None if gone else (run.hashes[-1] if run.hashes else run.parent_hash)
        if key == run.tail_key:
            return
        if run.tail_key is not None:
            peers = self.tails[run.tail_key]
            peers.pop(run, None)
            if not peers:
                del self.tails[run.tail_key]
        if key is not None:
            self.tails.setdefault(key, {})[run] = None
        run.tail_key = key

    def _grow(self, run: Run, blocks: int) -> None:
        run.capacity += blocks
        self.used_blocks += blocks
        assert self.used_blocks <= self.num_blocks

    def _evictable(self, run: Run) -> bool:
        return run.owner is None and not run.readers

    def _make_room(self, blocks: int, keep: set) -> bool:
        """Evict cached runs (least recently used first, not those in `keep`) until `blocks`
        are free; False, evicting nothing, if even that would not make room."""
        if blocks <= self.free_blocks:
            return True
        victims = sorted((r for r in self.runs.values() if self._evictable(r) and r not in keep),
                         key=lambda r: (r.last_used, -r.start))
        room = self.free_blocks
        chosen = []
        for run in victims:
            if room >= blocks:
                break
            chosen.append(run)
            room += run.capacity
        if room < blocks:
            return False
        for run in chosen:
            self._free(run)
        return True

    def _drop_if_dead(self, run: Run) -> None:
        if self._evictable(run) and (not run.tokens or not self.share):
            self._free(run)

    def _free(self, run: Run) -> None:
        self._truncate(run, run.start)
        self._retail(run, gone=True)
        self.used_blocks -= run.capacity
        run.capacity = 0
        del self.runs[run.run_id]
        self._freed.append(run.run_id)


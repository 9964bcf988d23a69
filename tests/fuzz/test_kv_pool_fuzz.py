"""The KV block pool (runner/kv/pool.py) under random sequences of operations: admissions of
prompts from a tiny alphabet (so prefixes are shared, adopted and copied often) into a pool small
enough to evict and refuse, commits of progress, growth, finishes, preemptions and resets.
After every operation the pool's invariants are recomputed from scratch, and a model of every
sequence's context checks that the pool never serves positions computed for another prefix."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxr.runner.kv.pool import ROOT_HASH, KVPool
from tests.fuzz import strategies as s

SETTINGS = settings(s.SETTINGS, max_examples=300)
OPS = ("admit", "admit", "admit", "readmit", "commit", "commit", "append", "reserve", "finish",
       "finish", "preempt", "reset")


def snapshot(pool: KVPool) -> tuple:
    runs = tuple(sorted((r.run_id, r.start, r.capacity, r.owner, tuple(r.tokens),
                         tuple(r.hashes), tuple(sorted(r.readers.items())), r.tail_key)
                        for r in pool.runs.values()))
    registry = tuple(sorted((cid, run.run_id, i) for (run, i, cid) in pool.registry.values()))
    tables = tuple(sorted((k, t.run.run_id, tuple((g.run.run_id, g.start, g.end)
                                                  for g in t.shared))
                          for k, t in pool.tables.items()))
    tails = tuple(sorted((k, tuple(sorted(r.run_id for r in v))) for k, v in pool.tails.items()))
    return (pool.used_blocks, runs, registry, tables, tails, pool.hits, pool.queried,
            tuple(pool._freed))


def chain(pool: KVPool, tokens, block_size: int) -> int | None:
    """The chain id after the full blocks of `tokens` (a whole number of blocks), walking the
    registry; None where a block is no longer registered."""
    h = ROOT_HASH
    for i in range(0, len(tokens), block_size):
        entry = pool.registry.get((h, tuple(tokens[i:i + block_size])))
        if entry is None:
            return None
        h = entry[2]
    return h


class Model:
    """What the pool should hold: each live sequence's context and progress, and for each run
    the context its creator had before the run's first position (its KV depends on it)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.live: dict[int, dict] = {}  # seq id -> tokens, computed, reserved
        self.waiting: dict[int, list[int]] = {}  # preempted, to be admitted again
        self.history: list[list[int]] = []  # contexts computed so far, to draw prefixes from
        self.prefix_of: dict[int, tuple[int, ...]] = {}  # run id -> tokens before its start
        self.known: set[int] = set()  # every run id the pool has held
        self.drained: set[int] = set()
        self.next_id = 1

    def context_of(self, run) -> list[int]:
        return list(self.prefix_of[run.run_id]) + run.tokens

    # -- invariants, recomputed from scratch ------------------------------------------------
    def check(self) -> None:
        pool, bs = self.pool, self.pool.block_size
        drained = pool.drain_freed()
        assert len(drained) == len(set(drained)), f"a run freed twice: {drained}"
        assert not set(drained) & self.drained, "a run freed twice"
        assert not set(drained) & set(pool.runs), "a freed run is still held"
        self.drained |= set(drained)
        self.known |= set(pool.runs)
        assert self.known - set(pool.runs) <= self.drained, "a run went without being reported"

        assert pool.used_blocks == sum(r.capacity for r in pool.runs.values())
        assert pool.used_blocks <= pool.num_blocks and pool.free_blocks >= 0
        assert set(pool.tables) == set(self.live)

        for run_id, run in pool.runs.items():
            assert run.run_id == run_id and run.capacity > 0 and run.start % bs == 0
            assert run.owner is not None or run.readers or run.tokens, "a leaked run"
            if not pool.share:
                assert run.owner is not None and not run.readers and not run.hashes
            assert len(run.tokens) <= run.capacity * bs
            assert len(run.hashes) * bs <= len(run.tokens) and len(run.hashes) <= run.capacity
            prefix = self.prefix_of[run_id]
            assert len(prefix) == run.start
            if pool.share:
                assert chain(pool, prefix, bs) in (run.parent_hash, None)
            assert len(run.keys) == len(run.hashes)
            for i, (h, key) in enumerate(zip(run.hashes, run.keys)):
                parent = run.hashes[i - 1] if i else run.parent_hash
                assert key == (parent, tuple(run.tokens[i * bs:(i + 1) * bs]))
                entry = pool.registry.get(key)
                assert entry is None or entry[2] == h, "one key, one chain id"
            if run.owner is not None:
                assert pool.tables[run.owner].run is run
                owner = self.live[run.owner]
                assert run.tokens == owner["tokens"][run.start:run.start + len(run.tokens)]
                # registered positions are never written again: the owner writes from computed
                assert owner["computed"] >= run.start + len(run.hashes) * bs
            for seq_id, end in run.readers.items():
                assert seq_id in pool.tables and seq_id != run.owner
                assert end <= run.start + len(run.tokens), "a reader past what was written"
                ends = [g.end for g in pool.tables[seq_id].shared if g.run is run]
                assert ends and max(ends) == end
            if pool.share:
                tail = run.hashes[-1] if run.hashes else run.parent_hash
                assert run.tail_key == tail and run in pool.tails[tail]
            else:
                assert run.tail_key is None

        for key, (run, i, h) in pool.registry.items():
            assert pool.runs.get(run.run_id) is run, "the registry points to a freed run"
            assert i < len(run.hashes) and run.hashes[i] == h and run.keys[i] == key
        assert all(peers for peers in pool.tails.values())
        assert all(pool.runs.get(r.run_id) is r for peers in pool.tails.values() for r in peers)
        assert sum(len(peers) for peers in pool.tails.values()) == \
            (len(pool.runs) if pool.share else 0)

        for seq_id, seq in self.live.items():
            table, tokens = pool.tables[seq_id], seq["tokens"]
            pos = 0
            for g in table.shared:
                assert g.start == pos and g.start < g.end, "segments not contiguous"
                assert pool.runs.get(g.run.run_id) is g.run and g.run is not table.run
                assert g.run.start <= g.start
                assert g.end <= g.run.start + len(g.run.tokens)
                assert g.run.readers.get(seq_id) is not None
                assert self.context_of(g.run)[:g.end] == tokens[:g.end], "another prefix"
                pos = g.end
            run = table.run
            assert run.start == pos and run.owner == seq_id
            assert seq_id not in run.readers
            assert list(self.prefix_of[run.run_id]) == tokens[:run.start]
            assert run.end(bs) >= seq["reserved"] >= len(tokens)
            assert seq["computed"] <= len(tokens)

    # -- operations -------------------------------------------------------------------------
    def admit(self, seq_id: int, tokens: list[int], reserve: int) -> None:
        pool = self.pool
        before = snapshot(pool)
        hits, queried = pool.hits, pool.queried
        adm = pool.admit(seq_id, tokens, reserve)
        if adm is None:
            assert snapshot(pool) == before, "a refused admission changed the pool"
            self.waiting[seq_id] = tokens
            return
        self.waiting.pop(seq_id, None)
        assert 0 <= adm.cached < len(tokens), "no token left to compute"
        assert (pool.hits, pool.queried) == (hits + adm.cached, queried + len(tokens))
        if not pool.share:
            assert adm.cached == 0 and not adm.shared and adm.copy is None and not adm.adopted
        pos = 0
        for g in adm.shared:
            assert g.start == pos
            assert self.context_of(g.run)[:g.end] == tokens[:g.end], "served another prefix"
            pos = g.end
        run = adm.run
        assert run.start == pos and run.owner == seq_id
        if adm.adopted:
            assert adm.copy is None and run.run_id in self.prefix_of
            assert run.start + len(run.tokens) == adm.cached
            assert self.context_of(run)[:adm.cached] == tokens[:adm.cached], \
                "adopted a run of another prefix"
        else:
            assert run.run_id not in self.prefix_of and run.tokens == [] and not run.hashes
            self.prefix_of[run.run_id] = tuple(tokens[:run.start])
            if adm.copy is not None:
                c = adm.copy
                assert c.start == run.start and c.end == adm.cached and c.start < c.end
                assert c.run is not run and c.run.start <= c.start
                assert c.end <= c.run.start + len(c.run.tokens)
                assert self.context_of(c.run)[:c.end] == tokens[:c.end], \
                    "copied from a run of another prefix"
            else:
                assert adm.cached == run.start
        assert run.end(pool.block_size) >= reserve
        self.live[seq_id] = {"tokens": tokens, "computed": adm.cached, "reserved": reserve}

    def release(self, seq_id: int, computed: int, preempt: bool) -> None:
        """The sequence leaves having computed `computed` positions (at least as before)."""
        seq = self.live.pop(seq_id)
        seq["computed"] = computed
        self.pool.release(seq_id, seq["tokens"], computed)
        self.history.append(seq["tokens"][:seq["computed"]])
        if preempt:
            self.waiting[seq_id] = seq["tokens"]

    def reserve(self, seq_id: int, positions: int) -> bool:
        pool, seq = self.pool, self.live[seq_id]
        before = snapshot(pool)
        if pool.reserve(seq_id, positions):
            assert pool.table(seq_id).run.end(pool.block_size) >= positions
            seq["reserved"] = max(seq["reserved"], positions)
            return True
        assert snapshot(pool) == before, "a refused reserve changed the pool"
        return False


class Choices:
    """A step's drawn numbers, read as choices. Every step draws the same numbers whatever the
    pool's state, so the examples do not depend on it (the pool picks among equally good runs
    in set order, which varies from run to run)."""

    def __init__(self, numbers: list[int]):
        self.numbers = iter(numbers)

    def between(self, lo: int, hi: int) -> int:
        return lo + next(self.numbers) % (hi - lo + 1)

    def pick(self, items):
        return items[self.between(0, len(items) - 1)]


def prompt(c: Choices, model: Model, rng: random.Random, alphabet: int, max_len: int):
    """Fresh tokens, or a context seen before (whole, or cut anywhere, or cut near its end:
    the multi-turn case) with fresh tokens after it."""
    seen = model.history + [s["tokens"] for s in model.live.values()]
    fresh = c.between(1, max_len)
    if not seen or c.between(0, 3) == 0:
        return [rng.randrange(alphabet) for _ in range(fresh)]
    base = c.pick(seen)
    keep = c.between(0, len(base)) if c.between(0, 1) else max(len(base) - c.between(0, 3), 0)
    more = c.between(0, min(fresh, 2 * model.pool.block_size))
    tokens = base[:keep] + [rng.randrange(alphabet) for _ in range(more)]
    return tokens or [rng.randrange(alphabet)]


STEPS = st.lists(st.tuples(st.sampled_from(OPS),
                           st.lists(st.integers(0, 2**16 - 1), min_size=8, max_size=8)),
                 min_size=10, max_size=60)


@SETTINGS
@given(steps=STEPS, block_size=st.integers(1, 16), blocks=st.integers(1, 48),
       growth=st.sampled_from([0.0, 0.125, 0.5]), share=st.sampled_from([True, True, True, False]),
       alphabet=st.integers(1, 3), max_len=st.sampled_from([4, 20, 60, 300]),
       seed=st.integers(0, 2**32 - 1))
def test_pool_keeps_its_invariants_under_random_operations(steps, block_size, blocks, growth,
                                                           share, alphabet, max_len, seed):
    # The pool holds a few prompts of max_len at most: enough to share, evict and refuse.
    num_blocks = min(blocks, 3 * -(-max_len // block_size) + 2)
    pool = KVPool(num_blocks, block_size=block_size, share=share, growth=growth)
    model = Model(pool)
    rng = random.Random(seed)
    for op, numbers in steps:
        c = Choices(numbers)
        live = sorted(model.live)
        if op == "admit" or (op == "readmit" and not model.waiting):
            tokens = prompt(c, model, rng, alphabet, max_len)
            seq_id, model.next_id = model.next_id, model.next_id + 1
            model.admit(seq_id, tokens, len(tokens) + c.between(0, 2 * block_size))
        elif op == "readmit":
            seq_id = c.pick(sorted(model.waiting))
            tokens = model.waiting[seq_id]
            model.admit(seq_id, tokens, len(tokens) + 1)
        elif not live:
            continue
        elif op == "reset":
            gone = live[0]
            tokens, computed = model.live[gone]["tokens"], model.live[gone]["computed"]
            pool.reset()
            model.live.clear()
            model.check()
            before = snapshot(pool)
            pool.release(gone, tokens, computed)  # a sequence the pool no longer holds
            assert snapshot(pool) == before
        else:
            seq_id = c.pick(live)
            seq = model.live[seq_id]
            if op == "commit":
                done = c.between(seq["computed"], len(seq["tokens"]))
                pool.commit(seq_id, seq["tokens"], done)
                seq["computed"] = done
            elif op == "append":  # decode: room for more positions, then the tokens
                more = c.between(1, 2 * block_size)
                if model.reserve(seq_id, len(seq["tokens"]) + more):
                    seq["tokens"] = seq["tokens"] + [rng.randrange(alphabet) for _ in range(more)]
            elif op == "reserve":
                model.reserve(seq_id, len(seq["tokens"]) + c.between(0, 3 * block_size))
            else:
                done = c.between(seq["computed"], len(seq["tokens"]))
                model.release(seq_id, done, preempt=op == "preempt")
        model.check()

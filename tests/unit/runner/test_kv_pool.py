"""The KV block pool's accounting (runner/kv/pool.py): admission, growth, release, prefix
sharing by reference, adoption of a cached run, the partial-block copy, LRU eviction, reset and
the hash-collision guard. Block size 4 throughout, so a few tokens make a few blocks."""

from __future__ import annotations

import mlxr.runner.kv.pool as pool_module
from mlxr.runner.kv.pool import KVPool, Segment

BS = 4


def toks(n: int, base: int = 100) -> list[int]:
    """`n` distinct tokens starting at `base`."""
    return list(range(base, base + n))


def finished(pool: KVPool, seq_id: int, tokens: list[int], computed: int | None = None):
    """Admit a sequence, let it compute its whole context (or `computed` positions), release
    it; returns its run."""
    computed = len(tokens) if computed is None else computed
    admission = pool.admit(seq_id, tokens, len(tokens))
    assert admission is not None
    pool.release(seq_id, tokens, computed)
    return admission.run


def seg(s: Segment) -> tuple:
    return (s.run.run_id, s.start, s.end)


def served(admission) -> list[int]:
    """The tokens at the positions the admission says are cached, read from where it says they
    are: the shared segments, then the adopted run or the copied segment."""
    out: list[int] = []
    for s in admission.shared:
        out += s.run.tokens[s.start - s.run.start:s.end - s.run.start]
    if admission.adopted:
        run = admission.run
        out += run.tokens[len(out) - run.start:admission.cached - run.start]
    elif admission.copy is not None:
        c = admission.copy
        out += c.run.tokens[c.start - c.run.start:c.end - c.run.start]
    return out


def snapshot(pool: KVPool) -> tuple:
    runs = tuple(sorted((r.run_id, r.start, r.capacity, r.owner, tuple(r.tokens),
                         tuple(r.hashes), tuple(sorted(r.readers.items())))
                        for r in pool.runs.values()))
    registry = tuple(sorted((cid, run.run_id, i) for (run, i, cid) in pool.registry.values()))
    return (pool.used_blocks, runs, registry, tuple(sorted(pool.tables)), pool.hits,
            pool.queried, tuple(pool._freed))


# -- admission and growth ---------------------------------------------------------------------

def test_admission_allocates_the_blocks_for_its_reserve():
    pool = KVPool(10, block_size=BS)
    admission = pool.admit(1, toks(5), 9)
    assert admission.cached == 0 and admission.shared == [] and not admission.adopted
    assert admission.copy is None
    assert admission.run.start == 0 and admission.run.owner == 1
    assert admission.run.capacity == pool.blocks_for(9) == 3
    assert pool.used_blocks == 3 and pool.free_blocks == 7
    assert pool.table(1).run is admission.run


def test_admission_without_room_returns_none_and_changes_nothing():
    pool = KVPool(4, block_size=BS)
    pool.admit(1, toks(5), 12)
    before = snapshot(pool)
    assert pool.admit(2, toks(5, base=200), 8) is None
    assert snapshot(pool) == before
    assert 2 not in pool.tables


def test_fits_says_whether_the_whole_pool_could_hold_a_sequence():
    pool = KVPool(4, block_size=BS)
    assert pool.fits(16)
    assert not pool.fits(17)
    pool.admit(1, toks(5), 16)  # what is in use does not matter
    assert pool.fits(16)


def test_reserve_within_capacity_takes_nothing():
    pool = KVPool(10, block_size=BS)
    run = pool.admit(1, toks(5), 16).run
    assert pool.reserve(1, 16)
    assert run.capacity == 4 and pool.used_blocks == 4


def test_reserve_grows_by_the_need_plus_the_growth_fraction():
    pool = KVPool(20, block_size=BS, growth=0.5)
    run = pool.admit(1, toks(5), 16).run
    assert pool.reserve(1, 17)
    assert run.capacity == 4 + 1 + 2  # the block needed, and half the capacity more
    assert pool.used_blocks == 7


def test_reserve_falls_back_to_the_exact_need_when_the_extra_does_not_fit():
    pool = KVPool(5, block_size=BS, growth=0.5)
    run = pool.admit(1, toks(5), 16).run
    assert pool.reserve(1, 17)
    assert run.capacity == 5 and pool.free_blocks == 0


def test_reserve_that_cannot_be_met_returns_false_and_changes_nothing():
    pool = KVPool(5, block_size=BS, growth=0.5)
    pool.admit(1, toks(5), 16)
    pool.admit(2, toks(3, base=200), 4)
    before = snapshot(pool)
    assert not pool.reserve(1, 17)
    assert snapshot(pool) == before


def test_reserve_evicts_a_cached_run_to_grow():
    pool = KVPool(4, block_size=BS, growth=0)
    cached = finished(pool, 1, toks(8))
    run = pool.admit(2, toks(3, base=200), 8).run
    assert pool.reserve(2, 12)
    assert run.capacity == 3
    assert cached.run_id not in pool.runs and pool.drain_freed() == [cached.run_id]


# -- release ----------------------------------------------------------------------------------

def test_release_without_sharing_frees_the_run_at_once():
    pool = KVPool(10, block_size=BS, share=False)
    run = pool.admit(1, toks(9), 12).run
    pool.commit(1, toks(9), 9)
    pool.release(1, toks(9), 9)
    assert pool.used_blocks == 0 and pool.runs == {} and pool.tables == {}
    assert pool.drain_freed() == [run.run_id]
    assert pool.drain_freed() == []


def test_without_sharing_an_identical_prompt_is_not_served_from_cache():
    pool = KVPool(10, block_size=BS, share=False)
    pool.admit(1, toks(9), 9)
    pool.commit(1, toks(9), 9)
    admission = pool.admit(2, toks(9), 9)
    assert admission.cached == 0 and admission.shared == [] and admission.copy is None
    assert pool.registry == {}


def test_release_keeps_a_computed_run_cached():
    pool = KVPool(10, block_size=BS)
    run = finished(pool, 1, toks(9))
    assert run.run_id in pool.runs and run.owner is None
    assert pool.cached_blocks == run.capacity == 3
    assert pool.drain_freed() == []


def test_release_of_a_run_with_nothing_computed_frees_it():
    pool = KVPool(10, block_size=BS)
    run = finished(pool, 1, toks(9), computed=0)
    assert pool.runs == {} and pool.used_blocks == 0
    assert pool.drain_freed() == [run.run_id]


def test_release_of_an_unknown_sequence_is_ignored():
    pool = KVPool(10, block_size=BS)
    pool.admit(1, toks(9), 9)
    before = snapshot(pool)
    pool.release(7, toks(9), 9)
    assert snapshot(pool) == before


# -- sharing by reference ---------------------------------------------------------------------

def test_a_second_sequence_reads_a_finished_prefix_by_reference():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(14))  # three full blocks and a partial one
    used = pool.used_blocks
    prompt = toks(12) + [7, 8, 9]
    admission = pool.admit(2, prompt, 15)
    assert [seg(s) for s in admission.shared] == [(first.run_id, 0, 12)]
    assert admission.cached == 12 and not admission.adopted and admission.copy is None
    assert first.readers == {2: 12}
    assert admission.run is not first and admission.run.start == 12
    assert pool.used_blocks == used + pool.blocks_for(15 - 12)  # nothing for the shared part
    assert served(admission) == prompt[:12]


def test_release_of_a_reader_stops_its_reading():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(14))
    pool.admit(2, toks(12) + [7, 8, 9], 15)
    pool.release(2, toks(12) + [7, 8, 9], 15)
    assert first.readers == {}


def test_a_running_sequence_shares_only_its_committed_blocks():
    pool = KVPool(20, block_size=BS)
    prompt = toks(14)
    first = pool.admit(1, prompt, 16).run
    assert pool.admit(2, prompt + [1], 15).cached == 0  # nothing committed yet
    pool.release(2, prompt + [1], 0)
    pool.commit(1, prompt, 8)  # two full blocks
    admission = pool.admit(3, prompt + [1], 15)
    assert [seg(s) for s in admission.shared] == [(first.run_id, 0, 8)]
    assert admission.cached == 8 and admission.copy is None and not admission.adopted
    assert first.owner == 1 and first.readers == {3: 8}
    assert served(admission) == prompt[:8]


def test_a_whole_prompt_of_full_blocks_leaves_one_token_to_compute():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(12))
    admission = pool.admit(2, toks(12), 12)
    assert admission.cached == 11
    assert [seg(s) for s in admission.shared] == [(first.run_id, 0, 8)]
    assert admission.copy == Segment(first, 8, 11)
    assert admission.run.start == 8 and served(admission) == toks(11)


def test_a_prompt_equal_to_a_finished_context_leaves_one_token_to_compute():
    pool = KVPool(20, block_size=BS)
    finished(pool, 1, toks(10))
    admission = pool.admit(2, toks(10), 10)
    assert admission.cached == 9 and not admission.adopted


def test_a_different_prompt_is_not_served_from_cache():
    pool = KVPool(20, block_size=BS)
    finished(pool, 1, toks(14))
    admission = pool.admit(2, toks(14, base=500), 14)
    assert admission.cached == 0 and admission.shared == [] and admission.copy is None


def test_a_prompt_differing_in_its_first_block_shares_nothing_after_it():
    pool = KVPool(20, block_size=BS)
    finished(pool, 1, toks(14))
    prompt = [0] + toks(13)[1:] + [5]  # same later blocks, but chained to a different first
    admission = pool.admit(2, prompt, 15)
    assert admission.cached == 0 and admission.shared == []


# -- adoption ---------------------------------------------------------------------------------

def test_a_prompt_continuing_a_finished_context_adopts_its_run():
    pool = KVPool(20, block_size=BS)
    context = toks(10)
    first = finished(pool, 1, context + [55], computed=10)  # the last token was not computed
    prompt = context + [55, 56, 57]
    admission = pool.admit(2, prompt, 16)
    assert admission.adopted and admission.run is first and admission.copy is None
    assert admission.cached == 10 and admission.shared == []
    assert first.owner == 2 and first.capacity == 4
    assert pool.used_blocks == 4  # grown in place, no new run
    assert served(admission) == prompt[:10]


def test_adoption_reads_the_prefix_below_the_run_from_shared_segments():
    pool = KVPool(20, block_size=BS)
    base = finished(pool, 1, toks(9))  # not adoptable by what follows: it goes on with 108
    turn = toks(8) + [1, 2, 3]
    second = pool.admit(2, turn + [4], 12)
    assert [seg(s) for s in second.shared] == [(base.run_id, 0, 8)]
    pool.release(2, turn + [4], 11)
    prompt = turn + [4, 5]
    admission = pool.admit(3, prompt, 13)
    assert admission.adopted and admission.run is second.run and admission.cached == 11
    assert [seg(s) for s in admission.shared] == [(base.run_id, 0, 8)]
    assert all(s.end <= admission.run.start for s in admission.shared)
    assert base.readers == {3: 8}
    assert served(admission) == prompt[:11]


def test_a_run_read_up_to_the_adoption_point_is_still_adopted():
    pool = KVPool(20, block_size=BS)
    first = pool.admit(1, toks(8), 8).run
    pool.commit(1, toks(8), 8)
    pool.admit(2, toks(8) + [1], 9)  # reads both blocks of `first`, which is running
    pool.release(1, toks(8), 8)
    assert first.readers == {2: 8} and first.owner is None
    admission = pool.admit(3, toks(8) + [7, 7], 12)
    assert admission.adopted and admission.run is first and admission.cached == 8


def test_a_running_run_is_not_adopted():
    pool = KVPool(20, block_size=BS)
    first = pool.admit(1, toks(10), 12).run
    pool.commit(1, toks(10), 10)
    admission = pool.admit(2, toks(10) + [1, 2], 12)
    assert not admission.adopted and first.owner == 1
    assert admission.cached == 10 and admission.copy == Segment(first, 8, 10)


def test_adoption_keeps_the_blocks_below_the_write_point_registered():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(10))
    registered = dict(pool.registry)
    assert len(first.hashes) == 2
    admission = pool.admit(2, toks(10) + [1, 2, 3, 4], 14)
    assert admission.adopted
    assert pool.registry == registered and len(first.hashes) == 2


def test_an_adopter_registers_the_blocks_it_fills():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(10))
    prompt = toks(10) + [1, 2, 3, 4]
    pool.admit(2, prompt, 14)
    pool.commit(2, prompt, 13)
    assert len(first.hashes) == 3 and pool.registry[first.keys[2]] == (first, 2, first.hashes[2])
    later = pool.admit(3, prompt[:12] + [9], 13)
    assert later.cached == 12 and [seg(s) for s in later.shared] == [(first.run_id, 0, 12)]


# -- the partial-block copy -------------------------------------------------------------------

def test_a_prompt_diverging_in_a_partial_block_copies_the_matched_part():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(11))  # two full blocks and three positions
    prompt = toks(9) + [0, 0]
    admission = pool.admit(2, prompt, 11)
    assert admission.copy == Segment(first, 8, 9)
    assert admission.cached == 9 and not admission.adopted
    assert [seg(s) for s in admission.shared] == [(first.run_id, 0, 8)]
    assert admission.run.start == 8 and admission.run is not first
    assert served(admission) == prompt[:9]


def test_the_copied_from_run_keeps_its_tokens_for_a_later_exact_continuation():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(11))
    pool.admit(2, toks(9) + [0, 0], 11)
    assert first.tokens == toks(11)
    again = pool.admit(3, toks(11) + [5], 12)
    assert again.adopted and again.run is first and again.cached == 11


def test_a_copy_from_a_run_without_full_blocks_starts_at_zero():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(3))
    admission = pool.admit(2, toks(2) + [0, 0], 4)
    assert admission.copy == Segment(first, 0, 2) and admission.cached == 2
    assert admission.shared == [] and admission.run.start == 0


def test_a_copy_does_not_make_its_source_a_reader():
    pool = KVPool(20, block_size=BS)
    first = finished(pool, 1, toks(11))
    pool.admit(2, toks(9) + [0, 0], 11)
    assert first.readers == {2: 8}  # the shared full blocks only


# -- LRU eviction -----------------------------------------------------------------------------

def test_admission_evicts_the_least_recently_used_cached_run():
    pool = KVPool(6, block_size=BS)
    a = finished(pool, 1, toks(8, base=100))
    b = finished(pool, 2, toks(8, base=200))
    c = finished(pool, 3, toks(8, base=300))
    assert pool.free_blocks == 0
    pool.admit(4, toks(8, base=400), 8)
    assert set(pool.runs) == {b.run_id, c.run_id, pool.table(4).run.run_id}
    assert pool.drain_freed() == [a.run_id]


def test_a_prefix_hit_makes_a_run_recently_used():
    pool = KVPool(7, block_size=BS)
    a = finished(pool, 1, toks(8, base=100))
    b = finished(pool, 2, toks(8, base=200))
    c = finished(pool, 3, toks(8, base=300))
    finished(pool, 4, toks(4, base=100) + [1])  # reads a's first block, then lets go
    assert pool.drain_freed() == []
    pool.admit(5, toks(8, base=400), 8)  # needs 2 blocks, 0 free (the hit's run is cached)
    gone = pool.drain_freed()
    assert a.run_id not in gone and b.run_id in gone
    assert a.run_id in pool.runs and c.run_id in pool.runs


def test_eviction_takes_as_many_runs_as_needed_oldest_first():
    pool = KVPool(6, block_size=BS)
    a = finished(pool, 1, toks(8, base=100))
    b = finished(pool, 2, toks(8, base=200))
    c = finished(pool, 3, toks(8, base=300))
    pool.admit(4, toks(16, base=400), 16)
    assert pool.drain_freed() == [a.run_id, b.run_id]
    assert c.run_id in pool.runs


def test_runs_that_are_read_or_owned_are_never_evicted():
    pool = KVPool(6, block_size=BS)
    read = finished(pool, 1, toks(8, base=100))
    reader = pool.admit(2, toks(4, base=100) + [1, 2], 6)  # reads read's first block
    owned = pool.admit(3, toks(8, base=300), 12).run
    assert read.readers == {2: 4} and pool.free_blocks == 0
    before = snapshot(pool)
    assert pool.admit(4, toks(4, base=400), 4) is None
    assert snapshot(pool) == before
    assert {read.run_id, reader.run.run_id, owned.run_id} <= set(pool.runs)
    assert pool.drain_freed() == []


def test_an_evicted_run_is_no_longer_matched():
    pool = KVPool(3, block_size=BS)
    a = finished(pool, 1, toks(8, base=100))
    finished(pool, 2, toks(12, base=200), computed=0)  # evicts a, then frees its own run
    assert pool.drain_freed() == [a.run_id, a.run_id + 1]
    again = pool.admit(3, toks(8, base=100) + [1], 9)
    assert again.cached == 0 and again.shared == [] and again.copy is None


def test_an_evicted_runs_blocks_leave_the_registry():
    pool = KVPool(4, block_size=BS)
    a = finished(pool, 1, toks(8, base=100))
    keys = list(a.keys)
    assert keys and all(k in pool.registry for k in keys)
    pool.admit(2, toks(16, base=200), 16)
    assert pool.drain_freed() == [a.run_id]
    assert not any(k in pool.registry for k in keys)


def test_admission_never_evicts_the_runs_it_reads():
    pool = KVPool(5, block_size=BS)
    b = finished(pool, 1, toks(10, base=200))  # the least recently used
    a = finished(pool, 2, toks(8, base=100))
    # reads b's two full blocks and needs two blocks more: a goes, b (older) stays
    admission = pool.admit(3, toks(8, base=200) + [1] * 5, 13)
    assert admission is not None and admission.cached == 8
    assert [seg(s) for s in admission.shared] == [(b.run_id, 0, 8)]
    assert b.run_id in pool.runs and pool.drain_freed() == [a.run_id]


# -- reset, counters, collisions --------------------------------------------------------------

def test_reset_frees_everything():
    pool = KVPool(10, block_size=BS)
    cached = finished(pool, 1, toks(8))
    running = pool.admit(2, toks(4, base=500), 8).run
    pool.reset()
    assert pool.used_blocks == 0 and pool.runs == {} and pool.tables == {}
    assert pool.registry == {} and pool.tails == {}
    assert sorted(pool.drain_freed()) == sorted([cached.run_id, running.run_id])
    pool.release(2, toks(4, base=500), 4)  # the sequence the pool no longer holds
    assert pool.runs == {} and pool.drain_freed() == []
    assert pool.admit(3, toks(8) + [1], 9).cached == 0


def test_hits_and_queried_count_served_and_looked_up_positions():
    pool = KVPool(10, block_size=BS)
    finished(pool, 1, toks(8))
    assert (pool.hits, pool.queried) == (0, 8)
    pool.admit(2, toks(8) + [1, 2], 10)
    assert (pool.hits, pool.queried) == (8, 18)
    pool.admit(3, toks(4, base=500), 4)
    assert (pool.hits, pool.queried) == (8, 22)


def test_a_refused_admission_counts_nothing():
    pool = KVPool(2, block_size=BS)
    pool.admit(1, toks(8), 8)
    assert pool.admit(2, toks(8), 8) is None
    assert (pool.hits, pool.queried) == (0, 8)


def test_a_different_first_block_is_not_served():
    pool = KVPool(20, block_size=BS)
    finished(pool, 1, toks(10, base=100))
    admission = pool.admit(2, toks(10, base=500), 10)
    assert admission.cached == 0 and admission.shared == [] and admission.copy is None
    assert not admission.adopted


# Registry keys hold the block's tokens and the chain id of the prefix before it, so equal
# blocks at other positions, or after other prefixes, never match (no hash to collide).
def test_an_equal_block_at_another_position_is_not_served():
    pool = KVPool(20, block_size=BS)
    finished(pool, 1, [1] * 4 + [2] * 4)
    prompt = [1] * 4 + [1] * 4 + [9]
    admission = pool.admit(2, prompt, len(prompt))
    assert served(admission) == prompt[:admission.cached]


def test_a_run_after_another_prefix_is_not_adopted():
    pool = KVPool(20, block_size=BS)
    finished(pool, 1, [1] * 4)
    finished(pool, 2, [5] * 4 + [3, 3])
    prompt = [1] * 4 + [3, 3, 9]
    admission = pool.admit(3, prompt, len(prompt))
    assert served(admission) == prompt[:admission.cached]

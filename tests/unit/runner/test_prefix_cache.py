from mlxr.runner.kv.prefix_cache import PrefixCache


def test_longest_prefix_wins_and_leaves_one_token():
    cache = PrefixCache(max_bytes=10_000, min_tokens=2)
    cache.store(list(range(10)), "ten", 10)
    cache.store([0, 1, 2, 50, 51], "other", 10)
    hit = cache.lookup(list(range(8)) + [77])
    assert hit.entry.payload == "ten" and hit.length == 8
    exact = cache.lookup(list(range(10)))
    assert exact.length == 9, "an exact hit must leave a token to compute"


def test_extension_replaces_prefix_entry_and_prefix_of_existing_is_not_stored():
    cache = PrefixCache(max_bytes=10_000, min_tokens=2)
    cache.store([1, 2, 3], "short", 3)
    cache.store([1, 2, 3, 4, 5], "long", 5)
    assert [e.payload for e in cache.entries] == ["long"] and cache.nbytes == 5
    assert not cache.store([1, 2, 3], "again", 3)
    assert cache.nbytes == 5


def test_lru_eviction_under_byte_budget():
    cache = PrefixCache(max_bytes=25, min_tokens=2)
    cache.store([1, 1, 1], "a", 10)
    cache.store([2, 2, 2], "b", 10)
    cache.lookup([1, 1, 1, 9])  # a is now more recent than b
    cache.store([3, 3, 3], "c", 10)
    assert sorted(e.payload for e in cache.entries) == ["a", "c"]
    assert cache.nbytes == 20


def test_short_matches_are_misses():
    cache = PrefixCache(max_bytes=100, min_tokens=4)
    cache.store([1, 2, 3, 4, 5, 6], "x", 6)
    assert cache.lookup([1, 2, 3, 9, 9]) is None
    assert cache.lookup([1, 2, 3, 4, 9]).length == 4

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


def test_a_state_that_cannot_serve_a_shorter_prefix_keeps_that_prefixs_entry():
    # A sliding-window model: a state taken at length n holds positions n - 4 .. n - 1 only,
    # so it serves lengths from n - 1 down to n - 3 (a window of 3 ending there), no shorter.
    def serves(payload, length):
        n = payload[1]
        return n - 4 <= length - 3 and length <= n

    cache = PrefixCache(max_bytes=10_000, min_tokens=2)
    prompt = list(range(10))
    cache.store(prompt, ("prompt", 10), 10, serves)
    cache.store(prompt + [20, 21, 22], ("reply", 13), 13, serves)
    assert [e.payload[0] for e in cache.entries] == ["prompt", "reply"], "both kept"
    again = cache.lookup(prompt, serves)  # the same prompt: 9 positions from the prompt's state
    assert again.entry.payload[0] == "prompt" and again.length == 9
    turn = cache.lookup(prompt + [20, 21, 22, 30], serves)
    assert turn.entry.payload[0] == "reply" and turn.length == 13
    # a later, longer state that does serve the reply's length replaces it
    cache.store(prompt + [20, 21, 22, 23], ("longer", 14), 14, serves)
    assert [e.payload[0] for e in cache.entries] == ["prompt", "longer"]
    # and the prompt's state, stored again, is not a prefix the others serve: refreshed, kept
    assert not cache.store(prompt, ("prompt again", 10), 10, serves)
    assert [e.payload[0] for e in cache.entries] == ["prompt", "longer"]

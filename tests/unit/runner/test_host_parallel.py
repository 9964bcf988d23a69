"""Element-wise work split by rows across threads (runner/host_parallel.py): every row once,
in order, each range in its own call; small work stays in the caller's thread; a failure is
raised only after every range has finished."""

from __future__ import annotations

import threading
import time

import pytest

from mlxr.runner import host_parallel


@pytest.mark.parametrize("rows,parts", [(1, 4), (7, 2), (10, 3), (512, 8), (3, 5)])
def test_ranges_cover_every_row_once_in_order(rows, parts):
    spans = host_parallel.ranges(rows, parts)
    assert len(spans) == min(rows, parts)
    assert [r for a, b in spans for r in range(a, b)] == list(range(rows))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1


def test_big_work_runs_every_range_and_uses_other_threads():
    seen, threads = [], set()

    def fn(a, b):
        time.sleep(0.02)  # long enough that the helpers are all busy at once
        seen.append((a, b))
        threads.add(threading.get_ident())

    host_parallel.for_rows(100, 1 << 20, fn, parts=4)
    assert sorted(seen) == host_parallel.ranges(100, 4)
    assert threading.get_ident() in threads and len(threads) > 1


def test_small_work_stays_in_the_callers_thread_as_one_range():
    calls = []
    host_parallel.for_rows(100, host_parallel.MIN_ELEMENTS - 1,
                           lambda a, b: calls.append((a, b, threading.get_ident())), parts=4)
    assert calls == [(0, 100, threading.get_ident())]
    calls.clear()
    host_parallel.for_rows(100, 1 << 20, lambda a, b: calls.append((a, b)), parts=1)
    assert calls == [(0, 100)]


def test_a_failing_range_is_raised_after_the_others_finish():
    finished = []

    def fn(a, b):
        if a == 0:
            raise ValueError("range 0")
        time.sleep(0.05)
        finished.append(a)

    with pytest.raises(ValueError, match="range 0"):
        host_parallel.for_rows(40, 1 << 20, fn, parts=4)
    assert sorted(finished) == [10, 20, 30]  # none was still running when it was raised


def test_workers_are_this_processs_cores_capped():
    assert 1 <= host_parallel.workers() <= host_parallel.MAX_WORKERS

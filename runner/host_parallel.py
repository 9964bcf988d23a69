"""Element-wise numpy work split by rows across the CPU's cores.

numpy's ufuncs run on one core, and so does MLX's CPU element-wise work, so while a prefill
chunk's softmax (runner/kv/host_attention.py) or SwiGLU (runner/host_swiglu.py) runs, the
other cores wait: with the attention products around the softmax, those are 40-60% of a
512-1,024-token chunk's time on the 30M model. numpy lets go of the interpreter lock inside a
ufunc's loop, so threads that each take a range of rows run at once. Measured on the 2-core
Zen 4 EPYC (docs/PERFORMANCE.md, "Prefill on every core"): a 512 x 2,048 softmax over 2 x 2
heads in 3.3 ms against 5.9 ms.

Invariants:
- `for_rows(rows, elements, fn)` returns after fn has run once over every row range; if a
  range raised, it raises that exception, still only after every range has finished.
- Ranges are contiguous, in order, cover 0..rows exactly once, and do not overlap, so fn may
  write its own rows in place.
- Work under MIN_ELEMENTS, or a machine of one core, runs in the caller's thread as one range.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

# Below this many elements a thread hand-off (tens of microseconds) costs more than it saves.
MIN_ELEMENTS = 1 << 16
MAX_WORKERS = 8

_pool: ThreadPoolExecutor | None = None


@functools.lru_cache(maxsize=1)
def workers() -> int:
    """How many ranges to split into: this process's cores (read once), at most
    MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """`rows` split into at most `parts` contiguous, nearly equal, non-empty ranges."""
    parts = max(1, min(parts, rows))
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, workers() - 1), thread_name_prefix="mlxr-host")
    return _pool


def for_rows(rows: int, elements: int, fn: Callable[[int, int], None],
             parts: int | None = None) -> None:
    """Call fn(start, end) over ranges of `rows` (a total of `elements` elements), in
    parallel where that is worth it; the caller's thread takes the last range."""
    parts = workers() if parts is None else parts
    if parts <= 1 or elements < MIN_ELEMENTS or rows < 2:
        fn(0, rows)
        return
    spans = ranges(rows, parts)
    futures = [_executor().submit(fn, a, b) for a, b in spans[:-1]]
    errors: list[BaseException] = []
    try:
        fn(*spans[-1])
    except BaseException as exc:  # re-raised below, once every range has finished
        errors.append(exc)
    errors += [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]

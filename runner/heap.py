"""The C heap under MLX's CPU buffers (glibc only).

MLX allocates a CPU array's buffer with malloc. glibc serves a large request (past a threshold
that grows to 32 MB at most) with a mapping of its own and unmaps it when freed, so a prefill
chunk over a long context, whose attention scores take tens of megabytes a layer, faulted its
buffers' pages in afresh in every layer of every chunk: copying one 49 MB score grid into MLX
took 28 ms and 12,000 page faults, against 4 ms once the memory is reused. `keep_freed` raises
glibc's mmap and trim thresholds, so freed buffers stay in the heap for the next chunk;
`release_freed` gives freed memory back to the system (malloc_trim), which the engine does
once it has been idle for a while. A 6,000-token prompt was read 27-34% faster; the runner's
RSS was 50-80 MiB higher until then (docs/PERFORMANCE.md, "Long prompts and the C heap").

Both are no-ops, returning False, where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

# Requests up to this size come from the heap, and up to this much free memory stays at its
# top: enough for a 512-token chunk's scores over 8,000 positions and more (4 heads: 65 MB).
THRESHOLD_BYTES = 256 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h


@functools.lru_cache(maxsize=1)
def _glibc() -> Any:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt",
                                                  "malloc_trim")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def keep_freed(threshold: int = THRESHOLD_BYTES) -> bool:
    """Keep freed buffers of up to `threshold` bytes for reuse; True where that took."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))


def release_freed() -> bool:
    """Give the heap's free memory back to the system; True where some was."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False

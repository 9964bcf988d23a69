"""A few rows times a float32 weight stored (out, in), through a small C kernel
(shared/assets/row_kernel.c) that reads the weight once for up to 16 rows: the decode head
(runner/host_head.py) and the numpy decode body's products (runner/host_ops.py `Gemm`).

On the 2-core Zen 4 EPYC the 30M model's 151,680 x 192 head took 4.2-7 ms for 1-16 rows this
way, against 8.6-13.5 ms for MLX's product (OpenBLAS's sgemm) on a transposed copy and 4 ms a
row for OpenBLAS's sgemv (docs/PERFORMANCE.md, "The decode step in C"). That head is most of a
decode step of this model.

The body's products go through it too, though they are no faster: OpenBLAS's threads spin for
a while after each of its threaded products, and with them spinning on both cores the head's
two threads took twice as long (a 16-row step: 20 ms against 13). So a decode step keeps
OpenBLAS's threads asleep, and a weight under SPLIT_ELEMENTS (all of a small body's) is one
thread's work: handing it to a second thread costs more than it saves.

The kernel is compiled on first use into the cache directory (shared/native.py); where there
is no C compiler, or the build fails, `RowKernel.load` returns None and the runner keeps
OpenBLAS and MLX. runner/host_head.py decides whether it is used, after a probe against the
model's own head.

Invariants: `product` writes every element of its (rows, out) output; the calls into C let go
of the interpreter lock (ctypes), so a large weight's ranges run at once on their threads.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from mlxr.runner import host_parallel
from mlxr.shared import native

MAX_LANES = 16  # rows one pass over the weight serves
TILE = 8  # weight rows the kernel takes at a time: ranges start on a multiple
SPLIT_ELEMENTS = 1 << 20  # smaller weights (4 MB) are one thread's work


class RowKernel:
    def __init__(self, fn):
        self._fn = fn

    @classmethod
    @functools.lru_cache(maxsize=1)
    def load(cls, cache_dir: Path | None = None) -> "RowKernel | None":
        """The kernel, built into `cache_dir` (default: the settings' cache directory) if
        need be; None where it cannot be built or loaded (logged)."""
        found = native.built_functions(native.row_kernel_library, cache_dir,
                                       ["mlxr_row_kernel"],
                                       "row kernel (using OpenBLAS and MLX instead)")
        if found is None:
            return None
        fn, = found
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_long,
                       ctypes.c_long]
        return cls(fn)

    def product(self, weight: np.ndarray, rows: np.ndarray, out: np.ndarray,
                split_elements: int = SPLIT_ELEMENTS) -> None:
        """out (B, out) = rows (B, in) @ weight.T, for a C-contiguous float32 weight (out, in)
        and float32 rows; out C-contiguous float32. One pass over the weight for every 16
        rows; a weight of `split_elements` or more is shared among the cores."""
        for start in range(0, rows.shape[0], MAX_LANES):
            block = rows[start:start + MAX_LANES]
            self._pass(weight, block, out[start:start + block.shape[0]], split_elements)

    def _pass(self, weight: np.ndarray, block: np.ndarray, out: np.ndarray,
              split_elements: int) -> None:
        (width, depth), b = weight.shape, block.shape[0]
        lanes = 4 if b <= 4 else 8 if b <= 8 else 16
        xt = np.zeros((depth, lanes), dtype=np.float32)
        xt[:, :b] = block.T
        w, x, o, fn = weight.ctypes.data, xt.ctypes.data, out.ctypes.data, self._fn

        def part(a: int, z: int) -> None:
            if fn(w, depth, x, lanes, o, width, b, a * TILE, min(z * TILE, width)) != 0:
                raise ValueError("row kernel refused its arguments")

        host_parallel.for_rows(-(-width // TILE), width * depth, part,
                               parts=None if width * depth >= split_elements else 1)

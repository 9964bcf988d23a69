"""One decode position's attention over a row's float32 keys and values in C
(shared/assets/attend_kernel.c), for the numpy decode body (runner/host_body.py).

numpy's version (runner/kv/host_attention.py `attend_position`) makes two products a key head
and piece and three passes for the softmax. At a few hundred positions that was call overhead;
at a few thousand it read the keys and values at about a third of this kernel's speed. A 0.6B
model's decode step at 3,000 positions took 179 ms, of which about 140 were attention
(docs/PERFORMANCE.md, "Attention for one position in C").

The key heads are split across the cores by the quantized kernel's workers (`mlxr_parts` in
shared/assets/quant_kernel.c: one pool of spinning threads, not a second one beside it) once a
call reads POOL_FLOATS of keys and values; a step's layers come every few tens of
microseconds, so a hand-off there costs a few. Where that library is not built, Python's
threads split it from SPLIT_FLOATS (a hand-off of tens of microseconds). The calls into C let
go of the interpreter lock (ctypes).

Where there is no C compiler or the build fails, `AttendKernel.load` returns None and the body
keeps numpy's attention. `__call__` returns None for pieces it does not take (not float32, or
rows of a piece not contiguous), and the caller then does the same.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from mlxr.runner import host_parallel
from mlxr.runner.quant_kernel import QuantKernel
from mlxr.shared import native

MAX_GROUP = 64  # query heads a key head serves (the C side's limit)
# From this many floats of keys and values a call is split across the cores: by the quantized
# kernel's workers (28 layers of 8 key heads of 128 at 256 positions, each layer's context in
# memory: 6.1 -> 2.7 ms a token on two cores); where they are not there, by Python's threads,
# whose hand-off costs more than the half it saves below SPLIT_FLOATS.
POOL_FLOATS = 1 << 15
SPLIT_FLOATS = 1 << 20


class AttendKernel:
    def __init__(self, fn, job: int | None = None, parts=None, rows_job: int | None = None,
                 decode=None, decode_layout: tuple[int, ...] = (), softmax=None):
        self._fn = fn
        self._softmax = softmax  # mlxr_softmax_rows: a prefill tile's (`softmax_rows`)
        # mlxr_decode_row: one row's whole decode step (runner/decode_row.py), and the sizes
        # of the table it reads (mlxr_decode_layout); None without the quantized kernel's
        # workers
        self.decode = decode
        self.decode_layout = decode_layout
        self._job = job  # the address of mlxr_attend_heads, a job for `parts`
        self._rows_job = rows_job  # mlxr_attend_rows's
        self._parts = parts  # the quantized kernel's mlxr_parts, or None

    @classmethod
    @functools.lru_cache(maxsize=1)
    def load(cls, cache_dir: Path | None = None) -> "AttendKernel | None":
        """The kernel, built into `cache_dir` (default: the settings' cache directory) if
        need be; None where it cannot be built or loaded (logged)."""
        found = native.built_functions(
            native.attend_kernel_library, cache_dir,
            ["mlxr_attend_position", "mlxr_attend_heads", "mlxr_attend_rows",
             "mlxr_decode_row", "mlxr_decode_layout", "mlxr_softmax_rows"],
            "attention kernel (using numpy instead)")
        if found is None:
            return None
        fn, job, rows, decode, layout, softmax = found
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                       ctypes.c_long, ctypes.c_long]
        softmax.restype = None
        softmax.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 6
        pool = QuantKernel.load(cache_dir)
        if pool is None:
            return cls(fn, softmax=softmax)
        decode.restype = ctypes.c_int
        decode.argtypes = [ctypes.c_void_p] * 7
        sizes = np.zeros(5, dtype=np.int64)
        layout.restype = None
        layout(ctypes.c_void_p(sizes.ctypes.data))
        return cls(fn, address(job), pool.parts, address(rows), decode, tuple(sizes.tolist()),
                   softmax)

    def softmax_rows(self, scores: np.ndarray, first: int, period: int) -> None:
        """Softmax in place over each row of `scores` (rows, cols) float32 with contiguous
        rows, row r over its first min(cols, first + r % period) columns, the rest set to 0
        (a causal mask: runner/host_prefill.py); the rows split across the cores."""
        rows, cols = scores.shape
        if scores.dtype != np.float32 or scores.strides[1] != 4 or first < 1:
            raise ValueError("softmax_rows takes float32 rows of contiguous floats")
        fn, address, stride = self._softmax, scores.ctypes.data, scores.strides[0] >> 2
        host_parallel.for_rows(rows, scores.size,
                               lambda a, z: fn(address, stride, cols, first, period, a, z))

    def __call__(self, q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                 group: int) -> np.ndarray | None:
        """`attend_position(q, keys, values, group)`: q (heads, dim) already scaled; keys and
        values pieces (kv_heads, n, dim) in position order. (heads, dim), or None where a
        piece is not laid out as the kernel reads it."""
        kv_heads, dim = keys[0].shape[0], q.shape[-1]
        if not 1 <= group <= MAX_GROUP or dim % 8 or q.dtype != np.float32:
            return None
        entries = piece_table(keys, values, kv_heads, dim)
        if entries is None:
            return None
        pieces = len(keys)
        positions = sum(entries[2 * pieces:3 * pieces])
        table = np.array(entries, dtype=np.int64)
        q = np.ascontiguousarray(q)
        heads = kv_heads * group
        space = np.empty(heads * (dim + positions), dtype=np.float32)  # out, then the scores
        fn, qp, tp, op = self._fn, q.ctypes.data, table.ctypes.data, space.ctypes.data
        sp = op + 4 * heads * dim
        floats = 2 * kv_heads * positions * dim
        if self._parts is not None and floats >= POOL_FLOATS:
            args = np.array([qp, group, dim, pieces, tp, sp, positions, op, 0], dtype=np.int64)
            self._parts(self._job, args.ctypes.data, kv_heads, host_parallel.workers())
            if args[8] != 0:
                raise ValueError("attention kernel refused its arguments")
            return space[:heads * dim].reshape(heads, dim)

        def part(a: int, z: int) -> None:
            if fn(qp, group, dim, pieces, tp, sp, positions, op, a, z) != 0:
                raise ValueError("attention kernel refused its arguments")

        if floats < SPLIT_FLOATS:
            part(0, kv_heads)
        else:
            host_parallel.for_rows(kv_heads, floats, part)
        return space[:heads * dim].reshape(heads, dim)


    def rows(self, q: np.ndarray, keys: list[list[np.ndarray]],
             values: list[list[np.ndarray]], group: int) -> np.ndarray | None:
        """Several rows' `__call__` in one call, split across the cores by (row, key head):
        q (rows, heads, dim), already scaled; keys[r] and values[r] row r's pieces. (rows,
        heads * dim), or None where the quantized kernel's workers are not there or a piece
        is not laid out as the kernel reads it (the caller then goes row by row)."""
        n, heads, dim = q.shape
        kv_heads = keys[0][0].shape[0]
        if self._parts is None or not 1 <= group <= MAX_GROUP or dim % 8 or \
                q.dtype != np.float32 or heads != kv_heads * group:
            return None
        q = np.ascontiguousarray(q)
        out = np.empty((n, heads * dim), dtype=np.float32)
        lengths = [sum(k.shape[1] for k in row) for row in keys]
        scores = np.empty(heads * sum(lengths), dtype=np.float32)
        qp, op, sp = q.ctypes.data, out.ctypes.data, scores.ctypes.data
        tables: list[int] = []
        header = [n, group, dim, kv_heads, 0]
        for r, (row_keys, row_values) in enumerate(zip(keys, values)):
            entries = piece_table(row_keys, row_values, kv_heads, dim)
            if entries is None:
                return None
            # the table's address is filled in below, once the array exists
            header += [qp + 4 * r * heads * dim, op + 4 * r * heads * dim, sp, len(row_keys),
                       len(tables), lengths[r]]
            sp += 4 * heads * lengths[r]
            tables += entries
        args = np.array(header + tables, dtype=np.int64)
        base = args.ctypes.data + 8 * len(header)
        args[9:len(header):6] = base + 8 * args[9:len(header):6]
        self._parts(self._rows_job, args.ctypes.data, n * kv_heads, host_parallel.workers())
        if args[4] != 0:
            raise ValueError("attention kernel refused its arguments")
        return out


def piece_table(keys: list[np.ndarray], values: list[np.ndarray], kv_heads: int,
           dim: int) -> list[int] | None:
    """A row's pieces as the kernel's table reads them: the keys' addresses, the values',
    the lengths, the keys' head strides and the values' (in floats), a list of each; None
    where a piece is not laid out as the kernel reads it."""
    pieces = len(keys)
    entries = [0] * (5 * pieces)
    for i, (k, v) in enumerate(zip(keys, values)):
        if not (_rows(k, kv_heads, dim) and _rows(v, kv_heads, dim)) or \
                k.shape[1] != v.shape[1]:
            return None
        entries[i], entries[pieces + i] = k.ctypes.data, v.ctypes.data
        entries[2 * pieces + i] = k.shape[1]
        entries[3 * pieces + i], entries[4 * pieces + i] = k.strides[0] >> 2, v.strides[0] >> 2
    return entries


def address(fn) -> int:
    """A ctypes function's address, to hand it to C as a job."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def _rows(piece: np.ndarray, kv_heads: int, dim: int) -> bool:
    """Is `piece` float32 (kv_heads, n, dim) with each position's dim floats contiguous?"""
    return piece.dtype == np.float32 and piece.ndim == 3 and piece.shape[0] == kv_heads and \
        piece.shape[2] == dim and piece.strides[2] == 4 and piece.strides[1] == 4 * dim and \
        piece.strides[0] % 4 == 0

"""numpy building blocks the host bodies share (runner/host_body.py for decode rows,
runner/host_prefill.py for prefill chunks): single-precision products through the OpenBLAS MLX
uses, and RoPE as per-position tables read from the model's own rope."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxr.runner.host_head import NO_TRANS, ROW_MAJOR, TRANS
from mlxr.runner.quant_kernel import QuantKernel, QuantizedWeight
from mlxr.runner.row_kernel import RowKernel

KERNEL_ROWS = 64  # a decode batch's rows; a prefill chunk's longer products stay OpenBLAS's
# More rows than this times a quantized weight: dequantized, then OpenBLAS's sgemm. Up to it,
# the quantized kernel in passes of 16 rows: for a 3,072 x 1,024 4-bit layer, 32 rows took
# 1.4 ms against 3.0 dequantized, 128 rows 5.5 against 5.8, 256 rows 12.3 against 10.7
# (docs/PERFORMANCE.md, "The quantized kernel, tuned").
QUANT_ROWS = 128
# OpenBLAS runs an sgemm of at most this m * n * k on the calling thread (interface/gemm.c:
# SMP_THRESHOLD_MIN 65,536 x GEMM_MULTITHREAD_THRESHOLD 4).
SERIAL_MNK = 65536 * 4


class Gemm:
    """Row-major single-precision products through `cblas_sgemm`, else numpy's matmul; a
    Linear's product for up to KERNEL_ROWS rows through the row kernel where there is one
    (runner/row_kernel.py: it keeps OpenBLAS's threads asleep during decode steps), and a
    quantized Linear's for any number through the quantized kernel."""

    def __init__(self, sgemm, kernel: RowKernel | None = None, quant: QuantKernel | None = None):
        self._sgemm = sgemm
        self.kernel = kernel
        self.quant = quant  # for quantized weights (runner/quant_kernel.py), any row count
        self._scratch = np.empty(0, dtype=np.float32)  # a quantized weight, dequantized
        # Set by the model step while rows decode: each attention product then stays on the
        # engine's thread, so OpenBLAS's threads, once woken, do not spin beside the row
        # kernel's (a head of 8 rows took 13 ms after a chunk's products instead of 7).
        self.serial = False

    def linear(self, x: np.ndarray, linear) -> np.ndarray:
        """x (n, in) times the transpose of a Linear's weight (out, in), plus its bias."""
        weight, bias = (linear.weight, linear.bias) if hasattr(linear, "weight") else linear
        if isinstance(weight, QuantizedWeight):
            if x.shape[0] > QUANT_ROWS and self._sgemm is not None:
                weight = self._dequantized(weight)
            else:
                x = np.ascontiguousarray(x, dtype=np.float32)
                out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
                self.quant.product(weight, x, out)
                return out if bias is None else out + bias
        if self.kernel is not None and x.shape[0] <= KERNEL_ROWS and \
                weight.flags.c_contiguous and weight.dtype == np.float32:
            x = np.ascontiguousarray(x, dtype=np.float32)
            out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
            self.kernel.product(weight, x, out)
        elif self._sgemm is None or not weight.flags.c_contiguous:
            out = x @ weight.T
        else:
            x = np.ascontiguousarray(x)
            n, k = x.shape
            rows = weight.shape[0]
            out = np.empty((n, rows), dtype=np.float32)
            self._sgemm(ROW_MAJOR, NO_TRANS, TRANS, n, rows, k, 1.0, x.ctypes.data, k,
                        weight.ctypes.data, k, 0.0, out.ctypes.data, rows)
        if bias is not None:
            out += bias
        return out

    def _dequantized(self, weight: QuantizedWeight) -> np.ndarray:
        """The weight's float32 values in this Gemm's scratch buffer (valid until the next
        call): one buffer for every layer, so a chunk does not fault in fresh pages."""
        size = weight.shape[0] * weight.shape[1]
        if self._scratch.size < size:
            self._scratch = np.empty(size, dtype=np.float32)
        out = self._scratch[:size].reshape(weight.shape)
        self.quant.dequantize(weight, out)
        return out

    def product(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool,
                alpha: float = 1.0, accumulate: bool = False) -> None:
        """out (m, n) = alpha * a (m, k) @ b (k, n), or b's transpose (n, k), plus out when
        `accumulate`. Every argument is a 2-D view whose rows are contiguous. While `serial`,
        in pieces that OpenBLAS runs on the calling thread."""
        if self._sgemm is None or not all(rows_contiguous(m) for m in (a, b, out)):
            result = alpha * (a @ (b.T if transpose_b else b))
            if accumulate:
                out += result
            else:
                out[...] = result
            return
        self._sgemm_pieces(a, b, out, transpose_b, alpha, 1.0 if accumulate else 0.0)

    def _sgemm_pieces(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool,
                      alpha: float, beta: float) -> None:
        """One sgemm call, or while `serial`, as many as keep each under SERIAL_MNK: slices
        of the largest dimension, addressed by pointer arithmetic (halving it recursively,
        with views and pointers made at every level, cost a 16-token chunk about 0.6 ms more
        at 1,000 positions). Where one unit of that dimension is itself over SERIAL_MNK, the
        product is halved along it and each half cut again."""
        m, k = a.shape
        n = b.shape[0] if transpose_b else b.shape[1]
        lda, ldb, ldo = a.strides[0] // 4, b.strides[0] // 4, out.strides[0] // 4
        pa, pb, po = a.ctypes.data, b.ctypes.data, out.ctypes.data
        tb = TRANS if transpose_b else NO_TRANS
        call = self._sgemm
        if not self.serial or m * n * k <= SERIAL_MNK:
            call(ROW_MAJOR, NO_TRANS, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, po, ldo)
            return
        if k >= m and k >= n:  # along k: each piece adds its part into out
            if m * n > SERIAL_MNK:
                return self._halve(a, b, out, transpose_b, alpha, beta)
            step = SERIAL_MNK // (m * n)
            for k0 in range(0, k, step):
                b0 = pb + 4 * (k0 if transpose_b else k0 * ldb)
                call(ROW_MAJOR, NO_TRANS, tb, m, n, min(step, k - k0), alpha, pa + 4 * k0, lda,
                     b0, ldb, beta if k0 == 0 else 1.0, po, ldo)
        elif n >= m:  # along n: columns of out
            if m * k > SERIAL_MNK:
                return self._halve(a, b, out, transpose_b, alpha, beta)
            step = SERIAL_MNK // (m * k)
            for n0 in range(0, n, step):
                b0 = pb + 4 * (n0 * ldb if transpose_b else n0)
                call(ROW_MAJOR, NO_TRANS, tb, m, min(step, n - n0), k, alpha, pa, lda, b0, ldb,
                     beta, po + 4 * n0, ldo)
        else:  # along m: rows of a and out
            if n * k > SERIAL_MNK:
                return self._halve(a, b, out, transpose_b, alpha, beta)
            step = SERIAL_MNK // (n * k)
            for m0 in range(0, m, step):
                call(ROW_MAJOR, NO_TRANS, tb, min(step, m - m0), n, k, alpha,
                     pa + 4 * m0 * lda, lda, pb, ldb, beta, po + 4 * m0 * ldo, ldo)

    def _halve(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool,
               alpha: float, beta: float) -> None:
        """`_sgemm_pieces` for a product too large along two dimensions: its largest one
        halved, each half cut again."""
        m, k = a.shape
        n = b.shape[0] if transpose_b else b.shape[1]
        if k >= m and k >= n:
            h = k // 2
            first, second = ((b[:, :h], b[:, h:]) if transpose_b else (b[:h], b[h:]))
            self._sgemm_pieces(a[:, :h], first, out, transpose_b, alpha, beta)
            self._sgemm_pieces(a[:, h:], second, out, transpose_b, alpha, 1.0)
        elif n >= m:
            h = n // 2
            first, second = ((b[:h], b[h:]) if transpose_b else (b[:, :h], b[:, h:]))
            self._sgemm_pieces(a, first, out[:, :h], transpose_b, alpha, beta)
            self._sgemm_pieces(a, second, out[:, h:], transpose_b, alpha, beta)
        else:
            h = m // 2
            self._sgemm_pieces(a[:h], b, out[:h], transpose_b, alpha, beta)
            self._sgemm_pieces(a[h:], b, out[h:], transpose_b, alpha, beta)


def rows_contiguous(a: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.ndim == 2 and a.strides[1] == 4 and \
        a.strides[0] % 4 == 0 and a.strides[0] >= 4 * a.shape[1]


class RopeTables:
    """A RoPE over many positions as two tables: any RoPE rotates pairs of a head's
    coordinates (or leaves one alone), so out[j] = x[j] * diag[p, j] + x[partner[j]] *
    off[p, j]. The pairing is read from the rotation matrices the model's own rope gives
    (runner/host_body.py `_Rotations`), and the tables from rotating two vectors (one
    coordinate of each pair set) at every position: one small MLX call for the positions
    0 .. N, kept and grown by doubling (a call per chunk cost a 16-token chunk 0.3-0.5 ms).
    Each time they grow, the chunk's own call must give the same tables, else (a rope whose
    angles depend on the call's length) every chunk makes its own."""

    FIRST = 1024  # positions in the first tables made

    def __init__(self, rotations):
        self.rope = rotations.rope
        d = rotations.head_dim
        nonzero = (rotations.make(7, 1)[0] != 0) | (rotations.make(1001, 1)[0] != 0)
        partner = np.arange(d)
        for j in range(d):
            others = [i for i in np.flatnonzero(nonzero[:, j]) if i != j]
            if len(others) > 1:
                raise ValueError("a rope that mixes more than pairs of coordinates")
            if others:
                partner[j] = others[0]
        if not np.array_equal(partner[partner], np.arange(d)):
            raise ValueError("a rope whose pairs are not symmetric")
        self.partner = partner
        # The two layouts models use, where slices replace the partner gather: each half
        # against the other (mlx's default), or neighbours (traditional)
        index = np.arange(d)
        self._halves = d % 2 == 0 and np.array_equal(partner, (index + d // 2) % d)
        self._neighbours = d % 2 == 0 and np.array_equal(partner, index ^ 1)
        self.first = partner >= np.arange(d)  # one coordinate of each pair, and the lone ones
        self.lone = partner == np.arange(d)
        self._probe = mx.array(np.stack([self.first, ~self.first]).astype(np.float32))
        self._diag = self._off = np.empty((0, len(partner)), dtype=np.float32)
        self._keep = True

    def tables(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(diag, off), each (count, d), for positions start .. start + count - 1 (views
        of the kept tables: read only)."""
        end = start + count
        if not self._keep:
            return self._make(start, count)
        if end > len(self._diag):
            own = self._make(start, count)
            self._diag, self._off = self._make(0, max(end, 2 * len(self._diag), self.FIRST))
            if not (np.array_equal(own[0], self._diag[start:end]) and
                    np.array_equal(own[1], self._off[start:end])):
                self._keep = False
                self._diag = self._off = self._diag[:0]
                return own
        return self._diag[start:end], self._off[start:end]

    def _make(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        d = self.partner.shape[0]
        rotated = np.array(self.rope(
            mx.broadcast_to(self._probe[:, None, None, :], (2, 1, count, d)),
            offset=start)[:, 0])  # (2, count, d)
        return self._split(rotated[0], rotated[1])

    def tables_at(self, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(diag, off), each (len(positions), d), for any positions: one rope call with a
        position per batch row, as the rows' decode pass makes it."""
        d = self.partner.shape[0]
        rotated = np.array(self.rope(
            mx.broadcast_to(self._probe[None, :, None, :], (len(positions), 2, 1, d)),
            offset=mx.array(positions, dtype=mx.int32))[:, :, 0])  # (rows, 2, d)
        return self._split(rotated[:, 0], rotated[:, 1])

    def _split(self, by_first: np.ndarray, by_second: np.ndarray) -> tuple[np.ndarray,
                                                                           np.ndarray]:
        diag = np.where(self.first, by_first, by_second)
        off = np.where(self.lone, 0.0, np.where(self.first, by_second, by_first))
        return diag.astype(np.float32), off.astype(np.float32)

    def apply(self, x: np.ndarray, diag: np.ndarray, off: np.ndarray) -> np.ndarray:
        """x (n, heads, d) rotated at the tables' positions. For the usual layouts the
        partners are read by slices: numpy's gather made it 4x slower (a 512-token chunk's
        queries, 16 heads of 128: 5.1-7.5 ms against 1.2)."""
        out = x * diag[:, None, :]
        if self._halves or self._neighbours:
            cut = x.shape[-1] // 2
            a, b = (np.s_[..., :cut], np.s_[..., cut:]) if self._halves else \
                (np.s_[..., 0::2], np.s_[..., 1::2])
            swapped = np.empty_like(out)
            np.multiply(x[b], off[:, None][a], out=swapped[a])
            np.multiply(x[a], off[:, None][b], out=swapped[b])
            out += swapped
        else:
            out += x[..., self.partner] * off[:, None, :]
        return out

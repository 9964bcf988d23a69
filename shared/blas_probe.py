"""`python -m mlxr.shared.blas_probe`: run under LD_PRELOAD=<library>, try MLX's matmuls and the
library's sgemv against numpy, time LM-head-sized products, print one JSON line.

shared/blas.py starts this in a throwaway process for each candidate library, so a library
built for another CPU (SIGILL) or one that computes wrong results takes down only this
process. Nothing here is imported by the server.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

HEAD_SHAPE = (151_680, 192)  # the test models' vocabulary x hidden: the head every step pays
HEAD_ROWS = (4, 8, 16)  # decode batches past the host head's 1-2 rows
_ROW_MAJOR, _NO_TRANS = 101, 111


def _global_symbol(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return None


def _config() -> str:
    fn = _global_symbol("openblas_get_config")
    if fn is None:
        return ""
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace")


def _check_matmuls(mx, np) -> str | None:
    """None if MLX's float32/float64 matmuls through this BLAS match numpy, else what differed."""
    rng = np.random.default_rng(0)
    for dtype, mx_dtype, tol in ((np.float32, mx.float32, 1e-3), (np.float64, mx.float64, 1e-9)):
        for m, k, n in ((1, 192, 300), (3, 64, 1000), (16, 192, 4099), (64, 256, 256)):
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((n, k)).astype(dtype)
            device = mx.cpu  # float64 runs on the CPU only
            got = np.asarray(mx.matmul(mx.array(a, dtype=mx_dtype), mx.array(b, dtype=mx_dtype).T,
                                       stream=device))
            want = a.astype(np.float64) @ b.astype(np.float64).T
            if not np.allclose(got, want, rtol=tol, atol=tol):
                return f"wrong {np.dtype(dtype).name} matmul {m}x{k}x{n}"
    return None


def _check_sgemv(np) -> tuple[str | None, float]:
    """sgemv of the preloaded library (the runner's host head calls it): (error, ms per head row)."""
    fn = _global_symbol("cblas_sgemv")
    if fn is None:
        return None, 0.0
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                   ctypes.c_void_p, ctypes.c_int]
    rng = np.random.default_rng(1)
    rows, cols = HEAD_SHAPE
    a = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal(cols, dtype=np.float32)
    y = np.empty(rows, dtype=np.float32)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(_ROW_MAJOR, _NO_TRANS, rows, cols, 1.0, a.ctypes.data, cols, x.ctypes.data, 1, 0.0,
           y.ctypes.data, 1)
        times.append(time.perf_counter() - start)
    if not np.allclose(y, a.astype(np.float64) @ x.astype(np.float64), rtol=1e-3, atol=1e-3):
        return "wrong sgemv", 0.0
    return None, 1000 * sorted(times)[len(times) // 2]


def _time_head(mx) -> float:
    """The decode head as a runner computes it, through MLX and so through cblas_sgemm: the
    mean over 4, 8 and 16 rows of the median ms of the faster of the two weight layouts (as
    stored, and the transposed copy runner/transposed_head.py keeps where it is faster)."""
    weight = mx.random.normal(HEAD_SHAPE, key=mx.random.key(0))
    weight_t = mx.contiguous(weight.T)
    mx.eval(weight, weight_t)
    per_rows = []
    for rows in HEAD_ROWS:
        hidden = mx.random.normal((rows, HEAD_SHAPE[1]), key=mx.random.key(rows))
        mx.eval(hidden)
        per_rows.append(min(_median_ms(mx, lambda: hidden @ weight.T),
                            _median_ms(mx, lambda: hidden @ weight_t)))
    return sum(per_rows) / len(per_rows)


def _median_ms(mx, product, repeats: int = 7) -> float:
    mx.eval(product())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(product())
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def run(timed: bool) -> dict:
    import mlx.core as mx
    import numpy as np

    result: dict = {"ok": False, "config": _config(), "device": mx.default_device().type.name}
    error = _check_matmuls(mx, np)
    if error is None:
        error, result["gemv_ms"] = _check_sgemv(np)
    if error is not None:
        result["reason"] = error
        return result
    if timed:
        result["head_ms"] = _time_head(mx)
    result.update(ok=True, reason="probed ok")
    return result


if __name__ == "__main__":
    print(json.dumps(run(timed="--untimed" not in sys.argv)), flush=True)

"""The LM head as BLAS matrix-vector products, for decode batches of a few rows on a CPU.

MLX's CPU matmul always calls `cblas_sgemm`. For one row of the 30M model's 151,680 x 192
head, OpenBLAS's sgemm takes 6-10 ms where `cblas_sgemv` over the same weights takes about
2 ms, so a single stream's token goes from 13.5 to 7.2 ms (docs/PERFORMANCE.md). At three
rows a whole token costs about the same either way, and from four on one sgemm wins, so the
MLX head is used from three rows.

Used only when all of these hold, else `HostHead.find` returns None and nothing changes:
the default device is the CPU; the head is a plain float32 matrix (an unquantized `lm_head`
without bias, or tied float32 embeddings); the runner was started with OpenBLAS preloaded;
and on a probe the products match the MLX head.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger("mlxr.runner")

MAX_ROWS = 2  # per-row sgemv (2.4 ms each) against one sgemm (8-10 ms); at 3 rows a wash
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # cblas: row-major, (no) transpose


def openblas_sgemv(library: str | None) -> Callable[..., None] | None:
    """`cblas_sgemv` of the OpenBLAS preloaded into this process, else of `library`, else
    None. The runner passes no library: where OpenBLAS was not preloaded (MLXR_OPENBLAS=off,
    or none installed) it does not load one."""
    return _openblas(library, "cblas_sgemv", [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
        ctypes.c_void_p, ctypes.c_int])


def openblas_sgemm(library: str | None) -> Callable[..., None] | None:
    """`cblas_sgemm` of the same OpenBLAS, found as `openblas_sgemv` finds its function."""
    return _openblas(library, "cblas_sgemm", [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int])


def _openblas(library: str | None, name: str, argtypes: list) -> Callable[..., None] | None:
    libraries: list[Any] = [ctypes.CDLL(None)]
    if library:
        try:
            libraries.append(ctypes.CDLL(library))
        except OSError as exc:
            log.info("cannot load %s: %s", library, exc)
    for lib in libraries:
        if hasattr(lib, "openblas_get_config") and hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = argtypes
            return fn
    return None


def cpu_head_weight(model, mlx_head: Callable[[mx.array], mx.array] | None) -> mx.array | None:
    """The head's weight where a CPU head may replace `mlx_head`: the default device is the
    CPU and the head is a plain float32 matrix; else None."""
    if mlx_head is None or mx.default_device() != mx.cpu:
        return None
    return _head_weight(model)


def matches(head: Callable[[mx.array], mx.array], mlx_head: Callable[[mx.array], mx.array],
            rows: int, hidden: int, name: str) -> bool:
    """Whether `head` gives `mlx_head`'s logits on a random probe (logs when not)."""
    probe = mx.random.normal((rows, hidden), key=mx.random.key(0))
    if mx.allclose(head(probe), mlx_head(probe), rtol=1e-4, atol=1e-4).item():
        return True
    log.info("the %s head does not match the model's head; not using it", name)
    return False


def _head_weight(model) -> mx.array | None:
    """The (vocab, hidden) float32 matrix the head multiplies by, if it is a plain one."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        if type(lm_head) is not nn.Linear or "bias" in lm_head:
            return None
        weight = lm_head.weight
    else:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if type(embed) is not nn.Embedding:
            return None
        weight = embed.weight
    return weight if weight.dtype == mx.float32 and weight.ndim == 2 else None


class HostHead:
    def __init__(self, weight: mx.array, sgemv: Callable[..., None]):
        mx.eval(weight)
        self._weight = weight  # keeps the buffer the numpy view points into alive
        self._matrix = np.asarray(weight)
        self._sgemv = sgemv
        self.vocab, self.hidden = self._matrix.shape

    @classmethod
    def find(cls, model, mlx_head: Callable[[mx.array], mx.array] | None,
             library: str | None = None) -> "HostHead | None":
        """A host head equal to `mlx_head` for this model, or None where it does not apply.
        `library`: an OpenBLAS to load when none is preloaded (tests)."""
        weight = cpu_head_weight(model, mlx_head)
        if weight is None:
            return None
        sgemv = openblas_sgemv(library)
        if sgemv is None or not np.asarray(weight).flags.c_contiguous:
            return None
        head = cls(weight, sgemv)
        return head if matches(head, mlx_head, 2, head.hidden, "BLAS") else None

    def __call__(self, hidden: mx.array) -> mx.array:
        """Logits (B, vocab) for evaluated-or-lazy hidden states (B, hidden)."""
        return self.project(np.asarray(hidden.astype(mx.float32)))

    def project(self, hidden: np.ndarray) -> mx.array:
        """Logits (B, vocab) for float32 hidden states (B, hidden) on the host."""
        return mx.array(self.host_logits(hidden))

    def host_logits(self, hidden: np.ndarray) -> np.ndarray:
        """`project`'s logits as a numpy array (no copy into MLX)."""
        rows = np.ascontiguousarray(hidden, dtype=np.float32)
        out = np.empty((rows.shape[0], self.vocab), dtype=np.float32)
        for i in range(rows.shape[0]):
            matvec(self._sgemv, self._matrix, rows[i], out[i])
        return out


def matvec(sgemv: Callable[..., None], matrix: np.ndarray, x: np.ndarray,
           out: np.ndarray) -> None:
    """out = matrix @ x with `cblas_sgemv`: a C-contiguous float32 matrix (rows, cols),
    contiguous float32 vectors."""
    rows, cols = matrix.shape
    sgemv(ROW_MAJOR, NO_TRANS, rows, cols, 1.0, matrix.ctypes.data, cols, x.ctypes.data, 1,
          0.0, out.ctypes.data, 1)

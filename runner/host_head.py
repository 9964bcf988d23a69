"""The LM head as host products, for decode batches on a CPU.

MLX's CPU matmul always calls `cblas_sgemm`, and OpenBLAS's sgemm packs the whole weight on
every call. For the 30M model's 151,680 x 192 head that is 8-14 ms for 1-16 rows on the Zen 4
EPYC. Two host products read the weight fewer times:
- the C kernel of runner/row_kernel.py, which reads the weight once for up to 16 rows: 4-7 ms
  for 1-16 rows, 27 ms for 64 against MLX's 46 (docs/PERFORMANCE.md, "The decode step in
  C"). It serves up to KERNEL_MAX_ROWS rows. For one row it is as fast as sgemv in isolation,
  and a served stream was 5-14% faster with it (OpenBLAS's threads stay asleep);
- without the kernel, `cblas_sgemv` a row at a time (about 4 ms a row) up to MAX_ROWS rows:
  at three a wash with MLX's one sgemm, from four MLX's wins.

Used only when all of these hold, else `HostHead.find` returns None and nothing changes:
the default device is the CPU; the head is a plain float32 matrix (an unquantized `lm_head`
without bias, or tied float32 embeddings); the kernel was built or OpenBLAS was preloaded;
and on a probe the products match the MLX head. The kernel is kept only where, on this CPU,
it beats the head it would replace (MLX's, or its transposed copy) at KERNEL_PROBE_ROWS rows.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr.runner import probe_verdicts
from mlxr.runner.quant_kernel import QuantKernel, QuantizedWeight
from mlxr.runner.row_kernel import RowKernel

log = logging.getLogger("mlxr.runner")

MAX_ROWS = 2  # per-row sgemv (2.4 ms each) against one sgemm (8-10 ms); at 3 rows a wash
KERNEL_MAX_ROWS = 64  # the kernel beat MLX's head at every count measured, 1-64
KERNEL_PROBE_ROWS = 16
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


def quantized_head_weight(model, mlx_head: Callable[[mx.array], mx.array] | None,
                          ) -> QuantizedWeight | None:
    """The head's weight where the quantized kernel may replace `mlx_head`: the default
    device is the CPU and the head is a quantized `lm_head` without bias, or tied quantized
    embeddings, in a layout the kernel takes; else None."""
    if mlx_head is None or mx.default_device() != mx.cpu:
        return None
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        return QuantizedWeight.of(lm_head) if type(lm_head) is nn.QuantizedLinear and \
            "bias" not in lm_head else None
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return QuantizedWeight.of(embed) if type(embed) is nn.QuantizedEmbedding else None


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
    def __init__(self, weight: mx.array | QuantizedWeight, sgemv: Callable[..., None] | None,
                 kernel: RowKernel | QuantKernel | None = None):
        if isinstance(weight, QuantizedWeight):  # read by the quantized kernel only
            self._weight, self._matrix = weight.keep, weight
        else:
            mx.eval(weight)
            self._weight = weight  # keeps the buffer the numpy view points into alive
            self._matrix = np.asarray(weight)
        self._sgemv = sgemv
        self.kernel = kernel
        self.vocab, self.hidden = self._matrix.shape
        self._out = np.empty((0, self.vocab), dtype=np.float32)

    @property
    def max_rows(self) -> int:
        """The most rows a decode step hands this head."""
        return KERNEL_MAX_ROWS if self.kernel is not None else MAX_ROWS

    @classmethod
    def find(cls, model, mlx_head: Callable[[mx.array], mx.array] | None,
             library: str | None = None, kernel: bool = True,
             rival: Callable[[mx.array], mx.array] | None = None) -> "HostHead | None":
        """A host head equal to `mlx_head` for this model, or None where it does not apply.
        `library`: an OpenBLAS to load when none is preloaded (tests). `kernel`: try the C
        kernel (runner/row_kernel.py), kept where it beats `rival` (the head the runner
        would use instead; default `mlx_head`)."""
        quantized = quantized_head_weight(model, mlx_head)
        if quantized is not None:  # MLX's quantized CPU product is 5-44x slower: no race
            quant = QuantKernel.load()
            head = None if quant is None else \
                cls(quant.compact(quantized), None, quant)
            return head if head is not None and probe_verdicts.decide(
                "quantized_head", lambda: all(matches(head, mlx_head, rows, head.hidden,
                                                      "quantized") for rows in {1, 2, 13})
            ) else None
        weight = cpu_head_weight(model, mlx_head)
        if weight is None or not np.asarray(weight).flags.c_contiguous:
            return None
        sgemv = openblas_sgemv(library)
        head = cls(weight, sgemv, RowKernel.load() if kernel else None)
        if head.kernel is not None and not probe_verdicts.decide(
                "row_kernel_head", lambda: head._kernel_pays(mlx_head, rival or mlx_head)):
            head.kernel = None
        if head.kernel is None and sgemv is None:
            return None
        return head if probe_verdicts.decide(
            "host_head" if head.kernel is None else "host_head+kernel",
            lambda: all(matches(head, mlx_head, rows, head.hidden, "host")
                        for rows in {1, 2, min(head.max_rows, 13)})) else None

    def _kernel_pays(self, mlx_head: Callable[[mx.array], mx.array],
                     rival: Callable[[mx.array], mx.array]) -> bool:
        """Does the kernel give the MLX head's logits and beat `rival` at KERNEL_PROBE_ROWS
        rows on this CPU?"""
        if not matches(self, mlx_head, KERNEL_PROBE_ROWS, self.hidden, "kernel"):
            return False
        probe = mx.random.normal((KERNEL_PROBE_ROWS, self.hidden), key=mx.random.key(2))
        # The best of several: right after loading, and after each of the rival's products,
        # OpenBLAS's threads spin for a while and take the cores the kernel's threads need.
        ours, theirs = median_ms(self, probe, 7, best=True), median_ms(rival, probe, 7, best=True)
        log.info("decode head at %d rows: C kernel %.1f ms, MLX %.1f ms", KERNEL_PROBE_ROWS,
                 ours, theirs)
        return ours < theirs

    def __call__(self, hidden: mx.array) -> mx.array:
        """Logits (B, vocab) for evaluated-or-lazy hidden states (B, hidden)."""
        return self.project(np.asarray(hidden.astype(mx.float32)))

    def project(self, hidden: np.ndarray) -> mx.array:
        """Logits (B, vocab) for float32 hidden states (B, hidden) on the host."""
        return mx.array(self.host_logits(hidden))

    def host_logits(self, hidden: np.ndarray) -> np.ndarray:
        """`project`'s logits as a numpy array (no copy into MLX). The array is this head's
        own buffer, valid until its next call: a fresh one for each step was 5,000 page faults
        at 16 rows, which cost as much as the product."""
        rows = np.ascontiguousarray(hidden, dtype=np.float32)
        if self._out.shape[0] < rows.shape[0]:
            self._out = np.empty((rows.shape[0], self.vocab), dtype=np.float32)
        out = self._out[:rows.shape[0]]
        if self.kernel is not None:
            self.kernel.product(self._matrix, rows, out)
            return out
        for i in range(rows.shape[0]):
            matvec(self._sgemv, self._matrix, rows[i], out[i])
        return out


def median_ms(head: Callable[[mx.array], mx.array], probe: mx.array, repeats: int = 5,
              best: bool = False) -> float:
    """The median (`best`: the least) milliseconds of `head` on `probe`, evaluated, after one
    untimed call."""
    mx.eval(head(probe))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(head(probe))
        times.append(time.perf_counter() - start)
    return 1000 * (min(times) if best else sorted(times)[repeats // 2])


def matvec(sgemv: Callable[..., None], matrix: np.ndarray, x: np.ndarray,
           out: np.ndarray) -> None:
    """out = matrix @ x with `cblas_sgemv`: a C-contiguous float32 matrix (rows, cols),
    contiguous float32 vectors."""
    rows, cols = matrix.shape
    sgemv(ROW_MAJOR, NO_TRANS, rows, cols, 1.0, matrix.ctypes.data, cols, x.ctypes.data, 1,
          0.0, out.ctypes.data, 1)

"""The gated MLP's `silu(gate) * up` in numpy, for float32 prefill chunks on a CPU.

mlx-lm's models (llama, qwen2, qwen3, mistral, phi3, ... and their vision models' language
parts) compute it with `mlx_lm.models.activations.swiglu`. MLX's CPU sigmoid is its `exp`,
at 15-25 ns an element on the 2-core EPYC, where numpy's runs at about 3. On a 128-token chunk
of the 30M model's MLP (128 x 768) it took 2.7 ms against numpy's 0.3 ms, more than the
chunk's attention or any of its matmuls (docs/PERFORMANCE.md, "SwiGLU in numpy").

Like runner/kv/host_attention.py it is a synchronisation point (`np.asarray` evaluates the
gate), so it is used only:
- while the model step builds a prefill chunk's forward pass (`active`), whose layers are
  computed as they are built anyway when the chunk attends in numpy; decode passes keep
  MLX's (they may be run ahead);
- for float32 gates of at least MIN_ELEMENTS elements with more than one position, with the
  CPU as the default device.
Outside `active` (mlx-lm's own generation in the same process, tests' references) the patched
name calls mlx-lm's function. The outputs differ from MLX's by float32 rounding (x / (1 +
exp(-x)) against x * sigmoid(x)). `MLXR_HOST_ATTENTION=0` turns this off too."""

from __future__ import annotations

import contextlib
import sys
import threading

import mlx.core as mx
import numpy as np

from mlxr.runner import host_parallel

MIN_ELEMENTS = 16_384  # positions x intermediate width; below it the sync costs more
_original = None
_state = threading.local()


@contextlib.contextmanager
def active(on: bool = True):
    """Let forward passes built inside take numpy's SwiGLU (this thread only)."""
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


def worth_it(gate: mx.array) -> bool:
    return (getattr(_state, "on", False) and gate.ndim == 3 and gate.shape[1] > 1
            and gate.size >= MIN_ELEMENTS and gate.dtype == mx.float32
            and mx.default_device() == mx.cpu)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`silu(gate) * x`."""
    if not worth_it(gate):
        return _original(gate, x)
    return mx.array(silu_times(np.asarray(gate), np.asarray(x)))  # evaluates both


def silu_times(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """`silu(gate) * up` in numpy, float32 (also the numpy decode body's, runner/host_body.py),
    positions split across the cores (runner/host_parallel.py) when there are many."""
    out = np.empty_like(gate)
    if gate.size < host_parallel.MIN_ELEMENTS:  # a decode row: no reshaping on this hot path
        _silu_into(gate, up, out)
        return out
    width = gate.shape[-1]
    rows_gate, rows_out = gate.reshape(-1, width), out.reshape(-1, width)
    rows_up = np.broadcast_to(up, gate.shape).reshape(-1, width)
    host_parallel.for_rows(rows_gate.shape[0], gate.size, lambda a, b: _silu_into(
        rows_gate[a:b], rows_up[a:b], rows_out[a:b]))
    return out


def _silu_into(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    np.negative(gate, out=out)
    with np.errstate(over="ignore"):  # exp(-g) = inf for very negative g: the output is -0
        np.exp(out, out=out)
    out += 1
    np.divide(gate, out, out=out)
    out *= up


def install(model) -> int:
    """Route `model`'s modules' `swiglu` through this module (idempotent); returns how many
    modules now do."""
    global _original
    from mlx_lm.models import activations

    if _original is None:
        _original = activations.swiglu
    routed = 0
    for name in {type(m).__module__ for m in model.modules()}:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "swiglu", None) in (_original, swiglu):
            mod.swiglu = swiglu
            routed += 1
    return routed

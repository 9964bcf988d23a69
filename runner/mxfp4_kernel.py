"""gpt-oss's experts at decode on a CPU, read as stored in MLX's mxfp4 format
(shared/assets/mxfp4_kernel.c): 4.25 bits a weight.

Why: MLX's CPU product of a token's 4 chosen mxfp4 experts (2,880 x 2,880 each, gpt-oss-20b's)
took about 32 ms a projection, three a layer, so a gpt-oss-20b-shaped file decoded at a tenth
of llama.cpp's speed (docs/PERFORMANCE.md, "gpt-oss on a CPU"). The C kernel reads a weight row
once per token at about the memory's pace.

`install(model)` gives each gpt-oss MLP block whose experts are mxfp4 a decode path: for a
forward pass of at most MAX_ROWS tokens (decode steps, short chunks) the router runs in MLX as
before, then each token's chosen experts run here (gate and up for every token in one kernel
call, then down), with mlx_lm's arithmetic: SwigluOAI (the gate clipped at 7 from above, the
linear part to [-7, 7], (x + 1) * gate * sigmoid(1.702 gate)), each expert's output times its
softmax weight, summed. Longer passes keep MLX's expert products. Nothing changes on a GPU,
for a sharded block, or where the kernel cannot be built.

Invariants: the kernel's weights are views of the block's own MLX arrays (kept alive by the
block); `products` writes every element of its outputs; the values equal MLX's dequantized
weights exactly, and the sums differ only by float32 rounding order.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxr.runner import host_parallel
from mlxr.shared import native

MAX_ROWS = 8  # forward passes of up to this many tokens take the kernel
_FUNCTIONS = ["mlxr_mxfp4_rows", "mlxr_mxfp4_width"]
SPLIT_ROWS = 256  # a projection of fewer weight rows is one thread's work


def takes(module) -> bool:
    """An mlx_lm QuantizedSwitchLinear in MLX's mxfp4 format (4 bits, groups of 32)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return isinstance(module, QuantizedSwitchLinear) and \
        getattr(module, "mode", "affine") == "mxfp4" and module.group_size == 32 and \
        module.bits == 4


@dataclass(frozen=True)
class Mxfp4Kernel:
    rows_fn: object
    width: int

    @classmethod
    @functools.lru_cache(maxsize=1)
    def load(cls, cache_dir: Path | None = None) -> "Mxfp4Kernel | None":
        """The kernel, built if need be; None where it cannot be built or loaded (logged)."""
        found = native.built_functions(native.mxfp4_kernel_library, cache_dir, _FUNCTIONS,
                                       "mxfp4 kernel")
        if found is None:
            return None
        rows_fn, width_fn = found
        rows_fn.restype = None
        rows_fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int]
        width_fn.restype = ctypes.c_int
        width_fn.argtypes = [ctypes.c_int]
        return cls(rows_fn, width_fn(16))

    def products(self, weights: list[tuple[np.ndarray, np.ndarray]],
                 xs: list[np.ndarray]) -> list[np.ndarray]:
        """weights[j] @ xs[j] for each j: a weight as (codes uint8 (out, in / 2), exponents
        uint8 (out, in / 32)), x float32 (in,). The rows are split over the cores."""
        n = len(weights)
        split = [np.ascontiguousarray(np.concatenate([x[0::2], x[1::2]]), np.float32)
                 for x in xs]
        outs = [np.empty(q.shape[0], np.float32) for q, _ in weights]
        pointers = [(ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]) for arrays in (
            [q for q, _ in weights], [e for _, e in weights], split, outs)]
        rows = [q.shape[0] for q, _ in weights]
        cols = (ctypes.c_int * n)(*[q.shape[1] * 2 for q, _ in weights])
        parts = host_parallel.workers() if min(rows) >= SPLIT_ROWS else 1

        def run(part: int, end: int) -> None:
            for p in range(part, end):  # each part: its share of every weight's rows
                begins = (ctypes.c_int * n)(*[r * p // parts for r in rows])
                ends = (ctypes.c_int * n)(*[r * (p + 1) // parts for r in rows])
                self.rows_fn(n, *pointers[:2], pointers[2], pointers[3], begins, ends, cols,
                             self.width)

        host_parallel.for_rows(parts, sum(rows) * 1024, run, parts=parts)
        return outs


class _Views:
    """One projection's experts as numpy views of its MLX arrays: codes (experts, out, in/2),
    exponents (experts, out, in/32), biases float32 (experts, out)."""

    def __init__(self, module):
        import mlx.core as mx

        mx.eval(module.weight, module.scales)
        self.keep = (module.weight, module.scales)
        self.codes = np.array(module.weight, copy=False).view(np.uint8)
        self.exponents = np.array(module.scales, copy=False)
        bias = module["bias"] if "bias" in module else None
        self.bias = None if bias is None else np.array(bias.astype(mx.float32))

    def weight(self, expert: int) -> tuple[np.ndarray, np.ndarray]:
        return self.codes[expert], self.exponents[expert]


class HostExperts:
    """A gpt-oss MLP block's experts on the kernel (see the module's docstring)."""

    def __init__(self, block, kernel: Mxfp4Kernel):
        switch = block.experts
        self.kernel = kernel
        self.gate, self.up, self.down = (_Views(getattr(switch, f"{p}_proj"))
                                         for p in ("gate", "up", "down"))
        self.top_k = block.num_experts_per_tok

    def __call__(self, block, x):
        import mlx.core as mx

        shape, dtype = x.shape, x.dtype
        flat = x.reshape(-1, shape[-1])
        logits = block.router(flat)
        chosen = mx.argpartition(logits, kth=-self.top_k, axis=-1)[..., -self.top_k:]
        weights = mx.softmax(mx.take_along_axis(logits, chosen, axis=-1), axis=-1,
                             precise=True)
        rows = flat.astype(mx.float32)
        mx.eval(rows, chosen, weights)
        rows, chosen, weights = np.array(rows), np.array(chosen), np.array(weights)
        pairs = [(r, int(e)) for r in range(len(rows)) for e in chosen[r]]
        firsts = self.kernel.products(
            [view.weight(e) for _, e in pairs for view in (self.gate, self.up)],
            [rows[r] for r, _ in pairs for _ in range(2)])
        hidden = []
        for i, (_, e) in enumerate(pairs):
            gate, up = firsts[2 * i] + self.gate.bias[e], firsts[2 * i + 1] + self.up.bias[e]
            gate = np.minimum(gate, np.float32(7.0))
            up = np.clip(up, np.float32(-7.0), np.float32(7.0))
            hidden.append((up + np.float32(1.0)) * gate /
                          (np.float32(1.0) + np.exp(np.float32(-1.702) * gate)))
        downs = self.kernel.products([self.down.weight(e) for _, e in pairs], hidden)
        out = np.zeros_like(rows)
        for i, (r, e) in enumerate(pairs):
            out[r] += weights[r, i % self.top_k] * (downs[i] + self.down.bias[e])
        return mx.array(out).reshape(shape).astype(dtype)


def install(model) -> int:
    """Give every gpt-oss MLP block of `model` whose experts the kernel takes its decode path
    (on a CPU, where the kernel builds); returns the blocks given it."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    mlps = [getattr(layer, "mlp", None) for layer in getattr(model, "layers", ())]
    blocks = [mlp for mlp in mlps  # (a Mixtral layer has `block_sparse_moe` instead)
              if type(mlp).__name__ == "MLPBlock" and hasattr(mlp, "experts")
              and all(takes(getattr(mlp.experts, f"{p}_proj", None))
                      for p in ("gate", "up", "down"))]
    kernel = Mxfp4Kernel.load() if blocks else None
    if kernel is None:
        return 0
    from mlx_lm.models import gpt_oss

    class Mxfp4Block(gpt_oss.MLPBlock):
        host: HostExperts

        def __call__(self, x):
            rows = x.size // x.shape[-1]
            if rows > MAX_ROWS or self.sharding_group is not None:
                return super().__call__(x)
            return self.host(self, x)

    for block in blocks:
        block.host = HostExperts(block, kernel)
        block.__class__ = Mxfp4Block
    return len(blocks)


def serves(model) -> bool:
    """Whether `install` gave any of `model`'s blocks the kernel."""
    return any(isinstance(getattr(getattr(layer, "mlp", None), "host", None), HostExperts)
               for layer in getattr(model, "layers", ()))

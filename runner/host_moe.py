"""A mixture of experts' MLP in numpy, for the numpy decode and prefill bodies
(runner/host_body.py, runner/host_prefill.py): mlx_lm's sparse MoE block (a router, then a
SwitchGLU over the experts each token chose, as in qwen3_moe), each chosen expert's
projections read from its slice of the stacked weights by the quantized kernel
(runner/quant_kernel.py) or BLAS.

Why: on a CPU MLX's expert products (`gather_qmm`, `gather_mm`) read a stored 4-bit expert
at a fraction of the kernel's speed. A random mixture in Qwen3-30B-A3B's layer shape (8
layers of 32 experts, 8 a token) decoded at 2.4 tok/s as stored and 5.5 tok/s widened to
float32 (docs/PERFORMANCE.md, "Mixtures of experts").

Invariants:
- The routing is mlx_lm's: a float32 softmax of the router's logits, the top k experts (the
  same set; ties aside), their weights renormalised to sum to 1 where the block says
  (`norm_topk_prob`); each chosen expert's SwiGLU output times its weight, summed.
- An expert's weight is a view into the stacked MLX arrays (kept alive here). Quantized
  experts are compacted for one row's products (`QuantKernel.compact`: a GGUF Q4_K import's
  super-block scales, 4.75 bits a weight) at load, a projection's experts in one pass; float32
  ones are bound for one row's products the first time a row chooses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mlxr.runner.host_swiglu import silu_times
from mlxr.runner.quant_kernel import (ITEM_FIELDS, ITEM_OUT, ITEM_X, QuantizedWeight,
                                      QuantKernel, SuperScales, into_row_order, one_row_order,
                                      takes_stacked)

PROJECTIONS = ("gate", "up", "down")


@dataclass(slots=True)
class Experts:
    """One layer's experts: `router` a (weight, bias) linear, and for each projection a list
    of (weight, bias) linears, one an expert: float32 (out, in) arrays or QuantizedWeights."""

    router: tuple
    gate: list[tuple]
    up: list[tuple]
    down: list[tuple]
    top_k: int
    renormalise: bool
    # one row's products, bound on first use (`bound`): (expert, projection) -> bound linear
    _bind: Callable | None = None
    _bound: dict = field(default_factory=dict)
    _on_kernel: "_OnKernel | None" = None  # one row's experts in two kernel calls, if quantized

    @classmethod
    def of(cls, mlp, router: tuple | None) -> "Experts | None":
        """The experts of an mlx_lm sparse MoE block whose shape this code computes, else
        None. `router`: the block's `gate` as host_body reads a linear."""
        from mlx_lm.models.switch_layers import SwiGLU

        switch = getattr(mlp, "switch_mlp", None)
        k, renormalise = getattr(mlp, "top_k", None), getattr(mlp, "norm_topk_prob", None)
        if switch is None or router is None or not isinstance(k, int) or \
                not isinstance(renormalise, bool) or type(switch.activation) is not SwiGLU:
            return None
        stacks = [_stacked(getattr(switch, f"{name}_proj", None)) for name in PROJECTIONS]
        if any(s is None for s in stacks) or len({len(s) for s in stacks}) != 1 or \
                not 1 <= k <= len(stacks[0]):
            return None
        return cls(router, *stacks, top_k=k, renormalise=renormalise)

    def bind(self, bind: Callable) -> "Experts":
        """A copy whose router is bound by `bind` (host_body's `_Products.bind`), and whose
        experts `bind` binds the first time a row chooses them."""
        kernel = QuantKernel.load()
        quantized = all(isinstance(w, QuantizedWeight) and b is None
                        for w, b in self.gate + self.up + self.down)
        return Experts(bind(self.router), self.gate, self.up, self.down, self.top_k,
                       self.renormalise, bind,
                       _on_kernel=_OnKernel(kernel, self) if quantized and kernel else None)

    def route(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts each row chose (rows, k) and their weights (rows, k), from the
        router's logits (rows, experts)."""
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True), dtype=np.float32)
        probs /= probs.sum(axis=-1, keepdims=True)
        chosen = np.argpartition(-probs, self.top_k - 1, axis=-1)[:, :self.top_k]
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if self.renormalise:
            weights /= weights.sum(axis=-1, keepdims=True)
        return chosen, weights

    def row(self, x: np.ndarray, project: Callable) -> np.ndarray:
        """The block's output for one row x (hidden,): `project(x, linear)` is host_body's
        one-row product."""
        chosen, weights = self.route(project(x, self.router)[None])
        if self._on_kernel is not None:
            return self._on_kernel(x, chosen[0], weights[0])
        out = np.zeros_like(x)
        for e, w in zip(chosen[0].tolist(), weights[0].tolist()):
            mixed = silu_times(project(x, self._one(e, 0)), project(x, self._one(e, 1)))
            out += np.float32(w) * project(mixed, self._one(e, 2))
        return out

    def rows(self, x: np.ndarray, gemm) -> np.ndarray:
        """The block's output for rows x (n, hidden): each chosen expert's products over the
        rows that chose it (`gemm`: runner/host_ops.py's Gemm)."""
        chosen, weights = self.route(gemm.linear(x, self.router))
        out = np.zeros_like(x)
        for e in np.unique(chosen).tolist():
            rows, slot = np.nonzero(chosen == e)
            xe = x[rows]
            mixed = silu_times(gemm.linear(xe, self.gate[e]), gemm.linear(xe, self.up[e]))
            out[rows] += gemm.linear(mixed, self.down[e]) * weights[rows, slot][:, None]
        return out

    def _one(self, expert: int, projection: int):
        bound = self._bound.get((expert, projection))
        if bound is None:
            linear = getattr(self, PROJECTIONS[projection])[expert]
            bound = self._bound[expert, projection] = \
                self._bind(linear) if self._bind is not None else linear
        return bound


class _OnKernel:
    """One row through its chosen experts in two calls of the quantized kernel
    (`QuantKernel.many`): every chosen expert's gate and up products, then their down
    products; a call and a hand-off to the workers an expert's product cost 8-11 us."""

    def __init__(self, kernel: QuantKernel, experts: Experts):
        self.kernel = kernel
        stacks = (experts.gate, experts.up, experts.down)
        k, count = experts.top_k, len(experts.gate)
        inter, hidden = experts.gate[0][0].shape
        self.orders = [one_row_order(s[0][0].bits, s[0][0].shape[1]) for s in stacks]
        # each expert's products as `many` reads them, and the weights they point into
        self.kept = [_compacted(kernel, stack) for stack in stacks]
        self.templates = np.stack([np.stack([kernel.item(w) for w in weights])
                                   for weights in self.kept])
        self.x = [np.empty(hidden, dtype=np.float32) for _ in range(2)]  # gate's, up's order
        self.gate_up = np.empty((2, k, inter), dtype=np.float32)
        self.mixed = np.empty((k, inter), dtype=np.float32)  # in the down products' order
        self.down = np.empty((k, hidden), dtype=np.float32)
        self.first = np.zeros((2 * k, ITEM_FIELDS), dtype=np.int64)
        self.second = np.zeros((k, ITEM_FIELDS), dtype=np.int64)
        self.first_rows = np.array(
            [(self.x[p].ctypes.data, self.gate_up[p, i].ctypes.data)
             for p in range(2) for i in range(k)], dtype=np.int64)
        self.second_rows = np.array(
            [(self.mixed[i].ctypes.data, self.down[i].ctypes.data) for i in range(k)],
            dtype=np.int64)

    def __call__(self, x: np.ndarray, chosen: np.ndarray, weights: np.ndarray) -> np.ndarray:
        for p in range(2):
            into_row_order(self.x[p], x[None], self.orders[p])
        k = len(chosen)
        self.first[:k], self.first[k:] = self.templates[0, chosen], self.templates[1, chosen]
        self.first[:, ITEM_X:ITEM_OUT + 1] = self.first_rows
        self.kernel.many(self.first)
        into_row_order(self.mixed, silu_times(self.gate_up[0], self.gate_up[1]), self.orders[2])
        self.second[:] = self.templates[2, chosen]
        self.second[:, ITEM_X:ITEM_OUT + 1] = self.second_rows
        self.kernel.many(self.second)
        return weights.astype(np.float32) @ self.down


def _compacted(kernel: QuantKernel, stack: list[tuple]) -> list[QuantizedWeight]:
    """A projection's experts compacted (`QuantKernel.compact`) in one pass over the stacked
    arrays: super-block codes, or an offset, found for every expert at once (one call an
    expert was 0.45 ms, some 18,000 for Qwen3-30B-A3B)."""
    first = stack[0][0]
    rows = first.shape[0]
    q, scales, biases = (np.asarray(a) for a in first.keep)  # the stacked arrays
    whole = kernel.compact(QuantizedWeight(
        q.view(np.uint8).reshape(-1, first.q.shape[1]), scales.reshape(-1, scales.shape[-1]),
        biases.reshape(-1, biases.shape[-1]), first.bits, first.group, first.keep))
    out = []
    for e in range(len(stack)):
        part = slice(e * rows, (e + 1) * rows)
        supers = whole.supers and SuperScales(whole.supers.codes[part],
                                              whole.supers.factors[part])
        out.append(QuantizedWeight(whole.q[part], whole.scales[part], whole.biases[part],
                                   whole.bits, whole.group, (whole.keep, whole.supers),
                                   supers, whole.offset))
    return out


def _stacked(module) -> list[tuple] | None:
    """One (weight, bias) linear an expert from mlx_lm's SwitchLinear (float32) or
    QuantizedSwitchLinear (a layout the quantized kernel takes), else None."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if type(module) is SwitchLinear:
        if module.weight.dtype != mx.float32 or module.weight.ndim != 3:
            return None
        mx.eval(module.parameters())
        weights = np.asarray(module.weight)
    elif type(module) is QuantizedSwitchLinear and takes_stacked(module):
        weights = QuantizedWeight.stacked(module)
        if weights is None or QuantKernel.load() is None:
            return None
    else:
        return None
    bias = None
    if "bias" in module:
        if module["bias"].dtype != mx.float32:
            return None
        bias = np.asarray(module["bias"])
    return [(weights[e], None if bias is None else bias[e]) for e in range(len(weights))]

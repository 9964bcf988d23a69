"""EmbeddingGemma's forward pass in numpy, for a CPU (runner/embed/bidirectional.py keeps the
MLX one for GPUs and as the reference; tests hold the two to the same vectors).

Why: on a CPU MLX's float32 path cost 200 ms for a 12-token query of the 300M model (24
layers of many small operations), where its products, read once, take about 30 ms.

- The inputs are packed: every real token of the batch is one row of each product, so no
  product computes padding (the row kernel for up to ROW_KERNEL_ROWS rows, else BLAS).
- q, k and v are one product, gate and up another (their weights joined once at load).
- A 4- or 8-bit model (a Q8_0 or Q4_0 GGUF) keeps its packed weights: its products are the
  quantized kernel's (runner/kernel_layers.py's `Host`: one pass a 16 rows, or the weight
  dequantized into a shared scratch buffer for BLAS), read at a quarter or an eighth of
  float32's bytes; its embedding rows are dequantized as they are looked up.
- Attention goes a sequence and a block of queries at a time: all of the sequence's keys on a
  global layer, those within `half_window` either side on a sliding one (a band of keys is
  sliced, so a long input's sliding layers cost its window, not its length).
- RMSNorm is Gemma's (x / rms * (1 + w)); the MLP's GELU is the tanh form; rope is the
  rotate-half form with the layer's base (local or global).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxr.runner.embed.host_encoder import ROW_KERNEL_ROWS, RowOps, _np
from mlxr.runner.kernel_layers import Host, Scratch
from mlxr.runner.quant_kernel import QuantizedWeight, QuantKernel
from mlxr.runner.row_kernel import RowKernel

QUERY_BLOCK = 256
SPLIT_ELEMENTS = 1 << 16  # a short input's products: weights this size and up over the cores
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * scale over the last axis (scale: Gemma's 1 + w)."""
    mean = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(mean + np.float32(eps))) * scale


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


# A weight: float32 (out, in), a quantized one on the kernel (`Host`), or several whose
# outputs are joined (quantized q, k and v).
Weight = Any


@dataclass(slots=True)
class _Layer:
    qkv: Weight  # (q + k + v rows, hidden)
    out: Weight
    gate_up: Weight  # (2 * intermediate, hidden)
    down: Weight
    input_norm: np.ndarray  # 1 + w, float32
    post_attention_norm: np.ndarray
    pre_mlp_norm: np.ndarray
    post_mlp_norm: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    sliding: bool
    rope_base: float


class HostGemma:
    """Packed token ids -> the body's last hidden states (after the final norm), float32."""

    def __init__(self, *, embed: Any, embed_scale: float, layers: list[_Layer],
                 norm: np.ndarray, heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, half_window: int):
        self.embed, self.embed_scale, self.layers, self.norm = embed, embed_scale, layers, norm
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.eps, self.scale, self.half_window = eps, np.float32(scale), half_window
        self.rows = RowKernel.load()  # None: BLAS for every product
        self.ops = RowOps.load()  # None: numpy's softmax

    @classmethod
    def of(cls, model: Any, sliding: list[bool], half_window: int,
           embed_scale: float) -> "HostGemma":
        """Views of an mlx_lm gemma3_text model's float32 weights (q/k/v and gate/up joined
        in copies), or its quantized layers the kernel takes, as they are stored (the model
        widened around them: runner/weights.py `widen_around_kernel`)."""
        body = model.model
        args = model.args
        scratch = Scratch()

        def one_plus(norm) -> np.ndarray:
            return (1.0 + _np(norm.weight)).astype(np.float32)

        def joined(*modules) -> Weight:
            weights = [_weight(m, scratch) for m in modules]
            if len(weights) == 1:
                return weights[0]
            if all(isinstance(w, np.ndarray) for w in weights):
                return np.concatenate(weights)
            return weights

        layers = []
        for layer, is_sliding in zip(body.layers, sliding):
            a, mlp = layer.self_attn, layer.mlp
            layers.append(_Layer(
                qkv=joined(a.q_proj, a.k_proj, a.v_proj), out=joined(a.o_proj),
                gate_up=joined(mlp.gate_proj, mlp.up_proj), down=joined(mlp.down_proj),
                input_norm=one_plus(layer.input_layernorm),
                post_attention_norm=one_plus(layer.post_attention_layernorm),
                pre_mlp_norm=one_plus(layer.pre_feedforward_layernorm),
                post_mlp_norm=one_plus(layer.post_feedforward_layernorm),
                q_norm=one_plus(a.q_norm), k_norm=one_plus(a.k_norm), sliding=is_sliding,
                rope_base=float(args.rope_local_base_freq if is_sliding else args.rope_theta)))
        return cls(embed=_weight(body.embed_tokens, scratch), embed_scale=embed_scale,
                   layers=layers, norm=one_plus(body.norm), heads=args.num_attention_heads,
                   kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                   eps=args.rms_norm_eps, scale=args.query_pre_attn_scalar ** -0.5,
                   half_window=half_window)

    def __call__(self, batch: list[list[int]]) -> np.ndarray:
        """(sum of lengths, hidden): each sequence's rows in order, one after another."""
        lengths = [len(ids) for ids in batch]
        starts = np.cumsum([0, *lengths])
        positions = np.concatenate([np.arange(n) for n in lengths])
        tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in batch])
        if isinstance(self.embed, np.ndarray):
            x = self.embed[tokens]
        else:  # quantized: the rows dequantized
            x = self.embed.weight[tokens]
        x = x * np.float32(self.embed_scale)
        ropes = {base: _rope(positions, self.head_dim, base)
                 for base in {layer.rope_base for layer in self.layers}}
        q_rows, kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer in self.layers:
            qkv = self._product(rms_norm(x, layer.input_norm, self.eps), layer.qkv)
            n = qkv.shape[0]
            q = qkv[:, :q_rows].reshape(n, self.heads, self.head_dim)
            k = qkv[:, q_rows:q_rows + kv_rows].reshape(n, self.kv_heads, self.head_dim)
            v = qkv[:, q_rows + kv_rows:].reshape(n, self.kv_heads, self.head_dim)
            cos, sin = ropes[layer.rope_base]
            q = _rotate(rms_norm(q, layer.q_norm, self.eps), cos, sin) * self.scale
            k = _rotate(rms_norm(k, layer.k_norm, self.eps), cos, sin)
            attn = np.empty((n, self.heads, self.head_dim), dtype=np.float32)
            for a, z in zip(starts[:-1], starts[1:]):
                self._attention(q[a:z], k[a:z], v[a:z], attn[a:z], layer.sliding)
            out = self._product(attn.reshape(n, q_rows), layer.out)
            x = x + rms_norm(out, layer.post_attention_norm, self.eps)
            gate_up = self._product(rms_norm(x, layer.pre_mlp_norm, self.eps), layer.gate_up)
            half = gate_up.shape[1] // 2
            act = gelu_tanh(gate_up[:, :half]) * gate_up[:, half:]
            x = x + rms_norm(self._product(act, layer.down), layer.post_mlp_norm, self.eps)
        return rms_norm(x, self.norm, self.eps)

    def _product(self, x: np.ndarray, weight: Weight) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if isinstance(weight, list):
            return np.concatenate([self._product(x, w) for w in weight], axis=1)
        if not isinstance(weight, np.ndarray):
            return weight.numpy_product(x)
        if self.rows is None or x.shape[0] > ROW_KERNEL_ROWS:
            return x @ weight.T
        out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        # (every weight over the cores: no BLAS threads spin beside a short input's pass)
        self.rows.product(weight, x, out, split_elements=SPLIT_ELEMENTS)
        return out

    def _attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                   sliding: bool) -> None:
        """One sequence: q (L, heads, d) already scaled, k and v (L, kv_heads, d) -> out."""
        length = q.shape[0]
        group = self.heads // self.kv_heads
        keys = k.transpose(1, 2, 0)  # (kv_heads, d, L)
        values = v.transpose(1, 0, 2)  # (kv_heads, L, d)
        for start in range(0, length, QUERY_BLOCK):
            stop = min(start + QUERY_BLOCK, length)
            lo, hi = (max(0, start - self.half_window),
                      min(length, stop + self.half_window)) if sliding else (0, length)
            # (kv_heads, group * queries, d): a KV head's query heads share its keys
            block = q[start:stop].reshape(stop - start, self.kv_heads, group, -1)
            block = block.transpose(1, 2, 0, 3).reshape(self.kv_heads, -1, self.head_dim)
            scores = block @ keys[:, :, lo:hi]  # (kv_heads, group * queries, keys)
            if sliding:
                rows = np.arange(start, stop)[:, None]
                far = np.abs(rows - np.arange(lo, hi)[None, :]) > self.half_window
                scores = scores.reshape(self.kv_heads, group, stop - start, hi - lo)
                scores[:, :, far] = -np.inf
                scores = scores.reshape(self.kv_heads, -1, hi - lo)
            scores = np.ascontiguousarray(scores)
            if self.ops is not None:
                self.ops.softmax(scores.reshape(-1, hi - lo), hi - lo)
            else:
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=-1, keepdims=True)
            result = scores @ values[:, lo:hi]  # (kv_heads, group * queries, d)
            result = result.reshape(self.kv_heads, group, stop - start, self.head_dim)
            out[start:stop] = result.transpose(2, 0, 1, 3).reshape(stop - start, self.heads,
                                                                   self.head_dim)


def _weight(module: Any, scratch: Scratch) -> Weight:
    """A layer's weight: its packed values on the quantized kernel where it is a 4- or 8-bit
    layer the kernel takes, else float32 (a view)."""
    import mlx.nn as nn

    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        kernel, weight = QuantKernel.load(), QuantizedWeight.of(module)
        if kernel is None or weight is None:
            raise ValueError("a quantized layer the kernel does not take: widen the model")
        return Host(kernel, weight, scratch)
    return _np(module.weight)


def _rope(positions: np.ndarray, dims: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (N, 1, dims / 2) of rotate-half rope at each packed row's position."""
    inv = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    angles = positions[:, None].astype(np.float64) * inv[None, :]
    return (np.cos(angles)[:, None, :].astype(np.float32),
            np.sin(angles)[:, None, :].astype(np.float32))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

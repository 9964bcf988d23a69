"""The encoders' forward pass in numpy, for a CPU: BERT (runner/embed/encoder.py) and Nomic BERT
(runner/embed/nomic.py), reading their float32 weights in place (numpy views of the MLX arrays).

Why: on a CPU, MLX's float32 products are 3-4x slower than numpy's BLAS for these shapes and
its dispatch costs milliseconds a short input (docs/PERFORMANCE.md, "Embedding models from
GGUF"): a nomic-embed-text-sized query took 85-95 ms, where llama.cpp takes about 26. The MLX modules stay the reference and serve
GPUs; tests hold the two to the same vectors.

- Projections are one BLAS product each over every row of the batch (q/k/v fused).
- Attention goes a row and a block of queries at a time (`QUERY_BLOCK`), so a 2,048-token input
  holds 12 x 256 x 2,048 scores, not 12 x 2,048 x 2,048; padded keys are masked out.
- GELU is BERT's erf form, with erf from Abramowitz and Stegun 7.1.26 (1.5e-7; within 6e-7
  computed in float32), since numpy has no erf.
- The element-wise steps (bias + GELU, SwiGLU's product, residual + LayerNorm, the softmax)
  run in C over the cores where the attention kernel's library builds
  (shared/assets/attend_kernel.c `mlxr_gelu_rows`...; numpy's were 40% of a batch's time,
  one core each); numpy otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxr.runner import host_parallel
from mlxr.runner.row_kernel import RowKernel
from mlxr.shared import native

QUERY_BLOCK = 256
ROW_KERNEL_ROWS = 32  # inputs of up to this many tokens (all rows together): the row kernel
_P = 0.3275911
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(x: np.ndarray) -> np.ndarray:
    """erf within 6e-7 (A&S 7.1.26's 1.5e-7, in float32), float32 in, float32 out."""
    a = np.abs(x)
    t = 1.0 / (1.0 + _P * a)
    poly = t * (_A[0] + t * (_A[1] + t * (_A[2] + t * (_A[3] + t * _A[4]))))
    return np.copysign(1.0 - poly * np.exp(-a * a), x).astype(np.float32, copy=False)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x * np.float32(0.7071067811865476)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps)) * weight + bias


class RowOps:
    """The C element-wise steps over rows of float32 (contiguous), split across the cores."""

    def __init__(self, gelu_fn, silu_fn, norm_fn, softmax_fn):
        self._gelu, self._silu, self._norm, self._softmax = gelu_fn, silu_fn, norm_fn, softmax_fn

    @classmethod
    @functools.lru_cache(maxsize=1)
    def load(cls, cache_dir: Path | None = None) -> "RowOps | None":
        found = native.built_functions(
            native.attend_kernel_library, cache_dir,
            ["mlxr_gelu_rows", "mlxr_silu_times_rows", "mlxr_add_layer_norm_rows",
             "mlxr_softmax_rows"], "encoder element-wise kernels (using numpy instead)")
        if found is None:
            return None
        gelu_fn, silu_fn, norm_fn, softmax_fn = found
        p, n = ctypes.c_void_p, ctypes.c_long
        gelu_fn.argtypes = [p, p, n, n, n]
        silu_fn.argtypes = [p, p, n, n, n]
        norm_fn.argtypes = [p, p, p, p, p, ctypes.c_float, n, n, n]
        softmax_fn.argtypes = [p, n, n, n, n, n, n]
        for fn in found:
            fn.restype = None
        return cls(gelu_fn, silu_fn, norm_fn, softmax_fn)

    def gelu(self, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        bias = np.zeros(x.shape[1], np.float32) if bias is None else bias
        self._rows(x, lambda a, z: self._gelu(x.ctypes.data, bias.ctypes.data, x.shape[1],
                                                a, z))
        return x

    def silu_times(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        self._rows(gate, lambda a, z: self._silu(gate.ctypes.data, up.ctypes.data,
                                                   gate.shape[1], a, z))
        return gate

    def add_layer_norm(self, x: np.ndarray, y: np.ndarray, bias: np.ndarray | None,
                       norm: tuple[np.ndarray, np.ndarray], eps: float) -> np.ndarray:
        address = bias.ctypes.data if bias is not None else None
        self._rows(x, lambda a, z: self._norm(x.ctypes.data, y.ctypes.data, address,
                                                norm[0].ctypes.data, norm[1].ctypes.data,
                                                eps, x.shape[1], a, z))
        return x

    def softmax(self, scores: np.ndarray, keys: int) -> None:
        """Softmax over each row's first `keys` columns (the rest 0), scores (rows, cols)."""
        rows, cols = scores.shape
        self._rows(scores, lambda a, z: self._softmax(scores.ctypes.data, cols, cols, keys, 1,
                                                        a, z))

    @staticmethod
    def _rows(x: np.ndarray, fn) -> None:
        assert x.dtype == np.float32 and x.flags.c_contiguous
        host_parallel.for_rows(x.shape[0], x.size, fn)


def _np(a: Any) -> np.ndarray:
    """A float32 view of an MLX array's memory (float32 weights, as on a CPU: no copy; the
    view keeps the array alive once the module goes), else a float32 copy."""
    import mlx.core as mx

    if a.dtype == mx.float32:
        mx.eval(a)
        return np.ascontiguousarray(np.asarray(a))  # (a copy only for a strided array)
    return np.array(a.astype(mx.float32), dtype=np.float32)


@dataclass(slots=True)
class _Layer:
    """Weights as the model stores them, (out, in): a product is x @ w.T."""
    qkv: np.ndarray  # (3 * hidden, hidden)
    qkv_bias: np.ndarray | None
    out: np.ndarray
    out_bias: np.ndarray | None
    norm1: tuple[np.ndarray, np.ndarray]
    up: np.ndarray  # BERT: the intermediate dense; Nomic: fc11
    up_bias: np.ndarray | None
    gate: np.ndarray | None  # Nomic: fc12 (SwiGLU)
    down: np.ndarray
    down_bias: np.ndarray | None
    norm2: tuple[np.ndarray, np.ndarray]


class HostEncoder:
    """input ids (B, L) and a 0/1 mask (B, L) -> last hidden states (B, L, H), float32."""

    def __init__(self, *, words: np.ndarray, types: np.ndarray, positions: np.ndarray | None,
                 norm: tuple[np.ndarray, np.ndarray], layers: list[_Layer], heads: int,
                 eps: float, rope_base: float | None):
        self.words, self.types, self.positions = words, types, positions
        self.norm, self.layers, self.heads, self.eps = norm, layers, heads, eps
        self.rope_base = rope_base
        self.ops = RowOps.load()  # None: numpy's element-wise steps
        self.rows = RowKernel.load()  # None: BLAS for every product

    @classmethod
    def of(cls, model: Any) -> "HostEncoder":
        """The weights of an encoder.BertEncoder or nomic.NomicEncoder, as views of its float32
        arrays (BERT's q, k and v joined in a copy); the caller may then drop the module."""
        from mlxr.runner.embed.nomic import NomicEncoder

        if isinstance(model, NomicEncoder):
            return cls._of_nomic(model)
        cfg, emb = model.config, model.embeddings
        layers = []
        for layer in model.encoder.layer:
            a = layer.attention
            layers.append(_Layer(
                qkv=np.concatenate([_np(p.weight) for p in (a.query, a.key, a.value)]),
                qkv_bias=np.concatenate([_np(p.bias) for p in (a.query, a.key, a.value)]),
                out=_np(a.output.dense.weight), out_bias=_np(a.output.dense.bias),
                norm1=(_np(a.output.LayerNorm.weight), _np(a.output.LayerNorm.bias)),
                up=_np(layer.intermediate.dense.weight),
                up_bias=_np(layer.intermediate.dense.bias), gate=None,
                down=_np(layer.output.dense.weight),
                down_bias=_np(layer.output.dense.bias),
                norm2=(_np(layer.output.LayerNorm.weight), _np(layer.output.LayerNorm.bias))))
        return cls(words=_np(emb.word_embeddings.weight), types=_np(emb.token_type_embeddings.weight),
                   positions=_np(emb.position_embeddings.weight),
                   norm=(_np(emb.LayerNorm.weight), _np(emb.LayerNorm.bias)), layers=layers,
                   heads=cfg.num_attention_heads, eps=cfg.layer_norm_eps, rope_base=None)

    @classmethod
    def _of_nomic(cls, model: Any) -> "HostEncoder":
        cfg = model.config
        layers = [_Layer(
            qkv=_np(b.attn.Wqkv.weight), qkv_bias=None,
            out=_np(b.attn.out_proj.weight), out_bias=None,
            norm1=(_np(b.norm1.weight), _np(b.norm1.bias)),
            up=_np(b.mlp.fc11.weight), up_bias=None,
            gate=_np(b.mlp.fc12.weight),
            down=_np(b.mlp.fc2.weight), down_bias=None,
            norm2=(_np(b.norm2.weight), _np(b.norm2.bias))) for b in model.encoder.layers]
        return cls(words=_np(model.embeddings.word_embeddings.weight),
                   types=_np(model.embeddings.token_type_embeddings.weight), positions=None,
                   norm=(_np(model.emb_ln.weight), _np(model.emb_ln.bias)), layers=layers,
                   heads=cfg.n_head, eps=cfg.layer_norm_epsilon, rope_base=cfg.rotary_emb_base)

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        b, length = ids.shape
        x = self.words[ids] + self.types[0]
        if self.positions is not None:
            x = x + self.positions[:length]
        x = layer_norm(x, *self.norm, self.eps).reshape(b * length, -1)
        hidden = x.shape[-1]
        rope = self._rope(length, hidden // self.heads) if self.rope_base else None
        # additive key mask (B, 1, 1, L)
        key_bias = np.where(mask[:, None, None, :] > 0, np.float32(0), np.float32(-np.inf))
        lengths = mask.sum(axis=1)
        for layer in self.layers:
            qkv = self._product(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            attn = self._attention(qkv.reshape(b, length, 3, self.heads, -1), key_bias, rope,
                                   lengths)
            attn = self._product(attn.reshape(b * length, hidden), layer.out)
            x = self._add_norm(x, attn, layer.out_bias, layer.norm1)
            up = self._product(x, layer.up)
            if layer.gate is not None:
                act = self._swiglu(self._product(x, layer.gate), up)
            elif self.ops is not None:
                act = self.ops.gelu(up, layer.up_bias)
            else:
                act = gelu(up + layer.up_bias if layer.up_bias is not None else up)
            x = self._add_norm(x, self._product(act, layer.down), layer.down_bias, layer.norm2)
        return x.reshape(b, length, hidden)

    def _product(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x @ weight.T: the row kernel for a few rows (one pass over the weight for 16 rows,
        at about twice BLAS's speed there), else BLAS."""
        if self.rows is None or x.shape[0] > ROW_KERNEL_ROWS:
            return x @ weight.T
        out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        self.rows.product(weight, x, out)
        return out

    def _add_norm(self, x: np.ndarray, y: np.ndarray, bias: np.ndarray | None,
                  norm: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """LayerNorm(x + y + bias)."""
        if self.ops is not None:
            return self.ops.add_layer_norm(x, y, bias, norm, self.eps)
        return layer_norm(x + y + bias if bias is not None else x + y, *norm, self.eps)

    def _swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.ops is not None:
            return self.ops.silu_times(gate, up)
        return silu(gate) * up

    def _rope(self, length: int, dims: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (L, 1, dims / 2) of rotate-half rope (GPT-NeoX's, Nomic's)."""
        inv = self.rope_base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
        angles = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
        return (np.cos(angles)[:, None, :].astype(np.float32),
                np.sin(angles)[:, None, :].astype(np.float32))

    def _attention(self, qkv: np.ndarray, key_bias: np.ndarray,
                   rope: tuple[np.ndarray, np.ndarray] | None,
                   lengths: np.ndarray) -> np.ndarray:
        """qkv (B, L, 3, heads, d) -> (B, L, heads, d); row r's keys are its first
        lengths[r] (the rest padding)."""
        b, length, _, heads, d = qkv.shape
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        scale = np.float32(1.0 / np.sqrt(d))
        out = np.empty((b, length, heads, d), dtype=np.float32)
        for row in range(b):
            keys = np.ascontiguousarray(k[row].transpose(1, 2, 0))  # (heads, d, L)
            values = np.ascontiguousarray(v[row].transpose(1, 0, 2))  # (heads, L, d)
            for start in range(0, length, QUERY_BLOCK):
                queries = q[row, start:start + QUERY_BLOCK].transpose(1, 0, 2) * scale
                scores = queries @ keys  # (heads, n, L)
                if self.ops is not None:
                    self.ops.softmax(scores.reshape(-1, length), int(lengths[row]))
                else:
                    scores += key_bias[row]
                    scores -= scores.max(axis=-1, keepdims=True)
                    np.exp(scores, out=scores)
                    scores /= scores.sum(axis=-1, keepdims=True)
                out[row, start:start + QUERY_BLOCK] = (scores @ values).transpose(1, 0, 2)
        return out


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half rope over the last axis of x (B, L, heads, d)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

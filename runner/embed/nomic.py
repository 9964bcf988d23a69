"""Nomic BERT (nomic-embed-text v1 and v1.5) in MLX, from a directory with Nomic's config.json
(model_type "nomic_bert") and weights under Nomic's names, as Hugging Face has them and as
supervisor/store/gguf/encoders.py writes them from a "nomic-bert" GGUF.

BERT with rotary positions (no position table), one fused q/k/v projection, a SwiGLU MLP
(silu(fc12(x)) * fc11(x)) and no biases; LayerNorm after each block (post-norm), as llama.cpp
runs it. Device-agnostic: mlx.core / mlx.nn only. Padding is right-sided and masked out of
the keys, so a padded row's real tokens get the values they would get alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr.runner.embed.encoder import key_mask, load_weights


@dataclass(slots=True)
class NomicConfig:
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    n_positions: int = 2048
    layer_norm_epsilon: float = 1e-12
    rotary_emb_base: float = 1000.0
    type_vocab_size: int = 2

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NomicConfig":
        wanted = {"rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                  "activation_function": "swiglu", "prenorm": False, "qkv_proj_bias": False,
                  "mlp_fc1_bias": False, "mlp_fc2_bias": False, "rotary_emb_scale_base": None}
        for key, value in wanted.items():
            if d.get(key, value) != value:
                raise ValueError(f"nomic_bert with {key}={d[key]!r} is not supported "
                                 f"(only {value!r})")
        if d.get("moe_every_n_layers"):
            raise ValueError("nomic_bert mixtures of experts (v2) are not supported")
        names = ("vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
                 "layer_norm_epsilon", "rotary_emb_base", "type_vocab_size")
        cfg = cls(**{n: d[n] for n in names if d.get(n) is not None})
        # v1 and v1.5 say 8192 positions but were trained on 2048 (llama.cpp keeps 2048).
        if cfg.n_positions == 8192 and d.get("max_trained_positions", 2048) == 2048:
            cfg.n_positions = 2048
        return cfg


class Attention(nn.Module):
    def __init__(self, cfg: NomicConfig):
        super().__init__()
        self.heads = cfg.n_head
        self.Wqkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.base = cfg.rotary_emb_base

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, length, dims = x.shape
        head_dim = dims // self.heads
        qkv = self.Wqkv(x).reshape(b, length, 3, self.heads, head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = mx.fast.rope(q, head_dim, traditional=False, base=self.base, scale=1.0, offset=0)
        k = mx.fast.rope(k, head_dim, traditional=False, base=self.base, scale=1.0, offset=0)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(head_dim),
                                                   mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, length, dims))


class Mlp(nn.Module):
    def __init__(self, cfg: NomicConfig):
        super().__init__()
        self.fc11 = nn.Linear(cfg.n_embd, cfg.n_inner, bias=False)  # up
        self.fc12 = nn.Linear(cfg.n_embd, cfg.n_inner, bias=False)  # gate
        self.fc2 = nn.Linear(cfg.n_inner, cfg.n_embd, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.silu(self.fc12(x)) * self.fc11(x))


class Block(nn.Module):
    def __init__(self, cfg: NomicConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = Mlp(cfg)
        self.norm1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.norm2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.norm1(x + self.attn(x, mask))
        return self.norm2(x + self.mlp(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: NomicConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.n_embd)


class Layers(nn.Module):
    def __init__(self, cfg: NomicConfig):
        super().__init__()
        self.layers = [Block(cfg) for _ in range(cfg.n_layer)]


class NomicEncoder(nn.Module):
    """input ids (B, L) and a 0/1 attention mask (B, L) -> last hidden states (B, L, H)."""

    def __init__(self, cfg: NomicConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.emb_ln = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.encoder = Layers(cfg)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array,
                 token_type_ids: mx.array | None = None) -> mx.array:
        if token_type_ids is None:
            token_type_ids = mx.zeros_like(input_ids)
        x = self.embeddings.word_embeddings(input_ids) + \
            self.embeddings.token_type_embeddings(token_type_ids)
        x = self.emb_ln(x)
        mask = key_mask(attention_mask, x.dtype)
        for block in self.encoder.layers:
            x = block(x, mask)
        return x


def load_nomic(model_dir: str | Path) -> NomicEncoder:
    """Build the encoder from config.json and load its weights (encoder.load_weights)."""
    model_dir = Path(model_dir)
    cfg = NomicConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    return load_weights(NomicEncoder(cfg), model_dir)

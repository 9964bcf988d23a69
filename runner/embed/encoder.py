"""A BERT-family encoder in MLX, loaded from a Hugging Face directory (config.json plus
*.safetensors with HF weight names, with or without the `bert.` prefix).

Device-agnostic: only mlx.core / mlx.nn operations, so it runs on CPU, Metal or CUDA alike.
Padding is right-sided and masked out of the keys with an additive mask, so a padded row
computes the same values for its real tokens as it would alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr.shared.encoders import position_offset

# Weights a bare encoder does not use: the pooler (sentence-transformers pools itself), the
# masked-LM head of *ForMaskedLM checkpoints and a buffer that HF saves with the weights.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")
_ACTIVATIONS = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx,
                "gelu_fast": nn.gelu_fast_approx, "relu": nn.relu}


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    layer_norm_eps: float = 1e-12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_act: str = "gelu"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BertConfig":
        kind = d.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"unsupported position_embedding_type {kind!r}")
        if d.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}")
        names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "layer_norm_eps", "max_position_embeddings",
                 "type_vocab_size", "hidden_act")
        return cls(**{n: d[n] for n in names if d.get(n) is not None})


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, input_ids: mx.array, token_type_ids: mx.array) -> mx.array:
        positions = mx.arange(input_ids.shape[1])[None, :]
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class DenseNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: LayerNorm(dense(x) + residual)."""

    def __init__(self, dims_in: int, dims_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(dims_in, dims_out)
        self.LayerNorm = nn.LayerNorm(dims_out, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, length, dims = x.shape
        head_dim = dims // self.num_heads

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, length, self.num_heads, head_dim).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
            scale=1.0 / math.sqrt(head_dim), mask=mask)
        return self.output(out.transpose(0, 2, 1, 3).reshape(b, length, dims), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Stack(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class BertEncoder(nn.Module):
    """input ids (B, L) and a 0/1 attention mask (B, L) -> last hidden states (B, L, H)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Stack(cfg)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array,
                 token_type_ids: mx.array | None = None) -> mx.array:
        if token_type_ids is None:
            token_type_ids = mx.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        mask = key_mask(attention_mask, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def key_mask(attention_mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """The additive key mask (B, 1, 1, L) of a 0/1 mask of real tokens: padded keys get -inf.
    Every row has at least one real token, so no softmax row is all -inf."""
    return mx.where(attention_mask[:, None, None, :].astype(mx.bool_),
                    mx.array(0.0, dtype), mx.array(-mx.inf, dtype))


def sanitize(weights: dict[str, mx.array], offset: int = 0) -> dict[str, mx.array]:
    """HF names -> this module's names: drop `bert.` (`roberta.`), unused tensors, and the
    `self.` level; the position table from its first position (`offset` rows in)."""
    out = {}
    for name, value in weights.items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith(_UNUSED_PREFIXES) or name.startswith("lm_head."):
            continue
        if name == "embeddings.position_embeddings.weight":
            value = value[offset:]
        out[name.replace(".attention.self.", ".attention.")] = value
    return out


def load_bert(model_dir: str | Path) -> BertEncoder:
    """Build the encoder from config.json and load its weights (`load_weights`). An
    XLM-RoBERTa directory becomes BERT with its position table cut to start at position 0."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    offset = position_offset(config)
    if offset:
        config = {**config, "max_position_embeddings": config["max_position_embeddings"] - offset}
    return load_weights(BertEncoder(BertConfig.from_dict(config)), model_dir,
                        lambda weights: sanitize(weights, offset))


def load_weights(model: nn.Module, model_dir: Path, rename=lambda weights: weights):
    """`model` with every *.safetensors file of `model_dir` loaded strictly (a missing or
    unexpected tensor is an error, not a silently random weight), after `rename`."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    weights: dict[str, mx.array] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    model.load_weights(list(rename(weights).items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model

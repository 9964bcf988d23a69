"""Embedding models made from a decoder whose attention looks both ways: EmbeddingGemma
(config.json `use_bidirectional_attention`, a gemma3_text body). mlx_lm builds the layers;
this module runs them with its own masks and pools, as sentence-transformers does:

- every token sees every real token on a global layer, and those within half the sliding
  window either side (|i - j| <= window // 2, inclusive) on a sliding one (transformers halves
  the config's window for this model; llama.cpp's symmetric window is the same);
- the embedding is scaled by sqrt(hidden) in float32 (mlx_lm's causal model rounds that
  factor to bfloat16; transformers and llama.cpp do not);
- then the final norm, the pooling of the sentence-transformers files, their Dense modules
  (runner/embed/dense.py) and normalization.

A padded position attends to itself at least, so no row of a mask is empty (an empty row is
NaN, and NaN times a pooling weight of 0 is still NaN).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxr.shared.errors import UnsupportedModel
from mlxr.shared.model_classes import base_named_classes
from mlxr.shared.sentence_transformers import PoolingConfig, read_pooling_config
from mlxr.runner.embed.dense import DenseLayer, load_dense
from mlxr.runner.embed.embeddings import _fit, finish, out_width, pad_batch
from mlxr.runner.embed.pooling import pool

MODEL_TYPES = ("gemma3_text",)


def is_bidirectional_dir(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("use_bidirectional_attention"))


def sliding_pattern(config: dict[str, Any]) -> int:
    """Every pattern-th layer is global: from `layer_types` where the config has them (they
    must be periodic: mlx_lm's gemma3 picks each layer's rope by the period), else
    `sliding_window_pattern` (transformers' `_sliding_window_pattern`), else 6."""
    pattern = int(config.get("sliding_window_pattern")
                  or config.get("_sliding_window_pattern") or 6)
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        pattern = next((i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"),
                       len(kinds) + 1)
        expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(len(kinds))]
        if kinds != expected:
            raise UnsupportedModel(f"layer_types {kinds} are not periodic")
    return pattern


def attention_masks(mask: np.ndarray, half_window: int) -> tuple[np.ndarray, np.ndarray]:
    """(global, sliding) boolean masks (B, 1, L, L), True where a query may attend to a key,
    from the (B, L) 0/1 mask of real tokens."""
    length = mask.shape[1]
    real = mask.astype(bool)[:, None, None, :]
    self_ = np.eye(length, dtype=bool)[None, None]
    positions = np.arange(length)
    near = np.abs(positions[:, None] - positions[None, :]) <= half_window
    full = real | self_
    return full, (real & near[None, None]) | self_


@dataclass(slots=True)
class BidirectionalEmbedder:
    model: Any  # mlx_lm's gemma3_text Model; its `model` holds the layers
    tokenizer: Any  # runner/tokenizer.py's Tokenizer
    pooling: PoolingConfig
    dense: list[DenseLayer]
    max_length: int
    dim: int
    vocab_size: int
    half_window: int
    sliding: list[bool]  # per layer
    embed_scale: float
    host: Any = None  # runner/embed/host_gemma.py's HostGemma: the forward pass in numpy

    def encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        # With the tokenizer's own special tokens (<bos> ... <eos> for EmbeddingGemma).
        return [_fit(self.tokenizer.encode(text), self.max_length, truncate) for text in texts]

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        import mlx.core as mx

        ids, mask = pad_batch(batch)
        if self.host is not None:
            packed = self.host(batch)
            hidden = np.zeros((*ids.shape, packed.shape[-1]), dtype=np.float32)
            hidden[mask.astype(bool)] = packed  # (rows in order, each row's tokens in order)
            return finish(pool(hidden, mask, self.pooling.modes), self.pooling, self.dense)
        full, sliding = (mx.array(m) for m in attention_masks(mask, self.half_window))
        body = self.model.model
        h = body.embed_tokens(mx.array(ids))
        h = h * mx.array(self.embed_scale, dtype=h.dtype)
        for layer, is_sliding in zip(body.layers, self.sliding):
            h = layer(h, sliding if is_sliding else full, None)
        hidden = body.norm(h).astype(mx.float32)
        return finish(np.array(pool(hidden, mx.array(mask), self.pooling.modes)), self.pooling,
                      self.dense)


def _all_on_kernel(model) -> bool:
    """Whether `model` has quantized layers and the quantized kernel takes every one of them
    (then the numpy pass keeps them packed; otherwise the model is widened whole)."""
    import mlx.nn as nn

    from mlxr.runner.quant_kernel import QuantKernel, takes

    quantized = [m for _, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    return bool(quantized) and QuantKernel.load() is not None and all(map(takes, quantized))


def load_bidirectional_embedder(model_dir: str | Path, context_length: int,
                                widen: bool, host: bool = False) -> BidirectionalEmbedder:
    """Load the body with mlx_lm (weights named as the base model saves them, `layers.0...`,
    or as a causal one's, `model.layers.0...`), the tokenizer, and the sentence-transformers
    files. `widen`: float32 weights (a CPU, where MLX's quantized products are slow); `host`
    (with `widen`): the forward pass in numpy (runner/embed/host_gemma.py), where the model
    has no rope scaling."""
    from mlx_lm.utils import load_model

    from mlxr.runner.tokenizer import load_tokenizer
    from mlxr.runner.weights import widen as widen_model, widen_around_kernel

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") not in MODEL_TYPES:
        raise UnsupportedModel(f"bidirectional attention in a {config.get('model_type')} "
                               "model is not supported (mlxr serves it in gemma3_text)")
    pattern = sliding_pattern(config)
    model, model_config = load_model(model_dir, model_config={"sliding_window_pattern": pattern},
                                     get_model_classes=base_named_classes)
    numpy_pass = host and widen and not model_config.get("rope_scaling")
    if numpy_pass and _all_on_kernel(model):
        widen_around_kernel(model)  # the numpy pass reads 4- and 8-bit layers as they are
    elif widen:
        widen_model(model)
    tokenizer = load_tokenizer(model_dir, model_config, model)
    pooling = read_pooling_config(model_dir)
    hidden = int(model_config["hidden_size"])
    width = hidden * len(pooling.modes)
    dense = load_dense(model_dir, pooling.dense, width)
    limits = [int(model_config.get("max_position_embeddings") or context_length),
              context_length]
    if pooling.max_seq_length:
        limits.append(pooling.max_seq_length)
    layers = int(model_config["num_hidden_layers"])
    sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    half_window = int(model_config.get("sliding_window") or 512) // 2
    if numpy_pass:
        from mlxr.runner.embed.host_gemma import HostGemma

        numpy_pass = HostGemma.of(model, sliding, half_window, math.sqrt(hidden))
    return BidirectionalEmbedder(
        model=model, tokenizer=tokenizer, pooling=pooling, dense=dense, max_length=min(limits),
        dim=out_width(dense, width),
        vocab_size=int(model_config["vocab_size"]), half_window=half_window, sliding=sliding,
        embed_scale=math.sqrt(hidden), host=numpy_pass or None)

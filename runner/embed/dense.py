"""sentence-transformers' Dense modules: linear layers applied to the pooled vector, in the
order modules.json lists them, before normalization (EmbeddingGemma: 768 -> 3072 -> 768).

Each module's folder holds config.json (read by shared/sentence_transformers.py into a
DenseSpec) and model.safetensors with `linear.weight` (out, in) and, with `bias`,
`linear.bias`. The products run in numpy, float32: a pooled batch is a few rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxr.shared.errors import InvalidModelFile
from mlxr.shared.sentence_transformers import DenseSpec


@dataclass(frozen=True, slots=True)
class DenseLayer:
    weight: np.ndarray  # (out, in) float32
    bias: np.ndarray | None
    activation: str  # DenseSpec.activation: "identity" or "tanh"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return np.tanh(y) if self.activation == "tanh" else y


def load_dense(model_dir: str | Path, specs: list[DenseSpec], width: int) -> list[DenseLayer]:
    """The layers `specs` name, checked against each other and the pooled `width`."""
    import mlx.core as mx  # reads bfloat16 files too, which numpy cannot

    layers = []
    for spec in specs:
        if spec.in_features != width:
            raise InvalidModelFile(f"{spec.path}: Dense takes {spec.in_features} values where "
                                   f"the vector before it has {width}")
        path = Path(model_dir) / spec.path / "model.safetensors"
        try:
            tensors = mx.load(str(path))
        except (OSError, ValueError, RuntimeError) as exc:
            raise InvalidModelFile(f"{spec.path}/model.safetensors: {exc}") from None
        weight = _float32(tensors, "linear.weight", spec)
        if weight.shape != (spec.out_features, spec.in_features):
            raise InvalidModelFile(f"{spec.path}: linear.weight has shape {weight.shape}, its "
                                   f"config says ({spec.out_features}, {spec.in_features})")
        bias = _float32(tensors, "linear.bias", spec) if spec.bias else None
        if bias is not None and bias.shape != (spec.out_features,):
            raise InvalidModelFile(f"{spec.path}: linear.bias has shape {bias.shape}")
        layers.append(DenseLayer(weight, bias, spec.activation))
        width = spec.out_features
    return layers


def apply_dense(layers: list[DenseLayer], x: np.ndarray) -> np.ndarray:
    for layer in layers:
        x = layer(x)
    return x


def _float32(tensors: dict, name: str, spec: DenseSpec) -> np.ndarray:
    import mlx.core as mx

    if name not in tensors:
        raise InvalidModelFile(f"{spec.path}/model.safetensors has no {name}")
    return np.array(tensors[name].astype(mx.float32))

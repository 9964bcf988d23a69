"""The sentence-transformers files of a model directory, read by the runner (how to pool and
normalize) and written by the store (GGUF embedding models become such directories).

Rules (see docs/embeddings.md):
- modules.json lists the modules. Pooling reads `<Pooling path>/config.json` (symlinks are
  fine), else a flattened `<path>_config.json` or `pooling_config.json`; with none of these,
  mean pooling. A `Normalize` module means L2 normalization. `Dense` modules after the
  pooling (EmbeddingGemma's two) are read from `<path>/config.json`: linear layers with an
  identity or tanh activation. Modules that change the vectors and that we do not implement
  (LayerNorm, a Dense before the pooling or with another activation, ...) are a load error,
  never silently wrong.
- Without modules.json: mean pooling and L2 normalization (Ollama normalizes every embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# sentence-transformers' concatenation order when several modes are on.
MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens":
             "mean_sqrt_len", "pooling_mode_lasttoken": "lasttoken"}
_IGNORED_MODULES = ("Transformer", "Pooling", "Normalize")
# sentence-transformers' Dense `activation_function` (its default is tanh)
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                "torch.nn.modules.activation.Tanh": "tanh"}
MAX_DENSE_FEATURES = 1 << 16


@dataclass(frozen=True, slots=True)
class DenseSpec:
    path: str  # the module's folder: config.json and model.safetensors
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" or "tanh"


@dataclass(slots=True)
class PoolingConfig:
    modes: list[str] = field(default_factory=lambda: ["mean"])
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json, when present
    dense: list[DenseSpec] = field(default_factory=list)  # after pooling, in order


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    model_dir = Path(model_dir)
    cfg = PoolingConfig()
    bert_cfg = _read_json(model_dir / "sentence_bert_config.json")
    if isinstance(bert_cfg, dict) and isinstance(bert_cfg.get("max_seq_length"), int):
        cfg.max_seq_length = bert_cfg["max_seq_length"]
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return cfg  # no sentence-transformers description: mean + normalize
    modules = [m for m in modules if isinstance(m, dict)]
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unsupported = [k for k in kinds if k not in (*_IGNORED_MODULES, "Dense")]
    if unsupported:
        raise ValueError(f"unsupported sentence-transformers modules: {', '.join(unsupported)}")
    if "Dense" in kinds and ("Pooling" not in kinds
                             or kinds.index("Dense") < kinds.index("Pooling")):
        raise ValueError("unsupported sentence-transformers modules: a Dense before the pooling")
    cfg.dense = [_dense_spec(model_dir, m) for m, kind in zip(modules, kinds) if kind == "Dense"]
    cfg.normalize = "Normalize" in kinds
    pooling = next((m for m in modules if isinstance(m, dict)
                    and str(m.get("type", "")).endswith("Pooling")), None)
    path = str(pooling.get("path") or "1_Pooling") if pooling else "1_Pooling"
    for candidate in (f"{path}/config.json", f"{path}_config.json", "pooling_config.json"):
        data = _read_json(model_dir / candidate)
        if isinstance(data, dict):
            cfg.modes = modes_from_config(data)
            break
    return cfg


def modes_from_config(data: dict[str, Any]) -> list[str]:
    """The pooling modes a 1_Pooling/config.json switches on, in concatenation order."""
    if data.get("pooling_mode_weightedmean_tokens"):
        raise ValueError("weighted-mean pooling is not supported")
    on = {mode for key, mode in MODE_KEYS.items() if data.get(key)}
    if not on:
        raise ValueError("the pooling config switches on no pooling mode")
    return [mode for mode in MODES if mode in on]


def _dense_spec(model_dir: Path, module: dict[str, Any]) -> DenseSpec:
    path = str(module.get("path") or "")
    if not path or "/" in path or "\\" in path or path.startswith("."):
        raise ValueError(f"a Dense module's path {path!r} is not a folder of the model")
    data = _read_json(model_dir / path / "config.json")
    if not isinstance(data, dict):
        raise ValueError(f"the Dense module {path} has no config.json")
    sizes = [data.get("in_features"), data.get("out_features")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_DENSE_FEATURES
               for n in sizes):
        raise ValueError(f"the Dense module {path}: in_features and out_features must be "
                         f"integers from 1 to {MAX_DENSE_FEATURES}, not {sizes}")
    name = data.get("activation_function", "torch.nn.modules.activation.Tanh")
    if name not in _ACTIVATIONS:
        raise ValueError(f"the Dense module {path}: activation {name!r} is not supported "
                         "(identity or tanh)")
    return DenseSpec(path, sizes[0], sizes[1], bool(data.get("bias", True)), _ACTIVATIONS[name])


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it is absent (a dangling symlink counts as absent)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None

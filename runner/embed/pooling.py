"""Pooling, L2 normalization and Matryoshka truncation, as sentence-transformers does them,
and the rules that read its module files from a model directory.

No mlx import: the math uses only operations that numpy and mlx arrays share, so the engine
runs it on mlx arrays and unit tests check it on numpy arrays.

Rules for the sentence-transformers files (see docs/embeddings.md):
- modules.json lists the modules. Pooling reads `<Pooling path>/config.json` (symlinks are
  fine), else a flattened `<path>_config.json` or `pooling_config.json`; with none of these,
  mean pooling. A `Normalize` module means L2 normalization. Modules that change the vectors
  and that we do not implement (Dense, LayerNorm, ...) are a load error, never silently wrong.
- Without modules.json: mean pooling and L2 normalization (Ollama normalizes every embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

# sentence-transformers' concatenation order when several modes are on.
MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens":
              "mean_sqrt_len", "pooling_mode_lasttoken": "lasttoken"}
_IGNORED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(slots=True)
class PoolingConfig:
    modes: list[str] = field(default_factory=lambda: ["mean"])
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json, when present


def _xp(x: Any) -> ModuleType:
    """The array module of `x`: mlx.core for mlx arrays, else numpy."""
    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        return mx
    return np


def pool(hidden: Any, mask: Any, modes: list[str]) -> Any:
    """(B, L, H) hidden states and a (B, L) 0/1 mask of real tokens (right padding) ->
    (B, H * len(modes)), one block per mode in the given order."""
    xp = _xp(hidden)
    m = mask[:, :, None].astype(hidden.dtype)
    counts = m.sum(axis=1)  # (B, 1)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "max":
            # Padded positions get a very negative value, as sentence-transformers does.
            out.append(xp.where(m > 0, hidden, xp.array(-1e9, dtype=hidden.dtype)).max(axis=1))
        elif mode == "mean":
            out.append((hidden * m).sum(axis=1) / xp.maximum(counts, 1e-9))
        elif mode == "mean_sqrt_len":
            out.append((hidden * m).sum(axis=1) / xp.sqrt(xp.maximum(counts, 1e-9)))
        elif mode == "lasttoken":
            last = (mask.sum(axis=1).astype(xp.int32) - 1)[:, None, None]
            index = xp.broadcast_to(last, (hidden.shape[0], 1, hidden.shape[2]))
            out.append(xp.take_along_axis(hidden, index, axis=1)[:, 0])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return out[0] if len(out) == 1 else xp.concatenate(out, axis=-1)


def l2_normalize(x: Any) -> Any:
    """Rows scaled to unit length; all-zero rows stay zero (torch's F.normalize, eps 1e-12)."""
    xp = _xp(x)
    norms = xp.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / xp.maximum(norms, 1e-12)


def truncate_dimensions(x: Any, dimensions: int | None) -> Any:
    """Matryoshka: keep the first `dimensions` values and renormalize."""
    if dimensions is None or dimensions >= x.shape[-1]:
        return x
    return l2_normalize(x[..., :dimensions])


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    model_dir = Path(model_dir)
    cfg = PoolingConfig()
    bert_cfg = _read_json(model_dir / "sentence_bert_config.json")
    if isinstance(bert_cfg, dict) and isinstance(bert_cfg.get("max_seq_length"), int):
        cfg.max_seq_length = bert_cfg["max_seq_length"]
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return cfg  # no sentence-transformers description: mean + normalize
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    unsupported = [k for k in kinds if k not in _IGNORED_MODULES]
    if unsupported:
        raise ValueError(f"unsupported sentence-transformers modules: {', '.join(unsupported)}")
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
    on = {mode for key, mode in _MODE_KEYS.items() if data.get(key)}
    if not on:
        raise ValueError("the pooling config switches on no pooling mode")
    return [mode for mode in MODES if mode in on]


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it is absent (a dangling symlink counts as absent)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None

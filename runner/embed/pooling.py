"""Pooling, L2 normalization and Matryoshka truncation, as sentence-transformers does them.
The rules that read its module files from a model directory are shared/sentence_transformers.py.

No mlx import: the math uses only operations that numpy and mlx arrays share, so the engine
runs it on mlx arrays and unit tests check it on numpy arrays.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


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

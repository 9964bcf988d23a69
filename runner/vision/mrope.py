"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL) on mlx-lm's text model.

mlx-lm serves these models' language part as plain qwen2 with one-dimensional RoPE, which is
exact for text: there the three position streams (time, height, width) are equal. An image's
tokens get their own positions in each stream, and the text after an image continues from the
largest of them, so a sequence's decode position is its offset plus a fixed `delta` (negative
after an image). `install` puts a `MultiRope` in place of every attention layer's RoPE; the
model step sets, for one forward pass, either explicit positions (3, B, L) for a prefill chunk
of an image prompt, or per-row deltas for a decode step. With neither set, the layer is the
plain RoPE it replaced: a text-only batch runs exactly as on a text model.

Invariant: the state is set and cleared around a single forward pass (`RopeState.use`), on the
engine thread; nothing else reads it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(slots=True)
class RopeState:
    positions: mx.array | None = None  # (3, B, L) int32
    deltas: mx.array | None = None  # (B,) int32, added to each row's offset

    @contextmanager
    def use(self, positions: mx.array | None = None, deltas: mx.array | None = None):
        self.positions, self.deltas = positions, deltas
        try:
            yield
        finally:
            self.positions = self.deltas = None


class MultiRope(nn.Module):
    def __init__(self, plain, dims: int, base: float, sections: list[int], state: RopeState):
        super().__init__()
        if sum(sections) != dims // 2:
            raise ValueError(f"mrope sections {sections} do not cover {dims // 2} frequencies")
        self._plain = plain
        self._state = state
        self._dims = dims
        inv = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
        self._inv_freq = inv
        # which of the three position streams each frequency reads
        self._stream = mx.array([i for i, n in enumerate(sections) for _ in range(n)],
                                dtype=mx.int32)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        state = self._state
        if state.positions is None:
            if state.deltas is not None:
                offset = offset + state.deltas
            return self._plain(x, offset=offset)
        return self._rotate(x, state.positions)

    def _rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        # freqs[s, b, l, f] = positions[s, b, l] * inv_freq[f]; frequency f takes stream s(f)
        freqs = positions.astype(mx.float32)[..., None] * self._inv_freq
        index = mx.broadcast_to(self._stream[None, None, None, :], (1,) + freqs.shape[1:])
        freqs = mx.take_along_axis(freqs, index, axis=0)[0]  # (B, L, dims/2)
        cos, sin = mx.cos(freqs)[:, None], mx.sin(freqs)[:, None]  # (B, 1, L, dims/2)
        half = self._dims // 2
        x1, x2 = x[..., :half].astype(mx.float32), x[..., half:self._dims].astype(mx.float32)
        out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        if self._dims < x.shape[-1]:
            out = mx.concatenate([out, x[..., self._dims:].astype(mx.float32)], axis=-1)
        return out.astype(x.dtype)


def install(text_model, config: dict) -> RopeState | None:
    """Give `text_model`'s attention layers multimodal RoPE where `config` (the checkpoint's
    config.json) asks for it; returns the state to drive it, or None (plain RoPE)."""
    text = config.get("text_config") or config
    scaling = text.get("rope_scaling") or config.get("rope_scaling") or {}
    sections = scaling.get("mrope_section")
    if not sections:
        return None
    state = RopeState()
    for layer in text_model.layers:
        attn = layer.self_attn
        plain = attn.rope
        if getattr(plain, "traditional", False):
            raise ValueError("multimodal RoPE over a traditional RoPE is not supported")
        base = getattr(plain, "base", None) or text.get("rope_theta") or \
            config.get("rope_theta") or 1e6
        attn.rope = MultiRope(plain, plain.dims, float(base), list(sections), state)
    return state

"""What the runner needs to know about particular architectures beyond mlx_lm's models.

- `logit_transform`: the step from the head's matrix product to the logits, where a model has
  one (Gemma 2's final soft-capping, Granite's logits scaling), so the runner still splits the
  model into body and head and computes a prefill's logits for its last position only.
- `fix_model` gives gpt-oss's mxfp4 experts the CPU kernel at decode (runner/mxfp4_kernel.py),
  and repairs mlx_lm's Gemma 2 attention, in place, after loading:
  * its mask did not broadcast against its grouped-query scores for a batch of more than one
    row (the left-padded batch cache gives one mask per row: (B, 1, L, S) against scores
    (B, kv_heads, repeats, L, S)), so batched decoding failed or mixed rows;
  * it attended to the whole context on every layer, where Gemma 2 (as trained, and in
    transformers and llama.cpp) limits every other layer, from the first, to the last
    `sliding_window` positions (4,096 in the released models).
  The replacement computes the same products in the same order, so below the window its
  output equals mlx_lm's exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import mlx.core as mx


def logit_transform(model) -> Callable[[mx.array], mx.array] | None:
    """logits = transform(head(hidden)) for this model, or None when the head's product is
    the logits."""
    cap = getattr(model, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and cap > 0:
        return lambda logits: mx.tanh(logits / cap) * cap
    scale = getattr(model, "logits_scaling", None)
    if isinstance(scale, (int, float)) and scale != 1:
        return lambda logits: logits / scale
    return None


def fix_model(model, config: Mapping[str, Any]) -> None:
    """Apply the architecture's fixes to a loaded mlx_lm model (nothing for most)."""
    if getattr(model, "model_type", None) == "gemma2":
        _fix_gemma2(model, config.get("sliding_window"))
    if getattr(model, "model_type", None) == "gpt_oss":  # mxfp4 experts at decode on a CPU
        from mlxr.runner.mxfp4_kernel import install

        install(model)


def _fix_gemma2(model, sliding_window: int | None) -> None:
    from mlx_lm.models import gemma2

    class Gemma2Attention(gemma2.Attention):
        window: int | None = None

        def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None):
            return _gemma2_attention(self, x, mask, cache)

    for index, layer in enumerate(model.layers):
        layer.self_attn.__class__ = Gemma2Attention
        layer.self_attn.window = sliding_window if index % 2 == 0 else None


def _gemma2_attention(attn, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
    B, L, _ = x.shape
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    keys = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    queries, keys = attn.rope(queries, offset=offset), attn.rope(keys, offset=offset)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    # Query heads grouped by the key/value head they share: (B, kv_heads, repeats, L, D).
    queries = (queries * attn.scale).reshape(B, attn.n_kv_heads, attn.repeats, L, attn.head_dim)
    keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / attn.attn_logit_softcapping) * attn.attn_logit_softcapping
    allowed = _allowed(mask, L, keys.shape[-2], attn.window)
    if allowed is not None:
        if allowed.dtype == mx.bool_:
            scores = mx.where(allowed, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + allowed
    scores = mx.softmax(scores, precise=True, axis=-1)
    output = (scores @ values).reshape(B, attn.n_heads, L, attn.head_dim)
    return attn.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _allowed(mask: mx.array | None, L: int, S: int, window: int | None) -> mx.array | None:
    """The mask as it broadcasts against grouped scores (a per-row mask gains the repeats
    axis), narrowed to the last `window` keys of each query. The L queries are the last L of
    the S keys in every row (rows of a batch are right-aligned), so key j is visible to query
    i when (S - L + i) - j < window."""
    if mask is not None and mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)
    if window is None or S <= window:
        return mask
    recent = (mx.arange(S - L, S)[:, None] - mx.arange(S)[None]) < window
    if mask is None:
        return recent
    if mask.dtype == mx.bool_:
        return mask & recent
    return mx.where(recent, mask, mx.array(mx.finfo(mask.dtype).min, mask.dtype))

"""Load-time probes compare two ways of computing the same logits (the block pool's rows
against mlx-lm's cache, body+head against the whole model). A wrong route (a missing key, a
wrong position or row) moves logits by about their own size; rounding moves them by a few
units of the dtype's precision. `logits_match` tells the two apart for every dtype and
device: float32 on a CPU agrees to about 1e-6, but a GPU's float32 products, and bfloat16 or
float16 anywhere (Metal and CUDA run 16-bit models as they are), differ by far more than the
fixed 1e-4 the probes used to ask for, which sent every 16-bit model on a GPU to the padded
batch."""

from __future__ import annotations

import mlx.core as mx

# (absolute, relative to the largest reference logit), by the reference's dtype. Measured on
# an H200 (docs/PERFORMANCE.md, "On a GPU"): the rows against mlx-lm's cache differed by up to
# 1e-3 of the largest logit in float32 and 1.5e-2 in bfloat16; a wrong route (one row's
# logits for another's) by 1.2-1.5 times it.
TOLERANCE = {mx.float32: (1e-4, 5e-3)}
SIXTEEN_BIT = (1e-2, 5e-2)


def logits_match(got: mx.array, want: mx.array) -> bool:
    if got.shape != want.shape:
        return False
    absolute, relative = TOLERANCE.get(want.dtype, SIXTEEN_BIT)
    want32 = want.astype(mx.float32)
    error = mx.abs(got.astype(mx.float32) - want32).max().item()
    scale = mx.abs(want32).max().item()
    return error <= absolute + relative * scale

"""The load-time probes' comparison (runner/logits_match.py), on the differences measured on
an H200: rounding passes, a wrong route fails, in float32 and in bfloat16."""

import mlx.core as mx
import numpy as np

from mlxr.runner.logits_match import logits_match


def logits(seed: int, scale: float, dtype=mx.float32) -> mx.array:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((2, 2048)).astype(np.float32)
    return mx.array(values * (scale / np.abs(values).max())).astype(dtype)


def test_rounding_passes_and_a_wrong_route_fails_in_float32():
    want = logits(0, 1.34)
    assert logits_match(want, want)
    # the rows against mlx-lm's cache in float32 on the GPU: 1.25e-3 at a scale of 1.34
    assert logits_match(want + 1.25e-3, want)
    assert not logits_match(want + 0.05, want)
    assert not logits_match(logits(1, 1.34), want)


def test_rounding_passes_and_a_wrong_route_fails_in_bfloat16():
    want = logits(0, 3.25, mx.bfloat16)
    # Qwen3-0.6B's shape in bfloat16 on the GPU: 0.047 at a scale of 3.25
    assert logits_match(want + 0.047, want)
    assert not logits_match(logits(1, 3.25, mx.bfloat16), want)
    small = logits(2, 0.133, mx.bfloat16)  # Granite's scaled logits: wrong by 0.19
    assert logits_match(small + 1.1e-3, small)
    assert not logits_match(logits(3, 0.133, mx.bfloat16), small)


def test_other_shapes_never_match():
    want = logits(0, 1.0)
    assert not logits_match(want[:1], want)

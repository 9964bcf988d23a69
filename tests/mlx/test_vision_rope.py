"""Multimodal RoPE (runner/vision/mrope.py): the plain RoPE when no positions are set, per-row
deltas on the offset, and Qwen2-VL's three position streams checked against a numpy
reference written from the model's definition."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen2

from mlxr.runner.vision.mrope import MultiRope, RopeState, install

DIMS, BASE, SECTIONS = 32, 1e6, [4, 6, 6]
B, H, L = 2, 3, 5


def make(dims: int = DIMS, sections=SECTIONS) -> tuple[nn.RoPE, MultiRope, RopeState]:
    plain = nn.RoPE(dims, traditional=False, base=BASE)
    state = RopeState()
    return plain, MultiRope(plain, dims, BASE, list(sections), state), state


def queries(seed: int = 0, head_dim: int = DIMS) -> mx.array:
    return mx.random.normal((B, H, L, head_dim), key=mx.random.key(seed))


def reference(x: np.ndarray, positions: np.ndarray, dims: int = DIMS,
              sections=SECTIONS) -> np.ndarray:
    """Qwen2-VL's multimodal RoPE: frequency f of section k turns by position stream k."""
    x = x.astype(np.float64)
    inv_freq = 1.0 / BASE ** (np.arange(0, dims, 2, dtype=np.float64) / dims)  # (dims/2,)
    stream = np.repeat(np.arange(3), sections)  # stream of each frequency
    # positions (3, B, L) -> angle (B, L, dims/2)
    angle = positions.astype(np.float64)[stream].transpose(1, 2, 0) * inv_freq
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # (B, 1, L, dims/2)
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:dims]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return np.concatenate([out, x[..., dims:]], axis=-1)


def close(a: mx.array, b, atol: float = 1e-5) -> bool:
    return np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                       atol=atol, rtol=0)


# -- no state: the plain RoPE ------------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 7, 1000])
def test_without_state_it_is_the_plain_rope_at_an_int_offset(offset):
    plain, rope, _ = make()
    x = queries()
    assert mx.array_equal(rope(x, offset=offset), plain(x, offset=offset))


def test_without_state_it_is_the_plain_rope_at_per_row_offsets():
    plain, rope, _ = make()
    x, offsets = queries(), mx.array([3, 40])
    out = rope(x, offset=offsets)
    assert mx.array_equal(out, plain(x, offset=offsets))
    assert not close(out[0], out[1])  # (the rows really turned by different amounts)


# -- deltas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [10, mx.array([10, 20])])
def test_deltas_shift_each_row_offset(offset):
    plain, rope, state = make()
    x, deltas = queries(1), mx.array([-4, 9])
    with state.use(deltas=deltas):
        out = rope(x, offset=offset)
    for row, delta in enumerate((-4, 9)):
        base = offset if isinstance(offset, int) else int(offset[row].item())
        expected = plain(x[row:row + 1], offset=base + delta)
        assert close(out[row:row + 1], expected), row
    assert not close(out, plain(x, offset=offset))


# -- explicit positions ------------------------------------------------------------------------
def test_equal_position_streams_are_the_plain_rope():
    plain, rope, state = make()
    # small positions: float32 angles drift apart by ~1e-5 per few hundred positions
    x, offsets = queries(2), [6, 40]
    rows = np.stack([offset + np.arange(L) for offset in offsets])  # (B, L)
    positions = mx.array(np.stack([rows] * 3).astype(np.int32))  # (3, B, L)
    with state.use(positions=positions):
        out = rope(x, offset=12345)  # the offset is ignored when positions are given
    assert close(out, plain(x, offset=mx.array(offsets)))


def test_unequal_position_streams_match_the_reference():
    _, rope, state = make()
    x = queries(3)
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 60, size=(3, B, L)).astype(np.int32)
    positions[1] += 100  # height and width far from time: every section matters
    positions[2] += 500
    with state.use(positions=mx.array(positions)):
        out = rope(x)
    assert close(out, reference(np.asarray(x), positions))
    # and the reference tells the streams apart: time alone everywhere would differ
    assert not close(out, reference(np.asarray(x), np.stack([positions[0]] * 3)))


def test_a_rope_over_part_of_the_head_leaves_the_rest_alone():
    dims = 16
    _, rope, state = make(dims, [2, 3, 3])
    x = queries(4, head_dim=DIMS)
    positions = np.random.default_rng(1).integers(0, 80, size=(3, B, L)).astype(np.int32)
    with state.use(positions=mx.array(positions)):
        out = rope(x)
    assert close(out, reference(np.asarray(x), positions, dims, [2, 3, 3]))
    assert mx.array_equal(out[..., dims:], x[..., dims:])


def test_half_precision_input_keeps_its_dtype():
    _, rope, state = make()
    x = queries(5).astype(mx.float16)
    positions = np.random.default_rng(2).integers(0, 50, size=(3, B, L)).astype(np.int32)
    with state.use(positions=mx.array(positions)):
        out = rope(x)
    assert out.dtype == mx.float16
    assert close(out, reference(np.asarray(x.astype(mx.float32)), positions), atol=1e-2)


# -- the state -------------------------------------------------------------------------------
def test_the_state_is_cleared_after_the_block():
    plain, rope, state = make()
    x = queries(6)
    with state.use(deltas=mx.array([5, 5])):
        pass
    assert state.positions is None and state.deltas is None
    assert mx.array_equal(rope(x, offset=3), plain(x, offset=3))


def test_the_state_is_cleared_when_the_block_raises():
    plain, rope, state = make()
    x = queries(7)
    positions = mx.zeros((3, B, L), dtype=mx.int32)
    with pytest.raises(RuntimeError, match="boom"):
        with state.use(positions=positions, deltas=mx.array([1, 2])):
            raise RuntimeError("boom")
    assert state.positions is None and state.deltas is None
    assert mx.array_equal(rope(x, offset=3), plain(x, offset=3))


@pytest.mark.parametrize("sections", [[4, 6, 5], [4, 6, 7], [8, 8, 8]])
def test_sections_that_do_not_cover_the_frequencies_are_refused(sections):
    with pytest.raises(ValueError, match="mrope"):
        make(sections=sections)


# -- install -----------------------------------------------------------------------------------
def tiny_qwen2() -> qwen2.Model:
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                           rms_norm_eps=1e-6, vocab_size=100, rope_theta=1e6,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


MROPE_CONFIG = {"model_type": "qwen2_5_vl", "rope_theta": 1e6,
                "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
                "vision_config": {}}


@pytest.mark.parametrize("config", [
    {"model_type": "qwen2", "rope_theta": 1e6},
    {"model_type": "qwen2", "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"model_type": "gemma3", "text_config": {"rope_scaling": None}, "vision_config": {}},
])
def test_install_without_mrope_sections_changes_nothing(config):
    model = tiny_qwen2()
    ropes = [layer.self_attn.rope for layer in model.layers]
    assert install(model, config) is None
    assert [layer.self_attn.rope for layer in model.layers] == ropes


@pytest.mark.parametrize("config", [MROPE_CONFIG,
                                    {"model_type": "x", "vision_config": {},
                                     "text_config": MROPE_CONFIG}])
def test_install_puts_multi_rope_in_every_layer(config):
    model = tiny_qwen2()
    state = install(model, config)
    assert isinstance(state, RopeState)
    assert all(isinstance(layer.self_attn.rope, MultiRope) for layer in model.layers)


def test_install_keeps_text_logits_and_follows_the_state():
    model = tiny_qwen2()
    tokens = mx.array([[5, 17, 42, 3, 99, 1]])
    before = model(tokens)
    state = install(model, MROPE_CONFIG)
    assert mx.array_equal(model(tokens), before)  # no state: exactly the plain model
    n = tokens.shape[1]
    equal = mx.array(np.stack([np.arange(n)[None]] * 3).astype(np.int32))  # (3, 1, n)
    with state.use(positions=equal):
        assert close(model(tokens), before, atol=1e-4)
    image_like = np.stack([np.arange(n)[None]] * 3).astype(np.int32)
    image_like[1, 0, 1:4] += 3  # three tokens laid out on a grid, as an image's are
    image_like[2, 0, 1:4] += np.arange(3)
    with state.use(positions=mx.array(image_like)):
        assert not close(model(tokens), before, atol=1e-4)

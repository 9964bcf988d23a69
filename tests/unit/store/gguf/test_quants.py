"""GGUF tensors as MLX weights, checked in numpy against gguf's own dequantizers (no MLX here:
tests/mlx/test_gguf_quants.py checks the same arrays with MLX itself)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.gguf import quants
from mlxr.supervisor.store.gguf.quants import (
    EXACT, MlxTensor, UnsupportedTensorType, describe_type, dequantize, pack, quantize_q4_k,
    quantize_q6_k, random_blocks, requantized_bits, to_mlx, unpack)

ROWS, COLS = 8, 512
EXACT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.MXFP4]


def test_the_exact_types_are_the_ones_named_here():
    # (MXFP4 as MLX's own mxfp4 mode, the others as affine groups)
    assert set(EXACT) | {"MXFP4"} == {t.name for t in EXACT_TYPES}


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16])
def test_float_types_become_float32_of_the_logical_shape(qtype):
    data = random_blocks(qtype, ROWS, COLS, np.random.default_rng(0))
    if qtype != T.BF16:  # the reader gives F32 and F16 typed, BF16 as bytes
        data = data.view(np.float32 if qtype == T.F32 else np.float16)
    tensor = to_mlx(qtype, data, (ROWS, COLS))
    assert tensor.weight.dtype == np.float32 and tensor.weight.shape == (ROWS, COLS)
    assert tensor.bits is None and tensor.scales is None and tensor.exact
    assert np.array_equal(tensor.weight, gguf_quants.dequantize(data, qtype))


def test_bf16_as_16_bit_words_widens_the_same():
    data = random_blocks(T.BF16, ROWS, COLS, np.random.default_rng(1))
    words = to_mlx(T.BF16, data.view(np.uint16), (ROWS, COLS)).weight
    assert np.array_equal(words, to_mlx(T.BF16, data, (ROWS, COLS)).weight)


@pytest.mark.parametrize("qtype, bits", [
    (T.Q8_0, 8), (T.Q4_0, 4), (T.Q4_1, 4), (T.Q5_0, 5), (T.Q5_1, 5), (T.Q4_K, 4), (T.Q5_K, 5),
    (T.MXFP4, 4), (T.Q6_K, 8), (T.Q3_K, 5), (T.Q2_K, 4), (T.IQ4_XS, 6), (T.IQ4_NL, 6),
    (T.IQ2_XXS, 4), (T.IQ2_XS, 4), (T.IQ2_S, 4), (T.IQ3_XXS, 5), (T.IQ3_S, 5), (T.IQ1_S, 3),
    (T.IQ1_M, 3), (T.TQ1_0, 3), (T.TQ2_0, 4), (T.NVFP4, 6),
])
def test_requantized_bits(qtype, bits):
    assert requantized_bits(qtype) == bits


def test_requantized_bits_refuses_float_and_unknown_types():
    with pytest.raises(ValueError):
        requantized_bits(T.F16)
    with pytest.raises(UnsupportedTensorType):
        requantized_bits(99)


def test_an_unknown_type_number_is_a_400_naming_it():
    with pytest.raises(UnsupportedTensorType) as caught:
        to_mlx(99, np.zeros(64, np.uint8), (2, 32), "blk.0.attn_q.weight")
    assert isinstance(caught.value, InvalidRequest) and caught.value.status == 400
    assert caught.value.kind == "unsupported_model"
    assert str(caught.value) == 'unsupported GGUF tensor type 99 in "blk.0.attn_q.weight"'


@pytest.mark.parametrize("qtype", [T.Q8_K, T.Q8_1, T.I32, T.F64])
def test_types_gguf_cannot_dequantize_are_unsupported(qtype):
    with pytest.raises(UnsupportedTensorType, match=f'type {qtype.name} in "w"'):
        to_mlx(qtype, np.zeros(1024, np.uint8), (1, 256), "w")


def test_describe_type():
    assert describe_type(12) == "Q4_K" and describe_type(99) == "99"


def test_bytes_that_do_not_fit_the_shape_are_refused():
    data = random_blocks(T.Q4_0, 2, 64, np.random.default_rng(0))
    with pytest.raises(InvalidRequest, match="do not fit shape"):
        to_mlx(T.Q4_0, data, (3, 64), "w")


@pytest.mark.parametrize("bits, words", [
    (4, [0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]),
    (5, [0x8A418820, 0xC5A92839, 0xCA307B9A, 0x38BDAB49, 0xFFBBCDEB]),
    (8, [0x03020100, 0x07060504, 0x0B0A0908, 0x0F0E0D0C,
         0x13121110, 0x17161514, 0x1B1A1918, 0x1F1E1D1C]),
])
def test_packing_is_mlx_little_endian_bit_stream(bits, words):
    # Pinned from mx.quantize/mx.dequantize (tests/mlx/test_gguf_quants.py checks it live).
    values = (np.arange(32) % 2 ** bits).astype(np.uint8)[None]
    assert pack(values, bits).tolist() == [words]


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_unpack_inverts_pack(bits):
    values = np.random.default_rng(bits).integers(0, 2 ** bits, (3, 2, 256)).astype(np.uint8)
    packed = pack(values, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 2, 256 * bits // 32)
    assert np.array_equal(unpack(packed, bits), values)


def affine(tensor: MlxTensor) -> np.ndarray:
    """Our own check of the packed layout: unpack and apply scale * q + bias per group (for
    mxfp4: value * 2^(e - 127) per group)."""
    assert tensor.group_size == 32 and tensor.exact
    scales = np.uint8 if tensor.mode == "mxfp4" else np.float32
    assert tensor.weight.dtype == np.uint32 and tensor.scales.dtype == scales
    return dequantize(tensor)


@pytest.mark.parametrize("qtype", EXACT_TYPES)
def test_exact_types_dequantize_to_gguf_values_bit_for_bit(qtype):
    data = random_blocks(qtype, ROWS, COLS, np.random.default_rng(int(qtype)))
    tensor = to_mlx(qtype, data, (ROWS, COLS))
    assert tensor.bits == requantized_bits(qtype)
    assert tensor.weight.shape == (ROWS, COLS * tensor.bits // 32)
    assert tensor.scales.shape == (ROWS, COLS // 32)
    assert tensor.biases is None if qtype == T.MXFP4 else tensor.biases.shape == (ROWS, COLS // 32)
    expected = gguf_quants.dequantize(data, qtype)
    assert np.array_equal(affine(tensor).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4])
def test_exact_types_on_gguf_quantized_gaussian_data(qtype):
    x = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32)
    data = gguf_quants.quantize(x, qtype)
    ours = affine(to_mlx(qtype, data, (ROWS, COLS)))
    expected = gguf_quants.dequantize(data, qtype)
    assert np.array_equal(ours, expected)
    # gguf gives -0.0 for a zero under a negative scale (Q4_0, Q5_0); adding +0.0 makes it +0.0.
    assert np.array_equal(ours.view(np.uint32), (expected + np.float32(0)).view(np.uint32))


def test_leading_dimensions_are_kept():
    data = random_blocks(T.Q4_K, 2 * 3, COLS, np.random.default_rng(3))
    tensor = to_mlx(T.Q4_K, data.reshape(2, 3, -1), (2, 3, COLS))
    assert tensor.weight.shape == (2, 3, COLS // 8) and tensor.scales.shape == (2, 3, COLS // 32)
    assert np.array_equal(affine(tensor), gguf_quants.dequantize(data, T.Q4_K).reshape(2, 3, COLS))


@pytest.mark.parametrize("qtype, shape", [(T.Q4_K, (ROWS, COLS)), (T.Q6_K, (ROWS, COLS)),
                                          (T.Q8_0, (COLS,))])
def test_unquantized_on_request_and_for_vectors(qtype, shape):
    rows = shape[0] if len(shape) == 2 else 1
    data = random_blocks(qtype, rows, shape[-1], np.random.default_rng(4)).reshape(*shape[:-1], -1)
    tensor = to_mlx(qtype, data, shape, quantize=len(shape) == 1)
    assert tensor.bits is None and tensor.exact and tensor.weight.shape == shape
    assert np.array_equal(tensor.weight, gguf_quants.dequantize(data, qtype))


def relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def test_q4_k_writer_round_trips_like_4_bit_min_max():
    x = np.random.default_rng(5).standard_normal((16, 1024)).astype(np.float32)
    data = quantize_q4_k(x)
    assert data.dtype == np.uint8 and data.shape == (16, 4 * 144)
    # 4-bit min/max over 32 Gaussian values: step ~ 4.1 sigma / 15, error ~ step / sqrt(12).
    assert relative_rms(gguf_quants.dequantize(data, T.Q4_K), x) < 0.09
    assert np.array_equal(affine(to_mlx(T.Q4_K, data, x.shape)),
                          gguf_quants.dequantize(data, T.Q4_K))


def test_q6_k_writer_round_trips_much_closer():
    x = np.random.default_rng(6).standard_normal((16, 1024)).astype(np.float32)
    data = quantize_q6_k(x)
    assert data.dtype == np.uint8 and data.shape == (16, 4 * 210)
    assert relative_rms(gguf_quants.dequantize(data, T.Q6_K), x) < 0.025


@pytest.mark.parametrize("source", ["writer", "random"])
def test_q6_k_becomes_8_bits_whose_scales_are_codes_times_a_factor_per_super_block(source):
    rng = np.random.default_rng(8)
    if source == "writer":
        data = quantize_q6_k(rng.standard_normal((ROWS, COLS)).astype(np.float32))
        data[2] = quantize_q6_k(np.zeros((1, COLS), np.float32))  # an all-zero row
    else:  # scales of either sign and any size
        data = random_blocks(T.Q6_K, ROWS, COLS, rng)
    tensor = to_mlx(T.Q6_K, data, (ROWS, COLS))
    assert tensor.bits == 8 and tensor.group_size == 32 and not tensor.exact
    assert tensor.scales.dtype == np.float32 and (tensor.scales >= 0).all()
    assert np.array_equal(tensor.biases, -128 * tensor.scales)
    # Per 256 values: a factor of at most 11 significant bits times codes 0..63, the
    # largest 63: what the runner's kernel finds again exactly.
    supers = tensor.scales.reshape(ROWS, -1, 8)
    factor = supers.max(axis=-1, keepdims=True) / 63
    nonzero = factor[..., 0] > 0
    assert nonzero.sum() == ROWS * COLS // 256 - (2 if source == "writer" else 0)
    codes = np.divide(supers, factor, out=np.zeros_like(supers), where=factor > 0)
    assert np.array_equal(codes, np.rint(codes)) and codes.max() == 63
    assert np.array_equal(factor * codes, supers)
    assert not (factor.view(np.uint32) & np.uint32((1 << 13) - 1)).any()
    # Every value within half its group's step of gguf's, none clipped.
    ours, theirs = dequantize(tensor), gguf_quants.dequantize(data, T.Q6_K)
    half_step = np.repeat(tensor.scales, 32, axis=-1) / 2
    assert (np.abs(ours - theirs) <= half_step * (1 + 1e-6) + 1e-30).all()
    if source == "writer":
        assert not ours[2].any()


def test_q6_k_is_requantized_a_slice_of_rows_at_a_time_with_the_same_result(monkeypatch):
    data = random_blocks(T.Q6_K, ROWS, COLS, np.random.default_rng(9))
    whole = to_mlx(T.Q6_K, data, (ROWS, COLS))
    monkeypatch.setattr(quants, "_Q6_K_ROWS", 3)  # slices of 3, 3 and 2 rows
    sliced = to_mlx(T.Q6_K, data, (ROWS, COLS))
    for a, b in ((whole.weight, sliced.weight), (whole.scales, sliced.scales),
                 (whole.biases, sliced.biases)):
        assert np.array_equal(a, b)


def test_writers_keep_zero_rows_zero():
    x = np.zeros((2, 256), np.float32)
    assert not gguf_quants.dequantize(quantize_q4_k(x), T.Q4_K).any()
    assert not gguf_quants.dequantize(quantize_q6_k(x), T.Q6_K).any()


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q6_K, T.IQ1_M, T.IQ4_XS, T.TQ1_0, T.NVFP4])
def test_random_blocks_are_finite(qtype):
    data = random_blocks(qtype, 4, 512, np.random.default_rng(7))
    values = gguf_quants.dequantize(data, qtype)
    assert np.isfinite(values).all() and np.abs(values).max() > 0

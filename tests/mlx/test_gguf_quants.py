"""GGUF tensors as MLX weights, checked with MLX itself: mx.dequantize of the exact types'
arrays gives gguf's float32 values bit for bit, the packing is MLX's, the requantized types stay
close to gguf's values, and quantized_matmul runs on the arrays as they are."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from mlxr.supervisor.store.gguf.quants import (
    MlxTensor, pack, quantize_q4_k, quantize_q6_k, random_blocks, requantized_bits, to_mlx,
    unpack)

ROWS, COLS = 8, 512
EXACT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.MXFP4]
# The fewest cosine similarities measured on random blocks (seeds 0-4), rounded down: the
# one-bit-ish types at 3 bits lose most (IQ1_M 0.988, TQ1_0 0.990).
REQUANTIZED_COSINE = {
    T.Q2_K: 0.998, T.Q3_K: 0.999, T.Q6_K: 0.9999, T.IQ4_NL: 0.9998, T.IQ4_XS: 0.9998,
    T.IQ2_XXS: 0.99, T.IQ2_XS: 0.99, T.IQ2_S: 0.99, T.IQ3_XXS: 0.999, T.IQ3_S: 0.999,
    T.IQ1_S: 0.99, T.IQ1_M: 0.985, T.TQ1_0: 0.985, T.TQ2_0: 0.9999, T.NVFP4: 0.9997,
}


def _biases(tensor: MlxTensor):
    return None if tensor.biases is None else mx.array(tensor.biases)


def mlx_dequantize(tensor: MlxTensor) -> np.ndarray:
    values = mx.dequantize(mx.array(tensor.weight), mx.array(tensor.scales), _biases(tensor),
                           group_size=tensor.group_size, bits=tensor.bits, mode=tensor.mode,
                           dtype=mx.float32)
    return np.array(values)


def same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    # gguf gives -0.0 for a zero under a negative scale, MLX's scale * q + bias +0.0; MLX's
    # mxfp4 gives -0.0 for its code 8, gguf +0.0: adding +0.0 turns -0.0 into +0.0 and changes
    # nothing else.
    zero = np.float32(0)
    return np.array_equal((ours + zero).view(np.uint32), (theirs + zero).view(np.uint32))


@pytest.mark.parametrize("qtype", EXACT_TYPES)
def test_exact_types_dequantize_in_mlx_to_gguf_values(qtype):
    data = random_blocks(qtype, ROWS, COLS, np.random.default_rng(int(qtype)))
    tensor = to_mlx(qtype, data, (ROWS, COLS))
    assert tensor.exact and tensor.bits == requantized_bits(qtype)
    # MXFP4 is MLX's own mxfp4: exponent bytes for scales, no biases, 4.25 bits a weight
    assert tensor.mode == ("mxfp4" if qtype == T.MXFP4 else "affine")
    assert (tensor.biases is None) == (qtype == T.MXFP4)
    assert same_bits(mlx_dequantize(tensor), gguf_quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4])
def test_exact_types_on_gguf_quantized_gaussian_data(qtype):
    x = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    data = gguf_quants.quantize(x, qtype)
    tensor = to_mlx(qtype, data, (ROWS, COLS))
    assert same_bits(mlx_dequantize(tensor), gguf_quants.dequantize(data, qtype))


def test_q4_k_writer_output_is_exact_and_experts_keep_their_axis():
    x = np.random.default_rng(2).standard_normal((2 * ROWS, COLS)).astype(np.float32)
    data = quantize_q4_k(x)
    tensor = to_mlx(T.Q4_K, data.reshape(2, ROWS, -1), (2, ROWS, COLS))
    expected = gguf_quants.dequantize(data, T.Q4_K).reshape(2, ROWS, COLS)
    assert same_bits(mlx_dequantize(tensor), expected)


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_our_packing_is_mlx_packing(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2 ** bits, (4, 256)).astype(np.uint8)
    ones, zeros = mx.ones((4, 8)), mx.zeros((4, 8))
    unpacked = mx.dequantize(mx.array(pack(values, bits)), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(unpacked), values)
    # And the other way: MLX's own quantized weight unpacks to the q it dequantizes with.
    weight, scales, biases = mx.quantize(mx.array(rng.standard_normal((4, 256)), dtype=mx.float32),
                                         group_size=32, bits=bits)
    q = unpack(np.array(weight), bits).astype(np.float32).reshape(4, 8, 32)
    ours = (np.array(scales)[..., None] * q + np.array(biases)[..., None]).reshape(4, 256)
    theirs = np.array(mx.dequantize(weight, scales, biases, group_size=32, bits=bits))
    assert np.allclose(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", list(REQUANTIZED_COSINE))
def test_requantized_types_stay_close_to_gguf_values(qtype):
    data = random_blocks(qtype, ROWS, COLS, np.random.default_rng(0))
    tensor = to_mlx(qtype, data, (ROWS, COLS))
    assert not tensor.exact and tensor.bits == requantized_bits(qtype)
    assert tensor.weight.dtype == np.uint32 and tensor.scales.dtype == np.float32
    ours, theirs = mlx_dequantize(tensor).ravel(), gguf_quants.dequantize(data, qtype).ravel()
    cosine = ours @ theirs / (np.linalg.norm(ours) * np.linalg.norm(theirs))
    assert cosine >= REQUANTIZED_COSINE[qtype]


@pytest.mark.parametrize("qtype, writer", [(T.Q4_K, quantize_q4_k), (T.Q6_K, quantize_q6_k),
                                           (T.Q5_0, None)])
def test_quantized_matmul_on_the_arrays(qtype, writer):
    rng = np.random.default_rng(3)
    if writer is None:
        data = random_blocks(qtype, ROWS, COLS, rng)
    else:
        data = writer(rng.standard_normal((ROWS, COLS)).astype(np.float32))
    tensor = to_mlx(qtype, data, (ROWS, COLS))
    x = mx.array(rng.standard_normal((4, COLS)).astype(np.float32))
    product = mx.quantized_matmul(x, mx.array(tensor.weight), mx.array(tensor.scales),
                                  _biases(tensor), transpose=True, group_size=32,
                                  bits=tensor.bits, mode=tensor.mode)
    dense = np.array(x @ mx.array(mlx_dequantize(tensor)).T)
    atol = 1e-5 * np.abs(dense).max()
    assert np.allclose(np.array(product), dense, rtol=1e-4, atol=atol)
    if tensor.exact:
        reference = np.array(x) @ gguf_quants.dequantize(data, qtype).T
        assert np.allclose(np.array(product), reference, rtol=1e-4, atol=atol)

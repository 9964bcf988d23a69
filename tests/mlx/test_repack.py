"""2-, 3-, 5- and 6-bit layers held in 4 or 8 bits for the quantized kernel
(runner/repack.py): the same dequantized values bit for bit, for linears and embeddings of
each group size; what is not repacked; a 5-bit model loaded the runner's way (its layers on
the kernel, not widened to float32) giving mlx-lm's greedy tokens for the 5-bit model; and
the bytes that holding a model around the kernel adds, counted before it is done, so that a
model they do not fit stays as stored."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load

from mlxr.runner import weights
from mlxr.runner.model_step import ModelStep
from mlxr.runner.quant_kernel import QuantKernel, takes
from mlxr.runner.repack import WIDER, repack, repackable
from tests.mlx.test_host_attention import mlx_lm_greedy
from tests.mlx.test_row_kernel import five_greedy_rows


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    built = QuantKernel.load()
    assert built is not None  # `make test` machines have a C compiler
    return built


def dequantized(module) -> np.ndarray:
    return np.array(mx.dequantize(module.weight, module.scales, module.biases,
                                  module.group_size, module.bits))


@pytest.mark.parametrize("bits", sorted(WIDER))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_repacked_layer_holds_the_same_values_in_the_kernels_width(kernel, bits, group):
    linear = nn.Linear(256, 40, bias=True)
    linear.weight = mx.random.normal((40, 256), key=mx.random.key(bits * group))
    layer = nn.QuantizedLinear.from_linear(linear, group, bits)
    want, x = dequantized(layer), mx.random.normal((3, 256), key=mx.random.key(1))
    want_out = np.array(layer(x))
    assert repackable(layer) and not takes(layer)
    repack(layer, kernel)
    assert layer.bits == WIDER[bits] and takes(layer)
    assert layer.weight.dtype == mx.uint32 and layer.weight.shape == (40, 256 * layer.bits // 32)
    assert np.array_equal(dequantized(layer), want)  # bit for bit
    assert np.allclose(np.array(layer(x)), want_out, rtol=1e-5, atol=1e-5)  # MLX's own pass


@pytest.mark.parametrize("bits", [3, 5])
def test_a_repacked_embedding_looks_up_and_projects_the_same(kernel, bits):
    embedding = nn.Embedding(5000, 64)  # rows enough for both cores' parts
    embedding.weight = mx.random.normal((5000, 64), key=mx.random.key(bits))
    layer = nn.QuantizedEmbedding.from_embedding(embedding, 32, bits)
    ids, x = mx.array([[0, 4097, 4999]]), mx.random.normal((2, 64), key=mx.random.key(2))
    want_rows, want_out, want = np.array(layer(ids)), np.array(layer.as_linear(x)), \
        dequantized(layer)
    repack(layer, kernel)
    assert layer.bits == WIDER[bits]
    assert np.array_equal(dequantized(layer), want)
    assert np.array_equal(np.array(layer(ids)), want_rows)
    assert np.allclose(np.array(layer.as_linear(x)), want_out, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_widths_it_has_no_field_for(kernel):
    packed = np.zeros((4, 40), dtype=np.uint8)  # 64 values of 5 bits a row
    assert kernel.repack(packed, 5, 8).shape == (4, 64)
    for bits, wide in ((4, 8), (5, 4), (3, 8), (8, 8)):
        with pytest.raises(ValueError):
            kernel.repack(packed, bits, wide)


def test_what_is_not_repacked():
    linear = nn.Linear(256, 32)
    assert not repackable(linear)
    for bits in (4, 8):  # the kernel's own widths
        assert not repackable(nn.QuantizedLinear.from_linear(linear, 32, bits))
    assert not repackable(nn.QuantizedLinear.from_linear(linear, 32, 4, mode="mxfp4"))


def test_a_5_bit_model_runs_on_the_kernel_and_gives_mlx_lms_greedy_tokens(tiny_model, kernel):
    original, _ = load(str(tiny_model))
    nn.quantize(original, group_size=32, bits=5)
    mx.eval(original.parameters())
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=5)
    mx.eval(model.parameters())
    held = weights.float32_on_cpu(model, "auto", 1 << 20, 1 << 34, host_kernel=True)
    assert held == "5-bit" + weights.ON_KERNEL
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert linears and all(m.bits == 8 and m.scales.dtype == mx.float32 for m in linears)
    step = ModelStep(model, 0, lambda token: "")
    assert step.host_body is not None and step.host_body.quantized
    seqs = five_greedy_rows(step)
    assert [s.output_tokens for s in seqs] == [
        mlx_lm_greedy(original, s.prompt_tokens, 6 + i) for i, s in enumerate(seqs)]


def test_the_bytes_held_around_the_kernel_are_counted_and_a_model_they_do_not_fit_stays_stored(
        tiny_model):
    five = nn.QuantizedLinear.from_linear(nn.Linear(256, 40), 32, 5)
    half = nn.QuantizedLinear.from_linear(nn.Linear(256, 40), 32, 4)
    half.scales, half.biases = half.scales.astype(mx.bfloat16), half.biases.astype(mx.bfloat16)
    six = nn.QuantizedLinear.from_linear(nn.Linear(256, 40, bias=False), 64, 6, mode="affine")
    mxfp4 = nn.QuantizedLinear.from_linear(nn.Linear(256, 40, bias=False), 32, 4, mode="mxfp4")
    assert weights.kernel_extra_bytes(five) == five.weight.nbytes * 3 // 5  # and its f32 bias
    assert weights.kernel_extra_bytes(half) == half.scales.nbytes + half.biases.nbytes
    assert weights.kernel_extra_bytes(six) == six.weight.nbytes * 2 // 6
    stored = sum(a.nbytes for a in (mxfp4.weight, mxfp4.scales))
    assert weights.kernel_extra_bytes(mxfp4) == 40 * 256 * 4 - stored  # widened to float32
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=5)
    mx.eval(model.parameters())
    need = weights.kernel_extra_bytes(model)
    assert need > 0
    held = weights.float32_on_cpu(model, "auto", 0, int(need / weights.FREE_SHARE) - 1,
                                  host_kernel=True)
    assert held == "5-bit"  # neither repacked nor widened: as stored
    assert all(m.bits == 5 for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear))

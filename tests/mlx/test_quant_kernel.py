"""The quantized kernel (runner/quant_kernel.py, shared/assets/quant_kernel.c): its products
against the dequantized weight's for every bit count, group size, row count and vector width
this CPU runs, and for the plain C build; a Q4_K, Q5_K (held in 8 bits) or Q6_K import's
scales found as super-blocks where exact, and its products from them equal to those from
float32 scales; its dequantization and embedding rows equal to MLX's; which layers it takes; and decoding a quantized model through it (body, head, prefill,
prompts arriving together read in one pass) giving mlx-lm's greedy tokens for that model."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load

from mlxr.runner import quant_kernel
from mlxr.runner.embed import embeddings
from mlxr.runner.embed.embeddings import LMEmbedder
from mlxr.runner.host_head import openblas_sgemm
from mlxr.runner import host_ops
from mlxr.runner.host_ops import QUANT_ROWS, Gemm
from mlxr.runner.decode_row import DecodeRow
from mlxr.runner.model_step import ModelStep
from mlxr.runner.quant_kernel import QuantizedWeight, QuantKernel, takes
from mlxr.shared import native
from mlxr.runner.repack import repack
from mlxr.supervisor.store.gguf.quants import quantize_q4_k, quantize_q6_k, random_blocks, to_mlx
from tests.mlx.test_heads import probed_blas
from tests.mlx.test_host_attention import mlx_lm_greedy
from tests.mlx.test_row_kernel import five_greedy_rows
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 40)  # every lane count; several passes


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    # The runners' own build in the default cache (built there if need be): a private build
    # took 13 s of the suite. Its vector width is set back for the rest of the process.
    built = QuantKernel.load()
    assert built is not None  # `make test` machines have a C compiler (the BLAS shim needs one)
    yield built
    built.use_width(16)


def quantized(width: int, depth: int, bits: int, group: int, seed: int = 0,
              scales=mx.float32) -> tuple[nn.QuantizedLinear, np.ndarray]:
    """A random quantized layer (out `width`, in `depth`) and its dequantized weight."""
    linear = nn.Linear(depth, width, bias=False)
    linear.weight = mx.random.normal((width, depth), key=mx.random.key(seed))
    layer = nn.QuantizedLinear.from_linear(linear, group, bits)
    layer.scales, layer.biases = layer.scales.astype(scales), layer.biases.astype(scales)
    dense = mx.dequantize(layer.weight, layer.scales, layer.biases, group, bits)
    return layer, np.array(dense.astype(mx.float32))


def products_match(kernel: QuantKernel, layer, dense: np.ndarray, rows=ROWS) -> None:
    weight = QuantizedWeight.of(layer)
    rng = np.random.default_rng(dense.shape[0])
    for n in rows:
        x = rng.standard_normal((n, dense.shape[1]), dtype=np.float32)
        out = np.full((n, dense.shape[0]), np.nan, dtype=np.float32)
        kernel.product(weight, x, out)
        want = x @ dense.T
        assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max(), (n, dense.shape)
    # A decode step's bound product: the same figures, into one buffer that each call reuses
    one_row = kernel.one_row(weight)
    x = rng.standard_normal(dense.shape[1], dtype=np.float32)
    first = one_row(x)
    want = dense @ x
    assert np.abs(first - want).max() <= 1e-5 * np.abs(want).max(), dense.shape
    assert one_row(-x) is first
    assert np.abs(first + want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("want", [16, 8, 4], ids=["avx512-or-less", "avx2-or-less", "plain"])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (8, 32), (4, 64), (8, 128), (4, 128)])
def test_the_kernel_gives_the_dequantized_weights_product(kernel, want, bits, group):
    width = kernel.use_width(want)
    assert width in (4, 8, 16) and width <= want
    # tails of 4 and 8 rows; under a tile; depths in blocks of 128 (one row's 4-bit order
    # transposes them) and, for groups of 32 and 64, not
    for shape in ((300, 256), (13, 128), (5, 384), (9, 3 * group)):
        products_match(kernel, *quantized(*shape, bits, group))


def test_a_large_weight_is_split_across_threads_and_still_exact(kernel):
    layer, dense = quantized(4100, 256, 8, 64)
    assert 4100 * 256 >= quant_kernel.SPLIT_ELEMENTS
    products_match(kernel, layer, dense, rows=(1, 2, 7, 16))


def test_the_plain_c_build_gives_the_same_products(tmp_path):
    # what a compiler without the x86 copies' targets, or an Arm machine, runs
    path, why = native.cached_library(native.QUANT_KERNEL_SOURCE, tmp_path,
                                      native.QUANT_KERNEL_FLAGS + ["-DMLXR_QUANT_GENERIC"])
    assert path is not None, why
    plain = QuantKernel.from_library(path)
    assert plain.width == 4 and plain.use_width(16) == 4
    for bits, group in ((8, 64), (4, 32)):
        products_match(plain, *quantized(300, 256, bits, group))
    for qtype in (T.Q4_K, T.Q6_K):
        weight = QuantizedWeight.of(gguf_layer(40, 512, qtype=qtype)[0])
        x = np.random.default_rng(4).standard_normal((1, 512)).astype(np.float32)
        outs = [np.empty((1, 40), np.float32) for _ in range(2)]
        for w, out in zip((weight, plain.with_supers(weight)), outs):
            plain.product(w, x, out)
        assert np.array_equal(*outs)


def gguf_layer(width: int, depth: int, seed: int = 0,
               qtype: T = T.Q4_K) -> tuple[nn.QuantizedLinear, np.ndarray]:
    """A layer as a GGUF Q4_K, Q6_K, Q8_0 or Q4_0 import has it
    (supervisor/store/gguf/quants.py), or a Q5_K or Q5_0 import once held in 8 bits
    (runner/repack.py); and its dequantized weight."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((width, depth)).astype(np.float32)
    blocks = {T.Q4_K: lambda: quantize_q4_k(x), T.Q6_K: lambda: quantize_q6_k(x),
              T.Q5_K: lambda: random_blocks(T.Q5_K, width, depth, rng)}.get(
                  qtype, lambda: gguf_quants.quantize(x, qtype))()
    tensor = to_mlx(qtype, blocks, (width, depth))
    layer = nn.QuantizedLinear(depth, width, bias=False, group_size=32, bits=tensor.bits)
    layer.weight, layer.scales, layer.biases = (mx.array(a) for a in (
        tensor.weight, tensor.scales, tensor.biases))
    if tensor.bits == 5:
        repack(layer, QuantKernel.load())
    dense = mx.dequantize(layer.weight, layer.scales, layer.biases, 32, layer.bits)
    return layer, np.array(dense)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
@pytest.mark.parametrize("want", [16, 8, 4], ids=["avx512-or-less", "avx2-or-less", "plain"])
def test_a_k_quant_imports_scales_as_super_blocks_give_the_same_products(kernel, want, qtype):
    kernel.use_width(want)
    layer, dense = gguf_layer(300, 512, qtype=qtype)
    assert layer.bits == (4 if qtype == T.Q4_K else 8)
    weight = QuantizedWeight.of(layer)
    supers = kernel.with_supers(weight).supers
    # llama.cpp's scale and our Q6_K import: top code 63 (the random Q5_K blocks: any)
    assert supers is not None and (qtype == T.Q5_K or supers.codes.max() == 63)
    assert supers.codes.shape == (300, 2 * 16) and supers.factors.shape == (300, 2 * 2)
    groups = supers.codes[:, :16].reshape(300, 2, 8) * supers.factors[:, :2, None]
    assert np.array_equal(groups.reshape(300, 16), weight.scales)  # exact, as the kernel rebuilds
    x = np.random.default_rng(1).standard_normal((1, 512)).astype(np.float32)
    plain, packed = (np.empty((1, 300), np.float32) for _ in range(2))
    kernel.product(weight, x, plain)
    kernel.product(kernel.with_supers(weight), x, packed)
    assert np.array_equal(plain, packed)  # the same floats, the same sums
    assert np.abs(packed[0] - dense @ x[0]).max() <= 1e-5 * np.abs(dense @ x[0]).max()
    assert np.array_equal(kernel.one_row(kernel.with_supers(weight))(x[0]), plain[0])
    products_match(kernel, layer, dense, rows=(2, 5, 16))  # several rows: the float32 scales


@pytest.mark.parametrize("want", [16, 8, 4], ids=["avx512-or-less", "avx2-or-less", "plain"])
def test_many_one_row_products_in_one_call_equal_each_alone(kernel, want):
    # a mixture's chosen experts (runner/host_moe.py): super-blocks (Q4_K, Q6_K as imported),
    # an offset (Q8_0), plain float32 scales, a depth QROW4 does not take; sizes that split
    # unevenly into the workers' tiles of 8 rows, and one product split across them
    kernel.use_width(want)
    weights = [kernel.compact(QuantizedWeight.of(gguf_layer(300, 512, qtype=t)[0]))
               for t in (T.Q4_K, T.Q6_K, T.Q8_0)]
    weights += [QuantizedWeight.of(quantized(*shape, bits, group)[0])
                for shape, bits, group in (((13, 256), 4, 32), ((5, 96), 4, 32),
                                           ((4100, 256), 8, 64))]
    assert [w.supers is not None for w in weights] == [True, True, False, False, False, False]
    assert weights[2].offset == 128
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(w.shape[1], dtype=np.float32) for w in weights]
    ordered = [np.empty_like(x) for x in xs]
    for into, x, w in zip(ordered, xs, weights):
        quant_kernel.into_row_order(into, x[None], quant_kernel.one_row_order(w.bits, len(x)))
    outs = [np.full(w.shape[0], np.nan, dtype=np.float32) for w in weights]
    items = np.stack([kernel.item(w) for w in weights])
    items[:, quant_kernel.ITEM_X] = [x.ctypes.data for x in ordered]
    items[:, quant_kernel.ITEM_OUT] = [o.ctypes.data for o in outs]
    kernel.many(items)
    for w, x, out in zip(weights, xs, outs):
        assert np.array_equal(out, kernel.one_row(w)(x))  # the same kernels, the same floats
    items[3, quant_kernel.ITEM_X + 2] = 12  # a depth that is not a whole group: refused, as alone
    with pytest.raises(ValueError, match="refused"):
        kernel.many(items)


@pytest.mark.parametrize("qtype, offset, bits", [(T.Q8_0, 128, 8), (T.Q4_0, 8, 4),
                                                  (T.Q5_0, 16, 8)])
@pytest.mark.parametrize("want", [16, 8, 4], ids=["avx512-or-less", "avx2-or-less", "plain"])
def test_biases_a_multiple_of_the_scales_are_not_read_and_give_the_same_products(
        kernel, want, qtype, offset, bits):
    kernel.use_width(want)
    layer, dense = gguf_layer(300, 512, qtype=qtype)
    weight = QuantizedWeight.of(layer)
    compact = kernel.compact(weight)
    assert layer.bits == bits and compact.supers is None and compact.offset == offset
    x = np.random.default_rng(2).standard_normal((1, 512)).astype(np.float32)
    plain, read = (np.empty((1, 300), np.float32) for _ in range(2))
    kernel.product(weight, x, plain)
    kernel.product(compact, x, read)
    assert np.array_equal(plain, read)  # -offset * scale is the stored bias, bit for bit
    assert np.array_equal(kernel.one_row(compact)(x[0]), plain[0])
    assert np.abs(read[0] - dense @ x[0]).max() <= 1e-5 * np.abs(dense @ x[0]).max()
    # several rows read the biases as stored, with the same figures as before
    rows = np.random.default_rng(3).standard_normal((5, 512)).astype(np.float32)
    many, many_plain = (np.empty((5, 300), np.float32) for _ in range(2))
    kernel.product(compact, rows, many)
    kernel.product(weight, rows, many_plain)
    assert np.array_equal(many, many_plain)


def test_an_offset_is_found_only_where_it_is_exact(kernel):
    weight = QuantizedWeight.of(gguf_layer(16, 256, qtype=T.Q8_0)[0])
    assert quant_kernel.with_offset(weight).offset == 128
    off = weight.biases.copy()
    off[3, 2] = np.nextafter(off[3, 2], np.float32(0))  # one bias off by its last bit
    assert quant_kernel.with_offset(dataclasses.replace(weight, biases=off)).offset is None
    mlx_weight = QuantizedWeight.of(quantized(16, 256, 8, 32)[0])  # MLX's own: min-max
    assert kernel.compact(mlx_weight) is mlx_weight
    q4_k = QuantizedWeight.of(gguf_layer(16, 256)[0])  # super-blocks first
    assert kernel.compact(q4_k).supers is not None and kernel.compact(q4_k).offset is None
    # the C side refuses a factor other than 1 for more than one row
    x = np.zeros((2, 256), np.float32)
    out = np.zeros((2, 16), np.float32)
    assert kernel.rows_parts(weight.q.ctypes.data, 8, 256, 32, weight.scales.ctypes.data,
                             weight.scales.ctypes.data, x.ctypes.data, 2, out.ctypes.data, 16,
                             2, 0, 16, 1, -128.0) == -1


def test_super_blocks_are_found_only_where_they_are_exact(kernel):
    layer, _ = gguf_layer(16, 256)
    weight = QuantizedWeight.of(layer)
    # An importance-weighted quantizer's top code may be under 63: still found.
    codes = np.random.default_rng(3).integers(0, 41, weight.scales.shape).astype(np.float32)
    factor = np.float32(np.float16(0.0123))
    codes[2] = 0  # an all-zero block (the row's only one): factor 0
    lower = QuantizedWeight(weight.q, (codes * factor).astype(np.float32), weight.biases,
                            4, 32, weight.keep)
    assert np.array_equal(rebuilt(kernel.with_supers(lower)), (lower.scales, lower.biases))
    assert np.array_equal(rebuilt(kernel.with_supers(weight)), (weight.scales, weight.biases))
    assert (weight.biases < 0).all()  # Q4_K's biases (-dmin * m): negative factors
    # A NaN anywhere: none.
    nan = weight.biases.copy()
    nan[9, 5] = np.nan
    assert kernel.with_supers(QuantizedWeight(weight.q, weight.scales, nan, 4, 32,
                                              weight.keep)).supers is None
    # MLX's own quantization: float32 scales of no such form, left as they are.
    mlx_weight = QuantizedWeight.of(quantized(16, 256, 4, 32)[0])
    assert kernel.with_supers(mlx_weight) is mlx_weight
    # One group off by its last bit is enough, in either part of the rows (two cores' work).
    for row in (5, 12):
        bad = weight.scales.copy()
        bad[row, 3] = np.nextafter(bad[row, 3], np.float32(np.inf))
        off = QuantizedWeight(weight.q, bad, weight.biases, 4, 32, weight.keep)
        assert kernel.with_supers(off).supers is None
    # Other layouts: MLX's own 8 bits (no such scales), groups of 64, fewer than 8 groups a
    # row.
    assert kernel.with_supers(QuantizedWeight.of(quantized(16, 256, 8, 32)[0])).supers is None
    assert kernel.with_supers(QuantizedWeight.of(quantized(16, 256, 4, 64)[0])).supers is None
    short = QuantizedWeight.of(gguf_layer(16, 256)[0])
    cut = QuantizedWeight(short.q[:, :64], short.scales[:, :4], short.biases[:, :4], 4, 32,
                          short.keep)
    assert kernel.with_supers(cut).supers is None


def rebuilt(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """A weight's scales and biases as its super-blocks give them."""
    supers, (out, groups) = weight.supers, weight.scales.shape
    values = supers.codes.reshape(out, 2, groups // 8, 8) * \
        supers.factors.reshape(out, 2, groups // 8, 1)
    return tuple(values.reshape(out, 2, groups).transpose(1, 0, 2))


def test_dequantized_weights_and_embedding_rows_equal_mlxs(kernel):
    for bits, group in ((8, 64), (4, 32), (4, 128)):
        layer, dense = quantized(301, 256, bits, group, seed=bits)
        weight = QuantizedWeight.of(layer)
        out = np.empty(weight.shape, dtype=np.float32)
        kernel.dequantize(weight, out)
        assert np.array_equal(out, dense)
        assert np.array_equal(weight[7], dense[7])
        ids = np.array([[3, 300], [0, 3]])
        assert np.array_equal(weight[ids], dense[ids])


def test_which_layers_it_takes():
    assert QuantizedWeight.of(quantized(64, 128, 8, 64)[0]) is not None
    half = quantized(64, 128, 8, 64, scales=mx.bfloat16)[0]
    assert takes(half) and QuantizedWeight.of(half) is None  # its scales are widened first
    for bits, group in ((3, 64), (6, 64), (5, 32)):
        layer = quantized(64, 128, bits, group)[0]
        assert not takes(layer) and QuantizedWeight.of(layer) is None, (bits, group)
    fp4 = nn.QuantizedLinear.from_linear(nn.Linear(128, 64), 32, 4, mode="mxfp4")
    assert not takes(fp4) and QuantizedWeight.of(fp4) is None  # not affine
    assert not takes(nn.Linear(128, 64))
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(50, 64), 32, 4)
    assert takes(embedding) and QuantizedWeight.of(embedding).shape == (50, 64)


def test_it_refuses_what_it_does_not_take(kernel):
    weight = QuantizedWeight.of(quantized(16, 128, 8, 64)[0])
    x = np.zeros((4, 128), dtype=np.float32)
    out = np.zeros((4, 16), dtype=np.float32)
    fn = lambda *a: kernel.rows_parts(*a, 1.0)  # noqa: E731 (zmul 1: the biases as stored)
    args = (weight.q.ctypes.data, 8, 128, 64, weight.scales.ctypes.data,
            weight.biases.ctypes.data, x.ctypes.data)
    for parts in (1, 2):
        assert fn(*args, 4, out.ctypes.data, 16, 4, 0, 16, parts) == 0
        assert fn(*args, 3, out.ctypes.data, 16, 3, 0, 16, parts) == -1  # lanes not a power of 2
        assert fn(*args, 4, out.ctypes.data, 16, 5, 0, 16, parts) == -1  # more rows than lanes
        assert fn(*args, 4, out.ctypes.data, 16, 4, 0, 17, parts) == -1  # past the weight
        bad_group = (*args[:3], 48, *args[4:])
        assert fn(*bad_group, 4, out.ctypes.data, 16, 4, 0, 16, parts) == -1
        # MLX's group sizes only: each has kernels of its own (96 divides this depth)
        wide = (*args[:2], 192, 96, *args[4:])
        assert fn(*wide, 4, out.ctypes.data, 16, 4, 0, 16, parts) == -1


def test_products_of_many_rows_are_dequantized_once_and_go_to_blas(kernel):
    layer, dense = quantized(96, 128, 4, 32)
    bias = np.arange(96, dtype=np.float32)
    gemm = Gemm(openblas_sgemm(probed_blas()), None, kernel)
    rng = np.random.default_rng(1)
    for n in (1, QUANT_ROWS, QUANT_ROWS + 1, 200):
        x = rng.standard_normal((n, 128), dtype=np.float32)
        got = gemm.linear(x, (QuantizedWeight.of(layer), bias))
        assert np.allclose(got, x @ dense.T + bias, rtol=1e-5, atol=1e-4), n
    assert gemm._scratch.size == 96 * 128  # the dequantized weight's buffer, kept


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_decoding_a_quantized_model_gives_mlx_lms_greedy_tokens(tiny_model, kernel, bits,
                                                                 group, monkeypatch):
    # the model as the runner holds it on a CPU (runner/weights.py): packed 4- or 8-bit
    # layers with float32 scales; five greedy rows, prompts read through the numpy prefill
    # (through the kernel and, past QUANT_ROWS tokens, dequantized: 8 here, so that the
    # 9-token prompts take that path too), decode steps of 5 .. 1 rows through the numpy body
    # (one row: the whole step in one C call, runner/decode_row.py, its products on the
    # kernel) and the head, all on the kernel
    monkeypatch.setattr(host_ops, "QUANT_ROWS", 8)
    one_rows = []
    one_row = DecodeRow.__call__
    monkeypatch.setattr(DecodeRow, "__call__", lambda self, row: (
        lambda out: one_rows.append(out is not None) or out)(one_row(self, row)))
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=group, bits=bits)
    mx.eval(model.parameters())
    step = ModelStep(model, 0, lambda token: "")
    assert isinstance(step.host_head.kernel, QuantKernel)
    assert step.host_body is not None and step.host_body.quantized
    assert step.host_prefill is not None
    step.host_body.gemm._sgemm = openblas_sgemm(probed_blas())  # as in a runner, preloaded
    calls = []
    product = QuantKernel.product
    step.host_body.gemm.quant = step.host_body._project._quant = step.host_head.kernel = type(
        "Spy", (), {"product": lambda self, w, x, o: calls.append(x.shape[0])
                    or product(kernel, w, x, o),
                    "dequantize": lambda self, w, o: calls.append("dequantized")
                    or kernel.dequantize(w, o)})()
    passes = []
    chunks = step.host_prefill.chunks
    monkeypatch.setattr(step.host_prefill, "chunks", lambda parts, *rest: passes.append(
        [len(p.tokens) for p in parts]) or chunks(parts, *rest))
    seqs = five_greedy_rows(step)
    assert [s.output_tokens for s in seqs] == [
        mlx_lm_greedy(model, s.prompt_tokens, 6 + i) for i, s in enumerate(seqs)]
    # the five prompts arrive together: one numpy pass over all their positions, each
    # weight dequantized once for them, not once a prompt (the last layer's keys and values
    # only: its other products read the five last positions, on the kernel)
    assert passes[0] == [9, 16, 23, 30, 37]
    assert calls.count("dequantized") == 7 * (len(model.layers) - 1) + 2
    assert {1, 5, 3}.issubset(calls) and "dequantized" in calls and 9 not in calls
    assert one_rows and all(one_rows)  # the one-row steps, each in one C call


def test_a_quantized_models_embeddings_read_through_the_numpy_body_equal_mlxs(
        tiny_model, kernel, monkeypatch):
    # its MLX body would run MLX's quantized CPU products, 30x the time; chunks of 16 here
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=64, bits=8)
    mx.eval(model.parameters())
    step = ModelStep(model, 0, lambda token: "")
    monkeypatch.setattr(embeddings, "LM_CHUNK", 16)
    via_mlx = LMEmbedder.make(model, step.split.body, None, 512, 1000)
    via_host = LMEmbedder.make(model, step.split.body, None, 512, 1000, host=step.host_prefill)
    batch = [[7], [(3 * i + 1) % 300 + 2 for i in range(40)], list(range(2, 18))]
    got, want = via_host.forward(batch), via_mlx.forward(batch)
    assert got.shape == want.shape == (3, via_mlx.dim)
    assert np.allclose(got, want, atol=1e-5)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

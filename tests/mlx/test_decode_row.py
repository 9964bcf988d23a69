"""One row's decode step in one C call (runner/decode_row.py, `mlxr_decode_row` in
shared/assets/attend_kernel.c): the same hidden state, keys and values as the numpy body's own
row path, for float32 (OpenBLAS) and quantized layers (a Q4_K import's among them), biases, per-head norms, a context in
several pieces and long enough to split the attention across the workers; large gate values
through its SwiGLU; greedy tokens equal to mlx-lm's through a runner's model step; where it
does not apply, the numpy path serves."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm.utils import load

from mlxr.runner.architectures import fix_model
from mlxr.runner import decode_row
from mlxr.runner.host_body import HostBody, HostRow
from mlxr.runner.kv import rows
from mlxr.runner.kv.attend_kernel import POOL_FLOATS, AttendKernel
from mlxr.runner.model_step import ModelStep
from mlxr.supervisor.store.random_model import write_random_model
from tests.mlx.test_heads import probed_blas
from tests.mlx.test_host_attention import mlx_lm_greedy
from tests.mlx.test_host_body import arch_models  # noqa: F401 (a fixture)
from tests.mlx.test_quant_kernel import gguf_layer
from tests.mlx.test_row_kernel import five_greedy_rows


def context(body: HostBody, lengths: list[int], seed: int) -> tuple[list, list]:
    """Keys and values per layer in pieces of `lengths` positions, each a slice of a larger
    array as the pool's rows are; the last piece's last position is the step's slot."""
    rng = np.random.default_rng(seed)
    kv_heads, dim = body.layers[0].kv_heads, body.head_dim
    keys, values = [], []
    for _ in body.layers:
        layer_keys, layer_values = [], []
        for n in lengths:
            k = rng.standard_normal((kv_heads, n + 3, dim), dtype=np.float32)
            v = rng.standard_normal((kv_heads, n + 3, dim), dtype=np.float32)
            layer_keys.append(k[:, 1:1 + n])
            layer_values.append(v[:, 1:1 + n])
        keys.append(layer_keys)
        values.append(layer_values)
    return keys, values


def both_ways(body: HostBody, token: int, lengths: list[int], seed: int = 0):
    """The C row's (hidden, keys, values) and the numpy path's, on copies of one context."""
    keys, values = context(body, lengths, seed)
    position = sum(lengths) - 1
    copies = [([[p.copy() for p in layer] for layer in keys],
               [[p.copy() for p in layer] for layer in values]) for _ in range(2)]
    rows = [HostRow(token, position, k, v) for k, v in copies]
    fused = body.decode_row
    assert fused is not None
    got = fused(rows[0])
    assert got is not None
    body.decode_row = None
    try:
        want = body([rows[1]])[0]
    finally:
        body.decode_row = fused
    return (got, rows[0]), (want, rows[1])


def assert_same(got, want) -> None:
    (h1, row1), (h2, row2) = got, want
    scale = float(np.abs(h2).max())
    assert np.abs(h1 - h2).max() <= 1e-5 * scale
    for a, b in zip(row1.keys + row1.values, row2.keys + row2.values):
        # relative to the vector's scale, as the hidden state: the kernels sum in another
        # order on each CPU (16 lanes with AVX-512, 8 with AVX2), so a small element of a
        # large key differs by a few float32 steps of the large ones
        got, want = a[-1][:, -1], b[-1][:, -1]
        assert np.abs(got - want).max() <= 1e-5 * max(float(np.abs(want).max()), 1.0)
        assert np.isfinite(got).all()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_it_equals_the_numpy_rows_step(arch_models, arch):  # noqa: F811
    # qwen2: q/k/v biases; qwen3: per-head q/k norms; float32 products through OpenBLAS
    body = HostBody.find(arch_models(arch), probed_blas())
    assert body is not None and body.decode_row is not None
    assert_same(*both_ways(body, 11, [16, 16, 9]))  # two shared blocks, then the row's own
    assert_same(*both_ways(body, 12, [1]))  # the first position


def test_a_long_context_is_split_across_the_workers_and_still_equal(arch_models):  # noqa: F811
    body = HostBody.find(arch_models("qwen3"), probed_blas())
    layer = body.layers[0]
    positions = POOL_FLOATS // (2 * layer.kv_heads * body.head_dim) + 40
    assert_same(*both_ways(body, 7, [positions - 7, 7], seed=3))


def test_large_gate_values_keep_swiglu_finite_and_equal(arch_models):  # noqa: F811
    model = arch_models("llama")
    gate = model.layers[0].mlp.gate_proj
    saved = gate.weight
    gate.weight = saved * 400  # gate values of hundreds either side: exp(-g) overflows
    try:
        body = HostBody.find(model, probed_blas())
        assert body is not None
        assert_same(*both_ways(body, 5, [20]))
    finally:
        gate.weight = saved


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_quantized_layers_equal_the_numpy_rows_step(tmp_path, bits, group):
    model, _, config = load(str(write_random_model(tmp_path, arch="qwen2")),
                            return_config=True)  # biases beside quantized weights
    fix_model(model, config)
    rows.install(model)
    nn.quantize(model, group_size=group, bits=bits)
    mx.eval(model.parameters())
    body = HostBody.find(model, probed_blas())
    assert body is not None and body.quantized and body.decode_row is not None
    assert_same(*both_ways(body, 9, [16, 5]))


@pytest.mark.parametrize("types, kind", [((T.Q4_K, T.Q6_K), decode_row.KIND_SUPER),
                                         ((T.Q4_0, T.Q8_0), decode_row.KIND_OFFSET)],
                         ids=["Q4_K_M", "Q4_0+Q8_0"])
def test_gguf_imports_layers_read_in_fewer_bytes_equal_the_numpy_rows_step(tmp_path, types,
                                                                            kind):
    model, _, config = load(str(write_random_model(tmp_path, arch="qwen2")), return_config=True)
    fix_model(model, config)
    rows.install(model)
    nn.quantize(model, group_size=32, bits=4)
    linears = [layer for _, layer in model.named_modules() if isinstance(layer, nn.QuantizedLinear)]
    for i, layer in enumerate(linears):  # as a GGUF import holds them: 4 and 8 bits
        width, depth = layer.weight.shape[0], layer.weight.shape[1] * 32 // layer.bits
        gguf, _ = gguf_layer(width, depth, seed=i, qtype=types[i % 2])
        layer.weight, layer.scales, layer.biases = gguf.weight, gguf.scales, gguf.biases
        layer.bits = gguf.bits
    assert {layer.bits for layer in linears} == {4, 8}
    mx.eval(model.parameters())
    body = HostBody.find(model, probed_blas())
    assert body is not None and body.decode_row is not None
    start = decode_row.M_HEADER + decode_row.Y_LINEARS  # the first layer's seven linears
    kinds = body.decode_row._model[start:start + 7 * decode_row.LIN_SLOTS:decode_row.LIN_SLOTS]
    assert set(kinds) == {kind}
    assert_same(*both_ways(body, 9, [16, 5]))


def test_a_quantized_runner_step_gives_mlx_lms_greedy_tokens(tiny_model):
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    step = ModelStep(model, 0, lambda token: "")
    assert step.host_body is not None and step.host_body.decode_row is not None
    calls = []
    fused = step.host_body.decode_row
    step.host_body.decode_row = lambda row: calls.append(row.position) or fused(row)
    seqs = five_greedy_rows(step)
    assert calls  # the steps with one row left went through it
    assert [s.output_tokens for s in seqs] == [
        mlx_lm_greedy(model, s.prompt_tokens, 6 + i) for i, s in enumerate(seqs)]


def test_without_blas_a_float32_body_keeps_its_numpy_rows(arch_models):  # noqa: F811
    body = HostBody.find(arch_models("llama"))  # no OpenBLAS loaded: numpy's products
    assert body is not None and body._project.sgemv is None
    assert body.decode_row is None


def test_a_row_whose_pieces_it_does_not_read_takes_the_numpy_path(arch_models):  # noqa: F811
    body = HostBody.find(arch_models("qwen3"), probed_blas())
    keys, values = context(body, [12], seed=1)
    strided = [[np.ascontiguousarray(np.swapaxes(layer[0], 0, 1)).swapaxes(0, 1)]
               for layer in keys]  # positions not rows of contiguous heads' floats
    row = HostRow(3, 11, strided, values)
    assert body.decode_row(row) is None
    assert np.isfinite(body([row])[0]).all()  # the body's own path served it


def test_a_stale_kernels_table_is_left_alone(arch_models, monkeypatch):  # noqa: F811
    kernel = AttendKernel.load()
    assert kernel is not None and kernel.decode_layout == decode_row.LAYOUT
    monkeypatch.setattr(kernel, "decode_layout", (1, 2, 3, 4, 5))  # a stale library's
    body = HostBody.find(arch_models("qwen3"), probed_blas())
    assert body is not None and body.decode_row is None  # numpy's rows serve

"""The load-time probes' reference passes (runner/probe_reference.py): inside the context a
quantized layer's products come from the quantized kernel and equal MLX's own; what the
kernel does not take is still MLX's; the classes are restored after, also on an exception;
a host path that differs from the model is still refused inside; and a runner's load leaves
MLX's classes as they were."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
import pytest
from mlx_lm.utils import load

from mlxr.runner import loader
from mlxr.runner.host_body import HostBody
from mlxr.runner.probe_reference import kernel_reference
from mlxr.runner.quant_kernel import QuantKernel
from mlxr.shared.config import RunnerConfig

ORIGINAL = (nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear)


@pytest.fixture
def products(monkeypatch) -> list[int]:
    """The row counts of the kernel's products while the test runs."""
    calls: list[int] = []
    product = QuantKernel.product
    monkeypatch.setattr(QuantKernel, "product", lambda self, w, x, o: calls.append(
        x.shape[0]) or product(self, w, x, o))
    return calls


def layer(bits: int, group: int, bias: bool) -> nn.QuantizedLinear:
    linear = nn.Linear(256, 48, bias=bias)
    linear.weight = mx.random.normal((48, 256), key=mx.random.key(bits))
    if bias:
        linear.bias = mx.random.normal((48,), key=mx.random.key(7))
    return nn.QuantizedLinear.from_linear(linear, group, bits)


@pytest.mark.parametrize("bits,group,bias", [(4, 32, False), (8, 64, True)])
def test_quantized_layers_inside_give_mlxs_own_products_from_the_kernel(products, bits,
                                                                         group, bias):
    quantized = layer(bits, group, bias)
    x = mx.random.normal((2, 3, 256), key=mx.random.key(1))
    want = quantized(x)
    with kernel_reference():
        got = quantized(x)
    assert products == [6]  # the pass's six rows in one product
    assert got.shape == want.shape == (2, 3, 48) and got.dtype == mx.float32
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [3, 40])  # mlx_lm sorts the rows by expert from 64 on
def test_a_mixtures_experts_inside_give_mlxs_own_products_from_the_kernel(products, tokens):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

    glu = SwitchGLU(256, 128, 8)
    glu.update(tree_map(lambda a: mx.random.normal(a.shape, key=mx.random.key(3)) * 0.05,
                        glu.parameters()))
    nn.quantize(glu, group_size=32, bits=4)
    assert isinstance(glu.down_proj, QuantizedSwitchLinear)
    x = mx.random.normal((1, tokens, 256), key=mx.random.key(4))
    chosen = mx.random.randint(0, 8, (1, tokens, 2), key=mx.random.key(5))
    want = glu(x, chosen)
    with kernel_reference():
        got = glu(x, chosen)
    assert products and sum(products) == 3 * 2 * tokens  # each (row, chosen expert) once
    assert got.shape == want.shape == (1, tokens, 2, 256)
    assert np.allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    calls = len(products)
    mx.eval(glu(x, chosen))  # the context closed: MLX's own again
    assert len(products) == calls


def test_tied_embeddings_as_the_head_inside_give_mlxs_own(products):
    embedding = nn.Embedding(300, 128)
    embedding.weight = mx.random.normal((300, 128), key=mx.random.key(2))
    quantized = nn.QuantizedEmbedding.from_embedding(embedding, 32, 4)
    x = mx.random.normal((5, 128), key=mx.random.key(3))
    want = quantized.as_linear(x)
    with kernel_reference():
        got = quantized.as_linear(x)
        rows = quantized(mx.array([[3, 299]]))  # the lookup is MLX's own
    assert products == [5]
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(rows), np.array(quantized(mx.array([[3, 299]]))))


def test_what_the_kernel_does_not_take_is_still_mlxs(products):
    six_bits, four_bits = layer(6, 32, False), layer(4, 32, False)
    x = mx.random.normal((4, 256), key=mx.random.key(4))
    half = x.astype(mx.bfloat16)  # rows that are not float32
    with kernel_reference():
        got, got_half = six_bits(x), four_bits(half)
    assert products == []
    assert np.array_equal(np.array(got), np.array(six_bits(x)))
    assert np.array_equal(np.array(got_half), np.array(four_bits(half)))


def test_the_classes_are_restored_after_and_on_an_exception():
    with kernel_reference():
        assert nn.QuantizedLinear.__call__ is not ORIGINAL[0]
    assert (nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear) == ORIGINAL
    with pytest.raises(RuntimeError), kernel_reference():
        raise RuntimeError("a probe failed")
    assert (nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear) == ORIGINAL


def test_a_host_body_that_differs_from_the_model_is_still_refused_inside(tiny_model, products):
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    with kernel_reference():
        host = HostBody.find(model)
        assert host is not None and host.quantized
        assert 7 in products  # the model's own pass over the 7-token probe, on the kernel
        norm = model.model.layers[1].input_layernorm
        norm.weight = norm.weight * 1.5  # the model changes; the host body's copy does not
        assert not host.matches(model)


def test_a_runner_load_of_a_quantized_model_probes_inside_and_restores_the_classes(
        tiny_model, tmp_path, products):
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    out = tmp_path / "q4"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_model / name).exists():
            (out / name).write_bytes((tiny_model / name).read_bytes())
    config = json.loads((tiny_model / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    model.save_weights(str(out / "model.safetensors"))
    loaded = loader.load_model(RunnerConfig(model_dir=str(out)), "test", lambda p: None)
    assert products  # the probes' passes took the kernel
    assert loaded.model_step.host_body is not None and loaded.model_step.host_body.quantized
    assert (nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear) == ORIGINAL

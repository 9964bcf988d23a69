"""Quantized layers on the quantized kernel while serving (runner/kernel_layers.py), for the
architectures the numpy body does not serve: random Gemma 3, Gemma 4 and Gemma 4 mixture
models quantized to 8 and 4 bits give MLX's own logits (to float32 rounding) for a prompt
(the wide path: dequantized into scratch, BLAS) and for decode steps (the kernel's product),
and the same greedy tokens; layers the kernel does not take keep MLX's product."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.runner import kernel_layers
from mlxr.runner.weights import widen_around_kernel
from mlxr.supervisor.store.random_model import write_random_model

PROMPT = "river stone cloud " * 14  # over MAX_ROWS tokens: the prompt takes the wide path


def _model(tmp_path, preset: str, bits: int):
    model, tokenizer = load(str(write_random_model(tmp_path / preset, preset)))
    nn.quantize(model, group_size=32, bits=bits)
    widen_around_kernel(model)  # float32 scales and biases, as the runner holds them
    return model, tokenizer


def _passes(model, ids: list[int], steps: int = 4) -> list[mx.array]:
    """The prompt's last logits, then each decode step's, feeding back the greedy token."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out = [logits]
    for _ in range(steps):
        logits = model(mx.array([[int(mx.argmax(logits))]]), cache=cache)[0, -1]
        out.append(logits)
    return out


def _greedy(model, ids: list[int], n: int = 12) -> list[int]:
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("preset, bits", [("gemma3", 4), ("gemma4", 8), ("gemma4", 4),
                                          ("gemma4-moe", 8)])
def test_the_kernel_gives_mlxs_products(tmp_path, preset, bits):
    model, tokenizer = _model(tmp_path, preset, bits)
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > kernel_layers.MAX_ROWS
    want, tokens = _passes(model, ids), _greedy(model, ids)
    taken = kernel_layers.install(model)
    quantized = [m for _, m in model.named_modules() if hasattr(m, "scales")]
    assert taken == len(quantized) and kernel_layers.serves(model)
    for got, ref in zip(_passes(model, ids), want):
        assert float(mx.abs(got - ref).max()) <= 1e-4 * float(mx.abs(ref).max())
    assert _greedy(model, ids) == tokens


def test_layers_the_kernel_does_not_take_keep_mlxs_product(tmp_path):
    model, _ = load(str(write_random_model(tmp_path / "g3", "gemma3")))
    nn.quantize(model, group_size=32, bits=3)  # 3 bits: the kernel reads 4 and 8
    assert kernel_layers.install(model) == 0 and not kernel_layers.serves(model)
    assert all(type(m) is nn.QuantizedLinear for _, m in model.named_modules()
               if isinstance(m, nn.QuantizedLinear))


def test_a_layer_too_large_for_the_scratch_takes_the_kernels_passes(tmp_path, monkeypatch):
    model, tokenizer = _model(tmp_path, "gemma4", 8)
    ids = tokenizer.encode(PROMPT)
    want = _passes(model, ids, steps=1)
    kernel_layers.install(model)
    monkeypatch.setattr(kernel_layers, "MAX_SCRATCH", 0)  # every layer: passes of 16 rows
    for got, ref in zip(_passes(model, ids, steps=1), want):
        assert float(mx.abs(got - ref).max()) <= 1e-4 * float(mx.abs(ref).max())
    scratch = next(m.host.scratch for _, m in model.named_modules()
                   if isinstance(m, kernel_layers.KernelLinear))
    assert scratch.take(0, 0).size == 0 and scratch._buffer.size == 0  # never dequantized

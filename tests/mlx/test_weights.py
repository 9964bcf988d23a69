"""Widening a model's weights to float32 (runner/weights.py): what `footprint` measures for
float32, bfloat16 and MLX 4-bit models, that `widen` leaves only float32 arrays and no
quantized layers, and that the widened model computes what the stored one does (the same
values, in wider arithmetic); a bfloat16 mixture of experts served as stored has its experts
in float32 (MLX's CPU expert product takes no other type)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlx_lm.models.switch_layers import SwitchLinear

from mlxr.runner.weights import (EXPERTS_WIDE, ON_KERNEL, float32_on_cpu, footprint,
                                 kernel_layers, widen, widen_around_kernel)
from mlxr.supervisor.store.quantize import quantize_dir
from mlxr.supervisor.store.random_model import write_random_model

PROMPT = mx.array([[5, 17, 300, 42, 9, 1000, 77]])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weights")
    f32 = write_random_model(tmp / "f32", preset="tiny")
    bf16 = write_random_model(tmp / "bf16", preset="tiny", dtype="bfloat16")
    q4 = tmp / "q4"
    quantize_dir(f32, q4, 4)
    for extra in f32.iterdir():
        if not (q4 / extra.name).exists():
            shutil.copy(extra, q4 / extra.name)
    return {"f32": f32, "bf16": bf16, "q4": q4}


def dtypes(model) -> set:
    return {a.dtype for _, a in tree_flatten(model.parameters())}


def test_footprint_of_each_format(models):
    f32, _ = load(str(models["f32"]))
    bf16, _ = load(str(models["bf16"]))
    q4, _ = load(str(models["q4"]))
    wide = footprint(f32)
    assert wide.stored_as == "float32" and wide.stored_bytes == wide.float32_bytes
    assert wide.stored_bytes == sum(a.nbytes for _, a in tree_flatten(f32.parameters()))
    half = footprint(bf16)
    assert half.stored_as == "bfloat16"
    assert (half.stored_bytes * 2, half.float32_bytes) == (wide.float32_bytes,) * 2
    quarter = footprint(q4)
    assert quarter.stored_as == "4-bit" and quarter.float32_bytes == wide.float32_bytes
    assert quarter.stored_bytes < wide.stored_bytes / 4


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
def test_widen_leaves_float32_arrays_only_and_computes_the_same_values(models, fmt):
    model, _ = load(str(models[fmt]))
    stored = model(PROMPT).astype(mx.float32)
    widen(model)
    assert dtypes(model) == {mx.float32}
    kinds = {type(m) for _, m in model.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding}
    wide = model(PROMPT)
    assert wide.dtype == mx.float32
    if fmt == "q4":  # the same float32 arithmetic over the dequantized values
        assert mx.allclose(wide, stored, atol=1e-4).item()
    else:  # bfloat16 arithmetic rounds; float32 is closer to the float32 source model
        source, _ = load(str(models["f32"]))
        exact = source(PROMPT)
        assert (mx.abs(wide - exact).max() < mx.abs(stored - exact).max()).item()
        assert mx.allclose(wide, stored, atol=0.1).item()


def test_a_widened_4_bit_model_generates_the_stored_models_greedy_tokens(models):
    stored, _ = load(str(models["q4"]))
    widened, _ = load(str(models["q4"]))
    widen(widened)

    def tokens(model):
        steps = generate_step(PROMPT[0], model, max_tokens=24, sampler=make_sampler(0.0))
        return [int(t) for t, _ in steps]

    assert tokens(widened) == tokens(stored)


def test_the_setting_decides_and_says_what_the_weights_are(models):
    model, _ = load(str(models["bf16"]))
    assert float32_on_cpu(model, "off", 0, 1 << 40) == "bfloat16"
    assert dtypes(model) == {mx.bfloat16}
    assert float32_on_cpu(model, "auto", 1 << 30, 1 << 20) == "bfloat16"  # does not fit
    assert float32_on_cpu(model, "auto", 0, 1 << 40) == "float32 from bfloat16"
    assert dtypes(model) == {mx.float32}
    assert float32_on_cpu(model, "auto", 0, 1 << 40) == "float32"


def test_a_bfloat16_mixture_kept_as_stored_has_float32_experts_and_runs(tmp_path):
    path = write_random_model(tmp_path / "moe", arch="qwen3_moe", dtype="bfloat16")
    stored, _ = load(str(path))
    with pytest.raises(RuntimeError, match="GatherMM"):  # what served it before
        mx.eval(stored(PROMPT))
    assert float32_on_cpu(stored, "off", 0, 1 << 40) == "bfloat16" + EXPERTS_WIDE
    experts = [m for _, m in stored.named_modules() if isinstance(m, SwitchLinear)]
    assert len(experts) == 6 and {m.weight.dtype for m in experts} == {mx.float32}
    assert stored.model.embed_tokens.weight.dtype == mx.bfloat16  # the rest as stored
    wide, _ = load(str(path))
    assert float32_on_cpu(wide, "on", 0, 1 << 40) == "float32 from bfloat16"
    a, b = stored(PROMPT)[0, -1].astype(mx.float32), wide(PROMPT)[0, -1]
    assert (a @ b / mx.sqrt((a @ a) * (b @ b))).item() > 0.99  # the same model


def test_ranks_that_do_not_all_agree_keep_the_stored_weights(models):
    model, _ = load(str(models["bf16"]))
    asked = []
    assert float32_on_cpu(model, "auto", 0, 1 << 40,
                          agree=lambda ok: asked.append(ok) or False) == "bfloat16"
    assert asked == [True] and dtypes(model) == {mx.bfloat16}
    assert float32_on_cpu(model, "auto", 0, 1 << 40, agree=lambda ok: ok) == \
        "float32 from bfloat16"


def test_around_the_kernel_4_and_8_bit_layers_stay_packed_and_the_rest_is_float32(models):
    # a GGUF import's mix: most layers 4-bit, some 6-bit (held in 8 for the kernel), and a
    # mode the kernel has no code for (MXFP4 as MLX holds it), in bfloat16
    model, _ = load(str(models["bf16"]))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: (
        {"group_size": 32, "bits": 6} if "down_proj" in path else
        {"group_size": 32, "bits": 4, "mode": "mxfp4"} if "o_proj" in path else
        hasattr(m, "to_quantized")))
    stored = model(PROMPT).astype(mx.float32)
    names = kernel_layers(model)
    assert any("down_proj" in n for n in names) and all("o_proj" not in n for n in names)
    assert widen_around_kernel(model) == len(model.layers)  # the down_proj layers, repacked
    for name, module in model.named_modules():
        if name.endswith("o_proj"):
            assert type(module) is nn.Linear and module.weight.dtype == mx.float32
        elif isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            assert module.bits == (8 if name.endswith("down_proj") else 4)
            assert module.weight.dtype == mx.uint32
            assert module.scales.dtype == module.biases.dtype == mx.float32
    assert dtypes(model) == {mx.float32, mx.uint32}
    assert {n for n, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert mx.allclose(model(PROMPT), stored, atol=0.1).item()  # bfloat16 against float32


def test_a_quantized_model_for_the_numpy_body_keeps_its_layers_for_the_kernel(models):
    model, _ = load(str(models["q4"]))
    stored = model(PROMPT)
    assert float32_on_cpu(model, "auto", 0, 1 << 40, host_kernel=True) == \
        "4-bit" + ON_KERNEL
    assert dtypes(model) == {mx.float32, mx.uint32}
    assert mx.allclose(model(PROMPT), stored, atol=1e-5).item()  # the same float32 values
    model, _ = load(str(models["q4"]))  # "on" still widens everything
    assert float32_on_cpu(model, "on", 0, 1 << 40, host_kernel=True) == "float32 from 4-bit"
    model, _ = load(str(models["q4"]))  # a model the numpy body cannot serve is widened
    assert float32_on_cpu(model, "auto", 0, 1 << 40) == "float32 from 4-bit"
    model, _ = load(str(models["q4"]))  # its KV budget does not fit: as stored
    assert float32_on_cpu(model, "auto", 1 << 30, 1 << 20, host_kernel=True) == "4-bit"

"""gpt-oss's mxfp4 experts on the CPU kernel (runner/mxfp4_kernel.py): each variant of the C
kernel (AVX-512, AVX2, plain C: the widths this CPU runs) against MLX's own dequantized
weights; a block's output and a model's greedy tokens against mlx_lm's, from a GGUF with MXFP4
experts; and what the kernel leaves alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.runner.mxfp4_kernel import MAX_ROWS, Mxfp4Kernel, install, takes
from mlxr.supervisor.store.gguf.convert import convert
from mlxr.supervisor.store.gguf.write import write_gguf
from mlxr.supervisor.store.random_model import write_random_model


@pytest.fixture(scope="module")
def kernel():
    k = Mxfp4Kernel.load()
    assert k is not None, "the mxfp4 kernel builds wherever a C compiler is"
    return k


@pytest.mark.parametrize("width", [16, 8, 1])
def test_every_variant_gives_mlxs_products(kernel, width):
    rng = np.random.default_rng(width)
    weights = mx.array(rng.standard_normal((3, 300, 512)).astype(np.float32) * 0.05)
    codes, exponents = mx.quantize(weights, group_size=32, bits=4, mode="mxfp4")
    wide = np.array(mx.dequantize(codes, exponents, None, group_size=32, bits=4, mode="mxfp4",
                                  dtype=mx.float32))
    codes, exponents = np.array(codes).view(np.uint8), np.array(exponents)
    xs = [rng.standard_normal(512).astype(np.float32) for _ in range(3)]
    variant = Mxfp4Kernel(kernel.rows_fn, min(width, kernel.width))
    outs = variant.products([(codes[e], exponents[e]) for e in range(3)], xs)
    for e in range(3):
        want = wide[e].astype(np.float64) @ xs[e].astype(np.float64)
        np.testing.assert_allclose(outs[e], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oss")
    source = write_random_model(tmp / "src", "gpt_oss")
    convert(write_gguf(source, tmp / "m.gguf", "MXFP4"), tmp / "mxfp4")
    return tmp / "mxfp4"


def test_a_model_on_the_kernel_gives_mlx_lms_logits_and_tokens(mxfp4_model):
    model, tokenizer = load(str(mxfp4_model))
    ids = mx.array(tokenizer.encode("river stone cloud ember maple harbor violet"))

    def run():
        steps = generate_step(ids, model, max_tokens=12, sampler=make_sampler(0.0))
        return [int(t) for t, _ in steps]

    x = mx.array(np.random.default_rng(0).standard_normal((MAX_ROWS, 1, 256)), mx.float32)
    before = [layer.mlp(x) for layer in model.layers]
    tokens = run()
    assert install(model) == 4 and takes(model.layers[0].mlp.experts.gate_proj)
    after = [layer.mlp(x) for layer in model.layers]  # MAX_ROWS rows: the kernel's path
    for a, b in zip(before, after):
        assert float(mx.abs(a - b).max()) <= 1e-5 * float(mx.abs(a).max())
    assert run() == tokens
    longer = mx.concatenate([x, x], axis=0)  # past MAX_ROWS: MLX's products, as before
    assert type(model.layers[0].mlp).__mro__[1].__call__(model.layers[0].mlp, longer).shape \
        == model.layers[0].mlp(longer).shape


def test_affine_or_float_experts_are_left_to_mlx(tmp_path):
    source = write_random_model(tmp_path / "src", "gpt_oss")
    model, _ = load(str(source))  # float experts
    assert install(model) == 0
    qwen = write_random_model(tmp_path / "moe", "qwen3_moe")
    model, _ = load(str(qwen))
    assert install(model) == 0

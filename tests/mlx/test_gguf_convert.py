"""GGUF files written from each architecture's random model (F32, F16, Q8_0, Q4_K) and
converted back to MLX by the store's converter:
- F32 and F16 imports generate the same greedy tokens as the safetensors model;
- quantized imports keep gguf's values bit for bit (mx.dequantize of the converted weights ==
  gguf.quants.dequantize of the file's tensor) and give logits close to those of the same
  file converted to floats (cosine >= 0.99);
- the tokenizer rebuilt from the file's metadata encodes a mixed text like the original."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.supervisor.store.gguf import arch as A
from mlxr.supervisor.store.gguf.convert import convert
from mlxr.supervisor.store.gguf.header import read_gguf
from mlxr.supervisor.store.gguf.write import write_gguf
from mlxr.supervisor.store.random_model import ARCH_NAMES, write_random_model

PROMPT = "def greet(name):\n    return f'你好, {name} 🙂'   # tabs\t\tand  spaces"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def make(arch: str):
        if arch not in made:
            made[arch] = write_random_model(tmp_path_factory.mktemp(arch), arch=arch)
        return made[arch]

    return make


def _run(model_dir, n: int = 8):
    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(PROMPT)
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0))
    return ids, [int(t) for t, _ in steps], logits


def _cosine(a: mx.array, b: mx.array) -> float:
    return float((a * b).sum() / mx.sqrt((a * a).sum() * (b * b).sum()))


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_float_imports_generate_what_the_safetensors_model_does(arch, sources, tmp_path):
    src = sources(arch)
    ids, tokens, logits = _run(src)
    for file_type in ("F32", "F16"):
        out = tmp_path / file_type
        convert(write_gguf(src, tmp_path / f"{file_type}.gguf", file_type), out)
        got_ids, got_tokens, got_logits = _run(out)
        assert got_ids == ids  # the tokenizer from GGUF metadata encodes the same
        assert got_tokens == tokens, file_type
        if file_type == "F32":
            assert mx.array_equal(got_logits, logits)


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_K"])
def test_quantized_imports_are_exact_and_close_to_their_float_values(arch, file_type, sources,
                                                                      tmp_path):
    gguf_path = write_gguf(sources(arch), tmp_path / "m.gguf", file_type)
    config = convert(gguf_path, tmp_path / "q")
    convert(gguf_path, tmp_path / "f", dequantize=True)
    assert config["quantization"]["bits"] == {"Q8_0": 8, "Q4_K": 4}[file_type]
    # Weights: every quantized tensor dequantizes to exactly gguf's reference values.
    weights = {}
    for path in (tmp_path / "q").glob("*.safetensors"):
        weights.update(mx.load(str(path)))
    gguf = read_gguf(gguf_path)
    checked = 0
    for t in gguf.tensors:
        if t.ggml_type not in (T.Q8_0, T.Q4_K):
            continue
        hf = A.hf_tensor_name(gguf.kv["general.architecture"], t.name)
        stem = hf.removesuffix(".weight")
        got = mx.dequantize(weights[hf], weights[stem + ".scales"], weights[stem + ".biases"],
                            group_size=32, bits=4 if t.ggml_type == T.Q4_K else 8)
        want = gq.dequantize(np.asarray(gguf.data(t)), T(t.ggml_type)).reshape(t.shape)
        order = A.row_order(gguf.kv["general.architecture"], hf, config)
        want = want if order is None else want[order]
        assert np.array_equal(np.array(got), want + np.float32(0)), t.name
        checked += 1
    assert checked >= 7
    # Logits: the quantized model against the same file's float values.
    _, _, quantized = _run(tmp_path / "q")
    _, _, floats = _run(tmp_path / "f")
    assert _cosine(quantized, floats) >= 0.99


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"], ids=["untied", "tied"])
def test_q4_k_m_keeps_llama_cpps_q6_k_tensors(arch, sources, tmp_path):
    path = write_gguf(sources(arch), tmp_path / "m.gguf", "Q4_K_M")  # 2 layers, hidden 256
    gguf = read_gguf(path)
    types = {t.name: T(t.ggml_type) for t in gguf.tensors}
    head = "output.weight" if arch == "qwen3" else "token_embd.weight"
    assert head in types
    # llama.cpp's rule: the first and last eighth of the layers, and every third between; of
    # 2 layers, the second
    wide = {head, "blk.1.attn_v.weight", "blk.1.ffn_down.weight"}
    assert {name for name, kind in types.items() if kind == T.Q6_K} == wide
    assert {kind for name, kind in types.items() if name not in wide} == {T.Q4_K, T.F32}
    assert gguf.kv["general.file_type"] == 15  # MOSTLY_Q4_K_M


def test_a_q6_k_file_holds_every_matrix_in_q6_k(sources, tmp_path):
    path = write_gguf(sources("qwen2"), tmp_path / "m.gguf", "Q6_K")
    gguf = read_gguf(path)
    assert {T(t.ggml_type) for t in gguf.tensors if len(t.shape) > 1} == {T.Q6_K}
    assert gguf.kv["general.file_type"] == 18  # MOSTLY_Q6_K

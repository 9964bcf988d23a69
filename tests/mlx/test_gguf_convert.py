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


def test_gpt_oss_as_its_ggufs_come_mxfp4_experts_exact(sources, tmp_path):
    path = write_gguf(sources("gpt_oss"), tmp_path / "m.gguf", "MXFP4")
    gguf = read_gguf(path)
    types = {t.name: T(t.ggml_type) for t in gguf.tensors}
    assert {n for n, kind in types.items() if kind == T.MXFP4} == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")}
    assert types["blk.0.ffn_gate_exps.bias"] == types["blk.0.attn_sinks.weight"] == T.F32
    config = convert(path, tmp_path / "q")
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    weights = {}
    for f in (tmp_path / "q").glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    for t in gguf.tensors:
        if types[t.name] != T.MXFP4:
            continue
        hf = A.hf_tensor_name("gpt-oss", t.name)
        assert hf.startswith("model.layers.") and ".mlp.experts." in hf
        stem = hf.removesuffix(".weight")
        assert stem + ".biases" not in weights and weights[stem + ".scales"].dtype == mx.uint8
        got = mx.dequantize(weights[hf], weights[stem + ".scales"], group_size=32, bits=4,
                            mode="mxfp4", dtype=mx.float32)
        want = gq.dequantize(np.asarray(gguf.data(t)), T.MXFP4).reshape(t.shape)
        assert np.array_equal(np.array(got) + 0, want + 0), t.name
    # the rest (F16 matrices, F32 biases and sinks) as floats; the model runs and differs from
    # the float source only by MXFP4's rounding
    assert weights["model.layers.0.self_attn.sinks"].shape == (8,)
    _, _, mxfp4 = _run(tmp_path / "q")
    _, _, floats = _run(sources("gpt_oss"))
    assert _cosine(mxfp4, floats) >= 0.9


def _ollama_gpt_oss(src, dest):
    """A GGUF laid out as Ollama's converter writes gpt-oss from OpenAI's own checkpoint:
    architecture "gptoss", q/k/v fused into attn_qkv (weights and biases), and the end ids
    listed in tokenizer.ggml.eos_token_ids."""
    from gguf import GGUFReader, GGUFValueType as V, GGUFWriter

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dest), "gptoss")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        key = field.name.replace("gpt-oss.", "gptoss.", 1)
        kind = field.types[0]
        if kind == V.ARRAY:
            writer.add_key_value(key, field.contents(), V.ARRAY, field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), kind)
    writer.add_key_value("tokenizer.ggml.eos_token_ids", [2040, 2041, 2047], V.ARRAY, V.INT32)
    tensors = {t.name: (np.array(t.data), T(t.tensor_type)) for t in reader.tensors}

    def add(name, data, kind):  # (quantized rows as their bytes)
        raw = None if kind in (T.F32, T.F16) else kind
        writer.add_tensor(name, data, raw_dtype=raw)

    for name in sorted(tensors):
        stem, _, kind = name.rpartition(".")
        if stem.endswith(("attn_k", "attn_v")):
            continue
        if stem.endswith("attn_q"):
            fused = stem.removesuffix("attn_q") + "attn_qkv"
            parts = [tensors[f"{stem[:-1]}{x}.{kind}"] for x in "qkv"]
            add(f"{fused}.{kind}", np.concatenate([p for p, _ in parts], axis=0), parts[0][1])
        else:
            add(name, *tensors[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def test_ollamas_gpt_oss_files_fused_qkv_and_gptoss_name_give_the_same_model(sources, tmp_path):
    src = sources("gpt_oss")
    f32 = write_gguf(src, tmp_path / "m.gguf", "F32")
    ollama = _ollama_gpt_oss(f32, tmp_path / "ollama.gguf")
    assert "blk.0.attn_qkv.weight" in {t.name for t in read_gguf(ollama).tensors}
    config = convert(ollama, tmp_path / "o")
    assert config["model_type"] == "gpt_oss" and config["eos_token_id"] == [2041, 2040, 2047]
    ids, tokens, logits = _run(src)
    got_ids, got_tokens, got_logits = _run(tmp_path / "o")
    assert (got_ids, got_tokens) == (ids, tokens)
    assert mx.array_equal(got_logits, logits)

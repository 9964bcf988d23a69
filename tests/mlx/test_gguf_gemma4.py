"""Gemma 4 GGUF files as llama.cpp's and Ollama's converters lay them out, converted by the
store and run by mlx_lm, against the random Gemma 4 models they were written from (every
architecture's common checks, F32/F16/Q8_0/Q4_K, are test_gguf_convert.py's; the preset
"gemma4" is among them):
- the mixture (gemma4-moe) with its experts' gate and up fused in one tensor, as llama.cpp
  writes them, or apart, as Ollama does: the same greedy tokens and logits;
- Ollama's tokenizer metadata ("llama" with pre-tokenizer "gemma4") and llama.cpp's ("gemma4")
  give the same tokenizer, which encodes as the model's own tokenizer.json: spaces as "▁" with
  none prepended, newline runs whole, bytes for what the vocabulary lacks, the chat tokens
  whole."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType as V, GGUFWriter
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.supervisor.store.gguf.convert import convert
from mlxr.supervisor.store.gguf.header import read_gguf
from mlxr.supervisor.store.gguf.write import write_gguf
from mlxr.supervisor.store.random_model import write_random_model

PROMPT = ("<|turn>user\nWhat's   the weather\n\n\nin Zürich? 日本 🙂\t(tabs)<turn|>\n"
          "<|turn>model\n<|channel>thought\n<channel|>")


def _run(model_dir, n: int = 8):
    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(PROMPT)
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0))
    return ids, [int(t) for t, _ in steps], logits


def _rewrite(src, dest, *, tokenizer_model: str | None = None, fuse_experts: bool = False):
    """`src` with llama.cpp's fused experts (`ffn_gate_up_exps`) or Ollama's tokenizer
    metadata (model "llama", pre-tokenizer "gemma4")."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dest), "gemma4")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value, kind = field.contents(), field.types[0]
        if field.name == "tokenizer.ggml.model" and tokenizer_model:
            value = tokenizer_model
        if kind == V.ARRAY:
            writer.add_key_value(field.name, value, V.ARRAY, field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    tensors = {t.name: (np.array(t.data), T(t.tensor_type)) for t in reader.tensors}
    for name in sorted(tensors):
        data, kind = tensors[name]
        if fuse_experts and ".ffn_up_exps." in name:
            continue
        if fuse_experts and ".ffn_gate_exps." in name:
            up, _ = tensors[name.replace("gate_exps", "up_exps")]
            name, data = name.replace("gate_exps", "gate_up_exps"), np.concatenate([data, up], 1)
        writer.add_tensor(name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("gemma4-moe"), "gemma4-moe")


@pytest.mark.parametrize("file_type", ["F32", "Q8_0"])
def test_the_mixture_with_fused_or_split_experts_is_one_model(moe, file_type, tmp_path):
    split = write_gguf(moe, tmp_path / "split.gguf", file_type)
    fused = _rewrite(split, tmp_path / "fused.gguf", fuse_experts=True)
    names = {t.name for t in read_gguf(fused).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert {"blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale"} <= names
    runs = []
    for path in (split, fused):
        convert(path, tmp_path / path.stem)
        runs.append(_run(tmp_path / path.stem))
    assert runs[0][:2] == runs[1][:2]
    assert mx.array_equal(runs[0][2], runs[1][2])
    if file_type == "F32":  # and both as the safetensors model
        ids, tokens, logits = _run(moe)
        assert (ids, tokens) == runs[0][:2]
        assert mx.allclose(logits, runs[0][2], atol=1e-4)


def test_ollamas_and_llama_cpps_tokenizer_metadata_encode_as_the_model_does(tmp_path):
    src = write_random_model(tmp_path / "g4", "gemma4")
    ours = write_gguf(src, tmp_path / "g4.gguf", "F32")
    ollama = _rewrite(ours, tmp_path / "ollama.gguf", tokenizer_model="llama")
    kv = read_gguf(ollama).kv
    assert (kv["tokenizer.ggml.model"], kv["tokenizer.ggml.pre"]) == ("llama", "gemma4")
    assert read_gguf(ours).kv["tokenizer.ggml.model"] == "gemma4"
    _, reference = load(str(src))
    texts = [PROMPT, "  two leading spaces\n\n\n\nfour newlines", "\u0f3a\u2603 rare ⚗ chars",
             "<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|>"]
    want = [reference.encode(t) for t in texts]
    assert any(4 <= i < 4 + 256 for i in want[2])  # bytes (ids 4-259) were needed
    for path in (ours, ollama):
        out = tmp_path / f"{path.stem}-dir"
        config = convert(path, out)
        assert config["model_type"] == "gemma4_text" and config["bos_token_id"] == 2
        _, tokenizer = load(str(out))
        assert [tokenizer.encode(t) for t in texts] == want
        assert tokenizer.decode(want[1][1:]) == texts[1]

"""GGUF tokenizer metadata <-> tokenizer.json: a tokenizer written as `tokenizer.ggml.*` fields and
rebuilt from them encodes mixed text (code, CJK, emoji, whitespace runs, special tokens) to the
same ids as the tokenizer.json it came from, and decodes back. No mlx."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from mlxr.shared.assets import write_qwen3_tokenizer
from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.gguf.pretokenizers import GPT2_SPLIT, LLAMA3_SPLIT
from mlxr.supervisor.store.gguf.tokenizer import (
    UnsupportedTokenizer,
    gguf_tokenizer_fields,
    hf_tokenizer_files,
    recover_merges,
    special_token_ids,
)
from mlxr.supervisor.store.small_tokenizer import write_small_tokenizer

K = gguf.Keys.Tokenizer
MIXED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
    "def área(r: float) -> float:\n\treturn 3.14159 * r ** 2  # 面积\n\n"
    "日本語のテキスト、한국어 텍스트 and emoji 🙂👍🏽 — 'QUOTES' DON'T break.\n"
    "    indented    runs   of\u3000spaces\r\n\n\n  trailing  <|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>{\"a\": 1}</tool_call>"
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    made = {name: tmp_path_factory.mktemp(name) for name in ("qwen3", "bpe", "spm")}
    write_qwen3_tokenizer(made["qwen3"])
    write_small_tokenizer(made["bpe"], "bpe")
    write_small_tokenizer(made["spm"], "spm")
    return made


@pytest.fixture(scope="module")
def qwen3_fields(dirs) -> dict:
    return gguf_tokenizer_fields(dirs["qwen3"])


def write_gguf(path: Path, fields: dict) -> None:
    """A GGUF holding `fields` and one tiny tensor."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_gguf_kv(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()
            if name.startswith("tokenizer.")}


def rebuilt(kv: dict, dest: Path) -> Tokenizer:
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in hf_tokenizer_files(kv).items():
        (dest / name).write_bytes(data)
    return Tokenizer.from_file(str(dest / "tokenizer.json"))


def assert_same_tokenizer(original: Tokenizer, copy: Tokenizer) -> None:
    for add_special_tokens in (True, False):
        ids = original.encode(MIXED, add_special_tokens=add_special_tokens).ids
        assert copy.encode(MIXED, add_special_tokens=add_special_tokens).ids == ids
        assert copy.decode(ids, skip_special_tokens=False) == original.decode(
            ids, skip_special_tokens=False
        )
    plain = MIXED.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    assert copy.decode(copy.encode(plain, add_special_tokens=False).ids) == plain


def test_qwen3_round_trips(dirs, qwen3_fields, tmp_path):
    assert qwen3_fields[K.MODEL] == "gpt2" and qwen3_fields[K.PRE] == "qwen2"
    assert K.SCORES not in qwen3_fields, "llama.cpp writes no scores for byte-level BPE"
    original = Tokenizer.from_file(str(dirs["qwen3"] / "tokenizer.json"))
    copy = rebuilt(qwen3_fields, tmp_path)
    assert copy.get_vocab_size(with_added_tokens=True) == original.get_vocab_size(True)
    assert_same_tokenizer(original, copy)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["add_bos_token"] is False and config["clean_up_tokenization_spaces"] is False
    assert "<|im_start|>" in config["chat_template"]


@pytest.mark.parametrize("kind,spm_merges", [("bpe", False), ("spm", True), ("spm", False)])
def test_small_tokenizers_round_trip_through_a_gguf_file(dirs, tmp_path, kind, spm_merges):
    fields = gguf_tokenizer_fields(dirs[kind], spm_merges=spm_merges)
    assert (K.MERGES in fields) is (kind == "bpe" or spm_merges)
    write_gguf(tmp_path / "model.gguf", fields)
    kv = read_gguf_kv(tmp_path / "model.gguf")
    assert kv[K.LIST] == fields[K.LIST] and kv[K.TOKEN_TYPE] == fields[K.TOKEN_TYPE]
    original = Tokenizer.from_file(str(dirs[kind] / "tokenizer.json"))
    assert_same_tokenizer(original, rebuilt(kv, tmp_path / "hf"))


def test_rebuilt_directory_loads_with_auto_tokenizer(dirs, tmp_path):
    from transformers import AutoTokenizer

    rebuilt(gguf_tokenizer_fields(dirs["spm"]), tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    original = Tokenizer.from_file(str(dirs["spm"] / "tokenizer.json"))
    assert hf.encode(MIXED) == original.encode(MIXED).ids
    assert (hf.bos_token, hf.eos_token, hf.unk_token) == ("<s>", "</s>", "<unk>")


def test_spm_fields_are_what_llama_cpp_writes(dirs):
    fields = gguf_tokenizer_fields(dirs["spm"])
    types, tokens, scores = fields[K.TOKEN_TYPE], fields[K.LIST], fields[K.SCORES]
    assert types[:4] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
                         gguf.TokenType.BYTE]
    assert tokens[3] == "<0x00>" and types[258] == gguf.TokenType.BYTE
    assert types[-2:] == [gguf.TokenType.CONTROL] * 2
    results = {left + right for left, right in _merges(dirs["spm"])}
    ranked = [score for token, score in zip(tokens, scores) if token in results]
    assert ranked == sorted(ranked, reverse=True) and len(set(ranked)) == len(ranked)
    assert all(s == 0.0 for s, t in zip(scores, types) if t != gguf.TokenType.NORMAL)
    assert (fields[K.BOS_ID], fields[K.EOS_ID], fields[K.UNK_ID]) == (1, 2, 0)
    assert fields[K.ADD_BOS] is True and fields[K.ADD_PREFIX] is True


def _merges(model_dir: Path) -> list[list[str]]:
    return json.loads((model_dir / "tokenizer.json").read_text())["model"]["merges"]


def test_padding_rows_up_to_the_model_vocab_size(dirs, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((dirs["bpe"] / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 2056, "bos_token_id": 2045}))
    fields = gguf_tokenizer_fields(tmp_path)
    assert len(fields[K.LIST]) == 2056 and fields[K.LIST][-1] == "[PAD2055]"
    assert fields[K.TOKEN_TYPE][-1] == gguf.TokenType.UNUSED
    assert fields[K.BOS_ID] == 2045
    copy = rebuilt(fields, tmp_path / "hf")
    original = Tokenizer.from_file(str(dirs["bpe"] / "tokenizer.json"))
    assert_same_tokenizer(original, copy)


def test_special_token_ids(qwen3_fields):
    assert special_token_ids(qwen3_fields) == {
        "bos_token_id": None,
        "eos_token_id": [151645, 151643],  # <|im_end|>, then <|endoftext|> by its text
        "pad_token_id": 151643,
    }
    kv = {K.LIST: ["<s>", "</s>", "<|eot_id|>", "<|eom_id|>", "a"], K.BOS_ID: 0, K.EOS_ID: 1,
          K.EOT_ID: 2, K.EOM_ID: 3, K.TOKEN_TYPE: [3, 3, 3, 3, 1]}
    assert special_token_ids(kv) == {"bos_token_id": 0, "eos_token_id": [1, 2, 3],
                                     "pad_token_id": None}
    assert special_token_ids({K.LIST: ["a", "b"], K.EOS_ID: 1})["eos_token_id"] == 1


def test_a_harmony_vocabularys_end_tokens_are_return_and_call_not_end():
    # gpt-oss: <|end|> closes one message of a reply (thinking, then the answer); <|return|>
    # and <|call|> end it. Ollama's files list their end ids too (eos_token_ids).
    tokens = ["a", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>",
              "<|call|>"]
    kv = {K.LIST: tokens, K.EOS_ID: 2, K.TOKEN_TYPE: [1, 3, 3, 3, 3, 3, 3]}
    assert special_token_ids(kv)["eos_token_id"] == [2, 1, 6]
    kv = {K.LIST: tokens, K.EOS_ID: 1, "tokenizer.ggml.eos_token_ids": [1, 2, 6]}
    assert special_token_ids(kv)["eos_token_id"] == [1, 2, 6]
    # elsewhere (Phi-3) <|end|> does end the turn
    kv = {K.LIST: ["a", "<|endoftext|>", "<|end|>"], K.EOS_ID: 1, K.TOKEN_TYPE: [1, 3, 3]}
    assert special_token_ids(kv)["eos_token_id"] == [1, 2]


@pytest.mark.parametrize("kind", ["bert", "t5", "rwkv", "none", None])
def test_unsupported_kinds_are_a_400(kind):
    with pytest.raises(UnsupportedTokenizer, match=f'unsupported GGUF tokenizer "{kind}"') as e:
        hf_tokenizer_files({K.MODEL: kind, K.LIST: ["a"]} if kind else {K.LIST: ["a"]})
    assert isinstance(e.value, InvalidRequest) and e.value.status == 400


def test_pre_types_choose_split_regexes(dirs, caplog):
    fields = gguf_tokenizer_fields(dirs["bpe"])
    del fields[K.ADD_BOS]  # absent: llama.cpp's default for Llama 3 adds BOS
    llama3 = json.loads(hf_tokenizer_files({**fields, K.PRE: "llama-bpe", K.BOS_ID: 2045})
                        ["tokenizer.json"])
    assert llama3["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == LLAMA3_SPLIT
    assert llama3["model"]["ignore_merges"] is True
    assert llama3["post_processor"]["type"] == "TemplateProcessing", "llama.cpp adds BOS here"
    refact = json.loads(hf_tokenizer_files({**fields, K.PRE: "refact"})["tokenizer.json"])
    regexes = [s["pattern"]["Regex"] for s in refact["pre_tokenizer"]["pretokenizers"][:-1]]
    assert regexes == [r"\p{N}", GPT2_SPLIT]
    with caplog.at_level(logging.WARNING):
        odd = json.loads(hf_tokenizer_files({**fields, K.PRE: "brand-new"})["tokenizer.json"])
    assert odd["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == GPT2_SPLIT
    assert "brand-new" in caplog.text


def test_no_space_prefix_gemma_style(dirs, tmp_path):
    fields = gguf_tokenizer_fields(dirs["spm"])
    tokens = list(fields[K.LIST])
    types = list(fields[K.TOKEN_TYPE])
    width = next(n for n in range(2, 64) if "\u2581" * n not in tokens)
    tokens[-1], types[-1] = " " * width, gguf.TokenType.USER_DEFINED  # stored with spaces
    kv = {**fields, K.ADD_PREFIX: False, K.LIST: tokens, K.TOKEN_TYPE: types}
    copy = rebuilt(kv, tmp_path)
    text = "hi" + " " * width + "there"
    encoding = copy.encode(text, add_special_tokens=False)
    assert not encoding.tokens[0].startswith("\u2581"), "no space is prepended"
    assert copy.id_to_token(len(tokens) - 1) == "\u2581" * width
    assert len(tokens) - 1 in encoding.ids, "merges reach the respelled whitespace token"
    assert copy.decode(encoding.ids) == text


def test_recover_merges_ranks_by_the_joined_tokens_score():
    tokens = ["a", "b", "c", "bc", "ab", "abc", "<0x61>"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, 0.0]
    mergeable = [True] * 6 + [False]
    assert recover_merges(tokens, scores, mergeable) == [
        ("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")
    ]

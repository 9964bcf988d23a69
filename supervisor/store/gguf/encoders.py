"""GGUF embedding models (encoders) <-> the Hugging Face directories runner/embed loads: BERT
("bert": all-minilm, mxbai-embed-large, snowflake-arctic-embed, bge...; and XLM-RoBERTa, which
llama.cpp writes as "bert" with a SentencePiece tokenizer: bge-m3, snowflake-arctic-embed2) and
Nomic BERT ("nomic-bert": nomic-embed-text v1 and v1.5), as llama.cpp's converter lays them out.

A converted directory is a sentence-transformers one: config.json, the weights under Hugging
Face's names, a WordPiece or Unigram tokenizer.json (wordpiece.py, unigram.py), and
modules.json with 1_Pooling/config.json for the file's `{arch}.pooling_type` (pooling.py).

Invariants:
- `hf_tensor_name` and `gguf_tensor_name` are inverses on every weight; a tensor this module
  cannot place (a reranker's classifier head, `cls.*`) is an error naming it.
- `hf_config(gguf_metadata(config))` gives back every field the encoders read.
- Weights are floats: a quantized GGUF tensor is dequantized (encoders are small, and
  runner/embed runs float layers only).
- Everything here is plain Python: no mlx, no numpy, no file access.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from mlxr.shared.encoders import position_offset

from .arch import UnsupportedArchitecture


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    gguf: str  # general.architecture
    model_type: str  # config.json model_type
    hf_class: str
    globals: dict[str, str]  # GGUF global tensor stem -> HF name
    block: dict[str, str]  # GGUF block tensor stem -> HF name inside the layer
    layer_prefix: str  # HF name of layer {i}


SPECS: dict[str, EncoderSpec] = {s.gguf: s for s in (
    EncoderSpec("bert", "bert", "BertModel",
                {"token_embd": "embeddings.word_embeddings",
                 "position_embd": "embeddings.position_embeddings",
                 "token_types": "embeddings.token_type_embeddings",
                 "token_embd_norm": "embeddings.LayerNorm"},
                {"attn_q": "attention.self.query", "attn_k": "attention.self.key",
                 "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
                 "attn_output_norm": "attention.output.LayerNorm",
                 "ffn_up": "intermediate.dense", "ffn_down": "output.dense",
                 "layer_output_norm": "output.LayerNorm"},
                "encoder.layer.{}"),
    EncoderSpec("nomic-bert", "nomic_bert", "NomicBertModel",
                {"token_embd": "embeddings.word_embeddings",
                 "token_types": "embeddings.token_type_embeddings",
                 "token_embd_norm": "emb_ln"},
                {"attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj",
                 "attn_output_norm": "norm1", "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12",
                 "ffn_down": "mlp.fc2", "layer_output_norm": "norm2"},
                "encoder.layers.{}"),
)}
ARCHITECTURES: tuple[str, ...] = tuple(SPECS)
# Tables llama.cpp's converter keeps in F32 whatever the file type (rows added to F32 values).
F32_TENSORS = ("position_embd.weight", "token_types.weight")
_BY_MODEL_TYPE = {s.model_type: s for s in SPECS.values()}
# XLM-RoBERTa (bge-m3, snowflake-arctic-embed2, paraphrase-multilingual) is BERT to llama.cpp:
# its position table starts at pad_token_id + 1, and the converter drops the rows before.
_BY_MODEL_TYPE["xlm-roberta"] = SPECS["bert"]

_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


def is_encoder(arch: str) -> bool:
    return arch in SPECS


def spec_for_model_type(model_type: str) -> EncoderSpec | None:
    return _BY_MODEL_TYPE.get(model_type)


def hf_tensor_name(arch: str, gguf_name: str) -> str:
    s = SPECS[arch]
    if m := _GGUF_BLOCK.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        if stem in s.block:
            return f"{s.layer_prefix.format(layer)}.{s.block[stem]}.{kind}"
    elif (m := _GGUF_GLOBAL.fullmatch(gguf_name)) and m.group(1) in s.globals:
        return f"{s.globals[m.group(1)]}.{m.group(2)}"
    what = "a reranker's classifier" if gguf_name.startswith("cls") else "not supported"
    raise UnsupportedArchitecture(f'tensor "{gguf_name}" of a {arch} GGUF: {what}')


def gguf_tensor_name(arch: str, hf_name: str) -> str:
    s = SPECS[arch]
    stem, _, kind = hf_name.rpartition(".")
    for g, h in s.globals.items():
        if stem == h:
            return f"{g}.{kind}"
    prefix = s.layer_prefix.format("")
    if stem.startswith(prefix):
        layer, _, rest = stem[len(prefix):].partition(".")
        for g, h in s.block.items():
            if rest == h:
                return f"blk.{layer}.{g}.{kind}"
    raise UnsupportedArchitecture(f'weight "{hf_name}" has no GGUF name for {arch}')


def _get(kv: Mapping[str, Any], arch: str, key: str, default: Any = None) -> Any:
    value = kv.get(f"{arch}.{key}", default)
    if value is None:
        raise UnsupportedArchitecture(f"the GGUF file has no {arch}.{key}")
    return value


def hf_config(kv: Mapping[str, Any], *, vocab_size: int, type_vocab_size: int,
              positions: int | None) -> dict[str, Any]:
    """config.json from GGUF metadata. `positions`: the rows of the position table (BERT)."""
    arch = str(kv.get("general.architecture"))
    s = SPECS[arch]
    hidden = int(_get(kv, arch, "embedding_length"))
    heads = int(_get(kv, arch, "attention.head_count"))
    if hidden % heads:
        raise UnsupportedArchitecture(f"{arch} with {hidden} dimensions over {heads} heads")
    layers = int(_get(kv, arch, "block_count"))
    inner = int(_get(kv, arch, "feed_forward_length"))
    context = int(_get(kv, arch, "context_length"))
    eps = float(_get(kv, arch, "attention.layer_norm_epsilon", 1e-12))
    if arch == "bert":
        return {"architectures": [s.hf_class], "model_type": s.model_type,
                "hidden_size": hidden, "num_hidden_layers": layers,
                "num_attention_heads": heads, "intermediate_size": inner,
                "max_position_embeddings": positions or context, "layer_norm_eps": eps,
                "type_vocab_size": type_vocab_size, "vocab_size": vocab_size,
                "hidden_act": "gelu", "position_embedding_type": "absolute"}
    return {"architectures": [s.hf_class], "model_type": s.model_type,
            "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": inner,
            "n_positions": context, "layer_norm_epsilon": eps,
            "rotary_emb_base": float(_get(kv, arch, "rope.freq_base", 1000.0)),
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
            "type_vocab_size": type_vocab_size, "vocab_size": vocab_size,
            "activation_function": "swiglu", "prenorm": False, "causal": False,
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False}


def gguf_metadata(config: Mapping[str, Any], pooling_type: int = 1) -> tuple[str, dict[str, Any]]:
    """(architecture, metadata) as llama.cpp's converter writes them for an encoder config
    (`pooling_type`: llama.cpp's number, pooling.POOLING)."""
    s = spec_for_model_type(str(config.get("model_type")))
    if s is None:
        raise UnsupportedArchitecture(f'model type "{config.get("model_type")}" is no encoder')
    a = s.gguf
    if a == "bert":
        kv = {f"{a}.context_length": int(config["max_position_embeddings"])
              - position_offset(config),
              f"{a}.embedding_length": int(config["hidden_size"]),
              f"{a}.feed_forward_length": int(config["intermediate_size"]),
              f"{a}.block_count": int(config["num_hidden_layers"]),
              f"{a}.attention.head_count": int(config["num_attention_heads"]),
              f"{a}.attention.layer_norm_epsilon": float(config.get("layer_norm_eps", 1e-12))}
    else:
        positions = int(config["n_positions"])
        if positions == 8192 and config.get("max_trained_positions", 2048) == 2048:
            positions = 2048  # nomic-embed-text v1 / v1.5, trained on 2048 (llama.cpp's rule)
        heads = int(config["n_head"])
        kv = {f"{a}.context_length": positions,
              f"{a}.embedding_length": int(config["n_embd"]),
              f"{a}.feed_forward_length": int(config["n_inner"]),
              f"{a}.block_count": int(config["n_layer"]),
              f"{a}.attention.head_count": heads,
              f"{a}.attention.key_length": int(config["n_embd"]) // heads,
              f"{a}.attention.value_length": int(config["n_embd"]) // heads,
              f"{a}.attention.layer_norm_epsilon": float(config.get("layer_norm_epsilon", 1e-12)),
              f"{a}.rope.freq_base": float(config.get("rotary_emb_base", 1000.0))}
    kv.update({"general.architecture": a, f"{a}.attention.causal": False,
               f"{a}.pooling_type": pooling_type,
               "tokenizer.ggml.token_type_count": int(config.get("type_vocab_size", 2))})
    return a, kv

"""Random-weight test models: qwen3 with the real Qwen3 tokenizer (presets tiny, small, medium,
qwen3-0.6b), and one small model of every architecture we serve with a 2,048-token tokenizer
(the preset named after the architecture: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3,
granite, qwen3_moe, gpt_oss, gemma4; and gemma4-moe), the embedding model embeddinggemma
(supervisor/store/random_embedding.py), and the vision presets qwen2.5-vl, qwen2-vl and
gemma3-vision (supervisor/store/random_vision.py).

Invariants:
- The same arguments write the same bytes; the tiny/small/medium presets write exactly what
  they always have (many tests and benchmarks depend on them).
- The end-of-sequence rows of the output projection (of the embedding, where it is tied) are
  zeroed, so an EOS logit is exactly 0 and greedy decoding runs to the length asked (a test
  that needs EOS biases it with logit_bias).
- Architecture presets have hidden size 256 and rows of 256 or 512, so GGUF's K-quants (blocks
  of 256) apply to every matrix; each has its family's real hyper-parameters (rope theta and
  scaling, Gemma's soft-caps and sliding windows of 64 tokens that tests can cross, Granite's
  multipliers, Qwen2's q/k/v biases) and non-trivial norm weights, so a swapped tensor shows.
- Greedy output depends on the whole context (the qwen3 presets with an untied `lm_head`;
  every architecture preset, its layer weights scaled to their inputs), so token-exact
  comparisons catch cache and batching bugs (see ../shared/PLATFORM.md).
- `PRESETS` names every preset, so `mlxr create --random llama` needs nothing more;
  `arch_of(name)` says which architecture a name builds.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from safetensors.numpy import save_file

from mlxr.shared.assets import write_qwen3_tokenizer
from mlxr.supervisor.store import random_embedding

VOCAB_SIZE = 151680
EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
SMALL_VOCAB = 2048
DTYPES = ("float32", "bfloat16")
ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite",
              "qwen3_moe", "gpt_oss", "gemma4", "mixtral", "granitemoe")
# Presets of an architecture beyond the one named after it (a variant of that family).
VARIANT_PRESETS = ("gemma4-moe", "embeddinggemma")
TOKENIZER_KIND = {"llama": "bpe", "qwen2": "bpe", "qwen3": "bpe", "granite": "bpe",
                  "granitemoe": "bpe",
                  "qwen3_moe": "bpe", "gpt_oss": "harmony", "gemma4": "gemma4",
                  "mistral": "spm", "mixtral": "spm", "gemma2": "spm", "gemma3": "spm",
                  "phi3": "spm"}


@dataclass(frozen=True, slots=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    description: str
    arch: str = "qwen3"
    vocab: int = VOCAB_SIZE  # SMALL_VOCAB: the small tokenizer of TOKENIZER_KIND[arch]
    experts: int = 0  # a mixture of experts: experts a layer (0: one dense MLP)
    experts_used: int = 0  # experts each token goes through
    expert_intermediate: int = 0  # each expert's MLP width


def _arch(arch: str, tied: bool, layers: int = 2, heads: int = 4, note: str = "",
          experts: int = 0) -> Preset:
    head = "tied" if tied else "untied"
    text = (f"{arch} random model, {layers} layers, hidden 256, {SMALL_VOCAB:,}-token "
            f"{TOKENIZER_KIND[arch]} tokenizer, {head} head{note}")
    # a mixture's experts are 256 wide (K-quant blocks), 2 of them for each token
    moe = {"experts": experts, "experts_used": 2, "expert_intermediate": 256} if experts else {}
    return Preset(256, layers, heads, 2, 64, 512, tied, text, arch, SMALL_VOCAB, **moe)


PRESETS: dict[str, Preset] = {
    # ~0.1M parameters outside the 151,680-row embedding; untied head for token-exact tests.
    "tiny": Preset(64, 2, 2, 1, 32, 256, False, "tiny random qwen3 (untied head)"),
    # ~31M parameters, most of them the embedding (the benchmark model of docs/PERFORMANCE.md).
    "small": Preset(192, 4, 4, 2, 48, 768, True, "small random qwen3, ~31M parameters"),
    # 4 query and 4 KV heads: tensor-shards over 2 or 4 ranks (the distributed runner's tests).
    "tiny-kv4": Preset(128, 2, 4, 4, 32, 256, False,
                       "tiny random qwen3 with 4 KV heads (untied head)"),
    # ~147M parameters.
    "medium": Preset(512, 22, 8, 4, 64, 1408, True, "medium random qwen3, ~147M parameters"),
    # Qwen3-0.6B's shape (~596M parameters): the GPU benchmark's model, a real model's speed
    # without its weights.
    "qwen3-0.6b": Preset(1024, 28, 16, 8, 128, 3072, True,
                         "random qwen3 in Qwen3-0.6B's shape, ~596M parameters"),
    "llama": _arch("llama", True, note=", Llama 3 rope scaling"),
    "mistral": _arch("mistral", False),
    "qwen2": _arch("qwen2", True, note=", q/k/v biases"),
    # 8 query heads of 64: q/o are 512 wide, wider than the hidden size, as in real Qwen3.
    "qwen3": _arch("qwen3", False, heads=8),
    "gemma2": _arch("gemma2", True, note=", sliding window 64"),
    # Six layers: five sliding (window 64) and one global, llama.cpp's fixed Gemma 3 pattern.
    "gemma3": _arch("gemma3", True, layers=6, note=", sliding window 64"),
    "phi3": _arch("phi3", False, note=", LongRoPE"),
    # Untied: with Granite's embedding multiplier (12) a tied head repeats the last token.
    "granite": _arch("granite", False, note=", Granite multipliers"),
    # The qwen3 preset with 4 KV heads: tensor-shards over 4 ranks, one KV head each, with the
    # small tokenizer (7 MB for each rank to load where tiny-kv4 is 161 MB).
    "qwen3-kv4": dataclasses.replace(_arch("qwen3", False, heads=8, note=", 4 KV heads"),
                                     kv_heads=4),
    # Qwen3's mixture of experts (Qwen3-30B-A3B's family): 8 experts a layer, 2 used a token.
    "qwen3_moe": _arch("qwen3_moe", False, heads=8, note=", 8 experts (2 a token) a layer",
                       experts=8),
    # Mixtral's layout (Mistral's mixtures): every layer 4 experts, 2 a token, Hugging Face's
    # per-expert names (`block_sparse_moe.experts.E.w1`); a "llama" GGUF with experts.
    "mixtral": _arch("mixtral", False, note=", 4 experts (2 a token) a layer", experts=4),
    # Granite 3's mixtures: Granite's multipliers, 4 experts a layer (2 a token), Hugging
    # Face's fused `input_linear` (gate and up) and `output_linear`.
    "granitemoe": _arch("granitemoe", False, note=", Granite multipliers, 4 experts (2 a token)",
                        experts=4),
    # gpt-oss (OpenAI's open-weight mixtures): 8 experts a layer, 2 used a token; biases on
    # every projection, the router and the experts; attention sinks; sliding window 64 on
    # every other layer from the first; the harmony chat format.
    "gpt_oss": _arch("gpt_oss", False, layers=4, heads=8,
                     note=", 8 experts (2 a token) a layer, attention sinks, sliding window 64",
                     experts=8),
    # Gemma 4's small models (E2B, E4B) with the larger ones' keys-are-values global layers:
    # 6 layers, sliding (window 64, heads of 64) and global (heads of 128, a quarter rotated,
    # one projection for keys and values) as s, s, g, s, s, g; the last 3 reuse the keys and
    # values of layers 1 and 2, with MLPs twice as wide; per-layer token embeddings of 64.
    "gemma4": _arch("gemma4", True, layers=6,
                    note=", per-layer embeddings, 3 KV-sharing layers, sliding window 64"),
    # Gemma 4's mixture (26B-A4B): each layer's MLP beside 8 experts (2 a token).
    "gemma4-moe": _arch("gemma4", True, layers=6, experts=8,
                        note=", an MLP and 8 experts (2 a token) a layer, sliding window 64"),
    # EmbeddingGemma's layout (supervisor/store/random_embedding.py): the gemma3 preset's body
    # with attention both ways, mean pooling and two Dense modules; an embedding model only.
    "embeddinggemma": _arch("gemma3", True, layers=6,
                            note=", bidirectional attention (window 64), mean pooling, 2 Dense "
                                 "modules: an embedding model"),
    # A vision model (supervisor/store/random_vision.py writes it; these fields describe its
    # language part).
    "qwen2.5-vl": Preset(128, 2, 4, 2, 32, 256, False,
                         "qwen2.5-vl random vision model (2 text layers, 2-block image tower)",
                         arch="qwen2_5_vl"),
    "qwen2-vl": Preset(128, 2, 4, 2, 32, 256, False,
                       "qwen2-vl random vision model (2 text layers, 2-block image tower)",
                       arch="qwen2_vl"),
    "gemma3-vision": Preset(256, 6, 4, 2, 64, 512, True,
                            "gemma3 random vision model (6 text layers, sliding window 64, "
                            "2-layer SigLIP tower)", arch="gemma3_vision", vocab=2056),
}
VISION_ARCHS = {"qwen2_5_vl": "qwen2_5_vl", "qwen2_vl": "qwen2_vl", "gemma3_vision": "gemma3"}


def arch_of(name: str) -> str:
    """The architecture a preset name (`mlxr create --random NAME`) builds."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].arch


# -- config.json -------------------------------------------------------------------------
def model_config(preset: Preset) -> dict:
    """The historic qwen3 presets' config (151,680-token Qwen3 tokenizer)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": preset.hidden,
        "num_hidden_layers": preset.layers,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "head_dim": preset.head_dim,
        "intermediate_size": preset.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": preset.tied,
        "torch_dtype": "float32",
        "bos_token_id": 151643,
        "eos_token_id": list(EOS_IDS),
        "mlxr_random_preset": preset.description,
    }


def _long_factors(n: int) -> list[float]:
    """LongRoPE factors shaped like Phi-3.5's: 1 for high frequencies rising to ~40."""
    return [round(1.0 + 39.0 * (i / (n - 1)) ** 3, 4) for i in range(n)]


# What each family's real configs set, beyond the shape (Llama 3.2, Mistral 7B v0.3, Qwen2.5,
# Qwen3, Gemma 2 and 3, Phi-3.5-mini, Granite 3).
ARCH_SETTINGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
              "attention_bias": False, "mlp_bias": False},
    "mistral": {"architectures": ["MistralForCausalLM"], "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 40960},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "rope_theta": 10000.0,
               "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
               "hidden_act": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64,
               "sliding_window": 64},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0},
               "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
               "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64,
               "sliding_window": 64, "sliding_window_pattern": 6},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "rope_theta": 10000.0,
             "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
             "original_max_position_embeddings": 4096, "sliding_window": None,
             "rope_scaling": {"type": "longrope", "long_factor": _long_factors(32),
                              "short_factor": [1.0 + i / 64 for i in range(32)]}},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 32768},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "rope_theta": 1000000.0,
                  "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "rope_theta": 150000.0,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096},
                "sliding_window": 64, "swiglu_limit": 7.0, "attention_bias": True},
    "gemma4": {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
               "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
               "hidden_activation": "gelu_pytorch_tanh", "global_head_dim": 128,
               "num_global_key_value_heads": 1, "attention_k_eq_v": True,
               "num_kv_shared_layers": 3, "hidden_size_per_layer_input": 64,
               "use_double_wide_mlp": True, "sliding_window": 64,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
               "final_logit_softcapping": 30.0,
               "rope_parameters": {
                   "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                      "partial_rotary_factor": 0.25},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "granite": {"architectures": ["GraniteForCausalLM"], "rope_theta": 10000.0,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22, "logits_scaling": 8.0,
                "attention_bias": False, "mlp_bias": False},
    "granitemoe": {"architectures": ["GraniteMoeForCausalLM"], "rope_theta": 10000.0,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
                   "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
                   "residual_multiplier": 0.22, "logits_scaling": 8.0, "attention_bias": False},
}


def arch_config(preset: Preset, tokenizer, dtype: str) -> dict:
    """config.json of an architecture preset, for its small tokenizer."""
    moe = {"num_experts": preset.experts, "num_experts_per_tok": preset.experts_used,
           "moe_intermediate_size": preset.expert_intermediate} if preset.experts else {}
    if preset.arch == "gemma4":
        moe = {"vocab_size_per_layer_input": preset.vocab, "enable_moe_block": False}
        if preset.experts:  # the mixture has neither per-layer embeddings nor shared KV
            moe = {"enable_moe_block": True, "num_experts": preset.experts,
                   "top_k_experts": preset.experts_used,
                   "moe_intermediate_size": preset.expert_intermediate,
                   "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                   "use_double_wide_mlp": False}
    if preset.arch in ("mixtral", "granitemoe"):  # `intermediate_size` is an expert's
        moe = {"num_local_experts": preset.experts, "num_experts_per_tok": preset.experts_used,
               "intermediate_size": preset.expert_intermediate}
    if preset.arch == "gpt_oss":  # every layer a mixture; `intermediate_size` is an expert's
        moe = {"num_local_experts": preset.experts, "num_experts_per_tok": preset.experts_used,
               "intermediate_size": preset.expert_intermediate,
               "layer_types": ["sliding_attention", "full_attention"] * (preset.layers // 2)}
    return {
        "model_type": preset.arch,
        "hidden_size": preset.hidden,
        "num_hidden_layers": preset.layers,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "head_dim": preset.head_dim,
        "intermediate_size": preset.intermediate,
        "hidden_act": "silu",
        "vocab_size": preset.vocab,
        "tie_word_embeddings": preset.tied,
        **ARCH_SETTINGS[preset.arch],
        **moe,
        "torch_dtype": dtype,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": list(tokenizer.eos_ids),
        "pad_token_id": tokenizer.pad_id,
        "mlxr_random_preset": preset.description,
    }


# -- weights -----------------------------------------------------------------------------
def make_weights(preset: Preset, seed: int) -> dict[str, np.ndarray]:
    """The historic qwen3 presets' weights (the rng draws stay in this order)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    h, hd = preset.hidden, preset.head_dim
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for i in range(preset.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(preset.heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = normal(preset.kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = normal(preset.kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, preset.heads * hd)
        w[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "mlp.gate_proj.weight"] = normal(preset.intermediate, h)
        w[p + "mlp.up_proj.weight"] = normal(preset.intermediate, h)
        w[p + "mlp.down_proj.weight"] = normal(h, preset.intermediate)
    w["model.norm.weight"] = np.ones(h, np.float32)
    head = "model.embed_tokens.weight" if preset.tied else "lm_head.weight"
    if not preset.tied:
        w[head] = normal(VOCAB_SIZE, h)
    w[head][list(EOS_IDS)] = 0.0
    return w


# Kinds of tensor: an embedding or output row (normal, std 0.02), a layer's matrix (std
# 1/sqrt(inputs), so each layer adds as much as the embedding holds and the output depends on
# the context, not only on the last token), a bias (std 0.1), or an RMSNorm weight around 1
# (which Gemma applies as 1 + w: with its tied head, smaller post-norms leave the output
# repeating one token).
# An attention sink (gpt-oss: one logit a head that every query's softmax also weighs) is drawn
# around 0 with std 1, so a wrong or missing sink shows.
_EMBED, _MATRIX, _BIAS, _NORM, _SINK = "embed", "matrix", "bias", "norm", "sink"


def tensor_plan(p: Preset) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every weight of an architecture preset, in creation order."""
    if p.arch == "gemma4":
        return _gemma4_plan(p)
    plan = [("model.embed_tokens.weight", (p.vocab, p.hidden), _EMBED)]
    for i in range(p.layers):
        plan += [(f"model.layers.{i}.{name}", shape, kind) for name, shape, kind in _layer(p)]
    plan.append(("model.norm.weight", (p.hidden,), _NORM))
    if not p.tied:
        plan.append(("lm_head.weight", (p.vocab, p.hidden), _EMBED))
    return plan


def _layer(p: Preset) -> list[tuple[str, tuple[int, ...], str]]:
    h, hd, ff = p.hidden, p.head_dim, p.intermediate
    qkv = (("q", p.heads * hd), ("k", p.kv_heads * hd), ("v", p.kv_heads * hd))
    if p.arch == "phi3":  # fused q/k/v
        out = [("self_attn.qkv_proj.weight", (sum(n for _, n in qkv), h), _MATRIX)]
    else:
        out = [(f"self_attn.{x}_proj.weight", (n, h), _MATRIX) for x, n in qkv]
    if p.arch in ("qwen2", "gpt_oss"):
        out += [(f"self_attn.{x}_proj.bias", (n,), _BIAS) for x, n in qkv]
    out.append(("self_attn.o_proj.weight", (h, p.heads * hd), _MATRIX))
    if p.arch == "gpt_oss":  # mlx_lm's layout: experts stacked, biases everywhere
        eff, e = p.expert_intermediate, p.experts
        return out + [
            ("self_attn.o_proj.bias", (h,), _BIAS), ("self_attn.sinks", (p.heads,), _SINK),
            ("mlp.router.weight", (e, h), _MATRIX), ("mlp.router.bias", (e,), _BIAS),
            ("mlp.experts.gate_proj.weight", (e, eff, h), _MATRIX),
            ("mlp.experts.gate_proj.bias", (e, eff), _BIAS),
            ("mlp.experts.up_proj.weight", (e, eff, h), _MATRIX),
            ("mlp.experts.up_proj.bias", (e, eff), _BIAS),
            ("mlp.experts.down_proj.weight", (e, h, eff), _MATRIX),
            ("mlp.experts.down_proj.bias", (e, h), _BIAS),
            ("input_layernorm.weight", (h,), _NORM),
            ("post_attention_layernorm.weight", (h,), _NORM)]
    if p.arch in ("qwen3", "gemma3", "qwen3_moe"):
        out += [(f"self_attn.{x}_norm.weight", (hd,), _NORM) for x in ("q", "k")]
    if p.arch == "mixtral":  # a router, then each expert's w1 (gate), w3 (up), w2 (down)
        eff, moe = p.expert_intermediate, "block_sparse_moe"
        out.append((f"{moe}.gate.weight", (p.experts, p.hidden), _MATRIX))
        for e in range(p.experts):
            out += [(f"{moe}.experts.{e}.{w}.weight", (eff, p.hidden), _MATRIX)
                    for w in ("w1", "w3")]
            out.append((f"{moe}.experts.{e}.w2.weight", (p.hidden, eff), _MATRIX))
    elif p.arch == "granitemoe":  # the router, every expert's gate and up fused, the downs
        eff, moe = p.expert_intermediate, "block_sparse_moe"
        out += [(f"{moe}.router.layer.weight", (p.experts, p.hidden), _MATRIX),
                (f"{moe}.input_linear.weight", (p.experts, 2 * eff, p.hidden), _MATRIX),
                (f"{moe}.output_linear.weight", (p.experts, p.hidden, eff), _MATRIX)]
    elif p.experts:  # a router, then each expert's MLP (Hugging Face's names)
        eff = p.expert_intermediate
        out.append(("mlp.gate.weight", (p.experts, h), _MATRIX))
        for e in range(p.experts):
            out += [(f"mlp.experts.{e}.{x}_proj.weight", (eff, h), _MATRIX)
                    for x in ("gate", "up")]
            out.append((f"mlp.experts.{e}.down_proj.weight", (h, eff), _MATRIX))
    else:
        if p.arch == "phi3":  # fused gate/up
            out.append(("mlp.gate_up_proj.weight", (2 * ff, h), _MATRIX))
        else:
            out += [(f"mlp.{x}_proj.weight", (ff, h), _MATRIX) for x in ("gate", "up")]
        out.append(("mlp.down_proj.weight", (h, ff), _MATRIX))
    norms = ["input_layernorm", "post_attention_layernorm"]
    if p.arch.startswith("gemma"):  # Gemma's norms around both sublayers
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    return out + [(f"{name}.weight", (h,), _NORM) for name in norms]


def _gemma4_plan(p: Preset) -> list[tuple[str, tuple[int, ...], str]]:
    c = {**ARCH_SETTINGS["gemma4"], **arch_config(p, _NO_TOKENIZER, "float32")}
    h, layers = p.hidden, p.layers
    ple = int(c["hidden_size_per_layer_input"])
    first_shared = layers - int(c["num_kv_shared_layers"])
    plan = [("model.embed_tokens.weight", (p.vocab, h), _EMBED)]
    if ple:
        plan += [("model.embed_tokens_per_layer.weight", (p.vocab, layers * ple), _EMBED),
                 ("model.per_layer_model_projection.weight", (layers * ple, h), _MATRIX),
                 ("model.per_layer_projection_norm.weight", (ple,), _NORM)]
    for i, kind in enumerate(c["layer_types"]):
        full = kind == "full_attention"
        hd = int(c["global_head_dim"]) if full else p.head_dim
        kv = int(c["num_global_key_value_heads"]) if full and c["attention_k_eq_v"] \
            else p.kv_heads
        ff = p.intermediate * (2 if c["use_double_wide_mlp"] and i >= first_shared else 1)
        x = f"model.layers.{i}."
        out = [(x + "self_attn.q_proj.weight", (p.heads * hd, h), _MATRIX)]
        if i < first_shared:
            out.append((x + "self_attn.k_proj.weight", (kv * hd, h), _MATRIX))
            if not (full and c["attention_k_eq_v"]):
                out.append((x + "self_attn.v_proj.weight", (kv * hd, h), _MATRIX))
            out.append((x + "self_attn.k_norm.weight", (hd,), _NORM))
        out += [(x + "self_attn.o_proj.weight", (h, p.heads * hd), _MATRIX),
                (x + "self_attn.q_norm.weight", (hd,), _NORM),
                (x + "mlp.gate_proj.weight", (ff, h), _MATRIX),
                (x + "mlp.up_proj.weight", (ff, h), _MATRIX),
                (x + "mlp.down_proj.weight", (h, ff), _MATRIX)]
        if p.experts:
            e, eff = p.experts, p.expert_intermediate
            out += [(x + "router.proj.weight", (e, h), _MATRIX),
                    (x + "router.scale", (h,), _NORM),
                    (x + "router.per_expert_scale", (e,), _NORM),
                    (x + "experts.switch_glu.gate_proj.weight", (e, eff, h), _MATRIX),
                    (x + "experts.switch_glu.up_proj.weight", (e, eff, h), _MATRIX),
                    (x + "experts.switch_glu.down_proj.weight", (e, h, eff), _MATRIX)]
            out += [(x + f"{n}.weight", (h,), _NORM) for n in (
                "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2")]
        if ple:
            out += [(x + "per_layer_input_gate.weight", (ple, h), _MATRIX),
                    (x + "per_layer_projection.weight", (h, ple), _MATRIX),
                    (x + "post_per_layer_input_norm.weight", (h,), _NORM)]
        out += [(x + f"{n}.weight", (h,), _NORM) for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")]
        out.append((x + "layer_scalar", (1,), _NORM))
        plan += out
    plan.append(("model.norm.weight", (h,), _NORM))
    return plan


@dataclass(frozen=True)
class _Ids:  # arch_config's tokenizer fields, where only the shapes matter
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None


_NO_TOKENIZER = _Ids()


_DRAW: dict[str, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]] = {
    _EMBED: lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * 0.02,
    _MATRIX: lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1]),
    _BIAS: lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * 0.1,
    _NORM: lambda rng, shape: 1.0 + rng.standard_normal(shape, dtype=np.float32) * 0.1,
    _SINK: lambda rng, shape: rng.standard_normal(shape, dtype=np.float32),
}


def make_arch_weights(preset: Preset, seed: int, eos_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((seed, zlib.crc32(preset.arch.encode())))  # differ by arch
    w = {name: _DRAW[kind](rng, shape).astype(np.float32)
         for name, shape, kind in tensor_plan(preset)}
    w["model.embed_tokens.weight" if preset.tied else "lm_head.weight"][list(eos_ids)] = 0.0
    return w


def _save(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype == "float32":
        save_file(weights, str(path), metadata={"format": "pt"})
        return
    import mlx.core as mx  # numpy has no bfloat16

    mx.save_safetensors(str(path), {k: mx.array(v).astype(mx.bfloat16) for k, v in weights.items()},
                        metadata={"format": "pt"})


# -- entry points ------------------------------------------------------------------------
def resolve(preset: str | None, arch: str | None) -> str:
    """The preset name for `write_random_model`'s arguments: `arch` alone is its
    architecture's preset; a preset of another architecture than `arch` is an error."""
    name = preset if preset is not None else (arch or "tiny")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    if arch is not None and PRESETS[name].arch != arch:
        if arch not in ARCH_NAMES:
            raise ValueError(f"unknown architecture {arch!r}; choose one of "
                             + ", ".join(ARCH_NAMES))
        raise ValueError(f"preset {name!r} is a {PRESETS[name].arch} model, not {arch}")
    return name


def write_random_model(dest: Path, preset: str | None = None, seed: int = 0,
                       arch: str | None = None, dtype: str = "float32") -> Path:
    """Write a loadable Hugging Face-layout model directory; the same arguments give the same
    bytes. `preset` defaults to "tiny" (qwen3), or to `arch`'s preset when `arch` is given."""
    name = resolve(preset, arch)
    p = PRESETS[name]
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if p.arch in VISION_ARCHS:
        from mlxr.supervisor.store.random_vision import write_random_vision

        return write_random_vision(dest, seed, dtype, _save, VISION_ARCHS[p.arch])
    if p.vocab == VOCAB_SIZE:
        config, weights = model_config(p), make_weights(p, seed)
        config["torch_dtype"] = dtype
        write_qwen3_tokenizer(dest)
    else:
        from mlxr.supervisor.store.small_tokenizer import write_small_tokenizer

        tokenizer = write_small_tokenizer(dest, TOKENIZER_KIND[p.arch], p.vocab)
        config = arch_config(p, tokenizer, dtype)
        weights = make_arch_weights(p, seed, tokenizer.eos_ids)
    if name == random_embedding.PRESET:
        config = random_embedding.embedding_config(config)
        weights = random_embedding.base_model_names(weights)
        random_embedding.write_sentence_transformers(dest, p.hidden, seed, _save, dtype)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    _save(weights, dest / "model.safetensors", dtype)
    return dest


def count_parameters(preset: str) -> int:
    p = PRESETS[preset]
    if p.arch in VISION_ARCHS:
        from mlxr.supervisor.store.random_vision import count_parameters as vision_count

        return vision_count(VISION_ARCHS[p.arch])
    if p.vocab != VOCAB_SIZE:
        return sum(int(np.prod(shape)) for _, shape, _ in tensor_plan(p))
    per_layer = (p.hidden * p.head_dim * (2 * p.heads + 2 * p.kv_heads) + 3 * p.hidden * p.intermediate
                 + 2 * p.head_dim + 2 * p.hidden)
    head = 0 if p.tied else VOCAB_SIZE * p.hidden
    return VOCAB_SIZE * p.hidden + p.layers * per_layer + p.hidden + head

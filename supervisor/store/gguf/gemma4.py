"""Gemma 4 (GGUF "gemma4") <-> mlx_lm's gemma4_text: the settings that differ from layer to
layer, as llama.cpp's and Ollama's converters write them.

Gemma 4 mixes sliding-window layers (small heads, all rotated, their own rope base) with global
ones (heads twice as wide or more, "proportional" rope on a quarter of each head, possibly one
projection for keys and values); its last `shared_kv_layers` layers reuse the keys and values
of the last earlier layer of their kind; the small models (E2B, E4B) add a per-layer token
embedding and, where KV is shared, an MLP twice as wide; the 26B model adds a mixture of
experts beside each layer's MLP.

- Per-layer arrays: `feed_forward_length` (the MLP's width, doubled on shared layers),
  `attention.head_count_kv` (sliding and global values), `attention.sliding_window_pattern`
  (one bool a layer, true: sliding).
- Head sizes: `attention.key_length` is the global layers', `key_length_swa` the sliding
  ones'. A global layer rotates the first `n` of its head's half-pairs, `n` read from the
  `rope_freqs` tensor (1 for a rotated pair, 1e30 for one left alone); a sliding layer rotates
  all of its head (`rope.dimension_count_swa`; a file that says fewer is refused).
- The router's input scale and each expert's output scale are stored as `.scale` tensors
  (`ffn_gate_inp.scale`, `ffn_down_exps.scale`); the experts' gate and up projections as one
  `ffn_gate_up_exps` tensor (llama.cpp) or two (Ollama), split on import.
- Gemma 4's RMSNorm weights are stored as they are (no 1 + w as Gemma 2 and 3 have).

Plain Python and numpy: no mlx, no file access.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

ARCH = "gemma4"
MODEL_TYPE = "gemma4_text"
HF_CLASS = "Gemma4ForCausalLM"
BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
    "layer_output_scale": "layer_scalar",
    # per-layer token embeddings (E2B, E4B)
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    # the mixture of experts beside the MLP (26B-A4B)
    "ffn_gate_inp": "router.proj",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "ffn_gate_up_exps": "experts.switch_glu.gate_up_proj",  # split into gate and up
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# (GGUF stem, kind) of tensors stored as `.scale`, and mlx_lm's bare parameters they become.
SCALES = {("ffn_gate_inp", "scale"): "router.scale",
          ("ffn_down_exps", "scale"): "router.per_expert_scale"}
BARE = (".layer_scalar", ".router.scale", ".router.per_expert_scale")
GLOBALS = {"per_layer_token_embd": "model.embed_tokens_per_layer",
           "per_layer_model_proj": "model.per_layer_model_projection",
           "per_layer_proj_norm": "model.per_layer_projection_norm"}
SKIP_PREFIXES = ("v.", "a.", "mm.")  # a multimodal file's vision and audio towers
UNROTATED = 1e30  # a rope_freqs factor that leaves its pair of dimensions alone
GATE_UP = ".experts.switch_glu.gate_up_proj."


class Gemma4Error(ValueError):
    """A Gemma 4 setting this converter cannot map (arch.py raises it as
    UnsupportedArchitecture)."""


def _per_layer(value: Any, layers: int, key: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != layers:
            raise Gemma4Error(f"gemma4.{key} has {len(value)} values for {layers} layers")
        return list(value)
    return [value] * layers


def hf_config(p: Any, base: dict[str, Any], rope: Mapping[str, np.ndarray],
              names: set[str]) -> dict[str, Any]:
    """mlx_lm's gemma4_text config from the file's metadata (`p.get(key)` reads `gemma4.key`)
    and its tensors' names; `base` holds what every architecture has (hidden size, layers,
    heads, eps, context, vocabulary, tying)."""
    layers = base["num_hidden_layers"]
    swa = [bool(v) for v in _per_layer(p.get("attention.sliding_window_pattern"), layers,
                                        "attention.sliding_window_pattern")]
    if None in swa or not any(not s for s in swa):
        raise Gemma4Error("gemma4 file without global layers in attention.sliding_window_pattern")
    shared = int(p.get("attention.shared_kv_layers", 0))
    if not 0 <= shared < layers:
        raise Gemma4Error(f"gemma4 with {shared} shared KV layers of {layers}")
    first_shared = layers - shared
    if shared and (swa[first_shared - 1] or not swa[first_shared - 2]):
        # llama.cpp reuses the last two unshared layers (sliding, then global); mlx_lm the
        # last of each kind: the same layers only in that order
        raise Gemma4Error("gemma4 whose last unshared layers are not a sliding then a global one")
    head_dim = int(p.get("attention.key_length_swa", 256))
    global_head_dim = int(p.get("attention.key_length", head_dim))
    if int(p.get("attention.value_length_swa", head_dim)) != head_dim or \
            int(p.get("attention.value_length", global_head_dim)) != global_head_dim:
        raise Gemma4Error("gemma4 with different key and value head sizes")
    widths = [int(w) for w in _per_layer(p.get("feed_forward_length"), layers,
                                          "feed_forward_length")]
    width = widths[0]
    double = bool(shared) and widths == [width if i < first_shared else 2 * width
                                         for i in range(layers)]
    if not double and any(w != width for w in widths):
        raise Gemma4Error(f"gemma4 MLP widths {widths[:8]}... (one width, doubled on shared "
                          "layers, expected)")
    kv_heads = [int(h) for h in _per_layer(p.get("attention.head_count_kv"), layers,
                                            "attention.head_count_kv")]
    swa_kv = {h for h, s in zip(kv_heads, swa) if s}
    global_kv = {h for h, s in zip(kv_heads, swa) if not s}
    if len(swa_kv) > 1 or len(global_kv) != 1:
        raise Gemma4Error(f"gemma4 KV head counts {kv_heads} vary within a kind of layer")
    k_eq_v = any(f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names
                 for i in range(first_shared) if not swa[i])
    if int(p.get("rope.dimension_count_swa", head_dim)) != head_dim:
        raise Gemma4Error("gemma4 whose sliding layers rotate part of a head")  # (mlx_lm: all)
    config = {
        **base,
        "architectures": [HF_CLASS],
        "model_type": MODEL_TYPE,
        "intermediate_size": width,
        "use_double_wide_mlp": double,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_key_value_heads": swa_kv.pop() if swa_kv else global_kv.copy().pop(),
        "num_global_key_value_heads": global_kv.pop(),
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(p.get("embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": base["vocab_size"],
        "sliding_window": int(p.get("attention.sliding_window", 512)),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "final_logit_softcapping": p.get("final_logit_softcapping"),
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional",
                               "rope_theta": float(p.get("rope.freq_base", 1_000_000.0)),
                               "partial_rotary_factor": _global_rotary(rope, global_head_dim)},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(p.get("rope.freq_base_swa", 10_000.0))},
        },
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if config["final_logit_softcapping"] is not None:
        config["final_logit_softcapping"] = float(config["final_logit_softcapping"])
    experts = int(p.get("expert_count", 0))
    config["enable_moe_block"] = experts > 0
    if experts:
        used = int(p.get("expert_used_count", 0))
        if not 1 <= used <= experts:
            raise Gemma4Error(f"gemma4 with {used} of {experts} experts a token")
        config.update({"num_experts": experts, "top_k_experts": used,
                       "moe_intermediate_size": int(p.get("expert_feed_forward_length"))})
    return config


def _global_rotary(rope: Mapping[str, np.ndarray], head_dim: int) -> float:
    """The share of a global head that rotates, from `rope_freqs` (1: rotated, 1e30: not);
    without the tensor, llama.cpp rotates the whole head."""
    freqs = rope.get("rope_freqs.weight")
    if freqs is None:
        return 1.0
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    rotated = int(np.sum(freqs == 1.0))
    if freqs.size != head_dim // 2 or not np.all(freqs[:rotated] == 1.0) or \
            not np.all(freqs[rotated:] >= UNROTATED / 2):
        raise Gemma4Error("gemma4 rope_freqs is not 1 for the first pairs of a global head and "
                          "1e30 for the rest")
    return 2 * rotated / head_dim


def split_gate_up(hf_name: str, config: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """The experts' fused gate and up projection -> the two mlx_lm holds ([(name, rows)]: the
    first half of each expert's rows is the gate); None for any other tensor."""
    if GATE_UP not in hf_name:
        return None
    rows = int(config["moe_intermediate_size"])
    return [(hf_name.replace(GATE_UP, ".experts.switch_glu.gate_proj."), rows),
            (hf_name.replace(GATE_UP, ".experts.switch_glu.up_proj."), rows)]


# -- the inverse: config.json -> GGUF metadata -------------------------------------------
def gguf_metadata(kv: dict, a: str, config: Mapping[str, Any]) -> None:
    """The gemma4 keys llama.cpp's converter writes, into `kv` (which holds the common ones)."""
    layers = int(config["num_hidden_layers"])
    types = list(config["layer_types"])
    swa = [t == "sliding_attention" for t in types]
    shared = int(config.get("num_kv_shared_layers") or 0)
    head_dim = int(config["head_dim"])
    global_head_dim = int(config.get("global_head_dim") or head_dim)
    width = int(config["intermediate_size"])
    double = bool(config.get("use_double_wide_mlp")) and shared > 0
    kv[f"{a}.feed_forward_length"] = [width * (2 if i >= layers - shared else 1)
                                      for i in range(layers)] if double else width
    swa_kv = int(config["num_key_value_heads"])
    global_kv = int(config.get("num_global_key_value_heads") or swa_kv)
    kv[f"{a}.attention.head_count_kv"] = [swa_kv if s else global_kv for s in swa]
    kv[f"{a}.attention.key_length"] = kv[f"{a}.attention.value_length"] = global_head_dim
    kv[f"{a}.attention.key_length_swa"] = kv[f"{a}.attention.value_length_swa"] = head_dim
    kv[f"{a}.attention.sliding_window"] = int(config["sliding_window"])
    kv[f"{a}.attention.sliding_window_pattern"] = swa
    kv[f"{a}.attention.shared_kv_layers"] = shared
    kv[f"{a}.embedding_length_per_layer_input"] = int(config.get("hidden_size_per_layer_input")
                                                      or 0)
    rope = config["rope_parameters"]
    kv[f"{a}.rope.freq_base"] = float(rope["full_attention"]["rope_theta"])
    kv[f"{a}.rope.freq_base_swa"] = float(rope["sliding_attention"]["rope_theta"])
    kv[f"{a}.rope.dimension_count"] = global_head_dim
    kv[f"{a}.rope.dimension_count_swa"] = head_dim
    if config.get("final_logit_softcapping"):
        kv[f"{a}.final_logit_softcapping"] = float(config["final_logit_softcapping"])
    if config.get("enable_moe_block"):
        kv[f"{a}.expert_count"] = int(config["num_experts"])
        kv[f"{a}.expert_used_count"] = int(config["top_k_experts"])
        kv[f"{a}.expert_feed_forward_length"] = int(config["moe_intermediate_size"])


def rope_freqs(config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp's `rope_freqs` for the global layers' proportional rope."""
    head_dim = int(config.get("global_head_dim") or config["head_dim"])
    factor = float(config["rope_parameters"]["full_attention"].get("partial_rotary_factor", 1.0))
    rotated = int(head_dim * factor / 2)
    return np.array([1.0] * rotated + [UNROTATED] * (head_dim // 2 - rotated), np.float32)

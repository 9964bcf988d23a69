"""Gemma 4's GGUF metadata and tensor names <-> mlx_lm's gemma4_text (supervisor/store/gguf/
gemma4.py through arch.py): the per-layer settings, the rope_freqs tensor, the mixture's scale
tensors and fused experts, and what is refused. numpy only."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mlxr.supervisor.store.gguf import arch as A
from mlxr.supervisor.store.random_model import PRESETS, arch_config, tensor_plan

TOKENIZER = SimpleNamespace(bos_id=2, eos_ids=(1, 2037), pad_id=0)
KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "num_global_key_value_heads", "head_dim", "global_head_dim",
        "num_kv_shared_layers", "hidden_size_per_layer_input", "use_double_wide_mlp",
        "sliding_window", "layer_types", "final_logit_softcapping", "rope_parameters",
        "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
        "enable_moe_block", "attention_k_eq_v")


def config_of(preset: str) -> dict:
    return arch_config(PRESETS[preset], TOKENIZER, "float32")


def gguf_names(preset: str) -> list[str]:
    return [A.gguf_tensor_name("gemma4", name) for name, _, _ in tensor_plan(PRESETS[preset])]


def round_trip(preset: str, names: list[str] | None = None) -> tuple[dict, dict]:
    config = config_of(preset)
    arch, kv = A.gguf_metadata(config)
    assert arch == "gemma4"
    back = A.hf_config(kv, vocab_size=config["vocab_size"], tied=True,
                       rope_tensors=A.gguf_extra_tensors(config),
                       tensor_names=gguf_names(preset) if names is None else names)
    return config, back


@pytest.mark.parametrize("preset", ["gemma4", "gemma4-moe"])
def test_config_survives_the_trip_through_gguf_metadata(preset):
    config, back = round_trip(preset)
    assert back["model_type"] == "gemma4_text"
    for key in KEYS:
        assert back[key] == config[key], key
    if config["enable_moe_block"]:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            assert back[key] == config[key], key


def test_the_metadata_is_llama_cpps_per_layer_form():
    _, kv = A.gguf_metadata(config_of("gemma4"))
    # s, s, g, s, s, g; the last three share KV and have MLPs twice as wide
    assert kv["gemma4.attention.sliding_window_pattern"] == [True, True, False] * 2
    assert kv["gemma4.feed_forward_length"] == [512, 512, 512, 1024, 1024, 1024]
    assert kv["gemma4.attention.head_count_kv"] == [2, 2, 1, 2, 2, 1]
    assert (kv["gemma4.attention.key_length"], kv["gemma4.attention.key_length_swa"]) == (128, 64)
    assert kv["gemma4.attention.shared_kv_layers"] == 3
    assert kv["gemma4.embedding_length_per_layer_input"] == 64
    # one width everywhere: a single value, as llama.cpp writes it
    _, kv = A.gguf_metadata(config_of("gemma4-moe"))
    assert kv["gemma4.feed_forward_length"] == 512 and kv["gemma4.expert_count"] == 8


def test_rope_freqs_says_how_much_of_a_global_head_rotates():
    freqs = A.gguf_extra_tensors(config_of("gemma4"))["rope_freqs.weight"]
    assert freqs.shape == (64,) and list(freqs[:16]) == [1.0] * 16
    assert np.all(freqs[16:] == np.float32(1e30))  # a quarter of 128 dimensions rotates
    _, kv = A.gguf_metadata(config_of("gemma4"))
    whole = A.hf_config(kv, vocab_size=2048, tied=True, rope_tensors={})  # none: all rotate
    assert whole["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 1.0
    with pytest.raises(A.UnsupportedArchitecture, match="rope_freqs"):
        A.hf_config(kv, vocab_size=2048, tied=True,
                    rope_tensors={"rope_freqs.weight": np.ones(64) * 2})


def test_keys_equal_values_is_read_from_a_global_layer_without_attn_v():
    names = gguf_names("gemma4")
    assert "blk.2.attn_k.weight" in names and "blk.2.attn_v.weight" not in names
    assert "blk.3.attn_k.weight" not in names  # a shared layer has no keys of its own
    with_v = names + ["blk.2.attn_v.weight", "blk.5.attn_v.weight"]
    assert round_trip("gemma4", with_v)[1]["attention_k_eq_v"] is False


def test_every_tensor_name_maps_both_ways():
    for preset in ("gemma4", "gemma4-moe"):
        for hf_name, _, _ in tensor_plan(PRESETS[preset]):
            name = A.gguf_tensor_name("gemma4", hf_name)
            assert A.hf_tensor_name("gemma4", name) == hf_name, (hf_name, name)
    # the names llama.cpp's converter gives the parameters without `.weight`
    assert A.gguf_tensor_name("gemma4", "model.layers.3.layer_scalar") == \
        "blk.3.layer_output_scale.weight"
    assert A.gguf_tensor_name("gemma4", "model.layers.0.router.scale") == "blk.0.ffn_gate_inp.scale"
    assert A.hf_tensor_name("gemma4", "blk.1.ffn_down_exps.scale") == \
        "model.layers.1.router.per_expert_scale"
    assert A.hf_tensor_name("gemma4", "per_layer_token_embd.weight") == \
        "model.embed_tokens_per_layer.weight"
    # a multimodal file's towers are left out; what is unknown is refused by name
    assert A.hf_tensor_name("gemma4", "v.blk.0.attn_q.weight") is None
    assert A.hf_tensor_name("gemma4", "a.blk.0.conv.weight") is None
    with pytest.raises(A.UnsupportedArchitecture, match="blk.0.attn_q.scale"):
        A.hf_tensor_name("gemma4", "blk.0.attn_q.scale")
    with pytest.raises(A.UnsupportedArchitecture, match="per_layer_token_embd"):
        A.hf_tensor_name("llama", "per_layer_token_embd.weight")  # gemma4's alone


def test_fused_gate_up_experts_split_in_halves():
    config = config_of("gemma4-moe")
    name = A.hf_tensor_name("gemma4", "blk.2.ffn_gate_up_exps.weight")
    assert A.split_rows("gemma4", name, config) == [
        ("model.layers.2.experts.switch_glu.gate_proj.weight", 256),
        ("model.layers.2.experts.switch_glu.up_proj.weight", 256)]
    assert A.split_rows("gemma4", "model.layers.2.mlp.gate_proj.weight", config) is None


def _kv(**changes) -> dict:
    _, kv = A.gguf_metadata(config_of("gemma4"))
    kv.update({f"gemma4.{k}": v for k, v in changes.items()})
    return kv


@pytest.mark.parametrize("changes, fragment", [
    # llama.cpp shares the last unshared sliding and global layers; mlx_lm the last of each
    # kind: the same layers only when the unshared ones end sliding, global
    ({"attention.sliding_window_pattern": [True, False, True, True, True, False]},
     "last unshared layers"),
    ({"feed_forward_length": [512, 768, 512, 512, 512, 512]}, "MLP widths"),
    ({"attention.head_count_kv": [2, 1, 1, 2, 2, 1]}, "vary within a kind"),
    ({"rope.dimension_count_swa": 32}, "rotate part of a head"),
    ({"attention.sliding_window_pattern": [True] * 6}, "without global layers"),
    ({"attention.shared_kv_layers": 6}, "6 shared KV layers"),
    ({"feed_forward_length": [512] * 5}, "5 values for 6 layers"),
])
def test_settings_mlx_lm_cannot_run_are_refused_by_name(changes, fragment):
    with pytest.raises(A.UnsupportedArchitecture, match=fragment):
        A.hf_config(_kv(**changes), vocab_size=2048, tied=True,
                    tensor_names=gguf_names("gemma4"))


def test_a_mixture_needs_its_expert_counts():
    _, kv = A.gguf_metadata(config_of("gemma4-moe"))
    kv["gemma4.expert_used_count"] = 9
    with pytest.raises(A.UnsupportedArchitecture, match="9 of 8 experts"):
        A.hf_config(kv, vocab_size=2048, tied=True)

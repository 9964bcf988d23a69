"""GGUF <-> Hugging Face names, row orders, norm offsets and configs for every architecture
(supervisor/store/gguf/arch.py), checked against llama.cpp's own gguf-py tables where it has
them. numpy only."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.gguf import arch as A
from mlxr.supervisor.store.random_model import ARCH_NAMES, PRESETS, arch_config, tensor_plan

TOKENIZER = SimpleNamespace(bos_id=1, eos_ids=(2, 3), pad_id=None)
GGUF_ARCH = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
GGUF_ARCH["gptoss"] = GGUF_ARCH["gpt-oss"]  # Ollama's first name for it
# Tensors Ollama's converter writes that llama.cpp's does not: gpt-oss from OpenAI's own
# checkpoint keeps q/k/v fused; Gemma 4's experts keep gate and up apart (llama.cpp's loader
# takes them where its fused tensor is absent).
OLLAMA_ONLY = {"gptoss": {"attn_qkv"}, "gpt-oss": {"attn_qkv"},
               "gemma4": {"ffn_gate_exps", "ffn_up_exps"}}


def config_of(arch: str) -> dict:
    return arch_config(PRESETS[arch], TOKENIZER, "float32")


def stored(kv: dict) -> dict:
    """Metadata as a GGUF file gives it back: floats went through float32."""
    def f32(v):
        if isinstance(v, float):
            return float(np.float32(v))
        return [f32(x) for x in v] if isinstance(v, list) else v
    return {k: f32(v) for k, v in kv.items()}


def to_gguf(config: dict) -> tuple[str, dict, dict[str, np.ndarray]]:
    arch, kv = A.gguf_metadata(config)
    return arch, stored(kv), A.gguf_extra_tensors(config)


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_every_weight_name_round_trips_and_is_llama_cpps_name(name):
    config = config_of(name)
    arch, _, _ = to_gguf(config)
    llama_cpp = gguf.get_tensor_name_map(GGUF_ARCH[arch], config["num_hidden_layers"])
    # (a mixture's experts, one weight each, are stacked as mlx_lm's switch_mlp holds them:
    # llama.cpp's converter calls its stacked tensors mlp.experts.*)
    # (each tensor's experts, and 2 a further dimension: Granite's fused gate/up is split)
    plan = A.stack_experts({hf: np.zeros(shape[:1] + (2,) * (len(shape) - 1))
                            for hf, shape, _ in tensor_plan(PRESETS[name])})
    for hf in plan:
        g = A.gguf_tensor_name(arch, hf)
        assert A.hf_tensor_name(arch, g) == hf
        # (llama.cpp's converter adds ".weight" to gpt-oss's bare `sinks` parameter)
        bare = "" if hf.endswith((".weight", ".bias")) else ".weight"
        theirs = hf.replace(".switch_mlp.", ".experts.")
        if name == "mixtral":  # (Mixtral's stacked experts keep its w1/w3/w2 names there)
            for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                theirs = theirs.replace(f".experts.{proj}.", f".experts.{w}.")
        if name == "granitemoe" and ".switch_mlp." in hf:
            # (llama.cpp's converter splits Granite's fused input_linear into these itself)
            layer = int(hf.split(".")[2])
            kind = {"gate_proj": gguf.MODEL_TENSOR.FFN_GATE_EXP,
                    "up_proj": gguf.MODEL_TENSOR.FFN_UP_EXP,
                    "down_proj": gguf.MODEL_TENSOR.FFN_DOWN_EXP}[hf.split(".")[-2]]
            assert gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight" == g, hf
            continue
        assert llama_cpp.get_name(theirs, try_suffixes=(".weight", ".bias")) + bare == g, hf
    stacked = [hf for hf in plan if ".switch_mlp." in hf]
    experts = config.get("num_experts") or (
        config["num_local_experts"] if name in ("mixtral", "granitemoe") else 0)
    assert len(stacked) == (3 * config["num_hidden_layers"] if experts else 0)
    assert all(len(plan[hf]) == experts for hf in stacked)


@pytest.mark.parametrize("arch", A.ARCHITECTURES)
def test_every_block_tensor_is_one_llama_cpp_declares_for_the_architecture(arch):
    declared = {gguf.TENSOR_NAMES[t].format(bid=0)
                for t in gguf.MODEL_TENSORS[GGUF_ARCH[arch]]}
    for stem in set(A.spec(arch).block) - OLLAMA_ONLY.get(arch, set()):
        assert f"blk.0.{stem}" in declared, stem


def test_rope_tensors_and_a_multimodal_files_vision_tower_map_to_nothing():
    for name in A.ROPE_TENSORS:
        assert A.hf_tensor_name("llama", name) is None
    assert A.hf_tensor_name("gemma3", "v.blk.0.attn_q.weight") is None
    assert A.hf_tensor_name("gemma3", "mm.mm_input_projection.weight") is None
    assert A.hf_tensor_name("llama", "blk.3.attn_rot_embd.weight") is None  # old files
    with pytest.raises(A.UnsupportedArchitecture, match="v.blk.0.attn_q.weight"):
        A.hf_tensor_name("llama", "v.blk.0.attn_q.weight")


def test_unknown_architectures_and_tensors_are_400s_naming_them():
    with pytest.raises(A.UnsupportedArchitecture, match='"mamba"') as err:
        A.hf_config({"general.architecture": "mamba"}, vocab_size=10, tied=True)
    assert isinstance(err.value, InvalidRequest) and err.value.status == 400
    assert err.value.kind == "unsupported_model"
    with pytest.raises(A.UnsupportedArchitecture, match="blk.0.ffn_gate_shexp.weight"):
        A.hf_tensor_name("llama", "blk.0.ffn_gate_shexp.weight")  # a shared expert
    with pytest.raises(A.UnsupportedArchitecture, match="blk.0.ffn_gate.0.weight"):
        A.hf_tensor_name("llama", "blk.0.ffn_gate.0.weight")  # Mixtral's first layout
    with pytest.raises(A.UnsupportedArchitecture, match="blk.0.attn_qkv.weight"):
        A.hf_tensor_name("llama", "blk.0.attn_qkv.weight")  # fused q/k/v is phi3's only
    with pytest.raises(A.UnsupportedArchitecture, match="model.layers.0.mlp.experts"):
        A.gguf_tensor_name("llama", "model.layers.0.mlp.experts.weight")
    with pytest.raises(A.UnsupportedArchitecture, match='"deepseek_v3"'):
        A.gguf_metadata({"model_type": "deepseek_v3"})


def reference_interleave(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout spelled out: within each head of d rows, HF holds the rotary pairs
    as (i, i + d/2); GGUF holds them side by side as (2i, 2i + 1)."""
    d = rows.shape[0] // heads
    out = np.empty_like(rows)
    for h in range(heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = rows[h * d + i]
            out[h * d + 2 * i + 1] = rows[h * d + d // 2 + i]
    return out


@pytest.mark.parametrize("name", ["llama", "mistral", "granite"])
def test_q_and_k_rows_are_interleaved_per_head_and_restored(name):
    config = config_of(name)
    arch, _, _ = to_gguf(config)
    rng = np.random.default_rng(0)
    for proj, heads in (("q_proj", config["num_attention_heads"]),
                        ("k_proj", config["num_key_value_heads"])):
        for kind, shape in (("weight", (heads * 64, 256)), ("bias", (heads * 64,)),
                            ("scales", (heads * 64, 8))):
            hf_name = f"model.layers.1.self_attn.{proj}.{kind}"
            hf = rng.standard_normal(shape).astype(np.float32)
            to, back = A.gguf_row_order(arch, hf_name, config), A.row_order(arch, hf_name, config)
            np.testing.assert_array_equal(hf[to], reference_interleave(hf, heads))
            np.testing.assert_array_equal(hf[to][back], hf)
            np.testing.assert_array_equal(to[back], np.arange(shape[0]))


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_neox_rope_architectures_keep_rows_as_they_are(name):
    config = config_of(name)
    arch, _, _ = to_gguf(config)
    for hf, _, _ in tensor_plan(PRESETS[name]):
        assert A.row_order(arch, hf, config) is None and A.gguf_row_order(arch, hf, config) is None
    v_proj = "model.layers.0.self_attn.v_proj.weight"
    assert A.row_order("llama", v_proj, config_of("llama")) is None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_stores_every_rms_norm_weight_plus_one(arch):
    norms = [hf for hf, _, _ in tensor_plan(PRESETS[arch]) if hf.endswith("norm.weight")]
    assert len(norms) == PRESETS[arch].layers * (6 if arch == "gemma3" else 4) + 1
    assert all(A.value_offset(arch, hf) == -1.0 for hf in norms)
    assert A.value_offset(arch, "model.layers.0.self_attn.q_proj.weight") == 0.0
    assert A.value_offset(arch, "model.embed_tokens.weight") == 0.0
    assert A.value_offset("llama", "model.norm.weight") == 0.0
    assert A.value_offset("qwen3", "model.layers.0.self_attn.q_norm.weight") == 0.0


# Fields mlx_lm reads, per architecture, that must survive config -> GGUF -> config.
COMMON = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
          "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
          "tie_word_embeddings", "vocab_size")
EXTRA = {
    "llama": ("head_dim", "rope_scaling"),
    "mistral": ("head_dim",),
    "qwen2": (),
    "qwen3": ("head_dim",),
    "gemma2": ("head_dim", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar", "sliding_window"),
    "gemma3": ("head_dim", "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
               "rope_local_base_freq", "rope_scaling"),
    "phi3": ("original_max_position_embeddings", "sliding_window"),
    "granite": ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
                "logits_scaling", "attention_bias", "mlp_bias"),
    "qwen3_moe": ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"),
    "gpt_oss": ("head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "layer_types", "rope_scaling"),
    "mixtral": ("head_dim", "num_local_experts", "num_experts_per_tok"),
    "granitemoe": ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
                   "logits_scaling", "attention_bias", "num_local_experts",
                   "num_experts_per_tok"),
}


def assert_close(a, b, key):
    if isinstance(a, dict):
        assert set(a) <= set(b) | {"type"}, key
        for k in a:
            if k != "type":
                assert_close(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, list) and all(isinstance(x, str) for x in a):
        assert a == b, key
    elif isinstance(a, list):
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=key)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-6), key
    else:
        assert a == b, key


@pytest.mark.parametrize("name", [n for n in ARCH_NAMES if n != "gemma4"])  # (test_gemma4.py)
def test_config_survives_the_trip_through_gguf_metadata(name):
    config = config_of(name)
    arch, kv, extra = to_gguf(config)
    routers = [f"blk.{i}.ffn_gate_inp.weight" for i in range(config["num_hidden_layers"])]
    back = A.hf_config(kv, vocab_size=config["vocab_size"], tied=config["tie_word_embeddings"],
                       rope_tensors=extra, tensor_names=routers if name == "mixtral" else [])
    assert back["model_type"] == {"mistral": "llama", "gemma3": "gemma3_text"}.get(name, name)
    for key in COMMON + EXTRA[name]:
        assert_close(config[key], back[key], key)
    if name == "phi3":  # LongRoPE travels as two tensors
        scaling = back["rope_scaling"]
        assert scaling["type"] == "longrope"
        assert_close(config["rope_scaling"]["long_factor"], scaling["long_factor"], "long")
        assert_close(config["rope_scaling"]["short_factor"], scaling["short_factor"], "short")
    assert ("rope_freqs.weight" in extra) == (name == "llama")


def test_qwen2_biases_are_the_models_and_llama_biases_come_from_the_tensors():
    _, kv, _ = to_gguf(config_of("llama"))
    names = ["blk.0.attn_q.bias", "blk.0.attn_q.weight"]
    assert A.hf_config(kv, vocab_size=2048, tied=True, tensor_names=names)["attention_bias"]
    assert not A.hf_config(kv, vocab_size=2048, tied=True)["mlp_bias"]
    _, kv, _ = to_gguf(config_of("qwen2"))
    assert "attention_bias" not in A.hf_config(kv, vocab_size=2048, tied=True)


@pytest.mark.parametrize("factor,low,high,original", [
    (8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (32.0, 1.0, 4.0, 8192),  # Llama 3.2
    (16.0, 1.0, 4.0, 4096),
    (4.0, 1.0, 2.0, 2048),
])
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(factor, low, high, original):
    for theta, dims in ((500000.0, 128), (500000.0, 64), (10000.0, 128)):
        freqs = A.llama3_rope_factors(theta, dims, factor, low, high, original)
        got = A.llama3_rope_scaling(freqs, theta, dims)
        if got is None:  # every factor 1: no frequency is long enough to be scaled
            assert np.all(freqs == 1.0)
            continue
        again = A.llama3_rope_factors(theta, dims, got["factor"], got["low_freq_factor"],
                                      got["high_freq_factor"],
                                      got["original_max_position_embeddings"])
        np.testing.assert_allclose(again, freqs, rtol=1e-6)
        # Settings that scale original, low and high alike give the same factors; the real
        # ones (original 8192) come back as they were.
        if original == 8192 and dims == 128 and theta == 500000.0:
            assert got == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                           "high_freq_factor": high, "original_max_position_embeddings": original}


def test_llama3_factors_as_ollama_writes_them_in_float32_are_recovered():
    dims, theta = 64, 500000.0
    rows = []
    for i in range(0, dims, 2):  # the same formula evaluated in float32 throughout
        wavelen = np.float32(2 * np.pi) * np.float32(theta) ** np.float32(i / dims)
        if wavelen < np.float32(8192 / 4):
            rows.append(1.0)
        elif wavelen > np.float32(8192 / 1):
            rows.append(32.0)
        else:
            smooth = (np.float32(8192) / wavelen - 1) / (4 - 1)
            rows.append(1 / ((1 - smooth) / 32 + smooth))
    got = A.llama3_rope_scaling(np.array(rows, np.float32), theta, dims)
    assert got["factor"] == 32.0 and got["original_max_position_embeddings"] == 8192


def test_rope_freqs_that_match_no_llama3_setting_are_refused():
    freqs = A.llama3_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    with pytest.raises(A.UnsupportedArchitecture, match="rope_freqs"):
        A.llama3_rope_scaling(freqs * 1.3, 500000.0, 128)
    with pytest.raises(A.UnsupportedArchitecture, match="64 expected"):
        A.llama3_rope_scaling(freqs[:10], 500000.0, 128)
    assert A.llama3_rope_scaling(np.ones(64, np.float32), 500000.0, 128) is None
    _, kv, extra = to_gguf(config_of("llama"))
    with pytest.raises(A.UnsupportedArchitecture, match="rope_freqs"):
        A.hf_config(kv, vocab_size=2048, tied=True, rope_freqs=extra["rope_freqs.weight"] * 1.3)


def test_gemma_query_scale_follows_llama_cpps_27b_rule():
    for arch, layers in (("gemma2", 46), ("gemma3", 62)):
        config = {**config_of(arch), "num_hidden_layers": layers}
        config["query_pre_attn_scalar"] = config["hidden_size"] / config["num_attention_heads"] + 1
        with pytest.raises(A.UnsupportedArchitecture, match="query_pre_attn_scalar"):
            A.gguf_metadata(config)
        _, kv, _ = to_gguf({**config, "query_pre_attn_scalar": 64.0})
        kv[f"{arch}.attention.key_length"] = kv[f"{arch}.attention.value_length"] = 128
        back = A.hf_config(kv, vocab_size=2048, tied=True)
        assert back["query_pre_attn_scalar"] == 64  # hidden / heads, not the head size 128
        assert isinstance(back["query_pre_attn_scalar"], int)  # transformers insists


def test_gemma3_metadata_as_ollama_writes_it():
    _, kv, _ = to_gguf(config_of("gemma3"))
    kv["gemma3.attention.sliding_window_pattern"] = [True, True, True, True, True, False]
    kv["gemma3.rope.local.freq_base"] = 20000.0
    back = A.hf_config(kv, vocab_size=2048, tied=True)
    assert back["sliding_window_pattern"] == 6 and back["rope_local_base_freq"] == 20000.0
    # Its multimodal files leave out eps, rope bases and scaling: Ollama's defaults apply.
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.type",
                "rope.scaling.factor", "rope.local.freq_base", "attention.sliding_window_pattern"):
        kv.pop(f"gemma3.{key}", None)
    back = A.hf_config({**kv, "gemma3.rope.global.freq_base": 500000.0}, vocab_size=2048,
                       tied=True)
    assert back["rms_norm_eps"] == 1e-6 and back["rope_theta"] == 500000.0
    assert back["rope_local_base_freq"] == 10000.0 and "rope_scaling" not in back
    back = A.hf_config({**kv, "gemma3.rope.freq_scale": 0.125}, vocab_size=2048, tied=True)
    assert back["rope_theta"] == 1e6 and back["rope_scaling"] == {"rope_type": "linear",
                                                                   "factor": 8.0}
    kv["gemma3.attention.sliding_window_pattern"] = [True, False, True, True, True, False]
    with pytest.raises(A.UnsupportedArchitecture, match="periodic"):
        A.hf_config(kv, vocab_size=2048, tied=True)
    _, kv, _ = to_gguf({**config_of("gemma3"), "sliding_window_pattern": 2})
    assert kv["gemma3.attention.sliding_window_pattern"] == 2
    assert A.hf_config(kv, vocab_size=2048, tied=True)["sliding_window_pattern"] == 2


def test_yarn_and_linear_rope_scaling_and_partial_rotary_phi3():
    config = {**config_of("qwen2"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 32768}}
    _, kv, _ = to_gguf(config)
    assert kv["qwen2.rope.scaling.type"] == "yarn"
    assert A.hf_config(kv, vocab_size=2048, tied=True)["rope_scaling"] == config["rope_scaling"]
    config = {**config_of("phi3"), "partial_rotary_factor": 0.75, "rope_scaling": None}
    _, kv, _ = to_gguf(config)
    assert kv["phi3.rope.dimension_count"] == 48
    back = A.hf_config(kv, vocab_size=2048, tied=False)
    assert back["partial_rotary_factor"] == 0.75 and "rope_scaling" not in back
    kv["phi3.rope.scaling.type"] = "longrope-ish"
    with pytest.raises(A.UnsupportedArchitecture, match="longrope-ish"):
        A.hf_config(kv, vocab_size=2048, tied=False)


def test_head_sizes_mlx_lm_cannot_express_are_refused():
    _, kv, _ = to_gguf(config_of("qwen2"))
    kv["qwen2.attention.key_length"] = kv["qwen2.attention.value_length"] = 128
    with pytest.raises(A.UnsupportedArchitecture, match="head size 128"):
        A.hf_config(kv, vocab_size=2048, tied=True)
    _, kv, _ = to_gguf(config_of("llama"))
    kv["llama.attention.value_length"] = 32
    with pytest.raises(A.UnsupportedArchitecture, match="key and value"):
        A.hf_config(kv, vocab_size=2048, tied=True)
    kv = {**to_gguf(config_of("llama"))[1], "llama.feed_forward_length": [512, 1024]}
    with pytest.raises(A.UnsupportedArchitecture, match="varies across layers"):
        A.hf_config(kv, vocab_size=2048, tied=True)


def test_random_model_presets_name_their_architecture():
    from mlxr.supervisor.store.random_model import arch_of, resolve

    assert [arch_of(name) for name in ARCH_NAMES] == list(ARCH_NAMES)
    assert arch_of("tiny") == arch_of("medium") == "qwen3"
    assert resolve(None, None) == "tiny" and resolve(None, "gemma3") == "gemma3"
    assert resolve("small", "qwen3") == "small" and resolve("llama", None) == "llama"
    with pytest.raises(ValueError, match="'tiny' is a qwen3 model, not llama"):
        resolve("tiny", "llama")
    with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
        resolve("tiny", "mamba")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        arch_of("huge")


def test_a_llama_file_with_experts_is_mixtral():
    """Mistral's mixtures are "llama" GGUFs with experts: every layer's router and stacked
    experts, written and read back as mlx_lm's mixtral names."""
    config = config_of("mixtral")
    arch, kv, _ = to_gguf(config)
    assert arch == "llama" and kv["llama.expert_count"] == 4 and kv["llama.expert_used_count"] == 2
    layers = config["num_hidden_layers"]
    routers = [f"blk.{i}.ffn_gate_inp.weight" for i in range(layers)]
    back = A.hf_config(kv, vocab_size=2048, tied=False, tensor_names=routers)
    assert back["architectures"] == ["MixtralForCausalLM"]
    assert "attention_bias" not in back and "mlp_bias" not in back
    for stem, hf in (("ffn_gate_inp", "block_sparse_moe.gate"),
                     ("ffn_gate_exps", "block_sparse_moe.switch_mlp.gate_proj"),
                     ("ffn_up_exps", "block_sparse_moe.switch_mlp.up_proj"),
                     ("ffn_down_exps", "block_sparse_moe.switch_mlp.down_proj")):
        assert A.hf_tensor_name("llama", f"blk.1.{stem}.weight") == f"model.layers.1.{hf}.weight"
        assert A.gguf_tensor_name("llama", f"model.layers.1.{hf}.weight") == f"blk.1.{stem}.weight"
    experts = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": np.full((2, 3), e)
               for e in range(4) for w in ("w1", "w2", "w3")}
    stacked = A.stack_experts(experts)
    assert sorted(stacked) == [f"model.layers.0.block_sparse_moe.switch_mlp.{p}_proj.weight"
                               for p in ("down", "gate", "up")]
    assert stacked["model.layers.0.block_sparse_moe.switch_mlp.up_proj.weight"][:, 0, 0].tolist() \
        == [0, 1, 2, 3]
    with pytest.raises(A.UnsupportedArchitecture, match="every layer"):
        A.hf_config(kv, vocab_size=2048, tied=False, tensor_names=routers[:-1])
    with pytest.raises(A.UnsupportedArchitecture, match="biases"):
        A.hf_config(kv, vocab_size=2048, tied=False,
                    tensor_names=[*routers, "blk.0.attn_q.bias"])
    with pytest.raises(A.UnsupportedArchitecture, match="3 of 2 experts"):
        A.hf_config({**kv, "llama.expert_count": 2, "llama.expert_used_count": 3},
                    vocab_size=2048, tied=False, tensor_names=routers)

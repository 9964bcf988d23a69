"""EmbeddingGemma GGUF files (`general.architecture` "gemma-embedding", llama.cpp's and
Ollama's alike) <-> an EmbeddingGemma directory: config, tensor names, the sentence-transformers
files and the capabilities. numpy only."""

from __future__ import annotations

import json
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from mlxr.supervisor.store.config_blob import gguf_capabilities
from mlxr.supervisor.store.gguf import arch as A, pooling
from mlxr.supervisor.store.random_embedding import embedding_config
from mlxr.supervisor.store.random_model import PRESETS, arch_config

TOKENIZER = SimpleNamespace(bos_id=2, eos_ids=(1,), pad_id=0)
# What llama.cpp's converter writes for google/embeddinggemma-300m (its config.json's window,
# 512, not the half transformers makes of it), less the tokenizer.
LLAMA_CPP_KV = {
    "general.architecture": "gemma-embedding",
    "gemma-embedding.block_count": 24, "gemma-embedding.context_length": 2048,
    "gemma-embedding.embedding_length": 768, "gemma-embedding.feed_forward_length": 1152,
    "gemma-embedding.attention.head_count": 3, "gemma-embedding.attention.head_count_kv": 1,
    "gemma-embedding.rope.freq_base": 1000000.0, "gemma-embedding.rope.freq_base_swa": 10000.0,
    "gemma-embedding.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma-embedding.attention.key_length": 256, "gemma-embedding.attention.value_length": 256,
    "gemma-embedding.attention.sliding_window": 512,
    "gemma-embedding.dense_2_feat_in": 768, "gemma-embedding.dense_2_feat_out": 3072,
    "gemma-embedding.dense_3_feat_in": 3072, "gemma-embedding.dense_3_feat_out": 768,
    "gemma-embedding.pooling_type": 1,
}


def test_llama_cpps_metadata_makes_embeddinggemmas_config():
    config = A.hf_config(LLAMA_CPP_KV, vocab_size=262144, tied=True)
    assert config["architectures"] == ["Gemma3TextModel"]
    assert config["model_type"] == "gemma3_text"
    assert config["use_bidirectional_attention"] is True
    assert config["sliding_window"] == 512 and config["sliding_window_pattern"] == 6
    assert config["rope_local_base_freq"] == 10000.0 and config["rope_theta"] == 1e6
    assert config["query_pre_attn_scalar"] == 256 and config["head_dim"] == 256
    assert config["max_position_embeddings"] == 2048
    assert "rope_scaling" not in config


def test_dense_tensors_go_to_their_module_folders_and_back():
    assert A.hf_tensor_name("gemma-embedding", "dense_2.weight") == "2_Dense/linear.weight"
    assert A.hf_tensor_name("gemma-embedding", "dense_3.weight") == "3_Dense/linear.weight"
    assert A.gguf_tensor_name("gemma-embedding", "3_Dense/linear.weight") == "dense_3.weight"
    # the body is gemma3's, llama.cpp's names for it
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA_EMBEDDING, 1)
    for hf in ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate_proj.weight",
               "model.layers.0.post_feedforward_layernorm.weight", "model.norm.weight"):
        g = A.gguf_tensor_name("gemma-embedding", hf)
        assert names.get_name(hf, try_suffixes=(".weight",)) == g
        assert A.hf_tensor_name("gemma-embedding", g) == hf
    assert A.value_offset("gemma-embedding", "model.norm.weight") == -1.0
    # a gemma3 file has no such tensors
    with pytest.raises(A.UnsupportedArchitecture, match="dense_2"):
        A.hf_tensor_name("gemma3", "dense_2.weight")


def test_a_bidirectional_config_is_written_as_gemma_embedding_and_read_back():
    config = embedding_config(arch_config(PRESETS["embeddinggemma"], TOKENIZER, "float32"))
    arch, kv = A.gguf_metadata(config)
    assert arch == "gemma-embedding"
    assert kv["gemma-embedding.attention.sliding_window"] == 64
    back = A.hf_config(kv, vocab_size=config["vocab_size"], tied=True)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "sliding_window", "max_position_embeddings",
                "use_bidirectional_attention"):
        assert back[key] == config[key], key
    # a causal gemma3_text config is still written as gemma3
    causal = arch_config(PRESETS["gemma3"], TOKENIZER, "float32")
    assert A.gguf_metadata(causal)[0] == "gemma3"


def test_an_embeddinggemma_file_is_an_embedding_model_whatever_its_pooling_type_says():
    without = {k: v for k, v in LLAMA_CPP_KV.items() if not k.endswith("pooling_type")}
    assert pooling.embeds(without) and pooling.pooling_mode(without) == "mean"
    assert gguf_capabilities(without, None) == ["embedding"]
    assert gguf_capabilities(LLAMA_CPP_KV, None) == ["embedding"]
    with pytest.raises(A.UnsupportedArchitecture, match="rank"):
        pooling.pooling_mode({**LLAMA_CPP_KV, "gemma-embedding.pooling_type": 4})


def test_sentence_transformers_files_list_the_dense_modules_between_pooling_and_normalize():
    files = pooling.sentence_transformers_files(
        LLAMA_CPP_KV, dense=(("2_Dense", 768, 3072), ("3_Dense", 3072, 768)))
    modules = json.loads(files["modules.json"])
    assert [(m["idx"], m["path"], m["type"].rsplit(".", 1)[1]) for m in modules] == [
        (0, "", "Transformer"), (1, "1_Pooling", "Pooling"), (2, "2_Dense", "Dense"),
        (3, "3_Dense", "Dense"), (4, "4_Normalize", "Normalize")]
    assert json.loads(files["2_Dense/config.json"]) == {
        "in_features": 768, "out_features": 3072, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"}
    assert json.loads(files["1_Pooling/config.json"])["pooling_mode_mean_tokens"] is True
    # without Dense modules: as before
    plain = json.loads(pooling.sentence_transformers_files(LLAMA_CPP_KV)["modules.json"])
    assert [m["path"] for m in plain] == ["", "1_Pooling", "2_Normalize"]


def test_ollamas_per_layer_pattern_and_missing_settings_take_llama_cpps_defaults():
    kv = {k: v for k, v in LLAMA_CPP_KV.items()
          if not k.endswith(("rope.freq_base", "layer_norm_rms_epsilon"))}
    kv["gemma-embedding.attention.sliding_window_pattern"] = [
        (i + 1) % 6 != 0 for i in range(24)]
    config = A.hf_config(kv, vocab_size=262144, tied=True)
    assert config["sliding_window_pattern"] == 6
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert np.isclose(config["rope_local_base_freq"], 10000.0)

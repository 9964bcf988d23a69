"""The random Qwen2.5-VL test model (supervisor/store/random_vision.py): reproducible bytes, a
config mlx-vlm reads as Qwen2.5-VL, weights that follow the tensor plan, and EOS rows zeroed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mlxr.shared.vision import placeholder
from mlxr.supervisor.store.metadata import capabilities_for
from mlxr.supervisor.store.random_model import count_parameters, write_random_model
from mlxr.supervisor.store.random_vision import CHAT_TEMPLATE, EOS_IDS, tensor_plan

PRESET = "qwen2.5-vl"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("qwen2.5-vl-0"), PRESET, 0)


@pytest.fixture(scope="module")
def weights(model) -> dict[str, np.ndarray]:
    return load_file(str(model / "model.safetensors"))


@pytest.fixture(scope="module")
def config(model) -> dict:
    return json.loads((model / "config.json").read_text())


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_weights(model, tmp_path):
    again = files_of(write_random_model(tmp_path / "again", PRESET, 0))
    first = files_of(model)
    assert sorted(again) == sorted(first)
    for name in first:
        assert again[name] == first[name], name
    other = write_random_model(tmp_path / "other", PRESET, 1)
    assert (other / "model.safetensors").read_bytes() != first["model.safetensors"]
    assert (other / "config.json").read_bytes() == first["config.json"]


def test_config_is_qwen2_5_vl_with_an_image_tower(config):
    assert config["model_type"] == "qwen2_5_vl"
    assert isinstance(config["vision_config"], dict)
    assert config["vision_config"]["out_hidden_size"] == config["hidden_size"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    sections = config["rope_scaling"]["mrope_section"]
    assert len(sections) == 3
    assert sum(sections) == head_dim // 2
    assert config["torch_dtype"] == "float32"


def test_the_processor_config_is_written(model):
    processor = json.loads((model / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "Qwen2VLImageProcessor"
    assert processor["min_pixels"] <= processor["max_pixels"]


def test_the_chat_template_is_the_vision_one(model):
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert placeholder("qwen2_5_vl") in tok_config["chat_template"]
    assert (model / "tokenizer.json").is_file()


def test_the_image_token_is_in_the_tokenizer(model, config):
    vocab = json.loads((model / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    assert added["<|image_pad|>"] == config["image_token_id"]
    assert added["<|vision_start|>"] == config["vision_start_token_id"]
    assert added["<|vision_end|>"] == config["vision_end_token_id"]


def test_every_tensor_follows_the_plan_in_float32(weights):
    plan = {name: shape for name, shape, _ in tensor_plan()}
    assert len(plan) == len(tensor_plan())  # no name twice
    assert sorted(weights) == sorted(plan)
    for name, array in weights.items():
        assert array.shape == plan[name], name
        assert array.dtype == np.float32, name
        assert np.isfinite(array).all(), name


def test_the_end_of_sequence_rows_of_the_head_are_zero(weights):
    head = weights["language_model.lm_head.weight"]
    for row in EOS_IDS:
        assert not head[row].any(), row
    assert set(EOS_IDS) == {151645, 151643}
    zero_rows = np.flatnonzero(~head.any(axis=1))
    assert sorted(zero_rows) == sorted(EOS_IDS)  # and no other row


def test_count_parameters_is_the_sum_of_the_tensor_sizes(weights):
    assert count_parameters(PRESET) == sum(a.size for a in weights.values())


def test_the_model_has_the_vision_capability(model, config):
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    assert "vision" in capabilities_for(config, template, {})
    text_only = {k: v for k, v in config.items() if k != "vision_config"}
    assert "vision" not in capabilities_for(text_only, template, {})

"""The sentence-transformers file rules (shared/sentence_transformers.py) on tmp_path,
including the store's layout: a directory of symlinks to blobs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxr.shared.sentence_transformers import PoolingConfig, modes_from_config, read_pooling_config

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize",
     "type": "sentence_transformers.models.Normalize"},
]
CLS = {"word_embedding_dimension": 8, "pooling_mode_cls_token": True,
       "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False}


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_store_layout_symlinks_in_a_subfolder(tmp_path):
    blobs, model = tmp_path / "blobs", tmp_path / "model"
    (model / "1_Pooling").mkdir(parents=True)
    (model / "modules.json").symlink_to(write(blobs / "sha256-a", MODULES))
    (model / "1_Pooling" / "config.json").symlink_to(write(blobs / "sha256-b", CLS))
    (model / "sentence_bert_config.json").symlink_to(
        write(blobs / "sha256-c", {"max_seq_length": 128, "do_lower_case": False}))
    assert read_pooling_config(model) == PoolingConfig(["cls"], True, 128)


def test_flattened_pooling_config_is_found(tmp_path):
    write(tmp_path / "modules.json", MODULES)
    write(tmp_path / "1_Pooling_config.json", CLS)
    assert read_pooling_config(tmp_path).modes == ["cls"]
    (tmp_path / "1_Pooling_config.json").unlink()
    write(tmp_path / "pooling_config.json", CLS)
    assert read_pooling_config(tmp_path).modes == ["cls"]


def test_missing_pooling_config_means_mean_pooling(tmp_path):
    write(tmp_path / "modules.json", MODULES)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").symlink_to(tmp_path / "gone")  # dangling link
    assert read_pooling_config(tmp_path) == PoolingConfig(["mean"], True, None)


def test_normalize_only_when_modules_json_lists_it(tmp_path):
    write(tmp_path / "modules.json", MODULES[:2])
    assert read_pooling_config(tmp_path).normalize is False


def test_no_modules_json_means_mean_and_normalize(tmp_path):
    assert read_pooling_config(tmp_path) == PoolingConfig(["mean"], True, None)


def test_modules_we_do_not_implement_are_a_load_error(tmp_path):
    norm = {"idx": 3, "name": "3", "path": "3_LayerNorm",
            "type": "sentence_transformers.models.LayerNorm"}
    write(tmp_path / "modules.json", MODULES + [norm])
    with pytest.raises(ValueError, match="LayerNorm"):
        read_pooling_config(tmp_path)


def dense_module(idx: int, path: str) -> dict:
    return {"idx": idx, "name": str(idx), "path": path,
            "type": "sentence_transformers.models.Dense"}


EMBEDDING_GEMMA = [MODULES[0], MODULES[1], dense_module(2, "2_Dense"), dense_module(3, "3_Dense"),
                   {"idx": 4, "name": "4", "path": "4_Normalize",
                    "type": "sentence_transformers.models.Normalize"}]
IDENTITY = "torch.nn.modules.linear.Identity"


def test_dense_modules_after_the_pooling_are_read_in_order(tmp_path):
    write(tmp_path / "modules.json", EMBEDDING_GEMMA)
    write(tmp_path / "2_Dense" / "config.json", {"in_features": 768, "out_features": 3072,
                                                 "bias": False, "activation_function": IDENTITY})
    # sentence-transformers' defaults: a bias, tanh
    write(tmp_path / "3_Dense" / "config.json", {"in_features": 3072, "out_features": 768})
    cfg = read_pooling_config(tmp_path)
    assert [(d.path, d.in_features, d.out_features, d.bias, d.activation) for d in cfg.dense] == [
        ("2_Dense", 768, 3072, False, "identity"), ("3_Dense", 3072, 768, True, "tanh")]
    assert cfg.normalize and cfg.modes == ["mean"]


@pytest.mark.parametrize("modules, config, message", [
    ([MODULES[0], dense_module(1, "2_Dense"), MODULES[1]], {"in_features": 4, "out_features": 4},
     "before the pooling"),
    ([*MODULES[:2], dense_module(2, "2_Dense")],
     {"in_features": 4, "out_features": 4,
      "activation_function": "torch.nn.modules.activation.GELU"}, "GELU"),
    ([*MODULES[:2], dense_module(2, "2_Dense")], {"in_features": 4}, "out_features"),
    ([*MODULES[:2], dense_module(2, "2_Dense")], {"in_features": 4, "out_features": True},
     "out_features"),
    ([*MODULES[:2], dense_module(2, "../2_Dense")], {"in_features": 4, "out_features": 4},
     "not a folder"),
    ([*MODULES[:2], dense_module(2, "9_Dense")], {"in_features": 4, "out_features": 4},
     "no config.json"),
])
def test_dense_modules_we_cannot_run_are_a_load_error(tmp_path, modules, config, message):
    write(tmp_path / "modules.json", modules)
    write(tmp_path / "2_Dense" / "config.json", config)
    with pytest.raises(ValueError, match=message):
        read_pooling_config(tmp_path)


def test_modes_follow_sentence_transformers_order_and_reject_unsupported():
    both = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}
    assert modes_from_config(both) == ["cls", "mean"]
    with pytest.raises(ValueError):
        modes_from_config({"pooling_mode_weightedmean_tokens": True})
    with pytest.raises(ValueError):
        modes_from_config({"pooling_mode_mean_tokens": False})


def test_a_language_models_pooling_weights_pick_its_positions():
    from mlxr.runner.embed.embeddings import position_weights

    batch = [[5, 6, 7, 8], [9, 10]]
    np.testing.assert_allclose(position_weights(batch, "mean"),
                               [[0.25] * 4, [0.5, 0.5, 0, 0]])
    np.testing.assert_array_equal(position_weights(batch, "lasttoken"),
                                  [[0, 0, 0, 1], [0, 1, 0, 0]])
    np.testing.assert_array_equal(position_weights(batch, "cls"),
                                  [[1, 0, 0, 0], [1, 0, 0, 0]])

"""sentence-transformers' Dense modules (runner/embed/dense.py) after any embedder's pooling:
a random Nomic BERT given a tanh Dense with a bias, against the same model without it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxr.runner.embed.embeddings import load_encoder_embedder
from mlxr.shared.errors import InvalidModelFile
from tests.harness.encoders import write_random_nomic

IDS = [[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 2088, 102]]


def modules(dense: bool, normalize: bool) -> list[dict]:
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    kinds += [("2_Dense", "Dense")] if dense else []
    kinds += [("3_Normalize", "Normalize")] if normalize else []
    return [{"idx": i, "name": str(i), "path": path,
             "type": f"sentence_transformers.models.{kind}"} for i, (path, kind) in enumerate(kinds)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    plain = write_random_nomic(tmp_path_factory.mktemp("plain"), seed=3)
    (plain / "modules.json").write_text(json.dumps(modules(False, False)))  # raw pooled vectors
    dense = tmp_path_factory.mktemp("dense") / "m"
    shutil.copytree(plain, dense)
    (dense / "modules.json").write_text(json.dumps(modules(True, True)))
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((48, 64)) / 8).astype(np.float32)
    bias = (rng.standard_normal(48) * 0.1).astype(np.float32)
    (dense / "2_Dense").mkdir()
    (dense / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 64, "out_features": 48, "bias": True,
         "activation_function": "torch.nn.modules.activation.Tanh"}))
    save_file({"linear.weight": weight, "linear.bias": bias},
              str(dense / "2_Dense" / "model.safetensors"))
    return plain, dense, weight, bias


@pytest.mark.parametrize("host", [False, True], ids=["mlx", "numpy"])
def test_a_dense_module_applies_after_the_pooling_and_before_normalization(dirs, host):
    plain, dense, weight, bias = dirs
    pooled = load_encoder_embedder(plain, 512, host=host).forward(IDS)
    embedder = load_encoder_embedder(dense, 512, host=host)
    assert embedder.dim == 48
    expected = np.tanh(pooled @ weight.T + bias)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(embedder.forward(IDS), expected, atol=1e-6)


def test_a_dense_module_whose_weights_disagree_with_its_config_is_a_load_error(dirs, tmp_path):
    _, dense, weight, _ = dirs
    broken = tmp_path / "m"
    shutil.copytree(dense, broken)
    save_file({"linear.weight": weight[:, :32]}, str(broken / "2_Dense" / "model.safetensors"))
    with pytest.raises(InvalidModelFile, match="shape"):
        load_encoder_embedder(broken, 512)

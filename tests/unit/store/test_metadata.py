"""What the store says of a model directory from its files alone (supervisor/store/metadata.py):
parameter counts and quantization of packed formats."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file

from mlxr.supervisor.store.metadata import describe


def _describe(tmp_path, tensors: dict, config: dict):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return describe({p.name: p for p in tmp_path.iterdir()})


def test_openais_mxfp4_layout_counts_two_values_a_byte_and_no_scales(tmp_path):
    tensors = {"mlp.experts.down_proj_blocks": np.zeros((4, 64, 2, 16), np.uint8),  # 4x64x64
               "mlp.experts.down_proj_scales": np.zeros((4, 64, 2), np.uint8),
               "mlp.experts.down_proj_bias": np.zeros((4, 64), np.float32),
               "embed.weight": np.zeros((10, 64), np.float32)}
    d = _describe(tmp_path, tensors, {"model_type": "gpt_oss",
                                      "quantization_config": {"quant_method": "mxfp4"}})
    assert d.parameter_count == 4 * 64 * 64 + 4 * 64 + 10 * 64
    assert d.file_type == "MXFP4"
    assert d.quantization == {"bits": 4, "group_size": 32, "mode": "mxfp4"}


def test_mlx_mxfp4_layers_are_mxfp4_and_affine_ones_q_bits(tmp_path):
    tensors = {"w.weight": np.zeros((64, 8), np.uint32), "w.scales": np.zeros((64, 2), np.uint8)}
    d = _describe(tmp_path, tensors, {"model_type": "x", "quantization": {
        "group_size": 32, "bits": 4, "mode": "mxfp4"}})
    assert (d.parameter_count, d.file_type) == (64 * 64, "MXFP4")
    tensors = {"w.weight": np.zeros((64, 8), np.uint32), "w.scales": np.zeros((64, 1), np.float16),
               "w.biases": np.zeros((64, 1), np.float16)}
    d = _describe(tmp_path, tensors, {"model_type": "x", "quantization": {
        "group_size": 64, "bits": 4}})
    assert (d.parameter_count, d.file_type) == (64 * 64, "Q4")

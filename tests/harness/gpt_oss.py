"""gpt-oss as OpenAI's Hugging Face checkpoint lays it out (openai/gpt-oss-20b): the experts in
MXFP4 (`gate_up_proj_blocks` and `_scales`, gate and up rows interleaved; `down_proj_blocks`
and `_scales`), their biases beside, every other weight in bfloat16, and
`quantization_config: {"quant_method": "mxfp4"}`; made from the store's random gpt_oss preset
(mlx_lm's layout) with MLX's own mxfp4 quantizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def write_hf_gpt_oss(source: Path, dest: Path) -> Path:
    import mlx.core as mx

    weights = mx.load(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())

    def blocks(x):  # (..., rows, cols) -> (..., rows, cols / 32, 16) codes and exponent bytes
        q, scales = mx.quantize(x, group_size=32, bits=4, mode="mxfp4")
        return q.view(mx.uint8).reshape(*q.shape[:-1], -1, 16), scales

    def interleave(a, b):  # rows a0 b0 a1 b1 ... along the second axis
        return mx.stack([a, b], axis=2).reshape(a.shape[0], -1, *a.shape[2:])

    out = {k: (v.astype(mx.bfloat16) if v.ndim > 1 else v)
           for k, v in weights.items() if ".mlp.experts." not in k}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = interleave(weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"])
        out[p + "gate_up_proj_blocks"], out[p + "gate_up_proj_scales"] = blocks(gate_up)
        out[p + "gate_up_proj_bias"] = interleave(weights[p + "gate_proj.bias"],
                                                  weights[p + "up_proj.bias"])
        out[p + "down_proj_blocks"], out[p + "down_proj_scales"] = blocks(
            weights[p + "down_proj.weight"])
        out[p + "down_proj_bias"] = weights[p + "down_proj.bias"]
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), out, metadata={"format": "pt"})
    config.update(torch_dtype="bfloat16", quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, dest / name)
    return dest

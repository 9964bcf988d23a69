"""Random-weight vision test models: Qwen2.5-VL (preset `qwen2.5-vl`) with the real Qwen3
tokenizer (the same vocabulary and special tokens, <|image_pad|> and its neighbours included).

Written the way mlx-vlm's converter writes a checkpoint (the `mlx-community` layout: the
language model under `language_model.`, the image tower under `vision_tower.`, the patch
embedding in MLX's channels-last order), so mlx-lm, mlx-vlm and the runner read it as they
read a converted real model. The processor config keeps images small (at most 12,544 pixels:
at most 16 image tokens after the 2x2 merge), so tests stay fast.

Invariants (as for random_model.py's presets): the same arguments write the same bytes; the
end-of-sequence rows of `lm_head` are zeroed, so greedy decoding runs to the length asked; the
chat template renders image parts as the placeholder the runner expands (shared/vision.py).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from mlxr.shared.assets import write_qwen3_tokenizer
from mlxr.shared.vision import placeholder

VOCAB_SIZE = 151680
EOS_IDS = (151645, 151643)
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 2, 4, 2, 256
V_HIDDEN, V_DEPTH, V_HEADS, V_FFN = 64, 2, 2, 128
PATCH, TEMPORAL, MERGE = 14, 2, 2
DESCRIPTION = (f"qwen2.5-vl random model: {LAYERS} text layers of {HIDDEN}, a {V_DEPTH}-block "
               f"image tower, the {VOCAB_SIZE:,}-token Qwen tokenizer")

# A ChatML template with image parts: each image part is the placeholder the runner expands.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message.role != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' or part.type == 'image_url' %}" + placeholder("qwen2_5_vl")
    + "{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def config() -> dict:
    return {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        # 16 frequencies per head of 32: 4 for time, 6 each for height and width
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654,
        "bos_token_id": 151643, "eos_token_id": 151645,
        "vision_config": {
            "model_type": "qwen2_5_vl", "depth": V_DEPTH, "hidden_size": V_HIDDEN,
            "intermediate_size": V_FFN, "out_hidden_size": HIDDEN, "num_heads": V_HEADS,
            "patch_size": PATCH, "spatial_patch_size": PATCH, "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL, "window_size": 56, "fullatt_block_indexes": [1],
            "in_channels": 3, "tokens_per_second": 2},
    }


def processor_config() -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "min_pixels": 3136, "max_pixels": 12544, "patch_size": PATCH,
            "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}


def tensor_plan() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every weight, in creation order; kinds as random_model.py's."""
    head_dim = HIDDEN // HEADS
    plan = [("language_model.model.embed_tokens.weight", (VOCAB_SIZE, HIDDEN), "embed")]
    for i in range(LAYERS):
        at = f"language_model.model.layers.{i}."
        for x, n in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim),
                     ("v", KV_HEADS * head_dim)):
            plan += [(f"{at}self_attn.{x}_proj.weight", (n, HIDDEN), "matrix"),
                     (f"{at}self_attn.{x}_proj.bias", (n,), "bias")]
        plan += [(f"{at}self_attn.o_proj.weight", (HIDDEN, HEADS * head_dim), "matrix"),
                 (f"{at}mlp.gate_proj.weight", (FFN, HIDDEN), "matrix"),
                 (f"{at}mlp.up_proj.weight", (FFN, HIDDEN), "matrix"),
                 (f"{at}mlp.down_proj.weight", (HIDDEN, FFN), "matrix"),
                 (f"{at}input_layernorm.weight", (HIDDEN,), "norm"),
                 (f"{at}post_attention_layernorm.weight", (HIDDEN,), "norm")]
    plan += [("language_model.model.norm.weight", (HIDDEN,), "norm"),
             ("language_model.lm_head.weight", (VOCAB_SIZE, HIDDEN), "embed"),
             # MLX's Conv3d order: (out, time, height, width, in)
             ("vision_tower.patch_embed.proj.weight", (V_HIDDEN, TEMPORAL, PATCH, PATCH, 3),
              "patch")]
    for i in range(V_DEPTH):
        at = f"vision_tower.blocks.{i}."
        plan += [(f"{at}norm1.weight", (V_HIDDEN,), "norm"),
                 (f"{at}attn.qkv.weight", (3 * V_HIDDEN, V_HIDDEN), "matrix"),
                 (f"{at}attn.qkv.bias", (3 * V_HIDDEN,), "bias"),
                 (f"{at}attn.proj.weight", (V_HIDDEN, V_HIDDEN), "matrix"),
                 (f"{at}attn.proj.bias", (V_HIDDEN,), "bias"),
                 (f"{at}norm2.weight", (V_HIDDEN,), "norm"),
                 (f"{at}mlp.gate_proj.weight", (V_FFN, V_HIDDEN), "matrix"),
                 (f"{at}mlp.gate_proj.bias", (V_FFN,), "bias"),
                 (f"{at}mlp.up_proj.weight", (V_FFN, V_HIDDEN), "matrix"),
                 (f"{at}mlp.up_proj.bias", (V_FFN,), "bias"),
                 (f"{at}mlp.down_proj.weight", (V_HIDDEN, V_FFN), "matrix"),
                 (f"{at}mlp.down_proj.bias", (V_HIDDEN,), "bias")]
    merged = V_HIDDEN * MERGE * MERGE
    plan += [("vision_tower.merger.ln_q.weight", (V_HIDDEN,), "norm"),
             ("vision_tower.merger.mlp.0.weight", (merged, merged), "matrix"),
             ("vision_tower.merger.mlp.0.bias", (merged,), "bias"),
             ("vision_tower.merger.mlp.2.weight", (HIDDEN, merged), "matrix"),
             ("vision_tower.merger.mlp.2.bias", (HIDDEN,), "bias")]
    return plan


def _draw(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "embed":
        return x * 0.02
    if kind == "matrix":
        return x / np.sqrt(shape[1])
    if kind == "patch":
        return x / np.sqrt(int(np.prod(shape[1:])))
    if kind == "bias":
        return x * 0.1
    return 1.0 + x * 0.1  # norm


def count_parameters() -> int:
    return sum(int(np.prod(shape)) for _, shape, _ in tensor_plan())


def write_random_vision(dest: Path, seed: int, dtype: str, save) -> Path:
    """Write the model into `dest`; `save(weights, path, dtype)` is random_model.py's."""
    rng = np.random.default_rng((seed, zlib.crc32(b"qwen2_5_vl")))
    weights = {name: _draw(rng, shape, kind).astype(np.float32)
               for name, shape, kind in tensor_plan()}
    weights["language_model.lm_head.weight"][list(EOS_IDS)] = 0.0
    write_qwen3_tokenizer(dest)
    tok_config_path = dest / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config_path.write_text(json.dumps(tok_config, indent=2))
    cfg = config()
    cfg["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "preprocessor_config.json").write_text(json.dumps(processor_config(), indent=2))
    save(weights, dest / "model.safetensors", dtype)
    return dest

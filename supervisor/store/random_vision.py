"""Random-weight vision test models: Qwen2.5-VL and Qwen2-VL (presets `qwen2.5-vl`, `qwen2-vl`)
with the real Qwen3 tokenizer (the same vocabulary and special tokens, <|image_pad|> and its
neighbours included),
and Gemma 3 (preset `gemma3-vision`) on the small SentencePiece-style test tokenizer.

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


def config(arch: str = "qwen2_5_vl") -> dict:
    """Qwen2.5-VL's config, or Qwen2-VL's (`arch` "qwen2_vl": the same text model, a tower
    without windows, LayerNorms and a GELU MLP)."""
    cfg = _qwen25_config()
    if arch == "qwen2_vl":
        cfg["model_type"] = cfg["vision_config"]["model_type"] = "qwen2_vl"
        cfg["architectures"] = ["Qwen2VLForConditionalGeneration"]
        cfg["vision_config"] = {
            "model_type": "qwen2_vl", "depth": V_DEPTH, "embed_dim": V_HIDDEN,
            "hidden_size": HIDDEN, "num_heads": V_HEADS, "mlp_ratio": V_FFN // V_HIDDEN,
            "patch_size": PATCH, "spatial_patch_size": PATCH, "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL, "in_channels": 3}
    return cfg


def _qwen25_config() -> dict:
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


def processor_config(arch: str = "qwen2_5_vl") -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor" if arch == "qwen2_vl" else
            "Qwen2_5_VLProcessor",
            "min_pixels": 3136, "max_pixels": 12544, "patch_size": PATCH,
            "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}


def tensor_plan(arch: str = "qwen2_5_vl") -> list[tuple[str, tuple[int, ...], str]]:
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
    if arch == "qwen2_vl":
        return plan + _qwen2_tower_plan()
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


def _qwen2_tower_plan() -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen2-VL's tower after the patch embedding: LayerNorms with biases, a GELU MLP."""
    plan = []
    for i in range(V_DEPTH):
        at = f"vision_tower.blocks.{i}."
        for norm in ("norm1", "norm2"):
            plan += [(f"{at}{norm}.weight", (V_HIDDEN,), "norm"),
                     (f"{at}{norm}.bias", (V_HIDDEN,), "bias")]
        plan += [(f"{at}attn.qkv.weight", (3 * V_HIDDEN, V_HIDDEN), "matrix"),
                 (f"{at}attn.qkv.bias", (3 * V_HIDDEN,), "bias"),
                 (f"{at}attn.proj.weight", (V_HIDDEN, V_HIDDEN), "matrix"),
                 (f"{at}attn.proj.bias", (V_HIDDEN,), "bias"),
                 (f"{at}mlp.fc1.weight", (V_FFN, V_HIDDEN), "matrix"),
                 (f"{at}mlp.fc1.bias", (V_FFN,), "bias"),
                 (f"{at}mlp.fc2.weight", (V_HIDDEN, V_FFN), "matrix"),
                 (f"{at}mlp.fc2.bias", (V_HIDDEN,), "bias")]
    merged = V_HIDDEN * MERGE * MERGE
    return plan + [("vision_tower.merger.ln_q.weight", (V_HIDDEN,), "norm"),
                   ("vision_tower.merger.ln_q.bias", (V_HIDDEN,), "bias"),
                   ("vision_tower.merger.mlp.0.weight", (merged, merged), "matrix"),
                   ("vision_tower.merger.mlp.0.bias", (merged,), "bias"),
                   ("vision_tower.merger.mlp.2.weight", (HIDDEN, merged), "matrix"),
                   ("vision_tower.merger.mlp.2.bias", (HIDDEN,), "bias")]


def _draw(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "embed":
        return x * 0.02
    if kind == "matrix":
        return x / np.sqrt(shape[1])
    if kind == "patch":
        return x / np.sqrt(int(np.prod(shape[1:])))
    if kind == "matrix_in":  # (in, out): a projection stored input-major
        return x * 8 / np.sqrt(shape[0])
    if kind == "bias":
        return x * 0.1
    if kind == "gemma_norm":  # Gemma scales by (1 + weight)
        return x * 0.1
    return 1.0 + x * 0.1  # norm


def count_parameters(arch: str = "qwen2_5_vl") -> int:
    plan = gemma3_tensor_plan() if arch == "gemma3" else tensor_plan(arch)
    return sum(int(np.prod(shape)) for _, shape, _ in plan)


# -- Gemma 3 -------------------------------------------------------------------------------
# The text part is random_model.py's gemma3 preset (six layers: five sliding, window 64, and a
# global one) on the 2,048-token SentencePiece-style tokenizer, which gets Gemma 3's three image
# tokens at ids 2048-2050; the image tower is SigLIP on 56x56 images (16 patches, pooled to 4
# image tokens).
G_VOCAB, G_HIDDEN, G_LAYERS, G_HEADS, G_KV_HEADS, G_HEAD_DIM, G_FFN = 2056, 256, 6, 4, 2, 64, 512
G_BOI, G_EOI, G_IMAGE = 2048, 2049, 2050
G_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
G_EOS = (2, 2047)  # </s>, <|im_end|>
S_HIDDEN, S_LAYERS, S_HEADS, S_FFN, S_PATCH, S_IMAGE, S_TOKENS = 64, 2, 2, 128, 14, 56, 16

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message.role == 'assistant' else message.role %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' or part.type == 'image_url' %}" + placeholder("gemma3")
    + "{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_config() -> dict:
    text = {"model_type": "gemma3_text", "hidden_size": G_HIDDEN,
            "num_hidden_layers": G_LAYERS, "intermediate_size": G_FFN,
            "num_attention_heads": G_HEADS, "num_key_value_heads": G_KV_HEADS,
            "head_dim": G_HEAD_DIM, "rms_norm_eps": 1e-6, "vocab_size": G_VOCAB,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": G_HEAD_DIM, "sliding_window": 64,
            "sliding_window_pattern": 6, "mm_tokens_per_image": S_TOKENS,
            "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh"}
    vision = {"model_type": "siglip_vision_model", "num_hidden_layers": S_LAYERS,
              "hidden_size": S_HIDDEN, "intermediate_size": S_FFN,
              "num_attention_heads": S_HEADS, "patch_size": S_PATCH, "image_size": S_IMAGE,
              "num_channels": 3, "layer_norm_eps": 1e-6}
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "image_token_index": G_IMAGE,
            "boi_token_index": G_BOI, "eoi_token_index": G_EOI,
            "mm_tokens_per_image": S_TOKENS, "eos_token_id": list(G_EOS), "pad_token_id": 0,
            "vocab_size": G_VOCAB, "torch_dtype": "float32"}


def gemma3_processor_configs() -> tuple[dict, dict]:
    image = {"image_processor_type": "Gemma3ImageProcessor",
             "processor_class": "Gemma3Processor",
             "size": {"height": S_IMAGE, "width": S_IMAGE}, "resample": 2,
             "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "do_convert_rgb": True, "do_pan_and_scan": False}
    return image, {"processor_class": "Gemma3Processor", "image_seq_length": S_TOKENS}


def gemma3_tensor_plan() -> list[tuple[str, tuple[int, ...], str]]:
    plan = [("language_model.model.embed_tokens.weight", (G_VOCAB, G_HIDDEN), "embed")]
    q, kv = G_HEADS * G_HEAD_DIM, G_KV_HEADS * G_HEAD_DIM
    for i in range(G_LAYERS):
        at = f"language_model.model.layers.{i}."
        plan += [(f"{at}self_attn.q_proj.weight", (q, G_HIDDEN), "matrix"),
                 (f"{at}self_attn.k_proj.weight", (kv, G_HIDDEN), "matrix"),
                 (f"{at}self_attn.v_proj.weight", (kv, G_HIDDEN), "matrix"),
                 (f"{at}self_attn.o_proj.weight", (G_HIDDEN, q), "matrix"),
                 (f"{at}self_attn.q_norm.weight", (G_HEAD_DIM,), "gemma_norm"),
                 (f"{at}self_attn.k_norm.weight", (G_HEAD_DIM,), "gemma_norm"),
                 (f"{at}mlp.gate_proj.weight", (G_FFN, G_HIDDEN), "matrix"),
                 (f"{at}mlp.up_proj.weight", (G_FFN, G_HIDDEN), "matrix"),
                 (f"{at}mlp.down_proj.weight", (G_HIDDEN, G_FFN), "matrix")]
        plan += [(f"{at}{n}.weight", (G_HIDDEN,), "gemma_norm") for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")]
    plan.append(("language_model.model.norm.weight", (G_HIDDEN,), "gemma_norm"))
    at = "vision_tower.vision_model."
    # MLX's Conv2d order: (out, height, width, in)
    plan += [(f"{at}embeddings.patch_embedding.weight", (S_HIDDEN, S_PATCH, S_PATCH, 3),
              "patch"),
             (f"{at}embeddings.patch_embedding.bias", (S_HIDDEN,), "bias"),
             (f"{at}embeddings.position_embedding.weight",
              ((S_IMAGE // S_PATCH) ** 2, S_HIDDEN), "embed")]
    for i in range(S_LAYERS):
        layer = f"{at}encoder.layers.{i}."
        for x in ("q", "k", "v", "out"):
            plan += [(f"{layer}self_attn.{x}_proj.weight", (S_HIDDEN, S_HIDDEN), "matrix"),
                     (f"{layer}self_attn.{x}_proj.bias", (S_HIDDEN,), "bias")]
        plan += [(f"{layer}layer_norm1.weight", (S_HIDDEN,), "norm"),
                 (f"{layer}layer_norm1.bias", (S_HIDDEN,), "bias"),
                 (f"{layer}mlp.fc1.weight", (S_FFN, S_HIDDEN), "matrix"),
                 (f"{layer}mlp.fc1.bias", (S_FFN,), "bias"),
                 (f"{layer}mlp.fc2.weight", (S_HIDDEN, S_FFN), "matrix"),
                 (f"{layer}mlp.fc2.bias", (S_HIDDEN,), "bias"),
                 (f"{layer}layer_norm2.weight", (S_HIDDEN,), "norm"),
                 (f"{layer}layer_norm2.bias", (S_HIDDEN,), "bias")]
    plan += [(f"{at}post_layernorm.weight", (S_HIDDEN,), "norm"),
             (f"{at}post_layernorm.bias", (S_HIDDEN,), "bias"),
             ("multi_modal_projector.mm_input_projection_weight", (S_HIDDEN, G_HIDDEN),
              "matrix_in"),
             ("multi_modal_projector.mm_soft_emb_norm.weight", (S_HIDDEN,), "gemma_norm")]
    return plan


def _gemma3_tokenizer(dest: Path) -> None:
    """The small SentencePiece-style tokenizer with Gemma 3's image tokens added (ids 2048-2050)
    and named the way transformers' Gemma 3 processor looks them up."""
    from mlxr.supervisor.store.small_tokenizer import write_small_tokenizer

    write_small_tokenizer(dest, "spm", 2048)
    tok = json.loads((dest / "tokenizer.json").read_text())
    for i, name in enumerate(G_IMAGE_TOKENS):
        tok["model"]["vocab"][name] = G_BOI + i
        tok["added_tokens"].append({"id": G_BOI + i, "content": name, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})
    (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["additional_special_tokens"] = list(cfg["additional_special_tokens"]) + \
        list(G_IMAGE_TOKENS)
    cfg["extra_special_tokens"] = {"boi_token": G_IMAGE_TOKENS[0], "eoi_token": G_IMAGE_TOKENS[1],
                                   "image_token": G_IMAGE_TOKENS[2]}
    cfg["chat_template"] = GEMMA3_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def write_random_gemma3(dest: Path, seed: int, dtype: str, save) -> Path:
    rng = np.random.default_rng((seed, zlib.crc32(b"gemma3-vision")))
    weights = {name: _draw(rng, shape, kind).astype(np.float32)
               for name, shape, kind in gemma3_tensor_plan()}
    # tied head: the end-of-sequence rows of the embedding are zeroed
    weights["language_model.model.embed_tokens.weight"][list(G_EOS)] = 0.0
    _gemma3_tokenizer(dest)
    cfg = gemma3_config()
    cfg["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    image, processor = gemma3_processor_configs()
    (dest / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (dest / "processor_config.json").write_text(json.dumps(processor, indent=2))
    save(weights, dest / "model.safetensors", dtype)
    return dest


def write_random_vision(dest: Path, seed: int, dtype: str, save, arch: str = "qwen2_5_vl") -> Path:
    """Write the model into `dest`; `save(weights, path, dtype)` is random_model.py's."""
    if arch == "gemma3":
        return write_random_gemma3(dest, seed, dtype, save)
    rng = np.random.default_rng((seed, zlib.crc32(arch.encode())))
    weights = {name: _draw(rng, shape, kind).astype(np.float32)
               for name, shape, kind in tensor_plan(arch)}
    weights["language_model.lm_head.weight"][list(EOS_IDS)] = 0.0
    write_qwen3_tokenizer(dest)
    tok_config_path = dest / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config_path.write_text(json.dumps(tok_config, indent=2))
    cfg = config(arch)
    cfg["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "preprocessor_config.json").write_text(json.dumps(processor_config(arch),
                                                              indent=2))
    save(weights, dest / "model.safetensors", dtype)
    return dest

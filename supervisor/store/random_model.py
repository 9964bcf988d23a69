"""Random-weight qwen3 test models with the real Qwen3 tokenizer (float32, seeded).

The end-of-sequence rows of the output projection are zeroed, so an EOS logit is exactly 0 and
greedy decoding runs to the length asked (a test that needs EOS biases it with logit_bias).
Presets with an untied `lm_head` give greedy output that depends on the whole context, so
token-exact comparisons catch cache and batching bugs (see ../shared/PLATFORM.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from mlxr.shared.assets import write_qwen3_tokenizer

VOCAB_SIZE = 151680
EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>


@dataclass(frozen=True, slots=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    description: str


PRESETS: dict[str, Preset] = {
    # ~0.1M parameters outside the 151,680-row embedding; untied head for token-exact tests.
    "tiny": Preset(64, 2, 2, 1, 32, 256, False, "tiny random qwen3 (untied head)"),
    # ~31M parameters, most of them the embedding (the benchmark model of docs/PERFORMANCE.md).
    "small": Preset(192, 4, 4, 2, 48, 768, True, "small random qwen3, ~31M parameters"),
    # ~147M parameters.
    "medium": Preset(512, 22, 8, 4, 64, 1408, True, "medium random qwen3, ~147M parameters"),
}


def model_config(preset: Preset) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": preset.hidden,
        "num_hidden_layers": preset.layers,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "head_dim": preset.head_dim,
        "intermediate_size": preset.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": preset.tied,
        "torch_dtype": "float32",
        "bos_token_id": 151643,
        "eos_token_id": list(EOS_IDS),
        "mlxr_random_preset": preset.description,
    }


def make_weights(preset: Preset, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    h, hd = preset.hidden, preset.head_dim
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for i in range(preset.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(preset.heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = normal(preset.kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = normal(preset.kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, preset.heads * hd)
        w[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "mlp.gate_proj.weight"] = normal(preset.intermediate, h)
        w[p + "mlp.up_proj.weight"] = normal(preset.intermediate, h)
        w[p + "mlp.down_proj.weight"] = normal(h, preset.intermediate)
    w["model.norm.weight"] = np.ones(h, np.float32)
    head = "model.embed_tokens.weight" if preset.tied else "lm_head.weight"
    if not preset.tied:
        w[head] = normal(VOCAB_SIZE, h)
    w[head][list(EOS_IDS)] = 0.0
    return w


def write_random_model(dest: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a loadable Hugging Face-layout model directory; the same arguments give the same
    bytes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(model_config(p), indent=2))
    save_file(make_weights(p, seed), str(dest / "model.safetensors"), metadata={"format": "pt"})
    write_qwen3_tokenizer(dest)
    return dest


def count_parameters(preset: str) -> int:
    p = PRESETS[preset]
    per_layer = (p.hidden * p.head_dim * (2 * p.heads + 2 * p.kv_heads) + 3 * p.hidden * p.intermediate
                 + 2 * p.head_dim + 2 * p.hidden)
    head = 0 if p.tied else VOCAB_SIZE * p.hidden
    return VOCAB_SIZE * p.hidden + p.layers * per_layer + p.hidden + head

"""Which checkpoints mlxr serves with images, and how a prompt marks an image: both sides need
it (the store derives the `vision` capability, the supervisor writes the placeholder into a
Go template's prompt, the runner finds and expands it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# model_type -> (the config.json key of the image token id, the placeholder a prompt carries
# once per image; the model's processor expands it to the image's tokens)
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen2_5_vl": ("image_token_id", "<|vision_start|><|image_pad|><|vision_end|>"),
    "qwen2_vl": ("image_token_id", "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3": ("image_token_index", "<start_of_image>"),
}


def vision_family(config: Mapping[str, Any]) -> str | None:
    """The family of a checkpoint's config.json that mlxr serves with images, or None."""
    kind = config.get("model_type")
    return kind if kind in FAMILIES and isinstance(config.get("vision_config"), dict) else None


def placeholder(family: str) -> str:
    return FAMILIES[family][1]

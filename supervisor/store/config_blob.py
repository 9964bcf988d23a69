"""The config blob of an MLX model: Ollama's ConfigV2 fields plus what `show` reports.

Ollama's fields keep Ollama's meaning: `model_format` "safetensors", `model_family` (the
architecture, e.g. "qwen3"), `model_type` (the parameter size, e.g. "31.23M"), `file_type`
(the quantization level, e.g. "F32", "Q4"), and the OCI `architecture`/`os` of the image.
Ours are additional keys Ollama ignores: `parameter_count`, `quantization`, `model_info`
(keys as in Ollama's show), and `random` for random-weight test models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .manifest import Layer
from .gguf.encoders import is_encoder
from .gguf.pooling import embeds
from .metadata import capabilities_for, describe, human_number
from .random_model import PRESETS


def random_label(preset: str, seed: int) -> dict[str, Any]:
    return {"preset": preset, "seed": seed,
            "description": f"random test model: {PRESETS[preset].description}, seed {seed}"}


def _label_from_config(files: Mapping[str, Path]) -> dict[str, Any] | None:
    try:
        config = json.loads(files["config.json"].read_text())
    except (KeyError, OSError, ValueError):
        return None
    text = config.get("mlxr_random_preset") if isinstance(config, dict) else None
    if not isinstance(text, str):
        return None
    return {"preset": None, "seed": None, "description": f"random test model: {text}"}


def make_config_blob(files: Mapping[str, Path], layers: list[Layer], template: str | None,
                     random: dict[str, Any] | None) -> bytes:
    """Describe the model whose files are given (file name -> path) as config blob bytes."""
    desc = describe(files, template)
    random = random or _label_from_config(files)
    info = dict(desc.model_info)
    if random:
        info["general.description"] = random["description"]
    config: dict[str, Any] = {
        "model_format": "safetensors",
        "model_family": desc.architecture,
        "model_families": [desc.architecture],
        "model_type": human_number(desc.parameter_count),
        "file_type": desc.file_type,
        "capabilities": desc.capabilities,
        "context_length": desc.context_length,
        "embedding_length": desc.embedding_length,
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [x.digest for x in layers]},
        "parameter_count": desc.parameter_count,
        "quantization": desc.quantization,
        "model_info": info,
    }
    if random:
        config["random"] = random
    return json.dumps(config, separators=(",", ":")).encode() + b"\n"


def gguf_capabilities(kv: dict[str, Any], template: str | None) -> list[str]:
    """A GGUF model's capabilities as Ollama derives them from the file: an encoder, or a
    file with a pooling type, is an embedding model whatever its architecture; otherwise
    completion, with what the template (the model's TEMPLATE layer, else the file's chat
    template) adds."""
    arch = kv.get("general.architecture")
    if is_encoder(str(arch)) or embeds(kv):
        return ["embedding"]
    chat_template = kv.get("tokenizer.chat_template")
    return capabilities_for({"model_type": arch}, template or (
        chat_template if isinstance(chat_template, str) else None), {})


def make_gguf_config_blob(summary: Any, layers: list[Layer], template: str | None) -> bytes:
    """The config blob of a GGUF model, as Ollama writes it (format "gguf", the GGUF file
    type), with the GGUF metadata as `model_info` (long arrays such as the vocabulary shown as
    null, as Ollama's show does)."""
    kv = summary.kv
    arch = summary.architecture
    info: dict[str, Any] = {k: (None if isinstance(v, list) and len(v) > 64 else v)
                            for k, v in kv.items()}
    info["general.parameter_count"] = summary.parameter_count
    ctx, emb = kv.get(f"{arch}.context_length"), kv.get(f"{arch}.embedding_length")
    config: dict[str, Any] = {
        "model_format": "gguf",
        "model_family": arch,
        "model_families": [arch],
        "model_type": human_number(summary.parameter_count),
        "file_type": summary.file_type,
        "capabilities": gguf_capabilities(kv, template),
        "context_length": ctx if isinstance(ctx, int) else None,
        "embedding_length": emb if isinstance(emb, int) else None,
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [x.digest for x in layers]},
        "parameter_count": summary.parameter_count,
        "model_info": info,
    }
    return json.dumps(config, separators=(",", ":")).encode() + b"\n"

"""What a Hugging Face/MLX model directory is: architecture, size, quantization, capabilities.

Reads only config.json, the tokenizer config / chat template and the safetensors headers
(never the weights), so it is cheap enough to run on every create.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from mlxr.shared.errors import InvalidRequest
from mlxr.shared.model_checks import read_safetensors_header as check_safetensors_header
from mlxr.shared.vision import vision_family

_DTYPE_NAMES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "F8_E4M3": "F8_E4M3"}
_EMBEDDING_ARCHS = {"bert", "roberta", "xlm-roberta", "nomic_bert", "nomic-bert", "modernbert",
                    "distilbert"}


@dataclass(slots=True)
class ModelDescription:
    architecture: str  # config.json model_type, e.g. "qwen3"
    parameter_count: int
    file_type: str  # "F32", "BF16", "Q4", ...
    context_length: int | None
    embedding_length: int | None
    quantization: dict[str, Any] | None
    capabilities: list[str]
    model_info: dict[str, Any] = field(default_factory=dict)


def human_number(n: int) -> str:
    """A parameter count as Ollama shows it: 7.6B, 31.23M, 500K, 12."""
    for scale, unit, places in ((1e9, "B", 1), (1e6, "M", 2)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == math.floor(x) else f"{x:.{places}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's tensors as its header names them (name -> dtype, shape,
    data_offsets), after shared/model_checks.py has checked the header against the file: an
    untrusted file is a 400 (InvalidModelFile), never an allocation of its claimed size."""
    header = check_safetensors_header(path)
    return {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
            for name, t in header.tensors.items()}


_MX_FORMATS = {"mxfp4": 4, "mxfp8": 8}  # microscaling formats (groups of 32): bits a value


def count_parameters(headers: list[dict[str, Any]], bits: int | None) -> tuple[int, str]:
    """(parameter count, dominant float dtype). Packed quantized weights count 32/bits each;
    their scales and biases are not parameters."""
    tensors = {k: v for h in headers for k, v in h.items() if isinstance(v, dict)}
    total, by_dtype = 0, {}
    for name, t in tensors.items():
        n = math.prod(t.get("shape") or [1])
        stem = name.rsplit(".", 1)[0]
        if bits and name.endswith((".scales", ".biases")) and stem + ".weight" in tensors \
                and stem + ".scales" in tensors:
            continue
        if bits and t.get("dtype") == "U32" and stem + ".scales" in tensors:
            n = n * 32 // bits
        elif name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in tensors:
            continue  # OpenAI's MXFP4 layout (gpt-oss): one exponent byte a block
        elif name.endswith("_blocks") and t.get("dtype") == "U8":
            n *= 2  # two 4-bit values a byte
        total += n
        by_dtype[t.get("dtype", "")] = by_dtype.get(t.get("dtype", ""), 0) + n
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else ""
    return total, _DTYPE_NAMES.get(dtype, dtype)


def chat_template_of(files: Mapping[str, Path]) -> str | None:
    """The Jinja chat template from tokenizer_config.json or chat_template.jinja."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].read_text(errors="replace")
    if "tokenizer_config.json" in files:
        try:
            tc = json.loads(files["tokenizer_config.json"].read_text())
        except (ValueError, UnicodeDecodeError):
            return None
        ct = tc.get("chat_template") if isinstance(tc, dict) else None
        if isinstance(ct, list):  # named templates: [{"name": ..., "template": ...}]
            ct = next((x.get("template") for x in ct if isinstance(x, dict)
                       and x.get("name") == "default"), None)
        return ct if isinstance(ct, str) else None
    return None


def capabilities_for(config: Mapping[str, Any], template: str | None,
                     files: Mapping[str, Path]) -> list[str]:
    arch = str(config.get("model_type", "")).lower()
    if arch in _EMBEDDING_ARCHS or "modules.json" in files:
        return ["embedding"]
    caps = ["completion"]
    text = template or ""
    if "tools" in text.lower():  # Jinja `tools`, Go template `.Tools`
        caps.append("tools")
    # harmony's analysis channel; Gemma 4's thought channel
    if "<think>" in text or ".Think" in text or "<|channel|>" in text or "<|channel>" in text:
        caps.append("thinking")
    if vision_family(config):
        caps.append("vision")
    return with_template_capabilities(caps, text)


def with_template_capabilities(caps: list[str], template: str | None) -> list[str]:
    """`caps` plus what a Go TEMPLATE adds, as Ollama derives it: "insert" for a template
    that uses .Suffix (fill-in-the-middle)."""
    caps = list(caps)
    if template and ".Suffix" in template and "completion" in caps and "insert" not in caps:
        caps.append("insert")
    return caps


def tensor_list(files: Mapping[str, Path]) -> list[dict[str, Any]]:
    """Every tensor of the safetensors files: Ollama's /api/show `tensors` (name, type,
    shape), in name order."""
    out = []
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        for tensor, meta in read_safetensors_header(files[name]).items():
            if tensor != "__metadata__" and isinstance(meta, dict):
                out.append({"name": tensor, "type": str(meta.get("dtype", "")),
                            "shape": list(meta.get("shape", []))})
    out.sort(key=lambda t: t["name"])
    return out


def describe(files: Mapping[str, Path], template: str | None = None) -> ModelDescription:
    """Describe the model whose files (file name -> path) are given. `template` overrides the
    tokenizer's chat template when deriving capabilities."""
    if "config.json" not in files:
        raise InvalidRequest("model has no config.json")
    try:
        config = json.loads(files["config.json"].read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequest("config.json is not a JSON object")
    weights = sorted(n for n in files if n.endswith(".safetensors"))
    if not weights:
        raise InvalidRequest("model has no .safetensors weights")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") in _MX_FORMATS and "bits" not in quant:
        # (OpenAI's gpt-oss checkpoints: {"quant_method": "mxfp4"}, as mlx_lm reads them)
        quant = {"bits": _MX_FORMATS[quant["quant_method"]], "group_size": 32,
                 "mode": quant["quant_method"]}
    quant = dict(quant) if isinstance(quant, dict) and "bits" in quant else None
    bits = int(quant["bits"]) if quant else None
    mode = str(quant.get("mode") or "affine") if quant else "affine"
    count, dtype = count_parameters([read_safetensors_header(files[n]) for n in weights], bits)
    arch = str(config.get("model_type") or text.get("model_type") or "unknown")
    template = template if template is not None else chat_template_of(files)
    ctx = text.get("max_position_embeddings")
    emb = text.get("hidden_size")
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": count}
    if isinstance(config.get("architectures"), list) and config["architectures"]:
        info["general.basename"] = str(config["architectures"][0])
    for key, src in (("context_length", "max_position_embeddings"),
                     ("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
                     ("feed_forward_length", "intermediate_size"),
                     ("attention.head_count", "num_attention_heads"),
                     ("attention.head_count_kv", "num_key_value_heads"),
                     ("attention.key_length", "head_dim"),
                     ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
                     ("rope.freq_base", "rope_theta"), ("vocab_size", "vocab_size")):
        if isinstance(text.get(src), (int, float)) and not isinstance(text.get(src), bool):
            info[f"{arch}.{key}"] = text[src]
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            info[f"tokenizer.ggml.{key}"] = config[key]
    if quant:
        info["general.quantization_bits"] = bits
        info["general.quantization_group_size"] = quant.get("group_size")
    return ModelDescription(
        architecture=arch, parameter_count=count,
        file_type=mode.upper() if mode != "affine" else f"Q{bits}" if bits else
        (dtype or "unknown"),
        context_length=ctx if isinstance(ctx, int) else None,
        embedding_length=emb if isinstance(emb, int) else None,
        quantization=({"bits": bits, "group_size": quant.get("group_size"),
                       "mode": quant.get("mode", "affine")} if quant else None),
        capabilities=capabilities_for(config, template, files), model_info=info)

"""Quantization levels and the quantizer.

`parse_quantize` maps the names users give Ollama (GGUF file types such as Q4_K_M or Q8_0, and
Ollama's MLX names q4/int4, q8/int8) onto the nearest MLX affine quantization: the same bits
(4, 5, 6 or 8), group size 64. Names are case-insensitive; an unknown name is a 400 that lists
the accepted ones.

Run as a child process (`python quantize.py SRC DST BITS GROUP_SIZE`) it quantizes a Hugging
Face/MLX model directory with mlx-lm, so MLX work and memory stay out of the supervisor. It
writes only the weights (model*.safetensors, the index) and config.json into DST; the caller
reuses the source's tokenizer files. This module imports nothing of mlxr at its top, so it runs
as a plain script.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GROUP_SIZE = 64

# Ollama's names -> MLX bits. GGUF's K-quants keep a few tensors at higher precision (Q4_K_M
# stores half of ffn_down in Q6_K); MLX affine quantization uses one width for every layer, so
# the name's main width is the nearest.
QUANT_TYPES: dict[str, int] = {
    "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q4_K_S": 4, "Q4_K_M": 4, "Q4": 4, "INT4": 4,
    "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q5_K_S": 5, "Q5_K_M": 5, "Q5": 5,
    "Q6_K": 6, "Q6": 6,
    "Q8_0": 8, "Q8": 8, "INT8": 8,
}


@dataclass(frozen=True, slots=True)
class QuantChoice:
    name: str  # the accepted name, upper-cased: "Q4_K_M"
    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def describe(self) -> str:
        return f"{self.name} (MLX {self.bits}-bit, group size {self.group_size})"


def parse_quantize(name: str) -> QuantChoice:
    """The MLX quantization for an Ollama quantization name; else InvalidRequest (400)."""
    key = name.strip().upper()
    bits = QUANT_TYPES.get(key)
    if bits is None:
        from mlxr.shared.errors import InvalidRequest

        raise InvalidRequest(f'unsupported quantization type "{name}": supported types are '
                             + ", ".join(QUANT_TYPES) + " (case-insensitive; each becomes "
                             "MLX affine quantization of the same bits, group size "
                             f"{DEFAULT_GROUP_SIZE})")
    return QuantChoice(key, bits)


def quantize_dir(src: Path, dst: Path, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    import json

    from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

    classes = _get_classes
    if json.loads((src / "config.json").read_text()).get("use_bidirectional_attention"):
        # EmbeddingGemma: weights named as its base model saves them (its Dense modules, in
        # their folders, stay as they are: the caller keeps them)
        from mlxr.shared.model_classes import base_named_classes as classes
    model, config = load_model(src, lazy=True, get_model_classes=classes)
    if "quantization" in config or "quantization_config" in config:
        raise SystemExit("model is already quantized")
    model, config = quantize_model(model, config, group_size, bits, mode="affine")
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model, donate_model=True)
    save_config(config, config_path=dst / "config.json")


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: quantize.py SRC DST BITS GROUP_SIZE", file=sys.stderr)
        return 2
    quantize_dir(Path(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

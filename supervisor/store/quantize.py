"""Quantize a Hugging Face/MLX model directory with MLX affine quantization (mlx-lm).

Run as a child process (`python quantize.py SRC DST BITS GROUP_SIZE`) so MLX work and memory
stay out of the supervisor. Writes only the weights (model*.safetensors, the index) and
config.json into DST; the caller reuses the source's tokenizer files.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_GROUP_SIZE = 64


def quantize_dir(src: Path, dst: Path, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src, lazy=True)
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

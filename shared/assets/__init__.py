"""Vendored data files: the Qwen3 tokenizer and chat template (Apache-2.0, see qwen3/NOTICE)."""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

QWEN3_DIR = Path(__file__).parent / "qwen3"


def write_qwen3_tokenizer(dest: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and the NOTICE into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    with lzma.open(QWEN3_DIR / "tokenizer.json.xz") as src, open(dest / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(src, out)
    for name in ("tokenizer_config.json", "NOTICE"):
        shutil.copyfile(QWEN3_DIR / name, dest / name)

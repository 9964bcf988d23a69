"""What both sides know of encoder (embedding) model directories."""

from __future__ import annotations

from typing import Any, Mapping


def position_offset(config: Mapping[str, Any]) -> int:
    """Rows of an encoder's position table before its first position: XLM-RoBERTa (bge-m3,
    snowflake-arctic-embed2) counts positions from pad_token_id + 1 and never reads the rows
    before; BERT from 0. llama.cpp's converter drops those rows; the runner cuts them."""
    if config.get("model_type") != "xlm-roberta":
        return 0
    return int(config.get("pad_token_id", 1)) + 1

"""The model's tokenizer, as the runner uses it: encode a prompt, decode ids, the end-of-sequence
ids, and the Rust `tokenizers` object under it (text streaming and llguidance read that).

The supervisor renders chat templates itself, so the runner needs none of what mlx-lm's
`TokenizerWrapper` adds (a streaming detokenizer, thinking and tool-call markers, template
hooks). Building those took about 1 s of a runner's 4.5 s start on the 2-core EPYC (mlx-lm's
`load_tokenizer`: its own parse of tokenizer.json, the detokenizer's table, two walks of the
vocabulary); the tokenizer itself is transformers' `AutoTokenizer`, as mlx-lm loads it, so
the ids are the same.

End-of-sequence ids follow mlx-lm's `load`: config.json's `eos_token_id` (one or a list), else
the model module's `TOKENIZER_DEFAULTS`, plus the tokenizer's own `eos_token_id`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(eq=False)  # hashed by identity: llguidance's compilers are cached by it
class Tokenizer:
    hf: Any  # transformers' tokenizer
    eos_token_ids: set[int]

    @property
    def backend(self) -> Any:
        """The Rust `tokenizers.Tokenizer` of a fast tokenizer; None for a slow one."""
        return getattr(self.hf, "backend_tokenizer", None)

    @property
    def bos_token(self) -> str | None:
        return self.hf.bos_token

    @property
    def model_max_length(self) -> int:
        return int(getattr(self.hf, "model_max_length", 0) or 0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.hf)


def load_tokenizer(model_dir: str | Path, config: dict, model: Any = None) -> Tokenizer:
    """The tokenizer in `model_dir`; `config` is its config.json, `model` the loaded model
    (its module may name default end-of-sequence ids)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    eos = config.get("eos_token_id")
    if eos is None and model is not None:
        defaults = getattr(sys.modules.get(type(model).__module__), "TOKENIZER_DEFAULTS", None)
        eos = (defaults or {}).get("eos_token_ids")
    ids = {eos} if isinstance(eos, int) else set(eos or [])
    if hf.eos_token_id is not None:
        ids.add(hf.eos_token_id)
    return Tokenizer(hf, ids)

"""Ollama's `truncate` for chats: an over-long conversation loses its oldest turns so that its
prompt fits the context (server/prompt.go's chatPrompt).

Invariants:
- System messages are never dropped, and neither is anything from the last user message on
  (the turn being answered, and an assistant message the reply continues).
- Turns are dropped oldest first, one message at a time, until the rendered prompt has fewer
  tokens than num_ctx (the runner refuses a prompt of num_ctx tokens or more); if even the
  shortest form is too long it is sent, and the runner's 400 names the lengths.
- Tokens are counted with the model's own tokenizer.json, read here (the `tokenizers`
  library, no MLX, no runner round trip); a model without one is not truncated.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("mlxr.inference")


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer  # the supervisor's only use: count a prompt's tokens

    return Tokenizer.from_file(path)


def token_counter(model_dir: Path, add_special: bool) -> Callable[[str], int] | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = _tokenizer(str(path))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=add_special).ids)


def fit_messages(messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
                 num_ctx: int, model_dir: Path, add_special: bool) -> list[dict[str, Any]]:
    """`messages`, or a shorter copy whose rendered prompt fits `num_ctx` tokens."""
    count = token_counter(model_dir, add_special)
    if count is None or not messages:
        return messages
    if count(render(messages)) < num_ctx:
        return messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    keep_from = users[-1] if users else len(messages) - 1
    kept = messages
    for start in range(1, keep_from + 1):
        kept = [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]
        if count(render(kept)) < num_ctx:
            break
    log.info("truncated a chat to fit num_ctx=%d: dropped %d of %d messages", num_ctx,
             len(messages) - len(kept), len(messages))
    return kept

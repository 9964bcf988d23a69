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
- Most prompts are not encoded at all: every token covers at least one byte of the normalized
  text, besides the few a tokenizer adds itself, so a prompt of fewer bytes than num_ctx
  (less that slack) fits. Encoding costs about 4 us a token.
- Which turns to drop is found by bisection (dropping more never lengthens the prompt), so
  an over-long chat of n messages is encoded about log2(n) times, not n.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("mlxr.inference")

# The most tokens a tokenizer adds that cover no byte of the text: BOS, EOS, a prefix mark.
ADDED_TOKENS_SLACK = 8


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer  # the supervisor's only use: count a prompt's tokens

    return Tokenizer.from_file(path)


class Fits:
    """Whether a text has fewer than `limit` tokens, by a model's tokenizer."""

    def __init__(self, tokenizer: Any, add_special: bool, limit: int):
        self._tokenizer, self._add_special, self.limit = tokenizer, add_special, limit
        self.encoded = 0  # texts that needed encoding (the byte bound did not settle them)

    def __call__(self, text: str) -> bool:
        normalizer = self._tokenizer.normalizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        if len(normalized.encode()) + ADDED_TOKENS_SLACK < self.limit:
            return True
        self.encoded += 1
        ids = self._tokenizer.encode(text, add_special_tokens=self._add_special).ids
        return len(ids) < self.limit


def fits_for(model_dir: Path, add_special: bool, limit: int) -> Fits | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return Fits(_tokenizer(str(path)), add_special, limit)


def fit_messages(messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
                 num_ctx: int, model_dir: Path, add_special: bool) -> list[dict[str, Any]]:
    """`messages`, or a shorter copy whose rendered prompt fits `num_ctx` tokens."""
    fits = fits_for(model_dir, add_special, num_ctx)
    if fits is None or not messages or fits(render(messages)):
        return messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    keep_from = users[-1] if users else len(messages) - 1

    def dropped_before(start: int) -> list[dict[str, Any]]:
        return [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]

    # The fewest oldest messages to drop (start 1 drops one): the smallest start that fits,
    # else keep_from (the shortest form, sent even so).
    lo, hi, start = 1, keep_from, keep_from
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(render(dropped_before(mid))):
            start, hi = mid, mid - 1
        else:
            lo = mid + 1
    kept = dropped_before(start) if keep_from else messages
    log.info("truncated a chat to fit num_ctx=%d: dropped %d of %d messages", num_ctx,
             len(messages) - len(kept), len(messages))
    return kept

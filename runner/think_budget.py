"""A thinking budget (Anthropic's `budget_tokens`): once a request's output holds `budget`
tokens and no end-of-thinking tag yet, the tag's tokens are forced one by one, and the model
answers after it as it would after ending its thoughts itself.

Invariants:
- The output is read from `num_prompt` on in the token history (prompt + output, whatever
  context shifts dropped), so the count is of output tokens only.
- Before the budget is spent, or once the tag is in the output, logits pass untouched; while
  forcing, every token but the tag's next one is -inf, so any sampler picks it.
- With `opening` (the one token that opens a thinking section, where the prompt did not open
  it): output whose first token is anything else is not thinking, and nothing is forced.
- Host logic needs no MLX; `__call__` imports it only to mask.
"""

from __future__ import annotations

from typing import Any


class ThinkBudget:
    __slots__ = ("budget", "tag", "num_prompt", "forced_from", "ended", "opening")

    def __init__(self, budget: int, tag: list[int], num_prompt: int,
                 opening: int | None = None):
        self.budget = budget
        self.tag = tag
        self.num_prompt = num_prompt
        self.forced_from: int | None = None  # output length when forcing began
        self.ended = False  # the model wrote the tag itself within the budget, or never thought
        self.opening = opening

    def next_forced(self, tokens: list[int]) -> int | None:
        """The token to force after `tokens` (the history), or None for a free choice."""
        if self.ended:
            return None
        out = tokens[self.num_prompt:]
        if self.opening is not None and out:  # the first token: did the output open thinking?
            self.ended, self.opening = out[0] != self.opening, None
            if self.ended:
                return None
        if self.forced_from is None:
            if _contains(out[-len(self.tag) - 1:], self.tag):
                self.ended = True
                return None
            if len(out) < self.budget:
                return None
            self.forced_from = len(out)
        done = len(out) - self.forced_from
        return self.tag[done] if done < len(self.tag) else None

    def __call__(self, tokens: list[int], row: Any) -> Any:
        forced = self.next_forced(tokens)
        if forced is None:
            return row
        import mlx.core as mx

        return mx.where(mx.arange(row.shape[-1]) == forced, row, float("-inf"))


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))

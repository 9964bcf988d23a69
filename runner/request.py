"""Per-request state inside the runner. Imports no mlx.

Invariants:
- `SeqStatus` is ordered: everything after PREEMPTED is finished, so `is_finished` is one
  comparison, and `FINISH_REASONS` maps finished statuses to the wire's `done_reason`.
- A `Sequence` is built on the event loop thread with no MLX state (`make_sequence`); the
  engine thread attaches its `sampler` (which holds MLX arrays) and its `text` output when it
  takes the sequence from the inbox, before the scheduler sees it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxr.shared.protocol import Options


class SeqStatus(enum.IntEnum):
    WAITING = 0
    PREFILLING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_CANCELLED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > SeqStatus.PREEMPTED


FINISH_REASONS = {
    SeqStatus.FINISHED_STOPPED: "stop",
    SeqStatus.FINISHED_LENGTH: "length",
    SeqStatus.FINISHED_CANCELLED: "cancel",
    SeqStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class Sequence:
    """One request's tokens and progress. The scheduler counts computed tokens: the KV cache
    holds `num_computed` tokens of `all_tokens`, and the next step computes from there."""

    seq_id: int
    prompt_tokens: list[int]
    options: Options
    max_new_tokens: int
    context_length: int
    logprobs: bool = False
    top_logprobs: int = 0
    return_prompt_tokens: bool = False  # the final chunk carries `prompt_tokens`
    # Context shift (Ollama's `shift`): when the context is full, `dropped` more tokens after
    # the first `num_keep` leave it, and the sequence goes on from the shorter context.
    shift: bool = True
    num_keep: int = 4
    dropped: int = 0
    output_tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    status: SeqStatus = SeqStatus.WAITING
    cancelled: bool = False
    error: Any = None  # why it failed: a message, or the MlxrError to send
    # Set by the handler: where chunks go (its queue's put), and a structured-output grammar
    # (runner.grammar.GrammarProcessor) or None.
    sink: Callable[[Any], None] | None = None
    grammar: Any = None
    think_budget: Any = None  # runner.think_budget.ThinkBudget, or None
    # An image prompt's runner.vision.model.VisionPrompt (never shifted), or None.
    vision: Any = None
    # Attached on the engine thread: runner.sampling.Sampler and runner.outputs.TextOutput.
    sampler: Any = None
    text: Any = None
    # Timings, from time.perf_counter_ns().
    t_arrival_ns: int = field(default_factory=time.perf_counter_ns)
    t_prefill_start_ns: int = 0
    t_first_token_ns: int = 0
    t_last_token_ns: int = 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_tokens(self) -> int:
        """The context's length: what the KV cache holds when it is up to date."""
        return len(self.prompt_tokens) + len(self.output_tokens) - self.dropped

    @property
    def all_tokens(self) -> list[int]:
        """The context: the prompt and the output, less what context shifts dropped."""
        tokens = self.prompt_tokens + self.output_tokens
        if self.dropped:
            keep = self.kept_tokens
            return tokens[:keep] + tokens[keep + self.dropped:]
        return tokens

    @property
    def cache_tokens(self) -> list[int]:
        """What the KV cache is keyed by: `all_tokens`, except that an image's positions
        hold a key made from the image (runner/vision/model.py), not its placeholder id."""
        if self.vision is None:
            return self.all_tokens
        return self.vision.cache_tokens + self.output_tokens

    @property
    def history(self) -> list[int]:
        """The prompt and the whole output, shifts or not: what penalties and grammars read."""
        return self.prompt_tokens + self.output_tokens

    @property
    def kept_tokens(self) -> int:
        """How many tokens at the start of the context a shift keeps (at least one goes)."""
        keep = self.num_prompt if self.num_keep < 0 else self.num_keep
        return max(0, min(keep, self.context_length - 2))

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def done_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


def make_sequence(seq_id: int, tokens: list[int], options: Options, context_length: int,
                  logprobs: bool, top_logprobs: int, sink: Callable[[Any], None],
                  grammar: Any = None, return_prompt_tokens: bool = False,
                  shift: bool = True, think_budget: Any = None, vision: Any = None) -> Sequence:
    """A request's sequence, with no MLX state (it is built on the event loop thread).
    `context_length` is the request's effective num_ctx. Like Ollama, num_predict -1 with
    `shift` is bounded at ten contexts' worth of output; -2 (and -1 without shift) fills the
    context. An image prompt (`vision`) is never shifted."""
    if options.num_predict >= 0:
        max_new = options.num_predict
    elif options.num_predict == -1 and shift:
        max_new = 10 * context_length
    else:
        max_new = context_length
    return Sequence(seq_id=seq_id, prompt_tokens=tokens, options=options,
                    max_new_tokens=max_new, context_length=context_length, logprobs=logprobs,
                    top_logprobs=top_logprobs, sink=sink, grammar=grammar,
                    return_prompt_tokens=return_prompt_tokens,
                    shift=shift and vision is None, num_keep=options.num_keep,
                    think_budget=think_budget, vision=vision)

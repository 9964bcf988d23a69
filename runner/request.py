"""Per-request state inside the runner.

`SeqStatus` is ordered: everything after PREEMPTED is finished, so `is_finished` is one
comparison, and `FINISH_REASONS` maps finished statuses to the wire's `done_reason`.
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
    output_tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    status: SeqStatus = SeqStatus.WAITING
    cancelled: bool = False
    error: str | None = None
    # Host-side state the engine attaches (text stream, sampler, output sink).
    stream: Any = None
    sampler: Any = None
    sink: Callable[[Any], None] | None = None
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
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def done_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

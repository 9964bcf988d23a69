"""Turns a step's results into each request's chunks, on the engine thread. Imports no mlx.

Invariants:
- A sequence's `TextOutput` has fed its stream `output_tokens[:num_fed]` and sent the chunks
  for `output_tokens[:num_sent]` (num_sent <= num_fed); text the stream released and no chunk
  has carried yet waits in `unsent`.
- Text is fed ahead of sending only to answer the scheduler's `stop_matched`; whether a
  sequence is finished is never decided here (see Scheduler._finish_status).
- A stop string is never sent, nor anything after it; a finished sequence's last chunk is
  `done` and carries what the stream still held back (nothing, after a stop string).
- A failed sequence gets one error line instead of a chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxr.shared.errors import MlxrError, RunnerFailed
from mlxr.shared.protocol import Chunk, error_line
from mlxr.runner.request import Sequence, SeqStatus
from mlxr.runner.scheduler import StepPlan, StepResult
from mlxr.runner.text_stream import Decode, TextStream

Sink = Callable[[Any], None]


@dataclass(slots=True)
class TextOutput:
    """One request's text on its way out."""

    stream: TextStream
    num_fed: int = 0
    num_sent: int = 0
    unsent: list[str] = field(default_factory=list)

    def feed(self, tokens: list[int]) -> bool:
        """Feed the stream the output tokens it has not seen; True once a stop string
        appeared."""
        for token in tokens[self.num_fed:]:
            self.unsent.append(self.stream.push(token))
        self.num_fed = len(tokens)
        return self.stream.stopped

    def take(self, tokens: list[int], final: bool) -> tuple[str, list[int]]:
        """The text and the tokens not sent yet; with `final`, also what is held back."""
        self.feed(tokens)
        text = "".join(self.unsent)
        if final:
            text += self.stream.flush()
        self.unsent.clear()
        new_tokens = tokens[self.num_sent:]
        self.num_sent = len(tokens)
        return text, new_tokens


class Outputs:
    def __init__(self, decode: Decode):
        """`decode(ids)`: the tokenizer's decode, skipping special tokens."""
        self._decode = decode

    def open(self, seq: Sequence) -> None:
        seq.text = TextOutput(TextStream(self._decode, seq.options.stop))

    @staticmethod
    def stop_matched(seq: Sequence) -> bool:
        """The scheduler's stop-string check (see Scheduler._finish_status)."""
        return seq.text.feed(seq.output_tokens)

    @staticmethod
    def step_started(plan: StepPlan) -> None:
        now = time.perf_counter_ns()
        for chunk in plan.prefills:
            if not chunk.seq.t_prefill_start_ns:
                chunk.seq.t_prefill_start_ns = now

    def chunks(self, seqs: list[Sequence], result: StepResult) -> list[tuple[Sink, Any]]:
        """The line for each of `seqs` (those the step gave a token or failed), as (sink,
        item) pairs; sequences with nothing new are left out."""
        now = time.perf_counter_ns()
        batch: list[tuple[Sink, Any]] = []
        for seq in seqs:
            if seq.status == SeqStatus.FINISHED_ERROR:
                err = seq.error if isinstance(seq.error, MlxrError) else \
                    RunnerFailed(seq.error or "inference failed")
                batch.append((seq.sink, error_line(err)))
                continue
            if not seq.t_first_token_ns:
                seq.t_first_token_ns = now
            seq.t_last_token_ns = now
            text, new_tokens = seq.text.take(seq.output_tokens, final=seq.is_finished)
            if seq.is_finished:
                chunk = _final_chunk(seq, text, new_tokens)
            else:
                chunk = Chunk(content=text, tokens=new_tokens)
            lp = result.logprobs.get(seq.seq_id)
            if lp is not None:
                chunk.logprobs = [lp]
            if chunk.done or chunk.tokens or chunk.content or chunk.logprobs:
                batch.append((seq.sink, chunk.to_dict()))
        return batch


def _final_chunk(seq: Sequence, text: str, new_tokens: list[int]) -> Chunk:
    first = seq.t_first_token_ns or time.perf_counter_ns()
    start = seq.t_prefill_start_ns or seq.t_arrival_ns
    return Chunk(content=text, done=True, done_reason=seq.done_reason,
                 tokens=new_tokens,
                 prompt_eval_count=seq.num_prompt,
                 prompt_eval_cached_count=seq.num_cached,
                 prompt_eval_duration=max(first - start, 0),
                 eval_count=len(seq.output_tokens),
                 eval_duration=max(seq.t_last_token_ns - first, 0),
                 prompt_tokens=list(seq.prompt_tokens) if seq.return_prompt_tokens else None)

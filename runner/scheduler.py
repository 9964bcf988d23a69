"""Decides what each engine step computes. Imports no mlx.

Invariants:
- A sequence is in exactly one of `waiting`, `prefilling`, `running`, or nowhere (finished).
- `running` sequences have their whole context but the last token in the batch KV cache
  (`num_computed == num_tokens - 1`); each step feeds them that last token.
- Each step has one prefill allowance of prompt tokens, shared by the prefilling sequences in
  the order they were admitted (one chunk each); a sequence is admitted only while the
  allowance is not used up, so short prompts that arrive together start together.
- The allowance is `prefill_chunk`, or `burst_tokens` for a burst: more short prompts waiting
  to start than streams decoding (those that fit start in one step, and a burst goes on at
  `burst_tokens` a step until the prompts it left waiting have started, though the streams
  it started now outnumber them). It keeps a step's tokens (decode tokens + prefill chunks)
  within `step_token_budget`, but never shrinks below `min_prefill_chunk` (no starvation).
- While streams decode and a long prompt (over `long_prompt_tokens` left to compute) is being
  read, the allowance is also sized by time: prefill may add at most `stall_factor` times a
  decode step of as many rows (from measured step times, runner/step_timer.py) to a step, so
  running streams see their inter-token interval grow by at most that factor; once more for
  every prompt waiting to start beyond the next two, so that a queue of long prompts is not
  read at a trickle while a few streams decode. Short prompts are not throttled: getting
  them into the batch at once is what keeps throughput and time to first token up.
- On a GPU (`chunk_align`), a chunk that does not end its prompt ends at a multiple of
  `chunk_align` positions where it can, and the throttle's floor is larger
  (runner/loader.py `scheduler_config`).
- A throttled step decodes alone (no prefill) when its row count's decode time was last
  measured over `probe_after_s` ago, at most one step in `probe_every_s`: under a steady
  stream of prompts no step decodes alone otherwise, and the budget would rest on a step
  time measured with other rows long before.
- KV blocks are accounted by the pool (runner/kv/pool.py): a sequence in flight holds a
  table there from admission until it is released. Admission waits for free blocks; before
  each step every running sequence reserves the position it writes, and one that cannot
  preempts the newest running one (then prefilling ones), which is released and requeued for
  recompute (its computed blocks stay cached, so recompute is mostly a prefix hit). A sequence
  alone that cannot grow ends with an InsufficientMemory error (the server refuses a prompt
  that cannot fit at all before it streams: `fits`).
- After each prefill chunk the pool registers the sequence's full blocks, so a prompt that
  arrives while another with the same prefix is still being read already shares it.
- After a step that failed (out of memory on a GPU), `recover` fails only the sequences that
  step was growing (its prefills, else the newest running one) and requeues the others to
  compute their context again, since the model step lost every cache.
- Finished and cancelled sequences are handed to the model step once, in `StepPlan.release`.
- Whether a sequence is finished is decided in one place, `_finish_status`, as it takes each
  token: EOS, then length (`max_new_tokens`, or the context for a sequence that does not
  shift), then a stop string (the text side's verdict, `stop_matched`). From outside, only
  `cancel` and `abort` end a sequence.
- A sequence that fills its context and may shift drops the older half after its first
  `num_keep` tokens and is requeued, like a preempted one, to recompute the shorter context
  (any architecture, no re-rotation of cached keys); its output goes on where it was.
- A step that releases a requeued sequence admits nothing: the release must run before the
  sequence's new cache is made.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from mlxr.runner.kv.pool import Admission, KVPool
from mlxr.runner.request import Sequence, SeqStatus
from mlxr.shared.errors import InsufficientMemory
from mlxr.runner.step_timer import StepTimer


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    release: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # ended while planning (no memory)

    @property
    def has_compute(self) -> bool:
        return bool(self.decode or self.prefills)


@dataclass(slots=True)
class StepResult:
    """Sampled tokens by sequence id (decode sequences, and the prefill sequence when its last
    chunk ran), optional log-probabilities, and per-sequence failures."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, dict] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerConfig:
    max_running: int = 16
    prefill_chunk: int = 512
    min_prefill_chunk: int = 16
    step_token_budget: int = 2048
    # A burst's allowance: half the step budget, so of sixteen chat turns arriving together
    # the first half gets its first token after one pass of half the size (chat TTFT p50
    # 499/530 -> 362/416 ms, p99 1,187/1,238 -> 977/1,140 ms in alternating pairs against the
    # whole budget; the 16-stream sweep within noise: docs/PERFORMANCE.md).
    burst_tokens: int = 1024
    # Prefill may add 0.35 of a decode step to a step while streams decode and a long prompt
    # is read. Against 0.5, in five alternating pairs of the `long` and `stall` scenarios:
    # the short streams' inter-token p50 with the long prompts 1.27-1.64x their value alone
    # (1.44-1.56x), the stall's longest gap 1.85-3.48 intervals, median 1.91 (1.75-2.68, median
    # 2.35), the 8,000-token prompts' TTFT 10.1-11.1 s (10.2-12.7 s: the short streams end
    # first, and the rest is read unthrottled), and `mixed` at the same arrivals 429 against
    # 434 tok/s (docs/PERFORMANCE.md, "Prompts queued behind a throttle").
    stall_factor: float = 0.35
    long_prompt_tokens: int = 512
    # While prefill is throttled, a step decodes alone when its row count's decode time was
    # last measured over `probe_after_s` ago, at most one step in `probe_every_s`.
    probe_after_s: float = 2.0
    probe_every_s: float = 0.5
    # Where > 0, a chunk that does not end its prompt ends at a multiple of this many
    # positions when it can (see `_chunk_end`). 0 on a CPU; a GPU's runner sets it.
    chunk_align: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool,
                 admit: Callable[[Sequence, Admission], int], eos_token_ids: set[int],
                 stop_matched: Callable[[Sequence], bool] = lambda seq: False,
                 clock: Callable[[], float] = time.monotonic):
        """`admit(seq, admission)` prepares a sequence's cache where the pool placed it and
        returns how many of its tokens are already computed. `stop_matched(seq)` is the text
        side's verdict: True once a stop string appears in the text of `seq.output_tokens`."""
        self.config = config
        self.pool = pool
        self._admit_fn = admit
        self._eos = eos_token_ids
        self._stop_matched = stop_matched
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self._release: list[Sequence] = []
        self._clock = clock
        self.timer = StepTimer(clock=clock)
        self._probed_at = -math.inf
        self.num_preempted = 0  # sequences requeued for want of blocks, since the start
        self._bursting = False  # the last step was a burst's and left prompts waiting

    # -- intake ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True

    def fits(self, num_prompt: int) -> bool:
        """Can a prompt of this many tokens (and its first output token) ever be held?"""
        return self.pool.fits(num_prompt + 1)

    def out_of_memory(self, num_tokens: int) -> InsufficientMemory:
        capacity = self.pool.num_blocks * self.pool.block_size
        return InsufficientMemory(
            f"out of memory: {num_tokens} tokens do not fit in this runner's KV cache, which "
            f"holds {capacity} tokens; use a shorter prompt, a smaller num_ctx or num_predict, "
            "or give the server more memory")

    def recover(self, plan: StepPlan, error: Exception) -> list[Sequence]:
        """After `plan` failed and the model step lost its caches: fail what it was growing,
        requeue the rest of the batch; returns the failed sequences."""
        grown = [c.seq for c in plan.prefills] or self.running[-1:]
        self.pool.reset()  # the arrays are gone: nothing cached is left to share
        failed = self.abort(grown, InsufficientMemory(f"out of memory: {error}")
                            if _is_oom(error) else f"inference failed: {error}")
        for seq in self.prefilling + self.running:
            self._requeue(seq)
        self._release = [s for s in self._release if s.is_finished]  # the caches are gone
        return failed

    def abort(self, seqs: Iterable[Sequence], error: Any) -> list[Sequence]:
        """Finish `seqs` with `error` (those not finished already) and return them; their
        caches are released at the next schedule()."""
        aborted = [seq for seq in seqs if not seq.is_finished]
        for seq in aborted:
            self._finish(seq, SeqStatus.FINISHED_ERROR, error)
        return aborted

    @property
    def in_flight(self) -> list[Sequence]:
        """The sequences with KV state in the model step: running and prefilling."""
        return self.running + self.prefilling

    @property
    def unfinished(self) -> list[Sequence]:
        return list(self.waiting) + self.in_flight

    def _finish(self, seq: Sequence, status: SeqStatus, error: Any = None) -> None:
        """Mark a sequence finished; its cache is released at the next schedule()."""
        if seq.is_finished:
            return
        seq.status = status
        seq.error = error
        self.pool.release(seq.seq_id, seq.cache_tokens, seq.num_computed)
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self._release.append(seq)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._release)

    # -- planning ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._reap_cancelled()
        failed: list[Sequence] = []
        preempted = self._preempt_if_needed(failed)
        plan = StepPlan(release=self._release, decode=list(self.running), failed=failed)
        self._release = []
        burst = self._burst(len(plan.decode))
        allowance = self._prefill_allowance(len(plan.decode), burst)
        requeued = preempted or any(s.status is SeqStatus.PREEMPTED for s in plan.release)
        if not requeued:
            self._admit(allowance, plan.failed)
        for seq in self.prefilling:
            if allowance <= 0:
                break
            end = self._chunk_end(seq, allowance)
            plan.prefills.append(PrefillChunk(seq, seq.num_computed, end))
            allowance -= end - seq.num_computed
        # the burst goes on next step only for the prompts it left waiting
        self._bursting = burst and (bool(self.waiting) or
                                    len(plan.prefills) < len(self.prefilling) or
                                    not all(c.is_last for c in plan.prefills))
        return plan

    def _chunk_end(self, seq: Sequence, allowance: int) -> int:
        """Where `seq`'s chunk of at most `allowance` tokens ends: at its prompt's end, else,
        with `chunk_align`, at the last multiple of it the allowance reaches (past where the
        chunk starts). On a CUDA GPU, MLX's attention for a chunk builds a cuDNN graph for
        each new pair of query and context lengths (49 ms each on an H200): aligned chunks
        of a long prompt repeat the same pairs from one prompt to the next, so their graphs
        are built once (docs/PERFORMANCE.md, "On a GPU", session 22)."""
        end = min(seq.num_computed + allowance, seq.num_tokens)
        align = self.config.chunk_align
        if align and end < seq.num_tokens and end // align * align > seq.num_computed:
            end = end // align * align
        return end

    @property
    def stall_allowance_s(self) -> float:
        """How much time prefill work may add to a step while streams decode: `stall_factor`
        decode steps of this many rows (0 before a decode step is measured), once more for
        every prompt waiting to start beyond the next two in line."""
        rows = len(self.running)
        queued = len(self.waiting) + len(self.prefilling)
        share = max(1, queued - 1)
        return self.config.stall_factor * (self.timer.decode_for(rows) or 0.0) * share

    def _probe_decode(self, num_decode: int) -> bool:
        """Should this step, one whose prefill is throttled, decode alone, so that the time
        of a decode step of this many rows is measured again (at most every
        `probe_every_s`, for a row count measured over `probe_after_s` ago)?"""
        now = self._clock()
        if self.timer.decode_age_s(num_decode) <= self.config.probe_after_s or \
                now - self._probed_at < self.config.probe_every_s:
            return False
        self._probed_at = now
        return True

    def _long_prompt(self, waiting: int = 1) -> bool:
        """Is a long prompt being read (or among the next `waiting` in line)? Judged by the
        whole prompt less its cached prefix, so its last chunks stay throttled too, and a
        chat's next turn (a long history, most of it cached) is not a long prompt."""
        if any(s.num_tokens - s.num_cached > self.config.long_prompt_tokens
               for s in self.prefilling):
            return True
        # One still waiting has no num_cached yet: what admitting it now would find. (As
        # num_cached, it counted its whole history: 16 chat turns of 561 tokens, 458 cached,
        # were read 25-40 tokens a step, where a burst reads them in one.)
        return any(s.num_tokens - self.pool.cached_length(s.cache_tokens) >
                   self.config.long_prompt_tokens
                   for s in itertools.islice(self.waiting, waiting))

    def _prefill_allowance(self, num_decode: int, burst: bool) -> int:
        chunk = self.config.burst_tokens if burst else self.config.prefill_chunk
        size = min(chunk, self.config.step_token_budget - num_decode)
        if num_decode and self._long_prompt():
            if self._probe_decode(num_decode):
                return 0
            context = self.prefilling[0].num_computed if self.prefilling else 0
            timed = self.timer.chunk_for(self.stall_allowance_s, context)
            if timed is not None:
                size = min(size, timed)
        return max(size, self.config.min_prefill_chunk)

    def _burst(self, num_decode: int) -> bool:
        """Are more short prompts waiting to start than streams decoding, or is a burst
        still starting? Then they are read in passes of up to `burst_tokens`, so that they
        start together or nearly: the few streams decoding wait one longer step, and the
        prompts' time to first token is not a string of chunked steps each (p99 at 16
        streams 366/314 -> 306/286 ms in back-to-back pairs, docs/PERFORMANCE.md).

        A burst goes on while the prompts it left waiting start, though the streams its
        first pass started outnumber them: sixteen prompts that arrived together (the first
        often alone, a step ahead) were read 1,024 + 512 + 512 tokens with a decode pass
        between, and the last one's first token came 15-20% later than in two passes.

        With a long prompt among them the chunk size stays, so that a prompt arriving while
        it is read waits one chunk at most."""
        room = self.config.max_running - len(self.running) - len(self.prefilling)
        starting = len(self.prefilling) + min(len(self.waiting), max(room, 0))
        return (starting > num_decode or (self._bursting and starting > 0)) and \
            not self._long_prompt(self.config.max_running)

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self.unfinished if s.cancelled]:
            self._finish(seq, SeqStatus.FINISHED_CANCELLED)

    def _preempt_if_needed(self, failed: list[Sequence]) -> bool:
        """Each running sequence writes one more position this step: reserve it, oldest
        first. When the pool is out of blocks, requeue the newest running sequence, then the
        prefilling ones; a sequence alone that cannot grow fails (into `failed`)."""
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self.pool.reserve(seq.seq_id, seq.num_tokens):
                i += 1
                continue
            preempted = True
            self.num_preempted += 1
            if len(self.running) > 1:
                self._requeue(self.running[-1])  # the newest (perhaps `seq` itself)
            elif self.prefilling:
                self._requeue(self.prefilling[-1])
            else:
                self._finish(seq, SeqStatus.FINISHED_ERROR, self.out_of_memory(seq.num_tokens))
                failed.append(seq)
        return preempted

    def _requeue(self, seq: Sequence) -> None:
        """Take a running or prefilling sequence out to compute its context again."""
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.pool.release(seq.seq_id, seq.cache_tokens, seq.num_computed)
        seq.status = SeqStatus.PREEMPTED
        seq.num_computed = 0
        self._release.append(seq)
        self.waiting.appendleft(seq)

    def _shift(self, seq: Sequence) -> bool:
        """Drop half the context after the kept tokens; False when nothing can go."""
        discard = (seq.num_tokens - seq.kept_tokens) // 2
        if discard < 1:
            return False
        self._requeue(seq)  # the pool keeps what it computed, under the tokens it had
        seq.dropped += discard
        return True

    def _admit(self, allowance: int, failed: list[Sequence]) -> None:
        pending = sum(s.num_tokens - s.num_computed for s in self.prefilling)
        while self.waiting and pending < allowance and \
                self.num_active < self.config.max_running:
            seq = self.waiting[0]
            admission = self.pool.admit(seq.seq_id, seq.cache_tokens, seq.num_tokens)
            if admission is None:
                if not self.num_active:  # it would not fit even alone: it grew too long
                    self._finish(seq, SeqStatus.FINISHED_ERROR,
                                 self.out_of_memory(seq.num_tokens))
                    failed.append(seq)
                    continue
                return
            self.waiting.popleft()
            seq.num_computed = self._admit_fn(seq, admission)
            assert 0 <= seq.num_computed < seq.num_tokens, "a prefix hit must leave a token"
            seq.num_cached = seq.num_computed
            seq.status = SeqStatus.PREFILLING
            self.prefilling.append(seq)
            pending += seq.num_tokens - seq.num_computed

    # -- results -----------------------------------------------------------------------
    def observe(self, plan: StepPlan, elapsed_s: float) -> None:
        """The engine's measurement of how long `plan` took to run."""
        self.timer.observe(len(plan.decode), sum(c.end - c.start for c in plan.prefills),
                           elapsed_s, num_chunks=len(plan.prefills),
                           context=plan.prefills[0].start if plan.prefills else 0)

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Apply a step's results; returns the sequences that received a token or failed."""
        touched: list[Sequence] = list(plan.failed)
        for seq_id, message in result.failed.items():
            seq = next((s for s in self._plan_seqs(plan) if s.seq_id == seq_id), None)
            if seq is not None and not seq.is_finished:
                self._finish(seq, SeqStatus.FINISHED_ERROR, message)
                touched.append(seq)
        for seq in plan.decode:
            if seq.is_finished or seq.seq_id not in result.tokens:
                continue
            seq.num_computed += 1
            self._append(seq, result.tokens[seq.seq_id])
            touched.append(seq)
        for chunk in plan.prefills:
            seq = chunk.seq
            if seq.is_finished or seq not in self.prefilling:
                continue
            seq.num_computed = chunk.end
            self.pool.commit(seq.seq_id, seq.cache_tokens, chunk.end)
            if chunk.is_last:
                self.prefilling.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self._append(seq, result.tokens[seq.seq_id])
                touched.append(seq)
        return touched

    @staticmethod
    def _plan_seqs(plan: StepPlan) -> list[Sequence]:
        return list(plan.decode) + [c.seq for c in plan.prefills]

    def _append(self, seq: Sequence, token: int) -> None:
        if token not in self._eos:  # EOS ends the sequence without becoming output
            seq.output_tokens.append(token)
        status = self._finish_status(seq, token)
        if status is not None:
            self._finish(seq, status)
        elif seq.num_tokens >= seq.context_length and not self._shift(seq):
            self._finish(seq, SeqStatus.FINISHED_LENGTH)

    def _finish_status(self, seq: Sequence, token: int) -> SeqStatus | None:
        """The one place that decides a sequence is done, after it took `token`."""
        if token in self._eos:
            return SeqStatus.FINISHED_STOPPED
        if len(seq.output_tokens) >= seq.max_new_tokens or \
                (seq.num_tokens >= seq.context_length and not seq.shift):
            return SeqStatus.FINISHED_LENGTH
        if self._stop_matched(seq):
            return SeqStatus.FINISHED_STOPPED
        return None


def _is_oom(error: Exception) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or "out of memory" in text or \
        "resource limit" in text or "malloc" in text or "allocat" in text

"""The engine thread: owns the model and every MLX call.

    plan = scheduler.schedule(); result = model_step.run(plan); scheduler.update(plan, result)

HTTP handlers reach it only through `submit`/`cancel` (a thread-safe inbox). Each request's
output goes back to its asyncio queue through one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

from mlxr.shared.blas import loaded_blas
from mlxr.shared.config import RunnerConfig
from mlxr.shared.protocol import Chunk, RunnerStatus, error_line
from mlxr.runner.prefix_cache import PrefixCache
from mlxr.runner.request import Sequence, SeqStatus
from mlxr.runner.sampling import Sampler
from mlxr.runner.scheduler import Scheduler, SchedulerConfig, StepResult
from mlxr.runner.text_stream import TextStream

log = logging.getLogger("mlxr.runner")

Deliver = Callable[[list[tuple[Callable[[Any], None], Any]]], None]


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    max_context: int
    bytes_per_token: int
    vocab_size: int
    capabilities: list[str] = field(default_factory=lambda: ["completion"])
    embedder: Any = None  # runner.embeddings.Embedder, or None: no embeddings


class Engine:
    def __init__(self, config: RunnerConfig, deliver: Deliver):
        """`deliver(batch)` runs on the event loop thread and calls each sink with its item."""
        self.config = config
        self._deliver = deliver
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="mlxr-engine", daemon=True)
        self._stopping = False
        self.state = "loading"
        self.progress = 0.0
        self.error: str | None = None
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.model_step = None
        self.prefix_cache: PrefixCache | None = None
        self._kv_bytes = 0
        self.ready = threading.Event()
        self.blas = loaded_blas()

    # -- called from other threads ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(("add", seq))

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self._inbox.put(("cancel", seq))

    def call(self, fn: Callable[[], Any]) -> "concurrent.futures.Future":
        """Run `fn` on the engine thread between steps (MLX work outside the batch loop, such
        as embeddings); the future gets its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, future)))
        return future

    def status(self) -> RunnerStatus:
        import mlx.core as mx  # memory figures are process-wide reads

        loaded = self.loaded
        sched = self.scheduler
        return RunnerStatus(
            status=self.state, model=self.config.model_name or self.config.model_dir,
            progress=self.progress,
            context_length=min(self.config.context_length, loaded.max_context) if loaded else 0,
            memory=mx.get_active_memory() + mx.get_cache_memory() if loaded else 0,
            kv_bytes=self._kv_bytes, active=sched.num_active if sched else 0,
            waiting=sched.num_waiting if sched else 0, error=self.error,
            capabilities=loaded.capabilities if loaded else [],
            blas_path=self.blas.path or "", blas_config=self.blas.config)

    # -- the engine thread --------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._load()
        except Exception as exc:
            log.exception("model load failed")
            self.error = f"failed to load model: {exc}"
            self.state = "error"
            self.ready.set()
            return
        self.state = "ready"
        self.progress = 1.0
        self.ready.set()
        try:
            while not self._stopping:
                self._drain(block=not self.scheduler.has_work)
                if self._stopping:
                    break
                if self.model_step is not None:  # None: an encoder, served by Engine.call only
                    self._step()
        except BaseException as exc:  # a bug in the loop itself: never leave clients hanging
            log.exception("engine loop failed; exiting so the supervisor restarts the runner")
            self._fail_everything(f"runner engine failed: {exc}")
            time.sleep(0.5)  # let the event loop write the error lines
            os._exit(70)

    def _fail_everything(self, message: str) -> None:
        sched = self.scheduler
        seqs = list(sched.waiting) + sched.running + sched.prefilling
        self._deliver([(s.sink, error_line(message, 500)) for s in seqs if s.sink])
        self.state, self.error = "error", message

    def _load(self) -> None:
        from mlx_lm.utils import load

        from mlxr.runner.embed.embeddings import LMEmbedder, is_encoder_dir, load_encoder_embedder
        from mlxr.runner.model_step import ModelStep

        if is_encoder_dir(self.config.model_dir):
            emb = load_encoder_embedder(self.config.model_dir, self.config.context_length)
            self.loaded = LoadedModel(emb.model, emb.tokenizer, emb.max_length, 1,
                                      emb.vocab_size, ["embedding"], emb)
            # Never fed (the server refuses completions for an embedding-only model) and no
            # model_step: the loop only serves Engine.call.
            self.scheduler = Scheduler(SchedulerConfig(), admit=lambda seq: 0, eos_token_ids=set())
            return
        model, tokenizer, model_config = load(self.config.model_dir, return_config=True)
        self.progress = 0.9
        max_context = int(model_config.get("max_position_embeddings")
                          or getattr(tokenizer, "model_max_length", 0) or 1 << 20)
        self.prefix_cache = PrefixCache(max_bytes=self.config.prefix_cache_bytes)
        step = ModelStep(model, self.prefix_cache, self._token_text_fn(tokenizer))
        log.info("blas: %s", self.blas.describe())
        log.info("decode head: %s", "BLAS matrix-vector products for 1-2 rows"
                 if step.host_head is not None else "MLX")
        bytes_per_token = _kv_bytes_per_token(model)
        vocab_size = int(model_config.get("vocab_size") or len(tokenizer._tokenizer))
        embedder = None if step.split.body is None else LMEmbedder.make(
            model, step.split.body, tokenizer, min(self.config.context_length, max_context),
            vocab_size)
        self.loaded = LoadedModel(model, tokenizer, max_context, bytes_per_token, vocab_size,
                                  embedder=embedder)
        budget_bytes = self.config.kv_cache_bytes or int(psutil.virtual_memory().available * 0.5)
        self.model_step = step
        self.scheduler = Scheduler(
            SchedulerConfig(max_running=self.config.num_parallel,
                            prefill_chunk=self.config.prefill_chunk,
                            step_token_budget=self.config.step_token_budget,
                            kv_token_budget=max(budget_bytes // max(bytes_per_token, 1), 1)),
            admit=step.admit, eos_token_ids=set(tokenizer.eos_token_ids))

    @staticmethod
    def _token_text_fn(tokenizer) -> Callable[[int], str]:
        decode = _fast_decode(tokenizer, skip_special=False)
        return lambda token: decode([token])

    def _drain(self, block: bool) -> None:
        """Take everything in the inbox; wait for the first message only when idle."""
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while kind != "stop":
            if kind == "add" and not item.cancelled:
                self.scheduler.add(item)
            elif kind == "cancel":
                self.scheduler.cancel(item)
            elif kind == "call":
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:
                        future.set_exception(exc)
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        for chunk in plan.prefills:
            if not chunk.seq.t_prefill_start_ns:
                chunk.seq.t_prefill_start_ns = time.perf_counter_ns()
        started = time.perf_counter()
        try:
            result = self.model_step.run(plan)
            self.scheduler.observe(plan, time.perf_counter() - started)
        except Exception as exc:  # out of memory, or a bug: fail this step's requests only
            log.exception("engine step failed")
            involved = list(plan.decode) + [c.seq for c in plan.prefills]
            result = StepResult(failed={s.seq_id: f"inference failed: {exc}" for s in involved})
            self.model_step.reset()
            for seq in list(self.scheduler.running):
                if seq not in involved:
                    involved.append(seq)
                    result.failed[seq.seq_id] = f"inference failed: {exc}"
            self.scheduler.running = [s for s in self.scheduler.running if s not in involved]
            for seq in involved:
                self.scheduler.finish(seq, SeqStatus.FINISHED_ERROR, result.failed[seq.seq_id])
            self._emit(involved, result)
            return
        touched = self.scheduler.update(plan, result)
        self._kv_bytes = self.model_step.kv_bytes() + self.prefix_cache.nbytes
        self._emit(touched, result)

    def _emit(self, seqs: list[Sequence], result: StepResult) -> None:
        now = time.perf_counter_ns()
        batch: list[tuple[Callable[[Any], None], Any]] = []
        for seq in seqs:
            if seq.status == SeqStatus.FINISHED_ERROR:
                batch.append((seq.sink, error_line(seq.error or "inference failed", 500)))
                continue
            if not seq.t_first_token_ns:
                seq.t_first_token_ns = now
            seq.t_last_token_ns = now
            stream: TextStream = seq.stream
            new_tokens = seq.output_tokens[stream.num_tokens:]
            text = "".join([stream.push(t) for t in new_tokens])
            if stream.stopped and not seq.is_finished:
                self.scheduler.finish(seq, SeqStatus.FINISHED_STOPPED)
            if seq.is_finished:
                text += stream.flush()
                chunk = self._final_chunk(seq, text, new_tokens)
            else:
                chunk = Chunk(content=text, tokens=new_tokens)
            lp = result.logprobs.get(seq.seq_id)
            if lp is not None:
                chunk.logprobs = [lp]
            if chunk.done or chunk.tokens or chunk.content or chunk.logprobs:
                batch.append((seq.sink, chunk.to_dict()))
        if batch:
            self._deliver(batch)

    @staticmethod
    def _final_chunk(seq: Sequence, text: str, new_tokens: list[int]) -> Chunk:
        first = seq.t_first_token_ns or time.perf_counter_ns()
        start = seq.t_prefill_start_ns or seq.t_arrival_ns
        return Chunk(content=text, done=True, done_reason=seq.done_reason,
                     tokens=new_tokens,
                     prompt_eval_count=seq.num_prompt,
                     prompt_eval_cached_count=seq.num_cached,
                     prompt_eval_duration=max(first - start, 0),
                     eval_count=len(seq.output_tokens),
                     eval_duration=max(seq.t_last_token_ns - first, 0))

    # -- request preparation (any thread) ------------------------------------------------
    def make_sequence(self, seq_id: int, tokens: list[int], options, logprobs: bool,
                      top_logprobs: int, sink: Callable[[Any], None],
                      grammar: Any = None) -> Sequence:
        """`grammar`: a runner.grammar.GrammarProcessor for structured output, or None."""
        loaded = self.loaded
        num_ctx = min(options.num_ctx or self.config.context_length, loaded.max_context)
        max_new = options.num_predict if options.num_predict >= 0 else num_ctx
        seq = Sequence(seq_id=seq_id, prompt_tokens=tokens, options=options,
                       max_new_tokens=max_new, context_length=num_ctx, logprobs=logprobs,
                       top_logprobs=top_logprobs, sink=sink)
        seq.sampler = Sampler.from_options(options, num_ctx)
        if grammar is not None:
            seq.sampler.processors.append(grammar)  # last: it masks after penalties and bias
        seq.stream = TextStream(_fast_decode(loaded.tokenizer, skip_special=True), options.stop)
        return seq


def _fast_decode(tokenizer, skip_special: bool) -> Callable[[list[int]], str]:
    """The Rust tokenizer's decode when there is one (no Python overhead per call)."""
    inner = getattr(getattr(tokenizer, "_tokenizer", None), "_tokenizer", None)
    if inner is not None and hasattr(inner, "decode"):
        return lambda ids: inner.decode(ids, skip_special_tokens=skip_special)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)


def _kv_bytes_per_token(model) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[1]]), cache=caches)
    total = 0
    for c in caches:
        state = c.state
        if isinstance(state, tuple) and len(state) >= 2 and hasattr(state[0], "shape"):
            keys, values = state[0], state[1]
            total += (keys.nbytes + values.nbytes) // max(keys.shape[2], 1)
    return max(total, 1)

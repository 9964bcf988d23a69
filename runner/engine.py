"""The engine thread: owns the model and every MLX call. Its loop, one step at a time:

    plan = scheduler.schedule(); result = model_step.run(plan)
    deliver(outputs.chunks(scheduler.update(plan, result), result))

Invariants:
- Only this thread calls MLX or changes the scheduler, the model step and the sequences in
  them. HTTP handlers reach it only through `submit`/`cancel`/`call` (a thread-safe inbox) and
  read plain figures it publishes (`state`, `memory_bytes`, `kv_bytes`, the scheduler's counts).
- A sequence gets its sampler (MLX arrays) and its text output here, when it leaves the inbox,
  and drops its sampler here when the model step has released it.
- An image prompt whose images are not all in the cached prefix is encoded first, a stage
  (one image-tower block) per loop turn between model steps, and joins the scheduler when its
  embeddings are ready (runner/vision/model.py).
- Each step's lines go to the event loop in one `deliver` call. Every request that is not
  cancelled ends with one final line: a `done` chunk, or an error line when its step fails
  (the scheduler aborts what the model step held) or the loop itself fails (then the process
  exits).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator

import mlx.core as mx

from mlxr.shared.blas import loaded_blas
from mlxr.shared.config import RunnerConfig
from mlxr.shared.errors import MlxrError, RunnerFailed
from mlxr.shared.protocol import RunnerStatus, error_line
from mlxr.runner import heap
from mlxr.runner.loader import LoadedModel, freeze_heap, load_model, make_scheduler
from mlxr.runner.outputs import Outputs
from mlxr.runner.request import Sequence
from mlxr.runner.sampling import Sampler
from mlxr.runner.scheduler import Scheduler, StepResult
from mlxr.runner.text_stream import output_decode

log = logging.getLogger("mlxr.runner")

# Idle this long (no message, nothing to run), the engine gives the C heap's freed buffers back
# to the system (runner/heap.py); it is also how long an idle wait lasts before re-checking.
IDLE_S = 0.5

Deliver = Callable[[list[tuple[Callable[[Any], None], Any]]], None]


class Engine:
    def __init__(self, config: RunnerConfig, deliver: Deliver):
        """`deliver(batch)` runs on the event loop thread and calls each sink with its item."""
        self.config = config
        self._deliver = deliver
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="mlxr-engine", daemon=True)
        self._stopping = False
        self._heap_in_use = False  # steps ran since the C heap last gave memory back
        self.state = "loading"
        self.progress = 0.0
        self.error: str | None = None
        self.error_kind: str | None = None
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.outputs: Outputs | None = None
        self.memory_bytes = 0
        self.kv_bytes = 0
        self._bytes_per_token = 0
        self.pool_figures: dict[str, Any] = {}  # RunnerStatus's kv_block* fields
        self._kv_published_at = float("-inf")
        self.blas = loaded_blas()
        # Rank 0 of a distributed runner: sends each step to the other ranks before running
        # it (runner/distributed/lockstep.py); None for a runner alone.
        self.leader: Any = None
        # The steps run on the CPU's cores: side work beside them (an image's preparation)
        # goes through `call`, between two steps, rather than into a thread that takes a
        # core from them (runner/server.py).
        self.on_cpu = mx.default_device() == mx.cpu
        # Image prompts whose images are being encoded, a stage per loop turn, before they
        # reach the scheduler: (sequence, its stages), in arrival order.
        self._encoding: collections.deque[tuple[Sequence, Iterator[None]]] = \
            collections.deque()

    # -- called from other threads ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(("add", seq))

    def check_fits(self, num_prompt: int) -> None:
        """Refuse (InsufficientMemory, 507) a prompt the KV cache could never hold, before
        its stream starts. Reads plain figures only: safe from the event loop."""
        if self.scheduler is not None and not self.scheduler.fits(num_prompt):
            raise self.scheduler.out_of_memory(num_prompt + 1)

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
        loaded = self.loaded
        sched = self.scheduler
        return RunnerStatus(
            status=self.state, model=self.config.model_name or self.config.model_dir,
            progress=self.progress,
            context_length=min(self.config.context_length, loaded.max_context) if loaded else 0,
            memory=self.memory_bytes if loaded else 0,
            kv_bytes=self.kv_bytes, **self.pool_figures,
            active=sched.num_active if sched else 0,
            waiting=(sched.num_waiting if sched else 0) + len(self._encoding),
            error=self.error,
            error_kind=self.error_kind,
            capabilities=loaded.capabilities if loaded else [],
            blas_path=self.blas.path or "", blas_config=self.blas.config,
            sharding=loaded.sharding if loaded else "",
            ranks=self.leader.channel.group.size() if self.leader else 1,
            weights=loaded.weights if loaded else "")

    # -- the engine thread --------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._load()
        except Exception as exc:
            log.exception("model load failed")
            self.error = f"failed to load model: {exc}"
            self.error_kind = exc.kind if isinstance(exc, MlxrError) else None
            self.state = "error"
            return
        self.state = "ready"
        self.progress = 1.0
        try:
            while not self._stopping:
                idle = not (self.scheduler.has_work or self._encoding)
                if idle and self.leader is not None:
                    self.leader.park()  # the other ranks sleep until the next step
                self._drain(block=idle)
                if self._stopping:
                    break
                if self._encoding:
                    self._encode_stage()
                if self.loaded.model_step is not None:
                    self._step()
                else:  # an encoder: the inbox's calls are all its work
                    self._read_memory()
                self._heap_in_use |= not idle
            if self.leader is not None:
                self.leader.stop()  # the other ranks exit too
        except BaseException as exc:  # a bug in the loop itself: never leave clients hanging
            log.exception("engine loop failed; exiting so the supervisor restarts the runner")
            self._fail_everything(f"runner engine failed: {exc}")
            time.sleep(0.5)  # let the event loop write the error lines
            os._exit(70)

    def _load(self) -> None:
        from mlxr.runner.distributed.lockstep import Leader, join_group

        group = join_group(self.config)
        loaded = load_model(self.config, self.blas.describe(), self._set_progress, group)
        if group is not None:
            self.leader = Leader(group, loaded.model_step, self.config)
        self.outputs = Outputs(output_decode(loaded.tokenizer))
        self.scheduler = make_scheduler(self.config, loaded, self.outputs.stop_matched,
                                        self.leader)
        self._bytes_per_token = loaded.bytes_per_token
        if loaded.model_step is not None:
            self._publish_kv(loaded.model_step)  # the pool's size is known before any request
        self._read_memory()
        freeze_heap()
        self.loaded = loaded

    def _set_progress(self, progress: float) -> None:
        self.progress = progress

    def _read_memory(self) -> None:
        self.memory_bytes = mx.get_active_memory() + mx.get_cache_memory()

    def _drain(self, block: bool) -> None:
        """Take what is in the inbox, up to and including one call (a call is side work that
        shares the turn with a step: two in one turn would hold the streams twice as long);
        wait for the first message only when idle."""
        try:
            kind, item = self._inbox.get(timeout=IDLE_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block and self._heap_in_use:  # idle for IDLE_S: give freed buffers back
                self._heap_in_use = False
                heap.release_freed()
            return
        while kind != "stop":
            if kind == "add" and not item.cancelled:
                self._accept(item)
            elif kind == "cancel":
                self.scheduler.cancel(item)
            elif kind == "call":
                fn, future = item
                self._heap_in_use = True  # an embedding batch, an image's side work
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:
                        future.set_exception(exc)
                    return
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, seq: Sequence) -> None:
        """Give a new sequence its sampler (MLX arrays: made here, on this thread) and its
        text output, and queue it."""
        try:
            seq.sampler = Sampler.from_options(seq.options, seq.context_length)
        except Exception as exc:  # fail this request, not the loop
            log.exception("sampler setup failed")
            self._deliver([(seq.sink, error_line(RunnerFailed(f"inference failed: {exc}")))])
            return
        if seq.think_budget is not None:
            seq.sampler.processors.append(seq.think_budget)
        if seq.grammar is not None:
            seq.sampler.processors.append(seq.grammar)  # last: it masks after penalties and bias
        self.outputs.open(seq)
        vision = seq.vision
        if vision is not None and not vision.encoded and vision.image_positions and \
                self.scheduler.pool.cached_length(seq.cache_tokens) <= \
                vision.image_positions[-1]:
            self._encoding.append((seq, self.loaded.vision.encode_stages(vision)))
            return
        self.scheduler.add(seq)

    def _encode_stage(self) -> None:
        """Stages of the first image prompt's encoding: all of it when nothing else runs (no
        stream to keep waiting), else as many as fit in the time a prefill chunk may add to a
        decode step (the scheduler's `stall_allowance_s`), guessing each next
        stage costs what the last one did; at least one. A finished (or cancelled) one joins
        the scheduler."""
        seq, stages = self._encoding[0]
        budget = self.scheduler.stall_allowance_s
        started = last = time.perf_counter()
        try:
            while True:
                if seq.cancelled or next(stages, StopIteration) is StopIteration:
                    self._encoding.popleft()
                    self.scheduler.add(seq)  # a cancelled one is reaped there
                    return
                now = time.perf_counter()
                if self.scheduler.has_work and (now - started) + (now - last) > budget:
                    return
                last = now
        except Exception as exc:  # this request fails, not the loop
            log.exception("image encoding failed")
            self._encoding.popleft()
            self._deliver([(seq.sink, error_line(RunnerFailed(f"image encoding failed: "
                                                              f"{exc}")))])

    def _step(self) -> None:
        model_step = self.loaded.model_step
        plan = self.scheduler.schedule()
        self.outputs.step_started(plan)
        started = time.perf_counter()
        runs = self.leader or model_step  # a distributed runner's rank 0 tells the others
        try:
            result = runs.run(plan)
        except Exception as exc:  # out of memory (a GPU's allocator), or a bug
            log.exception("engine step failed")
            runs.reset()  # every cache is gone: the step's growth fails, the rest recompute
            mx.clear_cache()
            result = StepResult()
            touched = plan.failed + self.scheduler.recover(plan, exc)
        else:
            self.scheduler.observe(plan, time.perf_counter() - started)
            touched = self.scheduler.update(plan, result)
        for seq in plan.release:
            if seq.is_finished:
                seq.sampler = None  # its MLX arrays are freed here, not where the request ends
        self._publish_kv(model_step)
        self._read_memory()
        batch = self.outputs.chunks(touched, result)
        if batch:
            self._deliver(batch)
            if any(len(seq.output_tokens) == 1 for seq in touched):
                # Hand the interpreter lock to the event loop, which `_deliver` just woke, so
                # that a first token is written now: else it waits for this thread's next
                # release (up to the 5 ms switch interval) and reached the supervisor 3.1-3.4
                # ms after it was ready, not 0.3. Only for first tokens: for every token the
                # step waits for the write, and one stream's tokens came slower
                # (docs/PERFORMANCE.md, "A first token's way out").
                time.sleep(0)

    def _publish_kv(self, model_step) -> None:
        """The KV figures /v1/status reports: they walk every run, so at most every 0.2 s
        while busy, and after the last step."""
        now = time.monotonic()
        if self.scheduler.has_work and now - self._kv_published_at < 0.2:
            return
        self._kv_published_at = now
        pool = self.scheduler.pool
        self.kv_bytes = model_step.kv_bytes()
        self.pool_figures = {
            "kv_block_size": pool.block_size, "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.used_blocks, "kv_blocks_cached": pool.cached_blocks,
            "kv_block_bytes": self._bytes_per_token * pool.block_size,
            "kv_live_bytes": model_step.kv_live_bytes(),
            "prefix_hit_rate": pool.hits / pool.queried if pool.queried else 0.0,
            "preemptions": self.scheduler.num_preempted}

    def _fail_everything(self, message: str) -> None:
        seqs = self.scheduler.abort(self.scheduler.unfinished, message)
        seqs += [seq for seq, _ in self._encoding]
        self._encoding.clear()
        self._deliver([(s.sink, error_line(RunnerFailed(message))) for s in seqs if s.sink])
        self.state, self.error = "error", message

"""Owns the runners: loading, leases (reference counts), keep-alive expiry, eviction.

Invariants:
- At most one runner per model name is in the table, and a model is never loaded twice at
  once: loads of one name are serialized by that name's lock, and placement decisions (which
  runners to evict, then spawning) by one global lock.
- A slot with `refs > 0` is never stopped by expiry or eviction; eviction of a busy runner marks
  it `draining` (no new leases), and it is removed when its last lease is released.
- A slot leaves the table exactly once (`_remove`): on expiry, eviction, unload, or when its
  process exits on its own. Waiters are woken on every change.
- Queue depth = requests waiting for a runner + requests beyond `num_parallel` per runner;
  a request that would queue past `max_queue` is refused (ServerBusy) before it waits.
- A model that keeps failing to load is refused without spawning (failures.py); a
  successful load or `unload` forgets its failures.
- After `abort_all` (shutdown) no lease is given out; open streams end with its error.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from mlxr.shared.config import Settings
from mlxr.shared.errors import InsufficientMemory, MlxrError, ServerBusy
from mlxr.shared.exits import describe_exit
from mlxr.shared.protocol import RunnerStatus
from mlxr.supervisor.runners import memory
from mlxr.supervisor.runners.failures import LoadFailures

log = logging.getLogger("mlxr.manager")

STATUS_INTERVAL_S = 5.0  # live memory is re-read this often, and after requests end
REFRESH_AFTER_REQUEST_S = 1.0  # ...but not more often than this per runner
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"
SHUTTING_DOWN = "server shutting down"


class Runner(Protocol):
    @property
    def alive(self) -> bool: ...
    async def status(self) -> RunnerStatus: ...
    async def wait_exit(self) -> int: ...
    async def stop(self) -> None: ...
    def stderr_tail(self) -> str: ...
    def abort_streams(self, make_error: Callable[[], MlxrError]) -> int: ...


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


@dataclass(slots=True)
class LoadSpec:
    """What to load: the model's directory and the figures placement needs."""
    name: str
    model_dir: Path
    estimate_bytes: int
    context_length: int
    kv_cache_bytes: int = 0
    min_kv_bytes: int = 0  # the KV budget may shrink to this (one full context) to fit
    digest: str = ""
    info: Any = None  # the store's record, for /api/ps
    # A distributed runner: every rank's host (rank 0 first), how many are on this host (the
    # figures above are theirs: kv_cache_bytes / local_ranks is each one's pool), the split.
    hosts: tuple | None = None
    local_ranks: int = 1
    sharding: str = "auto"


@dataclass(slots=True, eq=False)
class Slot:
    spec: LoadSpec
    runner: Any
    keep_alive_s: float
    last_used: float
    load_duration_s: float
    refs: int = 0
    idle_since: float | None = None
    memory_bytes: int = 0
    context_length: int = 0
    draining: bool = False
    removed: bool = False
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    stop_task: asyncio.Future | None = None
    refreshed_at: float = float("-inf")  # time.monotonic() of the last /v1/status read
    blas: dict[str, str] = field(default_factory=dict)  # what the runner says serves its sgemm
    weights: str = ""  # what the runner holds its weights as (RunnerStatus.weights)
    kv: dict[str, Any] = field(default_factory=dict)  # the runner's KV block pool figures
    active: int = 0  # sequences the runner is running, and waiting for room, when last read
    waiting: int = 0
    sharding: str = ""  # a distributed runner's split ("tensor", "pipeline")
    pool_bytes: int = 0  # the KV pool the runner made (its /v1/status), once read

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def estimate_bytes(self) -> int:
        """What placement charges this runner (before its live memory): the load's estimate,
        with the KV part replaced by the pool the runner reports once it has made it. The
        estimate reads config.json; the runner measures its cache's real bytes per token
        (sliding windows, latent attention, a shard's share), so the pool is the truth."""
        if self.pool_bytes <= 0:
            return self.spec.estimate_bytes
        return self.spec.estimate_bytes - self.spec.kv_cache_bytes + self.pool_bytes

    def expires_at(self, now: float) -> float | None:
        """Clock time at which this runner unloads; None while forever."""
        if self.keep_alive_s < 0:
            return None
        start = self.idle_since if self.refs == 0 and self.idle_since is not None else now
        return start + self.keep_alive_s


@dataclass(slots=True, eq=False)
class Lease:
    slot: Slot
    load_duration_s: float
    released: bool = False

    @property
    def runner(self) -> Any:
        return self.slot.runner


class RunnerManager:
    def __init__(self, settings: Settings, factory: Callable[[LoadSpec], Awaitable[Runner]], *,
                 clock: Clock | None = None,
                 available_memory: Callable[[], int] = memory.available_bytes):
        self.settings = settings
        self._factory = factory
        self._clock = clock or MonotonicClock()
        self._available = available_memory
        self._slots: dict[str, Slot] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._place_lock = asyncio.Lock()
        self._loads: dict[str, asyncio.Task] = {}
        self._pending: collections.Counter[str] = collections.Counter()
        self._waiting = 0
        self._changed = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._watchers: set[asyncio.Task] = set()  # a subset of _background
        self._housekeeper: asyncio.Task | None = None
        self._failures = LoadFailures(settings.max_load_failures,
                                      settings.load_failure_cooldown_s, self._clock)
        self._closing: Callable[[], MlxrError] | None = None

    # -- public API ----------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        return list(self._slots.values())

    def now(self) -> float:
        return self._clock.now()

    def queue_depth(self) -> int:
        over = sum(max(0, s.refs - self.settings.num_parallel) for s in self._slots.values())
        return self._waiting + over

    async def acquire(self, spec: LoadSpec, keep_alive_s: float) -> Lease:
        """A lease on a ready runner for `spec`, loading (and evicting) as needed."""
        if self._closing is not None:
            raise self._closing()
        slot = self._usable(spec)
        if slot is not None and slot.refs < self.settings.num_parallel:
            return self._lease(slot, keep_alive_s, 0.0)
        if self.queue_depth() >= self.settings.max_queue:
            raise ServerBusy(BUSY_MESSAGE)
        self._waiting += 1
        try:
            while True:
                slot = self._usable(spec)
                if slot is not None:
                    return self._lease(slot, keep_alive_s, 0.0)
                task = self._loads.get(spec.name)
                if task is None:
                    async with self._locks[spec.name]:
                        if self._usable(spec) is not None or spec.name in self._loads:
                            continue
                        old = self._slots.get(spec.name)
                        if old is not None:
                            await self._retire(old)
                            continue
                        self._failures.check(spec.name, spec.digest)
                        # The load runs on its own, so a client that goes away mid-load
                        # does not kill it; the runner then idles out by keep-alive.
                        task = asyncio.ensure_future(self._load(spec, keep_alive_s))
                        self._loads[spec.name] = task
                        task.add_done_callback(lambda _t, n=spec.name: self._loads.pop(n, None))
                # Counted as a promised user until leased, so the new runner is neither
                # evicted nor expired in the moment between its load and our lease.
                self._pending[spec.name] += 1
                try:
                    slot = await asyncio.shield(task)
                    if not slot.removed:
                        return self._lease(slot, keep_alive_s, slot.load_duration_s)
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if (self._closing is None or not task.cancelled()
                            or (current is not None and current.cancelling())):
                        raise
                    raise self._closing() from None  # the load was cancelled by abort_all
                finally:
                    self._pending[spec.name] -= 1
        finally:
            self._waiting -= 1

    def release(self, lease: Lease) -> None:
        """Give a lease back. Idempotent. May unload at once (keep_alive 0, draining)."""
        if lease.released:
            return
        lease.released = True
        slot = lease.slot
        slot.refs -= 1
        slot.last_used = self._clock.now()
        if slot.refs > 0 or slot.removed:
            return
        slot.idle_since = slot.last_used
        if self._pending[slot.name]:
            pass  # a request is about to take it: unloading now would only reload it
        elif slot.draining or slot.keep_alive_s == 0:
            self._remove(slot, "keep_alive 0" if not slot.draining else "evicted")
        elif time.monotonic() - slot.refreshed_at >= REFRESH_AFTER_REQUEST_S:
            self._spawn(self._refresh(slot))
        self._notify()

    async def unload(self, name: str) -> bool:
        """Unload now if idle, else as soon as its last request ends (keep_alive becomes 0)."""
        self._failures.clear(name)  # unloading also ends a crash loop
        slot = self._slots.get(name)
        if slot is None:
            return False
        slot.keep_alive_s = 0.0
        if slot.refs == 0:
            await self._remove(slot, "unload requested")
        return True

    async def expire_due(self) -> None:
        """Unload idle runners whose keep-alive has passed."""
        now = self._clock.now()
        for slot in list(self._slots.values()):
            expires = slot.expires_at(now)
            if not self._busy(slot) and expires is not None and expires <= now:
                await self._remove(slot, "keep-alive expired")

    async def refresh_memory(self) -> None:
        await asyncio.gather(*(self._refresh(s) for s in list(self._slots.values())))

    def start(self) -> None:
        if self._housekeeper is None:
            self._housekeeper = asyncio.ensure_future(self._housekeeping())

    def abort_all(self, make_error: Callable[[], MlxrError]) -> int:
        """Shutdown: refuse new leases and end every open stream (and load waiters) with
        `make_error()`; returns the number of streams ended."""
        self._closing = make_error
        for task in list(self._loads.values()):
            task.cancel()
        return sum(s.runner.abort_streams(make_error) for s in list(self._slots.values()))

    async def close(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.cancel()
        for task in list(self._loads.values()):
            task.cancel()
        await asyncio.gather(*(self._remove(s, "shutdown") for s in list(self._slots.values())),
                             return_exceptions=True)
        for task in self._watchers:  # a runner that never reports its exit must not hang us
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # -- loading and placement -------------------------------------------------------------

    def _usable(self, spec: LoadSpec) -> Slot | None:
        slot = self._slots.get(spec.name)
        # Compare with the context asked for at load, not the runner's (possibly capped) figure,
        # or a model whose maximum is below the request would reload forever.
        if (slot is None or slot.draining or slot.removed or not slot.runner.alive
                or slot.spec.context_length < spec.context_length):
            return None
        return slot

    def _lease(self, slot: Slot, keep_alive_s: float, load_duration_s: float) -> Lease:
        slot.refs += 1
        slot.keep_alive_s = keep_alive_s  # the latest request's keep_alive wins (as Ollama)
        slot.last_used = self._clock.now()
        slot.idle_since = None
        self._notify()
        return Lease(slot, load_duration_s)

    async def _retire(self, slot: Slot) -> None:
        """Wait for a slot that cannot serve this request (draining, dead, too small a
        context) to leave the table, draining it if it is busy."""
        if slot.refs == 0 or not slot.runner.alive:
            await self._remove(slot, "reload")
            return
        marked = not slot.draining
        slot.draining = True
        try:
            await slot.gone.wait()
        finally:
            if marked and not slot.removed:
                slot.draining = False  # we gave up waiting: let it serve again

    async def _load(self, spec: LoadSpec, keep_alive_s: float) -> Slot:
        async with self._place_lock:
            await self._make_room(spec)
            start = self._clock.now()
            log.info("loading %s (estimated %.2f GiB)", spec.name, spec.estimate_bytes / memory.GIB)
            try:
                runner = await self._factory(spec)
            except MlxrError as err:
                self._failures.record(spec.name, spec.digest, err)
                raise
            self._failures.clear(spec.name)
            now = self._clock.now()
            slot = Slot(spec=spec, runner=runner, keep_alive_s=keep_alive_s, last_used=now,
                        load_duration_s=now - start,
                        idle_since=now, context_length=spec.context_length)
            self._slots[spec.name] = slot
            self._watchers.add(self._spawn(self._watch(slot)))
            await self._refresh(slot)
            log.info("loaded %s in %.2fs (%.2f GiB)", spec.name, slot.load_duration_s,
                     slot.memory_bytes / memory.GIB)
            self._notify()
            return slot

    async def _make_room(self, spec: LoadSpec) -> None:
        """Evict until `spec` fits by count and memory; wait for busy victims to drain."""
        while True:
            others = [s for s in self._slots.values() if s.name != spec.name]
            available = self._available()
            margin = self.settings.memory_margin_bytes
            victims = memory.plan_eviction(spec.estimate_bytes, others, available=available,
                                           margin=margin,
                                           max_loaded=self.settings.max_loaded_models,
                                           busy=self._busy)
            if victims is None and self._shrink_kv(spec, others, available, margin):
                continue
            if victims is None:
                usable = memory.usable_bytes(others, available, margin)
                least = spec.estimate_bytes - spec.kv_cache_bytes + (spec.min_kv_bytes
                                                                     or spec.kv_cache_bytes)
                raise InsufficientMemory(memory.insufficient_message(least, usable))
            if not victims:
                return
            idle = [s for s in victims if not self._busy(s)]
            if idle:
                await asyncio.gather(*(self._remove(s, f"evicted for {spec.name}") for s in idle))
                continue
            marked = [s for s in victims if not s.draining]
            for s in victims:
                s.draining = True
            try:
                await asyncio.wait([asyncio.ensure_future(s.gone.wait()) for s in victims],
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for s in marked:
                    if not s.removed:
                        s.draining = False

    def _shrink_kv(self, spec: LoadSpec, others: list[Slot], available: int,
                   margin: int) -> bool:
        """When the full KV budget (num_parallel full contexts) cannot fit, give the runner
        what fits next to the busy runners, down to one full context (like Ollama lowering
        its parallelism)."""
        if spec.kv_cache_bytes <= spec.min_kv_bytes or spec.min_kv_bytes <= 0:
            return False
        base = spec.estimate_bytes - spec.kv_cache_bytes
        busy = [s for s in others if self._busy(s)]
        room = (memory.usable_bytes(others, available, margin)
                - sum(memory.reserve(s) for s in busy) - base)
        if room < spec.min_kv_bytes:
            return False
        log.info("%s: KV budget %.2f GiB instead of %.2f GiB to fit in memory", spec.name,
                 room / memory.GIB, spec.kv_cache_bytes / memory.GIB)
        spec.kv_cache_bytes = min(spec.kv_cache_bytes, room)
        spec.estimate_bytes = base + spec.kv_cache_bytes
        return True

    def _remove(self, slot: Slot, reason: str) -> asyncio.Future:
        """Take a slot out of the table now and stop its runner in the background; the
        returned future completes when the process is gone."""
        if slot.removed:
            return slot.stop_task or _done()
        slot.removed = True
        if self._slots.get(slot.name) is slot:
            del self._slots[slot.name]
        log.info("unloading %s (%s)", slot.name, reason)
        task = slot.stop_task = self._spawn(self._stop(slot))
        self._notify()
        return task

    async def _stop(self, slot: Slot) -> None:
        try:
            await slot.runner.stop()
        except Exception:  # a runner that fails to stop must not take the manager down
            log.exception("stopping runner for %s", slot.name)
        finally:
            slot.gone.set()
            self._notify()

    async def _watch(self, slot: Slot) -> None:
        code = await slot.runner.wait_exit()
        if not slot.removed:
            tail = slot.runner.stderr_tail()
            log.error("runner for %s %s unexpectedly%s", slot.name, describe_exit(code),
                      f":\n{tail}" if tail else "")
            self._remove(slot, f"runner {describe_exit(code)}")

    async def _refresh(self, slot: Slot) -> None:
        if slot.removed or not slot.runner.alive:
            return
        slot.refreshed_at = time.monotonic()
        try:
            status = await asyncio.wait_for(slot.runner.status(), 5.0)
        except Exception:  # a busy or dying runner: keep the last figures
            return
        slot.memory_bytes = int(status.memory or 0)
        slot.active, slot.waiting = int(status.active), int(status.waiting)
        slot.sharding = status.sharding
        slot.blas = {"path": status.blas_path, "config": status.blas_config}
        slot.weights = status.weights
        slot.kv = {"block_size": status.kv_block_size, "blocks_total": status.kv_blocks_total,
                   "blocks_used": status.kv_blocks_used,
                   "blocks_cached": status.kv_blocks_cached, "bytes": status.kv_bytes,
                   "live_bytes": status.kv_live_bytes,
                   "block_bytes": status.kv_block_bytes,
                   "prefix_hit_rate": round(status.prefix_hit_rate, 4),
                   "preemptions": status.preemptions}
        slot.pool_bytes = status.kv_blocks_total * status.kv_block_bytes * slot.spec.local_ranks
        if status.context_length:
            slot.context_length = int(status.context_length)

    async def _housekeeping(self) -> None:
        last_refresh = 0.0
        while True:
            now = self._clock.now()
            deadlines = [e for s in self._slots.values() if s.refs == 0
                         and (e := s.expires_at(now)) is not None]
            timeout = min([STATUS_INTERVAL_S] + [max(0.0, d - now) for d in deadlines])
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout + 0.01)
            except asyncio.TimeoutError:
                pass
            try:
                await self.expire_due()
                if time.monotonic() - last_refresh >= STATUS_INTERVAL_S:
                    last_refresh = time.monotonic()
                    await self.refresh_memory()
            except Exception:
                log.exception("housekeeping")

    # -- plumbing ----------------------------------------------------------------------

    def _busy(self, slot: Slot) -> bool:
        return slot.refs > 0 or self._pending[slot.name] > 0

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(self._watchers.discard)
        return task


def _done() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


"""RunnerManager with an injected runner factory, a fake clock and a fake memory probe."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from mlxr.shared.config import Settings
from mlxr.shared.errors import InsufficientMemory, RunnerFailed, ServerBusy
from mlxr.shared.protocol import RunnerStatus
from mlxr.supervisor.runners.manager import LoadSpec, RunnerManager

GB = 1 << 30


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeRunner:
    def __init__(self, name: str, memory: int, pool: tuple[int, int] = (0, 0)):
        self.name = name
        self.memory = memory
        self.pool = pool  # KV blocks, bytes a block
        self.stopped = False
        self.exited = asyncio.Event()

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    async def status(self) -> RunnerStatus:
        return RunnerStatus("ready", self.name, memory=self.memory, context_length=4096,
                            kv_blocks_total=self.pool[0], kv_block_bytes=self.pool[1])

    async def wait_exit(self) -> int:
        await self.exited.wait()
        return -9 if not self.stopped else 0

    async def stop(self) -> None:
        self.stopped = True
        self.exited.set()

    def stderr_tail(self) -> str:
        return "last words"

    def crash(self) -> None:
        self.exited.set()

    def abort_streams(self, make_error) -> int:
        self.aborted_with = make_error()
        return 1


class Factory:
    """Makes FakeRunners; `live` sets what a model's runner reports; `gate` holds loads."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.runners: list[FakeRunner] = []
        self.live: dict[str, int] = {}
        self.pools: dict[str, tuple[int, int]] = {}
        self.gate: asyncio.Event | None = None
        self.fail: str | None = None

    async def __call__(self, spec: LoadSpec) -> FakeRunner:
        self.loads.append(spec.name)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RunnerFailed(self.fail)
        runner = FakeRunner(spec.name, self.live.get(spec.name, spec.estimate_bytes),
                            self.pools.get(spec.name, (0, 0)))
        self.runners.append(runner)
        return runner

    def alive(self) -> list[str]:
        return [r.name for r in self.runners if r.alive]


def spec(name: str, estimate: int = GB, context: int = 4096) -> LoadSpec:
    return LoadSpec(name=name, model_dir=Path("/nonexistent"), estimate_bytes=estimate,
                    context_length=context)


def make(total: int = 100 * GB, **overrides):
    settings = dataclasses.replace(Settings(), memory_margin_bytes=GB, **overrides)
    factory, clock = Factory(), FakeClock()
    holder: dict[str, RunnerManager] = {}

    def available() -> int:  # like psutil: what our live runners hold is not available
        return total - sum(s.memory_bytes for s in holder["m"].slots())

    manager = RunnerManager(settings, factory, clock=clock, available_memory=available)
    holder["m"] = manager
    return manager, factory, clock


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def names(manager: RunnerManager) -> set[str]:
    return {s.name for s in manager.slots()}


def test_a_runner_is_charged_for_the_kv_pool_it_reports():
    """The estimate's KV part reads config.json; the runner's pool is measured on the model.
    Once read, the pool replaces it: a smaller pool leaves room that the estimate would have
    taken (no eviction), a larger one takes more (an eviction)."""
    async def main():
        for blocks, evicted in ((1024, False), (6 * 1024, True)):
            m, f, _ = make(total=10 * GB)  # 9 GiB usable beside a 1 GiB margin
            f.live["a"] = GB + GB // 2  # weights and what its cache holds so far
            f.pools["a"] = (blocks, GB // 1024)  # 1 or 6 GiB, against 5 estimated
            a = LoadSpec(name="a", model_dir=Path("/nonexistent"), estimate_bytes=6 * GB,
                         context_length=4096, kv_cache_bytes=5 * GB)
            m.release(await m.acquire(a, -1))
            slot = next(iter(m.slots()))
            assert slot.estimate_bytes == GB + blocks * (GB // 1024)
            m.release(await m.acquire(spec("b", 5 * GB), -1))  # 6 + 5 > 9: one must go
            assert names(m) == ({"b"} if evicted else {"a", "b"})
    asyncio.run(main())


def test_keep_alive_expiry_by_the_clock():
    async def main():
        m, f, clock = make()
        m.release(await m.acquire(spec("a"), 10.0))
        clock.advance(9.0)
        await m.expire_due()
        assert names(m) == {"a"}
        clock.advance(2.0)
        await m.expire_due()
        await settle()
        assert names(m) == set() and f.runners[0].stopped
    asyncio.run(main())


def test_keep_alive_counts_from_the_end_of_the_last_request():
    async def main():
        m, f, clock = make()
        lease = await m.acquire(spec("a"), 10.0)
        clock.advance(60.0)  # a long request: it must not expire while running
        await m.expire_due()
        assert names(m) == {"a"}
        m.release(lease)
        clock.advance(9.0)
        await m.expire_due()
        assert names(m) == {"a"}
    asyncio.run(main())


def test_keep_alive_zero_unloads_on_release_and_negative_never_expires():
    async def main():
        m, f, clock = make()
        m.release(await m.acquire(spec("a"), 0.0))
        assert names(m) == set()
        m.release(await m.acquire(spec("b"), -1.0))
        clock.advance(10**9)
        await m.expire_due()
        assert names(m) == {"b"}
        assert m.slots()[0].expires_at(clock.now()) is None
        await m.close()
        assert not f.alive()
    asyncio.run(main())


def test_latest_keep_alive_wins():
    async def main():
        m, f, clock = make()
        m.release(await m.acquire(spec("a"), -1.0))
        m.release(await m.acquire(spec("a"), 5.0))
        clock.advance(6.0)
        await m.expire_due()
        assert names(m) == set() and f.loads == ["a"]
    asyncio.run(main())


def test_concurrent_requests_load_a_model_once():
    async def main():
        m, f, _ = make()
        f.gate = asyncio.Event()
        tasks = [asyncio.ensure_future(m.acquire(spec("a"), 60.0)) for _ in range(5)]
        await settle()
        assert f.loads == ["a"]
        f.gate.set()
        leases = await asyncio.gather(*tasks)
        assert f.loads == ["a"]
        assert len({id(lease.runner) for lease in leases}) == 1
        assert m.slots()[0].refs == 5
        assert sum(lease.load_duration_s >= 0 for lease in leases) == 5
    asyncio.run(main())


def test_client_leaving_mid_load_does_not_cancel_the_load():
    async def main():
        m, f, _ = make()
        f.gate = asyncio.Event()
        task = asyncio.ensure_future(m.acquire(spec("a"), 60.0))
        await settle()
        task.cancel()
        await settle()
        f.gate.set()
        await settle()
        assert names(m) == {"a"} and m.slots()[0].refs == 0
        m.release(await m.acquire(spec("a"), 60.0))
        assert f.loads == ["a"]
    asyncio.run(main())


def test_eviction_is_lru_among_idle_runners():
    async def main():
        m, f, clock = make(total=10 * GB)  # usable: 10 - 1 (margin) = 9 GB
        for name in ("a", "b"):
            m.release(await m.acquire(spec(name, 4 * GB), 60.0))
            clock.advance(1.0)
        m.release(await m.acquire(spec("a", 4 * GB), 60.0))  # a is now the most recent
        clock.advance(1.0)
        m.release(await m.acquire(spec("c", 4 * GB), 60.0))
        await settle()
        assert names(m) == {"a", "c"}
        assert f.alive() == ["a", "c"]
    asyncio.run(main())


def test_eviction_uses_the_memory_runners_report():
    async def main():
        m, f, clock = make(total=10 * GB)
        f.live["a"] = 5 * GB  # estimated 2 GB, but it uses 5
        m.release(await m.acquire(spec("a", 2 * GB), 60.0))
        clock.advance(1.0)
        m.release(await m.acquire(spec("b", 2 * GB), 60.0))
        clock.advance(1.0)
        # By estimates 2 + 2 + 3 = 7 GB fits in 9; by live memory 5 + 2 + 3 = 10 does not.
        m.release(await m.acquire(spec("c", 3 * GB), 60.0))
        await settle()
        assert names(m) == {"b", "c"}
    asyncio.run(main())


def test_memory_figures_refresh_from_status():
    async def main():
        m, f, _ = make()
        m.release(await m.acquire(spec("a", GB), 60.0))
        f.runners[0].memory = 3 * GB
        await m.refresh_memory()
        assert m.slots()[0].memory_bytes == 3 * GB
    asyncio.run(main())


def test_model_too_big_is_insufficient_memory_not_a_crash():
    async def main():
        m, f, _ = make(total=10 * GB)
        m.release(await m.acquire(spec("a", 2 * GB), 60.0))
        with pytest.raises(InsufficientMemory) as info:
            await m.acquire(spec("huge", 20 * GB), 60.0)
        assert info.value.status == 507
        assert "requires more system memory (20.0 GiB)" in info.value.message
        assert names(m) == {"a"} and f.loads == ["a", "huge"][:1]
    asyncio.run(main())


def test_kv_budget_shrinks_to_fit_down_to_one_context():
    async def main():
        m, f, _ = make(total=10 * GB)  # usable 9 GB
        big_kv = LoadSpec("a", Path("/x"), estimate_bytes=2 * GB + 16 * GB, context_length=4096,
                          kv_cache_bytes=16 * GB, min_kv_bytes=GB)
        m.release(await m.acquire(big_kv, 60.0))
        slot = m.slots()[0]
        assert slot.spec.kv_cache_bytes == 7 * GB and slot.estimate_bytes == 9 * GB
        no_room = LoadSpec("b", Path("/x"), estimate_bytes=12 * GB, context_length=4096,
                           kv_cache_bytes=int(3.5 * GB), min_kv_bytes=GB)
        with pytest.raises(InsufficientMemory, match=r"\(9\.5 GiB\)"):
            await m.acquire(no_room, 60.0)
        assert names(m) == {"a"}  # nothing was evicted for a model that cannot fit anyway
    asyncio.run(main())


def test_max_loaded_models_evicts_idle():
    async def main():
        m, f, _ = make(max_loaded_models=1)
        m.release(await m.acquire(spec("a"), 60.0))
        m.release(await m.acquire(spec("b"), 60.0))
        await settle()
        assert names(m) == {"b"} and f.alive() == ["b"]
    asyncio.run(main())


def test_busy_runner_drains_before_eviction_and_models_alternate():
    async def main():
        m, f, _ = make(max_loaded_models=1)
        lease_a = await m.acquire(spec("a"), 60.0)
        want_b = asyncio.ensure_future(m.acquire(spec("b"), 60.0))
        await settle()
        assert not want_b.done() and m.slots()[0].draining
        want_a = asyncio.ensure_future(m.acquire(spec("a"), 60.0))  # must queue behind b
        await settle()
        assert not want_a.done()
        m.release(lease_a)
        lease_b = await asyncio.wait_for(want_b, 1.0)
        assert names(m) == {"b"}
        await settle()
        assert not want_a.done()
        m.release(lease_b)
        lease_a2 = await asyncio.wait_for(want_a, 1.0)
        assert names(m) == {"a"} and f.loads == ["a", "b", "a"]
        m.release(lease_a2)
    asyncio.run(main())


def test_queue_limit_refuses_past_max_queue():
    async def main():
        m, f, _ = make(num_parallel=1, max_queue=1)
        first = await m.acquire(spec("a"), 60.0)   # running
        second = await m.acquire(spec("a"), 60.0)  # queued in the runner
        assert m.queue_depth() == 1
        with pytest.raises(ServerBusy) as info:
            await m.acquire(spec("a"), 60.0)
        assert info.value.status == 503 and "server busy" in info.value.message
        m.release(first)
        m.release(second)
        m.release(await m.acquire(spec("a"), 60.0))
    asyncio.run(main())


def test_a_runner_that_dies_is_replaced_on_the_next_request():
    async def main():
        m, f, _ = make()
        m.release(await m.acquire(spec("a"), 60.0))
        f.runners[0].crash()
        await settle()
        assert names(m) == set()
        m.release(await m.acquire(spec("a"), 60.0))
        assert f.loads == ["a", "a"] and f.alive() == ["a"]
    asyncio.run(main())


def test_failed_load_reaches_every_waiter_and_the_next_request_retries():
    async def main():
        m, f, _ = make()
        f.gate, f.fail = asyncio.Event(), "no such weights"
        tasks = [asyncio.ensure_future(m.acquire(spec("a"), 60.0)) for _ in range(3)]
        await settle()
        f.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, RunnerFailed) for r in results)
        assert f.loads == ["a"]
        f.fail = None
        m.release(await m.acquire(spec("a"), 60.0))
        assert f.loads == ["a", "a"]
    asyncio.run(main())


def test_larger_context_reloads_once_idle():
    async def main():
        m, f, _ = make()
        m.release(await m.acquire(spec("a", context=2048), 60.0))
        m.release(await m.acquire(spec("a", context=1024), 60.0))  # fits: no reload
        assert f.loads == ["a"]
        m.release(await m.acquire(spec("a", context=8192), 60.0))
        await settle()
        assert f.loads == ["a", "a"] and len(f.alive()) == 1
        assert m.slots()[0].spec.context_length == 8192
    asyncio.run(main())


def test_unload_of_a_busy_model_waits_for_its_requests():
    async def main():
        m, f, _ = make()
        lease = await m.acquire(spec("a"), -1.0)
        assert await m.unload("a")
        assert names(m) == {"a"}
        m.release(lease)
        await settle()
        assert names(m) == set() and f.runners[0].stopped
        assert not await m.unload("a")
    asyncio.run(main())


# -- crash loops ---------------------------------------------------------------------------

def crash_looping(**overrides):
    m, f, clock = make(**{"max_load_failures": 3, "load_failure_cooldown_s": 60.0, **overrides})
    f.fail = "runner for a exited with code 1 while loading: bad weights"
    return m, f, clock


async def fail_loads(m, n: int, digest: str = "sha256:1") -> None:
    for _ in range(n):
        with pytest.raises(RunnerFailed):
            await m.acquire(dataclasses.replace(spec("a"), digest=digest), 60.0)


def test_a_crash_looping_model_is_refused_without_spawning_until_the_cool_down():
    async def main():
        m, f, clock = crash_looping()
        await fail_loads(m, 3)
        assert f.loads == ["a"] * 3
        with pytest.raises(RunnerFailed) as info:
            await m.acquire(dataclasses.replace(spec("a"), digest="sha256:1"), 60.0)
        assert f.loads == ["a"] * 3, "refused without a new runner"
        assert "failed to load 3 times in a row" in info.value.message
        assert "tried again in 60s" in info.value.message
        assert info.value.message.endswith("last error: runner for a exited with code 1 "
                                           "while loading: bad weights")
        clock.advance(59.0)
        await fail_loads(m, 1)
        assert len(f.loads) == 3
        clock.advance(1.0)  # the cool-down has passed: one more try, which fails again
        await fail_loads(m, 1)
        assert len(f.loads) == 4
        await fail_loads(m, 1)
        assert len(f.loads) == 4, "refused for another cool-down"
        clock.advance(60.0)
        f.fail = None
        m.release(await m.acquire(dataclasses.replace(spec("a"), digest="sha256:1"), 60.0))
        assert len(f.loads) == 5 and names(m) == {"a"}
    asyncio.run(main())


def test_a_crash_loop_ends_when_the_model_changes_or_is_unloaded():
    async def main():
        m, f, _ = crash_looping()
        await fail_loads(m, 3)
        await fail_loads(m, 1, digest="sha256:2")  # re-created: loaded again at once
        assert len(f.loads) == 4
        await fail_loads(m, 2, digest="sha256:2")
        assert len(f.loads) == 6
        await fail_loads(m, 1, digest="sha256:2")
        assert len(f.loads) == 6, "three failures of the new digest: refused again"
        assert not await m.unload("a")  # `ollama stop a`: nothing loaded, failures forgotten
        await fail_loads(m, 1, digest="sha256:2")
        assert len(f.loads) == 7
    asyncio.run(main())


def test_only_failures_in_a_row_count_and_zero_turns_it_off():
    async def main():
        m, f, _ = crash_looping()
        await fail_loads(m, 2)
        f.fail = None
        m.release(await m.acquire(dataclasses.replace(spec("a"), digest="sha256:1"), 0.0))
        f.fail = "still broken"
        await fail_loads(m, 2)
        assert len(f.loads) == 5, "a success in between starts the count again"

        m, f, _ = crash_looping(max_load_failures=0)
        await fail_loads(m, 5)
        assert len(f.loads) == 5
    asyncio.run(main())


# -- shutdown ------------------------------------------------------------------------------

def test_abort_all_ends_streams_fails_load_waiters_and_refuses_new_leases():
    async def main():
        m, f, _ = make()
        lease = await m.acquire(spec("a"), 60.0)
        f.gate = asyncio.Event()
        waiting = asyncio.ensure_future(m.acquire(spec("b"), 60.0))
        await settle()
        assert f.loads == ["a", "b"]
        assert m.abort_all(lambda: ServerBusy("server shutting down")) == 1
        assert f.runners[0].aborted_with.message == "server shutting down"
        with pytest.raises(ServerBusy, match="server shutting down"):
            await waiting
        with pytest.raises(ServerBusy, match="server shutting down"):
            await m.acquire(spec("a"), 60.0)
        m.release(lease)
        await m.close()
        assert not f.alive()
    asyncio.run(main())

"""The engine loop's side work (runner/engine.py `call`): each call takes a turn of its own,
between two steps, so two pieces of side work (an image's decoding, then its processor pass)
never hold the running streams in one turn. Uses the Engine without a model or a thread."""

from __future__ import annotations

import threading
import time

from mlxr.runner.engine import Engine
from mlxr.shared.config import RunnerConfig


def make_engine() -> Engine:
    return Engine(RunnerConfig(model_dir="unused"), deliver=lambda batch: None)


def test_each_call_takes_a_turn_of_its_own():
    engine = make_engine()
    ran: list[str] = []
    first = engine.call(lambda: ran.append("decode") or 1)
    second = engine.call(lambda: ran.append("processor") or 2)
    engine._drain(block=False)
    assert ran == ["decode"] and first.result(timeout=0) == 1 and not second.done()
    engine._drain(block=False)
    assert ran == ["decode", "processor"] and second.result(timeout=0) == 2
    engine._drain(block=False)  # nothing left: returns at once
    assert ran == ["decode", "processor"]


def test_a_failing_call_gives_its_exception_and_the_next_still_runs():
    engine = make_engine()
    failing = engine.call(lambda: 1 / 0)
    after = engine.call(lambda: "ok")
    engine._drain(block=False)
    assert isinstance(failing.exception(timeout=0), ZeroDivisionError)
    engine._drain(block=False)
    assert after.result(timeout=0) == "ok"


def test_a_call_cancelled_before_its_turn_is_skipped():
    engine = make_engine()
    ran: list[int] = []
    cancelled = engine.call(lambda: ran.append(1))
    assert cancelled.cancel()  # the request went away while it waited
    kept = engine.call(lambda: ran.append(2) or threading.current_thread().name)
    engine._drain(block=False)
    assert ran == [2] and kept.result(timeout=0) == threading.current_thread().name


class FakeScheduler:
    def __init__(self, has_work: bool, decode_s: float | None):
        self.has_work = has_work
        self.decode_s = decode_s
        self.added: list = []

    @property
    def stall_allowance_s(self) -> float:  # the real one's shape, with a factor of 0.75
        return 0.75 * (self.decode_s or 0.0)

    def add(self, seq) -> None:
        self.added.append(seq)


def encoding(engine: Engine, stage_s: float, count: int) -> list[int]:
    """Queue an image prompt whose encoding is `count` stages of `stage_s` each; returns the
    list the stages append their index to."""
    ran: list[int] = []

    def stages():
        for i in range(count):
            time.sleep(stage_s)
            ran.append(i)
            yield

    seq = type("Seq", (), {"cancelled": False})()
    engine._encoding.append((seq, stages()))
    return ran


def test_encoding_stages_fill_the_turns_budget_beside_streams():
    engine = make_engine()
    engine.scheduler = FakeScheduler(has_work=True, decode_s=0.040)  # budget 30 ms
    ran = encoding(engine, 0.002, 40)
    engine._encode_stage()
    assert 3 <= len(ran) <= 16  # several 2 ms stages, far from all 40 (80 ms)
    before = len(ran)
    engine._encode_stage()
    assert len(ran) > before and not engine.scheduler.added


def test_an_expensive_stage_ends_the_turn_and_no_estimate_means_one_stage():
    engine = make_engine()
    engine.scheduler = FakeScheduler(has_work=True, decode_s=0.010)  # budget 7.5 ms
    ran = encoding(engine, 0.008, 5)
    engine._encode_stage()
    assert ran == [0]  # the next 8 ms stage would pass the budget
    engine.scheduler.decode_s = None  # no decode step measured yet
    engine._encode_stage()
    assert ran == [0, 1]


def test_with_no_stream_waiting_the_whole_encoding_runs_at_once():
    engine = make_engine()
    engine.scheduler = FakeScheduler(has_work=False, decode_s=0.010)
    ran = encoding(engine, 0.001, 30)
    engine._encode_stage()
    assert ran == list(range(30)) and len(engine.scheduler.added) == 1
    assert not engine._encoding


def test_side_work_waits_for_the_engine_turn_on_the_cpu_and_uses_a_thread_on_a_gpu():
    import asyncio

    from mlxr.runner.server import _side_work

    engine = make_engine()
    assert engine.on_cpu  # the suite's MLX runs on the CPU

    async def run(on_cpu: bool):
        engine.on_cpu = on_cpu
        task = asyncio.ensure_future(_side_work(engine, threading.current_thread))
        await asyncio.sleep(0.05)
        if on_cpu:
            assert not task.done()  # queued for the engine loop's next turn
            turn = threading.Thread(target=engine._drain, args=(False,), name="engine-turn")
            turn.start()  # the engine loop's turn, on a thread of its own
            await asyncio.to_thread(turn.join)
        return await asyncio.wait_for(task, 5)

    engine_turn = asyncio.run(run(True))
    assert engine_turn.name == "engine-turn"
    executor = asyncio.run(run(False))
    assert executor.name.startswith("asyncio")


def test_idle_after_work_the_heap_gives_freed_memory_back_once(monkeypatch):
    from mlxr.runner import engine as engine_module

    released = []
    monkeypatch.setattr(engine_module, "IDLE_S", 0.01)
    monkeypatch.setattr(engine_module.heap, "release_freed", lambda: released.append(1))
    engine = make_engine()
    engine._drain(block=True)  # idle, but nothing ran since the start: nothing to give back
    assert released == []
    engine.call(lambda: "an embedding batch")
    engine._drain(block=True)  # the call runs: work, not idleness
    assert released == []
    engine._drain(block=True)
    assert released == [1]
    engine._drain(block=True)  # still idle: once is enough
    engine._drain(block=False)  # not waiting: never
    assert released == [1]

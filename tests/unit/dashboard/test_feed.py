"""The dashboard feed: one sampler for any number of pages, events only when there is news,
a slow page losing its oldest events, and the tok/s series."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest

from mlxr.supervisor.dashboard import feed as feed_module
from mlxr.supervisor.dashboard.feed import CLOSED, QUEUE_EVENTS, Feed, TokenRates
from mlxr.supervisor.inference.types import RunningModel


class FakeManager:
    def __init__(self) -> None:
        self.refreshes = 0

    async def refresh_memory(self) -> None:
        self.refreshes += 1


class FakeService:
    def __init__(self) -> None:
        self.manager = FakeManager()
        self.running: list[RunningModel] = []

    def ps(self) -> list[RunningModel]:
        return self.running


class FakeStore:
    def __init__(self) -> None:
        self.records: list = []

    def list(self) -> list:
        return self.records


def running(name: str) -> RunningModel:
    return RunningModel(name=name, model=name, size=1000, size_vram=0, digest="d",
                        details={}, expires_at=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc),
                        context_length=4096, blas={}, kv={"blocks_used": 3}, active=2,
                        waiting=1)


@pytest.fixture(autouse=True)
def fast_ticks(monkeypatch):
    monkeypatch.setattr(feed_module, "TICK_S", 0.01)


def drain(queue: asyncio.Queue) -> list[tuple[str, dict]]:
    out = []
    while not queue.empty():
        name, data = queue.get_nowait()
        out.append((name, json.loads(data) if data else None))
    return out


def make_feed(totals=None) -> tuple[Feed, FakeService]:
    service = FakeService()
    rates = TokenRates(lambda: totals or {})
    return Feed(service, FakeStore(), rates, "1.2.3"), service


def test_many_pages_share_one_sampler():
    async def main():
        feed, service = make_feed()
        queues = [feed.subscribe() for _ in range(5)]
        while feed.ticks < 3:  # (a loaded machine may take longer than 3 ticks' time)
            await asyncio.sleep(0.01)
        feed.close()
        return feed, service, queues

    feed, service, queues = asyncio.run(main())
    # one runner read per pass, not per page (close may cut the last pass after its read)
    assert feed.ticks <= service.manager.refreshes <= feed.ticks + 1
    for q in queues:
        events = drain(q)
        assert events[0] == ("hello", {"version": "1.2.3"})
        assert events[-1] == (CLOSED[0], None)


def test_no_page_no_sampling_and_models_only_on_change():
    async def main():
        feed, service = make_feed()
        await asyncio.sleep(0.05)
        assert feed.ticks == 0 and service.manager.refreshes == 0
        queue = feed.subscribe()
        await asyncio.sleep(0.05)
        first = drain(queue)
        service.running = [running("a:latest")]
        await asyncio.sleep(0.05)
        second = drain(queue)
        feed.unsubscribe(queue)
        await asyncio.sleep(0.05)
        ticks = feed.ticks
        await asyncio.sleep(0.05)
        assert feed.ticks == ticks  # the sampler stopped with the last page
        return first, second

    first, second = asyncio.run(main())
    assert [n for n, _ in first].count("models") == 1
    assert [n for n, _ in first].count("running") >= 2
    assert "models" not in [n for n, _ in second]  # nothing in the store changed
    entry = [d for n, d in second if n == "running"][-1]["models"][0]
    assert entry["name"] == "a:latest" and entry["active"] == 2 and entry["waiting"] == 1
    assert entry["kv"] == {"blocks_used": 3} and entry["expires_at"].startswith("2030-01-01")


def test_a_new_page_gets_the_latest_snapshot_at_once():
    async def main():
        feed, service = make_feed()
        service.running = [running("a:latest")]
        first = feed.subscribe()
        await asyncio.sleep(0.05)
        late = feed.subscribe()
        events = [late.get_nowait() for _ in range(3)]
        feed.close()
        return [name for name, _ in events]

    assert asyncio.run(main()) == ["hello", "models", "running"]


def test_a_slow_page_loses_its_oldest_events_only():
    async def main():
        feed, _ = make_feed()
        queue = feed.subscribe()
        await asyncio.sleep(0.3)  # ~30 passes, never read
        size = queue.qsize()
        feed.close()
        return size

    assert asyncio.run(main()) == QUEUE_EVENTS


def test_token_rates_are_per_second_over_the_window():
    now = [0.0]
    totals = {"m": 0}
    rates = TokenRates(lambda: totals, clock=lambda: now[0])
    for t, total in [(0, 0), (1, 10), (2, 30), (4, 30)]:
        now[0], totals["m"] = t, total
        rates.sample()
    assert rates.series("m") == [10.0, 20.0, 0.0]
    assert rates.series("other") == [0.0, 0.0, 0.0]
    for t in range(5, 200):
        now[0] = t
        rates.sample()
    assert len(rates.series("m")) == feed_module.WINDOW_S

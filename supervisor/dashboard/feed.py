"""The dashboard's live feed: what the page at /ui shows, sent to every open page as
Server-Sent Events from one sampler.

- `TokenRates` reads the metrics' per-model generated-token totals once a second, always (a
  dict read, no I/O), so a page opened now still draws the last minute's tok/s.
- `Feed` runs one sampler task while at least one page is subscribed: each tick it re-reads
  every runner's /v1/status (one local call per runner, however many pages are open), lists
  the store, and puts a `running` event, and a `models` event when the list changed, on each
  subscriber's queue. A page that does not keep up loses its oldest events, never the server's
  memory. With no page open, nothing but `TokenRates` runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable

import orjson

from mlxr.supervisor.api.ollama import running_model_json
from mlxr.supervisor.api.store import tags_entry

log = logging.getLogger("mlxr.dashboard")

TICK_S = 1.0
WINDOW_S = 60  # the tok/s chart's span: one point per second
QUEUE_EVENTS = 16  # events a slow page may fall behind by before it loses the oldest

Event = tuple[str, bytes]  # (SSE event name, its data as JSON)
CLOSED: Event = ("", b"")  # put on every queue when the feed closes: the stream ends


class TokenRates:
    """Generated tokens per second and model, over the last `WINDOW_S` seconds."""

    def __init__(self, totals: Callable[[], dict[str, int]], clock=time.monotonic):
        self._totals = totals
        self._clock = clock
        self._samples: deque[tuple[float, dict[str, int]]] = deque(maxlen=WINDOW_S + 1)

    def sample(self) -> None:
        self._samples.append((self._clock(), dict(self._totals())))

    def series(self, model: str) -> list[float]:
        """One rate per interval between samples, oldest first (at most WINDOW_S)."""
        out = []
        pairs = list(self._samples)
        for (t0, a), (t1, b) in zip(pairs, pairs[1:]):
            gap = t1 - t0
            out.append(round((b.get(model, 0) - a.get(model, 0)) / gap, 2) if gap > 0 else 0.0)
        return out

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(TICK_S)


def _event(name: str, payload: Any) -> Event:
    return name, orjson.dumps(payload)


class Feed:
    def __init__(self, service: Any, store: Any, rates: TokenRates, version: str):
        self.service = service
        self.store = store
        self.rates = rates
        self.version = version
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._sampler: asyncio.Task | None = None
        self._models: Event | None = None
        self._running: Event | None = None
        self._closed = False
        self.ticks = 0  # sampler passes so far (the tests count runner reads by it)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> asyncio.Queue[Event]:
        """A queue of events for one page: the latest snapshot first, if there is one."""
        queue: asyncio.Queue[Event] = asyncio.Queue(QUEUE_EVENTS)
        if self._closed:
            queue.put_nowait(CLOSED)
            return queue
        queue.put_nowait(_event("hello", {"version": self.version}))
        for event in (self._models, self._running):
            if event is not None:
                queue.put_nowait(event)
        self._subscribers.add(queue)
        if self._sampler is None or self._sampler.done():
            self._sampler = asyncio.create_task(self._sample())
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        self._subscribers.discard(queue)

    def close(self) -> None:
        """End every page's stream (the server is shutting down)."""
        self._closed = True
        for queue in list(self._subscribers):
            self._put(queue, CLOSED)
        self._subscribers.clear()
        if self._sampler is not None:
            self._sampler.cancel()

    async def snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(models in the store, running models), as the page shows them."""
        await self.service.manager.refresh_memory()
        running = []
        for m in self.service.ps():
            entry = running_model_json(m)
            entry.update(active=m.active, waiting=m.waiting,
                         tokens_per_s=self.rates.series(m.name))
            running.append(entry)
        records = await asyncio.to_thread(self.store.list)
        return [tags_entry(r) for r in records], running

    async def _sample(self) -> None:
        while self._subscribers:
            started = time.monotonic()
            try:
                models, running = await self.snapshot()
            except Exception:  # never let a bad read end the feed for every page
                log.exception("dashboard snapshot")
            else:
                self.ticks += 1
                event = _event("models", {"models": models})
                if self._models is None or event[1] != self._models[1]:
                    self._models = event
                    self._publish(event)
                self._running = _event("running", {"models": running, "time": time.time()})
                self._publish(self._running)
            await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - started)))

    def _publish(self, event: Event) -> None:
        for queue in list(self._subscribers):
            self._put(queue, event)

    @staticmethod
    def _put(queue: asyncio.Queue[Event], event: Event) -> None:
        if queue.full():
            queue.get_nowait()  # a page that fell behind loses its oldest event
        queue.put_nowait(event)

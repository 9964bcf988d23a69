"""Prometheus metrics (one registry per app, so tests and several apps never share counters)
and the one log line per request.

Handlers put what they learn into `request[LOG_FIELDS]` (model, token counts, durations); the
middleware adds method, path, status and wall time, and writes it as one line.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("mlxr.access")

LOG_FIELDS = web.RequestKey("mlxr_log_fields", dict)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class _RunnerCollector(Collector):
    """Gauges read at scrape time from the runner manager."""

    def __init__(self, source: Callable[[], Any]):
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        manager = self._source()
        queue = GaugeMetricFamily("mlxr_queue_depth",
                                  "Requests waiting for a runner or for a free batch slot")
        loaded = GaugeMetricFamily("mlxr_loaded_models", "Runners loaded")
        mem = GaugeMetricFamily("mlxr_runner_memory_bytes", "Live memory a runner reports",
                                labels=["model"])
        active = GaugeMetricFamily("mlxr_runner_requests", "Requests in flight per runner",
                                   labels=["model"])
        slots = manager.slots() if manager is not None else []
        queue.add_metric([], manager.queue_depth() if manager is not None else 0)
        loaded.add_metric([], len(slots))
        for s in slots:
            mem.add_metric([s.name], s.memory_bytes)
            active.add_metric([s.name], s.refs)
        return [queue, loaded, mem, active]


class _DashboardCollector(Collector):
    """The dashboard feed's pages open and sampler passes, read at scrape time."""

    def __init__(self, source: Callable[[], tuple[int, int] | None]):
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        pages, samples = self._source() or (0, 0)
        open_ = GaugeMetricFamily("mlxr_dashboard_pages", "Dashboard pages following the feed")
        passes = GaugeMetricFamily("mlxr_dashboard_samples",
                                   "Dashboard feed passes (each reads every runner's status once)")
        open_.add_metric([], pages)
        passes.add_metric([], samples)
        return [open_, passes]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxr_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.request_seconds = Histogram("mlxr_request_duration_seconds",
                                         "HTTP request time, streaming included", ["route"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mlxr_prompt_tokens", "Prompt tokens evaluated",
                                     ["model"], registry=r)
        self.generated_tokens = Counter("mlxr_generated_tokens", "Tokens generated", ["model"],
                                        registry=r)
        self.ttft = Histogram("mlxr_time_to_first_token_seconds",
                              "From request arrival to the first generated token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("mlxr_inter_token_seconds",
                                     "Time between generated tokens of one request", ["model"],
                                     buckets=_TOKEN_BUCKETS, registry=r)
        # Tokens generated per model since start, for the dashboard's live rate (a plain dict:
        # read every second without going through the Prometheus registry).
        self.generated_by_model: dict[str, int] = {}
        self._manager: Any = None
        self._dashboard: Callable[[], tuple[int, int]] | None = None
        r.register(_RunnerCollector(lambda: self._manager))
        r.register(_DashboardCollector(lambda: self._dashboard and self._dashboard()))

    def bind(self, manager: Any) -> None:
        self._manager = manager

    def bind_dashboard(self, figures: Callable[[], tuple[int, int]]) -> None:
        """`figures()` gives (pages open, sampler passes so far)."""
        self._dashboard = figures

    def observe_tokens(self, model: str, gap_s: float, count: int, first: bool) -> None:
        """`count` tokens arrived `gap_s` after the previous ones (or the request, if first)."""
        self.generated_tokens.labels(model).inc(count)
        self.generated_by_model[model] = self.generated_by_model.get(model, 0) + count
        if first:
            self.ttft.labels(model).observe(gap_s)
            count -= 1
            gap_s = 0.0
        for _ in range(count):
            self.inter_token.labels(model).observe(gap_s / max(count, 1))

    def observe_prompt(self, model: str, count: int) -> None:
        self.prompt_tokens.labels(model).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        start = time.monotonic()
        fields: dict[str, Any] = {}
        request[LOG_FIELDS] = fields
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            elapsed = time.monotonic() - start
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            self.requests.labels(route, str(status)).inc()
            self.request_seconds.labels(route).observe(elapsed)
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            log.info("%s %s %d %.1fms%s", request.method, request.path, status,
                     elapsed * 1000, f" {extra}" if extra else "")

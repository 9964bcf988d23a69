"""`/metrics`: the Prometheus exposition of the app's metrics registry."""

from __future__ import annotations

from aiohttp import web

from mlxr.supervisor.api.keys import METRICS
from mlxr.supervisor.metrics import CONTENT_TYPE


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": CONTENT_TYPE})

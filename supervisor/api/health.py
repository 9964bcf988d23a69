"""`/health` (liveness) and `/ready` (readiness) for supervisors and load balancers.

- `/health`: 200 `{"status": "ok"}` while the server answers (during shutdown every route,
  this one too, is a 503).
- `/ready`: 200 when the server can serve a request: the store is readable and holds at least
  one model a runner can load (a language or embedding model), and the runner module can be
  started (it is importable). Otherwise 503, with each check's result and what failed. No
  model is loaded to find out: a probe must stay cheap.

Both are open like `/` (no API key): a probe carries no credentials.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any

from aiohttp import web

from mlxr.supervisor.api.keys import SERVICE, STORE


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    store = request.app[STORE]
    runner_module = request.app[SERVICE].settings.runner_module
    checks: dict[str, Any] = {}
    problems: list[str] = []
    try:
        manifests = store.manifests_dir
        if not manifests.is_dir() or not os.access(manifests, os.R_OK | os.X_OK):
            raise OSError(f"{manifests} is not a readable directory")
        records = await asyncio.to_thread(store.list)
        servable = [r for r in records if {"completion", "embedding"} &
                    set(getattr(r, "capabilities", None) or ["completion"])]
        checks["store"] = "ok"
        checks["models"] = len(servable)
        if not servable:
            problems.append("the store has no model to serve (mlxr pull or mlxr create one)")
    except Exception as exc:  # any failure to read the store is "not ready", never a 500
        checks["store"] = f"unreadable: {exc}"
        problems.append("the model store cannot be read")
    try:
        found = importlib.util.find_spec(runner_module) is not None
    except (ImportError, ValueError):
        found = False
    checks["runner"] = "ok" if found else f"module {runner_module} not found"
    if not found:
        problems.append(f"the runner module {runner_module} cannot be started")
    if problems:
        return web.json_response({"status": "not ready", "checks": checks,
                                  "error": "; ".join(problems)}, status=503)
    return web.json_response({"status": "ready", "checks": checks})

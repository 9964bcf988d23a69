"""The objects every handler may need, each under one typed key: app.py puts them on the
application, handlers read them from `request.app`."""

from __future__ import annotations

from aiohttp import web

from mlxr.supervisor.inference.service import Service
from mlxr.supervisor.metrics import Metrics
from mlxr.supervisor.store.store import Store

SERVICE = web.AppKey("service", Service)
STORE = web.AppKey("store", Store)
METRICS = web.AppKey("metrics", Metrics)
VERSION = web.AppKey("version", str)

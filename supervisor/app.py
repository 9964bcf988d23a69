"""The supervisor's aiohttp application: Ollama's API (and the store's routes) over one
service, one runner manager, one metrics registry, all built from one Settings object."""

from __future__ import annotations

import fnmatch
import hmac
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from mlxr.shared.config import Settings
from mlxr.shared.errors import Unauthorized
from mlxr.supervisor.api.ollama import SERVICE, VERSION, add_ollama_routes
from mlxr.supervisor.api.middleware import error_middleware
from mlxr.supervisor.metrics import CONTENT_TYPE, Metrics
from mlxr.supervisor.runners.client import BlasSelection, make_runner_factory
from mlxr.supervisor.runners.manager import Clock, RunnerManager
from mlxr.supervisor.inference.service import Service

log = logging.getLogger("mlxr.app")

METRICS = web.AppKey("metrics", Metrics)
MANAGER = web.AppKey("manager", RunnerManager)
STORE = web.AppKey("store", object)
OPEN_PATHS = ("/", "/api/version", "/metrics")


def version() -> str:
    from mlxr.supervisor.cli.main import version as cli_version
    return cli_version()


def make_app(settings: Settings, *, store: Any = None,
             runner_factory: Callable[[Any], Awaitable[Any]] | None = None,
             clock: Clock | None = None,
             available_memory: Callable[[], int] | None = None) -> web.Application:
    """Everything is built from `settings`; collaborators can be swapped for tests."""
    if store is None:
        from mlxr.supervisor.store.store import Store
        store = Store(settings.models_dir)
    metrics = Metrics()
    kwargs: dict[str, Any] = {"clock": clock}
    if available_memory is not None:
        kwargs["available_memory"] = available_memory
    blas = BlasSelection(settings)
    manager = RunnerManager(settings, runner_factory or make_runner_factory(settings, blas),
                            **kwargs)
    metrics.bind(manager)
    cors = _Cors(settings.origins)
    middlewares = [metrics.middleware, cors.preflight, error_middleware]
    if settings.api_key:
        middlewares.append(_api_key_middleware(settings.api_key))
    # client_max_size bounds bodies read whole (JSON requests: 413 past it); blob uploads
    # stream from request.content and are not limited by it.
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=middlewares)
    app[METRICS] = metrics
    app[MANAGER] = manager
    app[STORE] = store
    app[SERVICE] = Service(settings, store, manager, metrics)
    app[VERSION] = version()
    add_ollama_routes(app)
    app.router.add_get("/metrics", _metrics)
    _add_optional_routes(app, store)

    async def on_startup(app: web.Application) -> None:
        manager.start()
        if runner_factory is None:
            blas.start()  # probe now, so the first load does not wait for it and the log says

    async def on_cleanup(app: web.Application) -> None:
        await manager.close()

    app.on_response_prepare.append(cors.on_prepare)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _add_optional_routes(app: web.Application, store: Any) -> None:
    """The store's and OpenAI's routes live in their own modules."""
    try:
        from mlxr.supervisor.api.store import add_store_routes
        add_store_routes(app, store)
    except ImportError as exc:
        log.warning("model store routes unavailable: %s", exc)
    try:
        from mlxr.supervisor.api.openai import add_openai_routes
        add_openai_routes(app)
    except ImportError as exc:
        log.warning("OpenAI routes unavailable: %s", exc)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": CONTENT_TYPE})


def _default_origins() -> tuple[str, ...]:
    """Ollama's defaults: local pages on any port, and app/file/editor webviews."""
    hosts = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
    return tuple(f"{scheme}://{h}{port}" for scheme in ("http", "https") for h in hosts
                 for port in ("", ":*")) + (
        "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")


class _Cors:
    """Browser pages may call the API from allowed origins (MLXR_ORIGINS / OLLAMA_ORIGINS add
    to Ollama's defaults; "*" allows any): preflights are answered here, and every response
    to an allowed origin gets its headers just before they are sent (streams included)."""

    def __init__(self, extra: tuple[str, ...]):
        self.allowed = _default_origins() + tuple(extra)

    def origin(self, request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        if origin and any(fnmatch.fnmatchcase(origin, p) for p in self.allowed):
            return origin
        return None

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        if request.method == "OPTIONS" and self.origin(request):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600"})
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self.origin(request)
        if origin:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"


def _api_key_middleware(key: str):
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise Unauthorized("invalid or missing API key")
        return await handler(request)

    return check

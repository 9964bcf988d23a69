"""The supervisor's aiohttp application: the one route table, and the app built from one
Settings object (one service, one runner manager, one metrics registry, one store).

Every route the server answers is in `ROUTES` below (Prometheus' /metrics included); the
handlers are plain functions in api/ that read what they need from the app under the keys in
api/keys.py. A GET route answers HEAD too; preflight OPTIONS are the CORS middleware's.

`serve` runs the app on its listener (host:port, or a Unix socket with MLXR_HOST=unix:///path)
until SIGTERM or SIGINT, then shuts down gracefully: no new requests, running ones get
`shutdown_grace_s` to finish, the rest end with a "server shutting down" error in their
stream, every runner is stopped, and it returns (exit status 0).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from mlxr.shared.config import Settings, is_loopback_host
from mlxr.shared.errors import ServerBusy
from mlxr.supervisor.api import metrics as metrics_api
from mlxr.supervisor.api import anthropic, health, ollama, openai
from mlxr.supervisor.api import store as store_api
from mlxr.supervisor.api.keys import METRICS, SERVICE, STORE, VERSION
from mlxr.supervisor.api.middleware import (Cors, Drain, HostCheck, error_middleware,
                                            make_api_key_middleware)
from mlxr.supervisor.api.responses import create_response
from mlxr.supervisor.dashboard import routes as dashboard
from mlxr.supervisor.dashboard.feed import Feed, TokenRates
from mlxr.supervisor.inference.service import Service
from mlxr.supervisor.metrics import Metrics
from mlxr.supervisor.runners.client import BlasSelection, make_runner_factory, start_spare
from mlxr.supervisor.runners.manager import SHUTTING_DOWN, Clock, RunnerManager
from mlxr.supervisor.runners.spare import SpareRunner
from mlxr.supervisor.store.store import Store
from mlxr.supervisor.version import version

log = logging.getLogger("mlxr")

# After the grace period, the handlers whose streams were ended get this long to write their
# error line; aiohttp then cancels whatever still runs (a pull, an upload) after as long again.
ABORT_WRITE_S = 2.0
HANDLER_CANCEL_S = 1.0

# Ollama's model management: these handlers need nothing but the app's STORE.
STORE_ROUTES = [
    web.get("/api/tags", store_api.tags),
    web.post("/api/show", store_api.show),
    web.post("/api/copy", store_api.copy),
    web.delete("/api/delete", store_api.delete),
    web.head("/api/blobs/{digest}", store_api.head_blob),
    web.post("/api/blobs/{digest}", store_api.upload_blob),
    web.post("/api/create", store_api.create),
    web.post("/api/pull", store_api.pull),
    web.post("/api/push", store_api.push),
]

ROUTES = [
    # Ollama's API
    web.get("/", ollama.root),
    web.get("/api/version", ollama.version),
    web.get("/api/status", ollama.status),
    web.post("/api/generate", ollama.generate),
    web.post("/api/chat", ollama.chat),
    web.get("/api/ps", ollama.ps),
    web.post("/api/embed", ollama.embed),
    web.post("/api/embeddings", ollama.embeddings_legacy),
    web.get("/metrics", metrics_api.metrics),
    web.get("/health", health.health),
    web.get("/ready", health.ready),
    *STORE_ROUTES,
    # OpenAI's API
    web.post("/v1/chat/completions", openai.chat_completions),
    web.post("/v1/completions", openai.completions),
    web.post("/v1/embeddings", openai.embeddings),
    web.get("/v1/models", openai.list_models),
    web.get("/v1/models/{model:.+}", openai.get_model),
    # Anthropic's API
    web.post("/v1/messages", anthropic.messages),
    web.post("/v1/messages/count_tokens", anthropic.count_tokens),
    web.post("/v1/responses", create_response),
    # The web dashboard (its actions are the routes above)
    *dashboard.ROUTES,
]


def make_app(settings: Settings, *, store: Any = None,
             runner_factory: Callable[[Any], Awaitable[Any]] | None = None,
             clock: Clock | None = None,
             available_memory: Callable[[], int] | None = None) -> web.Application:
    """Everything is built from `settings`; collaborators can be swapped for tests."""
    if store is None:
        store = Store(settings.models_dir)
    metrics = Metrics()
    kwargs: dict[str, Any] = {"clock": clock}
    if available_memory is not None:
        kwargs["available_memory"] = available_memory
    blas = BlasSelection(settings)
    spares = SpareRunner(settings, start_spare)
    manager = RunnerManager(settings,
                            runner_factory or make_runner_factory(settings, blas, spares),
                            **kwargs)
    metrics.bind(manager)
    cors = Cors(settings.origins)
    drain = Drain()
    middlewares = [metrics.middleware, cors.preflight, error_middleware, drain.middleware]
    if settings.socket_path is None and is_loopback_host(settings.host):
        middlewares.append(HostCheck().middleware)
    if settings.api_key:
        middlewares.append(make_api_key_middleware(settings.api_key))
    # client_max_size bounds bodies read whole (JSON requests: 413 past it); blob uploads
    # stream from request.content and are not limited by it.
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=middlewares)
    app[METRICS] = metrics
    app[STORE] = store
    app[SERVICE] = Service(settings, store, manager, metrics)
    app[VERSION] = version()
    rates = TokenRates(lambda: metrics.generated_by_model)
    app[dashboard.FEED] = feed = Feed(app[SERVICE], store, rates, app[VERSION])
    app[dashboard.CORS_CHECK] = cors.origin
    metrics.bind_dashboard(lambda: (feed.subscribers, feed.ticks))
    app.add_routes(ROUTES)
    background: list[asyncio.Task] = []

    async def on_startup(app: web.Application) -> None:
        manager.start()
        background.append(asyncio.create_task(rates.run()))
        if runner_factory is None:
            blas.start()  # probe now, so the first load does not wait for it and the log says
            background.append(asyncio.create_task(_first_spare(blas, spares)))

    async def on_shutdown(app: web.Application) -> None:
        # aiohttp has closed the listener and marked kept-alive connections to close.
        drain.begin()
        feed.close()  # open dashboards' streams end now: they must not hold up the drain
        if drain.in_flight:
            log.info("shutting down: waiting up to %gs for %d running request(s)",
                     settings.shutdown_grace_s, drain.in_flight)
        if not await drain.wait_idle(settings.shutdown_grace_s):
            ended = manager.abort_all(lambda: ServerBusy(SHUTTING_DOWN))
            log.info("shutting down: ended %d stream(s) still running", ended)
            await drain.wait_idle(ABORT_WRITE_S)

    async def on_cleanup(app: web.Application) -> None:
        for task in background:
            task.cancel()
        await manager.close()
        await spares.close()

    app.on_response_prepare.append(cors.on_prepare)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


async def _first_spare(blas: BlasSelection, spares: SpareRunner) -> None:
    """The spare runner for the first load, once the BLAS is chosen (a load that comes
    first starts its own process, and the spare is made after it)."""
    spares.replenish((await blas.choice()).path)


def serve(settings: Settings, app: web.Application | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (see the module's docstring).
    Raises OSError or ValueError when the listener cannot be made."""
    app = app if app is not None else make_app(settings)
    options: dict[str, Any] = dict(print=None, access_log=None, shutdown_timeout=HANDLER_CANCEL_S,
                                   # a client that disconnects cancels its request (and the
                                   # runner's)
                                   handler_cancellation=True)
    if settings.socket_path is None:
        log.info("Listening on %s:%d (version %s), models in %s", settings.host, settings.port,
                 version(), settings.models_dir)
        try:
            web.run_app(app, host=settings.host, port=settings.port, **options)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"{settings.host}:{settings.port} is already in use "
                                         "by another program (no mlxr server's pid file "
                                         "names it)") from None
            raise
        return
    path = settings.socket_path
    sock = bind_unix_socket(path)
    identity = os.stat(path).st_ino
    log.info("Listening on unix:%s (version %s), models in %s", path, version(),
             settings.models_dir)
    try:
        web.run_app(app, sock=sock, **options)
    finally:
        try:
            if os.stat(path).st_ino == identity:  # still ours, not a successor's
                path.unlink()
        except OSError:
            pass


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket at `path` that only this user may connect to (mode 0600). A
    stale socket file left by a server that died is replaced; a live one, or a file that is
    not a socket, is an error."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise ValueError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale: nothing listens on it
        else:
            raise ValueError(f"another server is listening on {path}")
        finally:
            probe.close()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # created 0600: no moment in which others may connect
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(umask)
    os.chmod(path, 0o600)
    sock.setblocking(False)
    return sock

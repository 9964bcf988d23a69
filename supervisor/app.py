"""The supervisor's aiohttp application: the one route table, and the app built from one
Settings object (one service, one runner manager, one metrics registry, one store).

Every route the server answers is in `ROUTES` below (Prometheus' /metrics included); the
handlers are plain functions in api/ that read what they need from the app under the keys in
api/keys.py. A GET route answers HEAD too; preflight OPTIONS are the CORS middleware's.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from aiohttp import web

from mlxr.shared.config import Settings
from mlxr.supervisor.api import metrics as metrics_api
from mlxr.supervisor.api import anthropic, ollama, openai
from mlxr.supervisor.api import store as store_api
from mlxr.supervisor.api.keys import METRICS, SERVICE, STORE, VERSION
from mlxr.supervisor.api.middleware import Cors, error_middleware, make_api_key_middleware
from mlxr.supervisor.api.responses import create_response
from mlxr.supervisor.inference.service import Service
from mlxr.supervisor.metrics import Metrics
from mlxr.supervisor.runners.client import BlasSelection, make_runner_factory
from mlxr.supervisor.runners.manager import Clock, RunnerManager
from mlxr.supervisor.store.store import Store
from mlxr.supervisor.version import version

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
    web.post("/api/generate", ollama.generate),
    web.post("/api/chat", ollama.chat),
    web.get("/api/ps", ollama.ps),
    web.post("/api/embed", ollama.embed),
    web.post("/api/embeddings", ollama.embeddings_legacy),
    web.get("/metrics", metrics_api.metrics),
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
    manager = RunnerManager(settings, runner_factory or make_runner_factory(settings, blas),
                            **kwargs)
    metrics.bind(manager)
    cors = Cors(settings.origins)
    middlewares = [metrics.middleware, cors.preflight, error_middleware]
    if settings.api_key:
        middlewares.append(make_api_key_middleware(settings.api_key))
    # client_max_size bounds bodies read whole (JSON requests: 413 past it); blob uploads
    # stream from request.content and are not limited by it.
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=middlewares)
    app[METRICS] = metrics
    app[STORE] = store
    app[SERVICE] = Service(settings, store, manager, metrics)
    app[VERSION] = version()
    app.add_routes(ROUTES)

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

"""The app's middlewares (the access log and metrics middleware is supervisor/metrics.py's).

- Errors: one middleware renders every error, Ollama's `{"error": "..."}` on /api routes,
  Anthropic's error object on /v1/messages routes and OpenAI's on the other /v1 routes.
  Handlers raise `shared.errors.MlxrError` subclasses.
- CORS: preflights from allowed origins are answered, and every response to an allowed origin
  gets its headers just before they are sent (streams included).
- API key: with MLXR_API_KEY set, every route but `OPEN_PATHS` needs it as a bearer token
  (or as `x-api-key`, the header Anthropic's clients send).
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
from typing import Any

from aiohttp import web

from mlxr.shared.errors import MlxrError, Unauthorized

log = logging.getLogger("mlxr.http")

OPEN_PATHS = ("/", "/api/version", "/metrics")


# -- errors ------------------------------------------------------------------------------------

def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(err: MlxrError, openai: bool) -> dict[str, Any]:
    if openai:
        return {"error": {"message": err.message, "type": err.openai_type,
                          "param": err.param, "code": err.code}}
    return {"error": err.message}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# Anthropic's error types by HTTP status; any other status is an "api_error".
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(err: MlxrError) -> dict[str, Any]:
    """Anthropic's error object: the HTTP body, and the data of a stream's `error` event."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def error_response(err: MlxrError, path: str) -> web.Response:
    if is_anthropic_path(path):
        return web.json_response(anthropic_error_body(err), status=err.status)
    return web.json_response(error_body(err, is_openai_path(path)), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except MlxrError as err:
        return error_response(err, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = MlxrError(exc.reason or "error")
        err.status = exc.status
        err.openai_type = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(err, request.path)
    except Exception as exc:  # a bug: answer 500 with the reason, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(MlxrError(f"internal error: {exc}"), request.path)


# -- CORS --------------------------------------------------------------------------------------

def _default_origins() -> tuple[str, ...]:
    """Ollama's defaults: local pages on any port, and app/file/editor webviews."""
    hosts = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
    return tuple(f"{scheme}://{h}{port}" for scheme in ("http", "https") for h in hosts
                 for port in ("", ":*")) + (
        "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")


class Cors:
    """Browser pages may call the API from allowed origins (MLXR_ORIGINS / OLLAMA_ORIGINS add
    to Ollama's defaults; "*" allows any). `preflight` is a middleware; `on_prepare` goes in
    the app's `on_response_prepare`."""

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


# -- API key -----------------------------------------------------------------------------------

def make_api_key_middleware(key: str):
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "").encode()
            other = f"Bearer {request.headers.get('x-api-key', '')}".encode()
            if not (hmac.compare_digest(given, expected)
                    or hmac.compare_digest(other, expected)):
                raise Unauthorized("invalid or missing API key")
        return await handler(request)

    return check

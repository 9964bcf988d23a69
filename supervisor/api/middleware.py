"""The app's middlewares (the access log and metrics middleware is supervisor/metrics.py's).

- Errors: one middleware renders every error, Ollama's `{"error": "..."}` on /api routes,
  Anthropic's error object on /v1/messages routes and OpenAI's on the other /v1 routes.
  Handlers raise `shared.errors.MlxrError` subclasses.
- CORS: preflights from allowed origins are answered, and every response to an allowed origin
  gets its headers just before they are sent (streams included).
- API key: with MLXR_API_KEY set, every route but `OPEN_PATHS` needs it as a bearer token
  (or as `x-api-key`, the header Anthropic's clients send).
- Hosts: on a server bound to a loopback address, a request whose Host header does not name
  this machine is a 403, as in Ollama: a web page that rebinds its own domain name to
  127.0.0.1 (DNS rebinding) must not read the API. Not applied on a Unix socket.
- Drain: counts requests in flight so shutdown can wait for them; after `begin`, new requests
  get a 503 "server shutting down".
"""

from __future__ import annotations

import asyncio
import fnmatch
import hmac
import ipaddress
import logging
import socket
from typing import Any, Iterable

import psutil
from aiohttp import web

from mlxr.shared.errors import Forbidden, MlxrError, ServerBusy, Unauthorized

log = logging.getLogger("mlxr.http")

OPEN_PATHS = ("/", "/api/version", "/api/status", "/metrics", "/health", "/ready",
              # the dashboard's page and files hold no data; its feed and API calls need the key
              "/ui", "/ui/")
OPEN_PREFIXES = ("/ui/static/",)


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
        path = request.path
        if (path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)
                and request.method != "OPTIONS"):
            given = request.headers.get("Authorization", "").encode()
            other = f"Bearer {request.headers.get('x-api-key', '')}".encode()
            if not (hmac.compare_digest(given, expected)
                    or hmac.compare_digest(other, expected)):
                raise Unauthorized("invalid or missing API key")
        return await handler(request)

    return check


# -- Hosts (DNS rebinding) ---------------------------------------------------------------------

# Ollama's rules: these name suffixes and these IP ranges are this machine or its network.
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))


def host_name(header: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets."""
    header = header.strip()
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    if header.count(":") == 1:
        header = header.partition(":")[0]
    return header.lower().rstrip(".")


def _interface_addresses() -> frozenset[str]:
    try:
        return frozenset(a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                         for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    except (OSError, RuntimeError):
        return frozenset()


class HostCheck:
    """`middleware` refuses (403) a request whose Host is not this machine: a loopback,
    private, unspecified or local interface address, "localhost", this machine's name, or a
    name under .localhost, .local or .internal."""

    def __init__(self, hostname: str | None = None, addresses: Iterable[str] | None = None):
        self.hostname = (socket.gethostname() if hostname is None else hostname).lower()
        self.addresses = frozenset(_interface_addresses() if addresses is None else addresses)

    def allowed(self, header: str) -> bool:
        name = host_name(header)
        if not name or name == "localhost" or name == self.hostname:
            return True
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            return name.endswith(LOCAL_SUFFIXES)
        return (ip.is_loopback or ip.is_unspecified or str(ip) in self.addresses
                or any(ip in net for net in PRIVATE_NETWORKS if net.version == ip.version))

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        host = request.headers.get("Host", "")
        if not self.allowed(host):
            raise Forbidden(f"host {host!r} is not allowed: this server listens on a loopback "
                            f"address and answers only requests for this machine")
        return await handler(request)


# -- Drain (graceful shutdown) -----------------------------------------------------------------

class Drain:
    """Counts requests in flight. After `begin()`, new requests are a 503 and `wait_idle`
    tells when the running ones have finished."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.stopping = False
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.stopping = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if self.stopping:
            raise ServerBusy("server shutting down")
        self.in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

"""Cross-origin requests: an allowlist of origins, as Ollama's OLLAMA_ORIGINS works.

The defaults admit local pages and desktop-app schemes; `Settings.origins` adds to them.
A request from an origin not on the list gets a 403; requests without an Origin header
(curl, the Ollama CLI, SDKs) are not affected."""

from __future__ import annotations

import fnmatch

from aiohttp import web

DEFAULT_ORIGINS = tuple(
    f"{scheme}://{host}{port}"
    for host in ("localhost", "127.0.0.1", "0.0.0.0")
    for scheme in ("http", "https")
    for port in ("", ":*")
) + ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")

ALLOWED_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"


def origin_allowed(origin: str, patterns: tuple[str, ...]) -> bool:
    return any(p == "*" or fnmatch.fnmatchcase(origin, p) for p in patterns)


def make_cors_middleware(extra_origins: tuple[str, ...]):
    patterns = DEFAULT_ORIGINS + tuple(extra_origins)

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        if not origin_allowed(origin, patterns):
            return web.json_response({"error": f"origin {origin} is not allowed"}, status=403)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = web.Response(status=204)
            response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type")
            response.headers["Access-Control-Max-Age"] = "43200"
        else:
            response = await handler(request)
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
        return response

    return cors

"""The web dashboard's routes: the page (/ui), its static files (/ui/static/...) and its one
live endpoint (/ui/events, Server-Sent Events from feed.py).

Security:
- The page and its files hold no data, so they are served without the API key (a browser
  cannot send a bearer token when it navigates). With MLXR_API_KEY set, the page asks for the
  key and sends it on every call it makes; /ui/events and the API itself refuse it missing.
- /ui/events answers only same-origin pages and the allowed origins (MLXR_ORIGINS): another
  site's script gets a 403, not the server's state.
- The page's headers keep it from being framed by another site (clickjacking) and from loading
  anything that is not this server's (a Content-Security-Policy of 'self').

The actions (pull, copy, delete, chat, unload) are the public API's own routes, called by the
page: nothing here acts on the store or the runners.
"""

from __future__ import annotations

import asyncio
import mimetypes
from pathlib import Path
from typing import Callable

from aiohttp import web

from mlxr.shared.errors import Forbidden
from mlxr.supervisor.dashboard.feed import CLOSED, Feed

STATIC_DIR = Path(__file__).parent / "static"
FEED = web.AppKey("dashboard_feed", Feed)
# The app's CORS check (middleware.Cors.origin: the allowed origin, or None).
CORS_CHECK = web.AppKey("dashboard_cors", Callable)
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream

SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# The page's files: a fixed list, so no request path ever reaches the file system.
STATIC_FILES = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()} if STATIC_DIR.is_dir() \
    else {}


def _file(path: Path) -> web.Response:
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    charset = "utf-8" if kind.startswith("text/") or kind.endswith("javascript") else None
    return web.Response(body=path.read_bytes(), content_type=kind, charset=charset,
                        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def page(request: web.Request) -> web.Response:
    return _file(STATIC_FILES["index.html"])


async def static(request: web.Request) -> web.Response:
    path = STATIC_FILES.get(request.match_info["name"])
    if path is None:
        raise web.HTTPNotFound(reason="no such file in the dashboard")
    return _file(path)


def _same_origin(request: web.Request, origin: str) -> bool:
    host = request.headers.get("Host", "")
    return origin in (f"http://{host}", f"https://{host}")


async def events(request: web.Request) -> web.StreamResponse:
    """The feed as text/event-stream: `hello`, then `models` (on change) and `running`
    (every second) events, each one JSON object."""
    origin = request.headers.get("Origin")
    cors = request.app[CORS_CHECK]
    if origin and not _same_origin(request, origin) and cors(request) is None:
        raise Forbidden(f"origin {origin!r} is not allowed (see MLXR_ORIGINS)")
    feed = request.app[FEED]
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no"})
    await response.prepare(request)
    queue = feed.subscribe()
    try:
        await response.write(b"retry: 2000\n\n")
        while True:
            try:
                name, data = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            if (name, data) == CLOSED:
                break
            await response.write(b"event: " + name.encode() + b"\ndata: " + data + b"\n\n")
    except (ConnectionResetError, ConnectionError):
        pass  # the page went away
    finally:
        feed.unsubscribe(queue)
    return response

ROUTES = [
    web.get("/ui", redirect),
    web.get("/ui/", page),
    web.get("/ui/static/{name}", static),
    web.get("/ui/events", events),
]

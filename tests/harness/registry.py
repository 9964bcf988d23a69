"""A real OCI registry (Debian's docker-registry, CNCF distribution) on 127.0.0.1, and an
aiohttp proxy in front of it that can demand Bearer tokens, stall blob downloads and log
requests. Both are started per test module; the proxy runs on its own thread and loop."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from aiohttp import ClientSession, web

from tests.harness.server import free_port, serve_in_thread

REGISTRY_BIN = "/usr/bin/docker-registry"
TOKEN_PREFIX = "test-token:"


@dataclass
class Registry:
    port: int
    proc: subprocess.Popen
    root: Path

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_registry(root: Path) -> Registry:
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: mlxr-test-secret\n")
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(root / "registry.log", "wb"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {(root / 'registry.log').read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 200:
                return Registry(port, proc, root)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("docker-registry did not start")


@dataclass
class LoggedRequest:
    method: str
    path: str
    range: str | None
    authorized: bool


@dataclass
class Proxy:
    """Forwards to the registry. `require_token`: answer /v2/ requests without a token with a
    Bearer challenge (realm on this proxy). `stall_after`: blob GETs send that many bytes and
    then hang until `release()`."""

    upstream: str
    require_token: bool = False
    stall_after: int | None = None
    port: int = 0
    log: list[LoggedRequest] = field(default_factory=list)
    tokens_issued: list[str] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _release: asyncio.Event | None = None
    _thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def release(self) -> None:
        self.stall_after = None
        if self._loop and self._release:
            self._loop.call_soon_threadsafe(self._release.set)

    def blob_gets(self) -> list[LoggedRequest]:
        return [r for r in self.log if r.method == "GET" and "/blobs/" in r.path]

    def start(self) -> "Proxy":
        self.port = free_port()
        self._loop, self._thread = serve_in_thread(self._serve)
        return self

    def stop(self) -> None:
        if self._loop:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    async def _serve(self, started: threading.Event) -> None:
        self._release = asyncio.Event()
        self._stop = asyncio.Event()
        self._session = ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/token", self._token)
        app.router.add_route("*", "/v2/{tail:.*}", self._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        started.set()
        await self._stop.wait()
        await self._session.close()
        await runner.cleanup()

    async def _token(self, request: web.Request) -> web.Response:
        scope = request.query.get("scope", "")
        self.tokens_issued.append(scope)
        return web.json_response({"token": TOKEN_PREFIX + scope})

    def _authorized(self, request: web.Request) -> bool:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer " + TOKEN_PREFIX):
            return False
        actions = auth.rsplit(":", 1)[-1].split(",")
        return request.method in ("GET", "HEAD") or "push" in actions

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        authorized = self._authorized(request)
        self.log.append(LoggedRequest(request.method, request.path,
                                      request.headers.get("Range"), authorized))
        if self.require_token and not authorized and request.path != "/v2/":
            parts = request.path.split("/")
            repo = "/".join(parts[2:parts.index("blobs" if "blobs" in parts else "manifests")])
            actions = "pull" if request.method in ("GET", "HEAD") else "push,pull"
            challenge = (f'Bearer realm="http://{self.host}/token",service="mlxr-test",'
                         f'scope="repository:{repo}:{actions}"')
            return web.json_response({"errors": [{"code": "UNAUTHORIZED"}]}, status=401,
                                     headers={"WWW-Authenticate": challenge})
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "authorization", "transfer-encoding")}
        body = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         headers=headers, data=body or None,
                                         allow_redirects=False) as up:
            out = {k: v for k, v in up.headers.items()
                   if k.lower() not in ("transfer-encoding", "content-encoding", "connection")}
            if "Location" in out:
                out["Location"] = out["Location"].replace(self.upstream, f"http://{self.host}")
            resp = web.StreamResponse(status=up.status, headers=out)
            await resp.prepare(request)
            sent = 0
            stalls = request.method == "GET" and "/blobs/" in request.path
            async for chunk in up.content.iter_chunked(256 << 10):
                limit = self.stall_after
                if stalls and limit is not None and sent + len(chunk) > limit:
                    await resp.write(chunk[:max(0, limit - sent)])
                    await self._release.wait()
                    return resp
                await resp.write(chunk)
                sent += len(chunk)
            await resp.write_eof()
            return resp

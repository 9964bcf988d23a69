"""A small OCI registry that misbehaves on purpose, served by the test itself: an aiohttp app
on its own thread and loop speaking enough of the distribution API for pull and push
(GET /v2/<name>/manifests/<tag>, GET and HEAD /v2/<name>/blobs/<digest> with `Range`,
POST /v2/<name>/blobs/uploads/, PUT of an upload and of a manifest).

Each repository is added by the test with its manifest, its blobs and one fault (`FAULTS`),
so tests that share one registry do not disturb each other. Every handler that waits or
streams forever ends when the client goes away or the registry stops; `Repo.sent` counts the
body bytes sent, so a test can show that a client stopped reading.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web

from tests.harness.server import free_port, serve_in_thread

MEDIA_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_CONFIG = "application/vnd.docker.container.image.v1+json"
MEDIA_TENSOR = "application/vnd.ollama.image.tensor"
MEDIA_JSON = "application/vnd.ollama.image.json"
CHUNK_BYTES = 64 << 10

FAULTS = {
    "": "behaves",
    "wrong_blob": "blobs are served with their bytes changed (same size)",
    "long_blob": "blobs are served with more bytes than declared (honest Content-Length)",
    "endless_blob": "blobs are served whole, then zeros forever (no Content-Length)",
    "short_blob": "blobs end cleanly after half their bytes",
    "redirect_loop": "blob requests redirect to themselves, forever",
    "stall_blob": "blobs send half their bytes, then nothing",
    "drip_blob": "blobs come one byte per 0.2 s (never a stall, never done)",
    "stall_manifest": "the manifest request is never answered",
    "drip_manifest": "the manifest comes one byte per 0.2 s, forever",
    "huge_manifest": "the manifest declares a Content-Length of 1 TiB",
    "endless_manifest": "the manifest never ends (no Content-Length)",
    "manifest_digest": "Docker-Content-Digest names other bytes than the manifest's",
    "endless_error": "pushes fail with a 500 whose body never ends",
}


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer(media_type: str, data: bytes, name: str | None = None) -> dict:
    out = {"mediaType": media_type, "digest": digest_of(data), "size": len(data)}
    if name:
        out["name"] = name
    return out


def model_manifest(files: dict[str, bytes], config: bytes = b'{"model_format":"safetensors"}\n',
                   ) -> tuple[bytes, dict[str, bytes]]:
    """(manifest bytes, blobs by digest) of a model made of named files."""
    layers = [layer(MEDIA_TENSOR if n.endswith(".safetensors") else MEDIA_JSON, data, n)
              for n, data in files.items()]
    manifest = {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST,
                "config": layer(MEDIA_CONFIG, config), "layers": layers}
    blobs = {digest_of(d): d for d in [config, *files.values()]}
    return json.dumps(manifest).encode(), blobs


@dataclass
class Repo:
    manifest: bytes
    blobs: dict[str, bytes]
    fault: str = ""
    sent: int = 0  # body bytes sent for this repository
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def blob_gets(self) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and "/blobs/" in r[1]]


class HostileRegistry:
    def __init__(self) -> None:
        self.port = 0
        self.repos: dict[str, Repo] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add(self, repository: str, manifest: bytes, blobs: dict[str, bytes],
            fault: str = "") -> str:
        """Serve `repository` (namespace/model) with `fault`; returns its model name."""
        assert fault in FAULTS, fault
        self.repos[repository] = Repo(manifest, dict(blobs), fault)
        return f"{self.host}/{repository}:latest"

    def start(self) -> "HostileRegistry":
        self.port = free_port()
        self._loop, self._thread = serve_in_thread(self._serve)
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(15)

    async def _serve(self, started: threading.Event) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/v2/", self._version_check)
        app.router.add_route("*", "/v2/{repo:.+}/manifests/{tag}", self._manifest)
        app.router.add_post("/v2/{repo:.+}/blobs/uploads/", self._start_upload)
        app.router.add_route("*", "/v2/{repo:.+}/blobs/{digest}", self._blob)
        app.router.add_put("/upload/{repo:.+}", self._finish_upload)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        started.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _version_check(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def _repo(self, request: web.Request) -> Repo:
        repo = self.repos.get(request.match_info["repo"])
        if repo is None:
            raise web.HTTPNotFound(text=json.dumps({"errors": [{"code": "NAME_UNKNOWN"}]}),
                                   content_type="application/json")
        repo.requests.append((request.method, request.path, request.headers.get("Range")))
        return repo

    async def _forever(self) -> None:
        await self._stop.wait()

    async def _stream(self, request: web.Request, repo: Repo, resp: web.StreamResponse,
                      parts, delay: float = 0.0) -> web.StreamResponse:
        """Send `parts` (an iterable of bytes) until it ends, the client leaves or we stop."""
        await resp.prepare(request)
        try:
            for part in parts:
                if self._stop.is_set():
                    break
                await resp.write(part)
                repo.sent += len(part)
                if delay:
                    await asyncio.sleep(delay)
            else:
                await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    async def _manifest(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        if request.method == "PUT":
            await request.read()
            if repo.fault == "endless_error":
                return await self._endless_error(request, repo)
            return web.Response(status=201)
        data, fault = repo.manifest, repo.fault
        headers = {"Content-Type": MEDIA_MANIFEST, "Docker-Content-Digest": digest_of(data)}
        if fault == "stall_manifest":
            await self._forever()
            return web.Response(status=503)
        if fault == "manifest_digest":
            headers["Docker-Content-Digest"] = digest_of(data + b" ")
        if fault == "huge_manifest":
            resp = web.StreamResponse(headers=headers)
            resp.content_length = 1 << 40
            return await self._stream(request, repo, resp, _endless(b" " * CHUNK_BYTES))
        if fault in ("endless_manifest", "drip_manifest"):
            resp = web.StreamResponse(headers=headers)
            resp.enable_chunked_encoding()
            if fault == "drip_manifest":
                return await self._stream(request, repo, resp, _endless(b" "), delay=0.2)
            return await self._stream(request, repo, resp,
                                      _chain([b'{"schemaVersion":2,"layers":['],
                                             _endless(b" " * CHUNK_BYTES)))
        repo.sent += len(data)
        return web.Response(body=data, headers=headers)

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        digest = request.match_info["digest"]
        data = repo.blobs.get(digest)
        if request.method == "HEAD":
            return web.Response(status=404)
        if data is None:
            return web.json_response({"errors": [{"code": "BLOB_UNKNOWN"}]}, status=404)
        fault = repo.fault
        if fault == "redirect_loop":
            raise web.HTTPTemporaryRedirect(request.path)
        if fault == "wrong_blob":
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        range_header = request.headers.get("Range", "")
        if range_header.startswith("bytes=") and range_header.endswith("-"):
            start = int(range_header[6:-1])
            if start >= len(data):
                return web.Response(status=416)
        body = data[start:]
        resp = web.StreamResponse(status=206 if start else 200,
                                  headers={"Content-Type": "application/octet-stream"})
        if start:
            resp.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if fault == "long_blob":
            body += bytes(len(data))
        if fault in ("endless_blob", "short_blob", "stall_blob"):
            resp.enable_chunked_encoding()
        else:
            resp.content_length = len(body)
        if fault == "endless_blob":
            return await self._stream(request, repo, resp,
                                      _chain(_chunks(body), _endless(bytes(CHUNK_BYTES))))
        if fault == "short_blob":
            return await self._stream(request, repo, resp, _chunks(body[:len(body) // 2]))
        if fault == "drip_blob":
            return await self._stream(request, repo, resp,
                                      (body[i:i + 1] for i in range(len(body))), delay=0.2)
        if fault == "stall_blob":
            await resp.prepare(request)
            try:
                await resp.write(body[:len(body) // 2])
                repo.sent += len(body) // 2
            except ConnectionError:
                return resp
            await self._forever()
            return resp
        return await self._stream(request, repo, resp, _chunks(body))

    async def _start_upload(self, request: web.Request) -> web.Response:
        self._repo(request)
        return web.Response(status=202, headers={
            "Location": f"/upload/{request.match_info['repo']}"})

    async def _finish_upload(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        await request.read()
        if repo.fault == "endless_error":
            return await self._endless_error(request, repo)
        return web.Response(status=201)

    async def _endless_error(self, request: web.Request, repo: Repo) -> web.StreamResponse:
        resp = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        return await self._stream(request, repo, resp,
                                  _chain([b'{"errors":[{"message":"'], _endless(b"x" * CHUNK_BYTES)))


def _chunks(data: bytes):
    for i in range(0, len(data), CHUNK_BYTES):
        yield data[i:i + CHUNK_BYTES]


def _endless(part: bytes):
    while True:
        yield part


def _chain(*iterables):
    for it in iterables:
        yield from it

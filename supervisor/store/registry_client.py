"""One repository on an OCI distribution registry, over httpx.

Manifests by tag, blobs by digest (with HTTP Range for resumes), monolithic or chunked upload
sessions, and the `WWW-Authenticate: Bearer realm=...,service=...,scope=...` challenge: on a
401 the client fetches an anonymous token from the realm (same host only, as Ollama insists)
and retries the request once.

A registry is not trusted to behave. Invariants:
- Everything read from it is bounded: a manifest by `MAX_MANIFEST_BYTES` (checked against
  Content-Length first, then while reading), every other whole answer (errors, tokens, upload
  replies) by `MAX_REPLY_BYTES`, redirects by `MAX_REDIRECTS`; blob bodies are streamed to the
  caller, which bounds them by the size the manifest declares.
- Time is bounded too: with `timeout_s`, a registry that sends nothing for that long fails the
  request, and a manifest must arrive whole within MANIFEST_DEADLINE_FACTOR times it.
- Every transport failure (timeouts, redirect loops, dropped connections), during the request
  or while its body streams, is a RegistryError that says what was being fetched.
- A manifest whose bytes do not hash to the registry's `Docker-Content-Digest` is rejected.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import httpx

from mlxr.shared.errors import ModelNotFound, RegistryError

from .manifest import MEDIA_MANIFEST
from .names import ModelName

MAX_MANIFEST_BYTES = 4 << 20
MAX_REPLY_BYTES = 256 << 10
# Past MLXR_REGISTRY_TIMEOUT, a body slower than this on average fails (a dripping registry).
MIN_RATE_BYTES_S = 1024
MAX_REDIRECTS = 10
CONNECT_TIMEOUT_S = 15.0
MANIFEST_DEADLINE_FACTOR = 3
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


def parse_challenge(header: str) -> dict[str, str]:
    """The parameters of a Bearer challenge ({"realm", "service", "scope"})."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise RegistryError(f"registry asks for unsupported authentication: {header!r}")
    return {k.lower(): v for k, v in _CHALLENGE_PARAM.findall(rest)}


@dataclass(slots=True)
class Reply:
    """A registry's whole answer to a request, its body cut at MAX_REPLY_BYTES."""
    status_code: int
    headers: httpx.Headers
    url: httpx.URL
    body: bytes
    reason: str = ""


def _error_text(reply: Reply) -> str:
    try:
        body = json.loads(reply.body)
        errors = body.get("errors") if isinstance(body, dict) else None
        if isinstance(errors, list) and errors:
            return "; ".join(str(e.get("message") or e.get("code")) if isinstance(e, dict)
                             else str(e) for e in errors)[:500]
        if isinstance(body, dict) and body.get("error"):
            return str(body["error"])[:500]
    except (ValueError, RecursionError):
        pass
    return reply.body[:200].decode(errors="replace") or reply.reason


def _declared_length(resp: httpx.Response) -> int | None:
    value = resp.headers.get("content-length", "")
    return int(value) if value.isdigit() else None


class RegistryClient:
    def __init__(self, name: ModelName, *, insecure: bool = False,
                 transport: httpx.AsyncBaseTransport | None = None,
                 timeout_s: float | None = 60.0):
        self.name = name
        self.base_url = f"{'http' if insecure else 'https'}://{name.host}"
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        connect = min(CONNECT_TIMEOUT_S, self.timeout_s or CONNECT_TIMEOUT_S)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=connect), follow_redirects=True,
            max_redirects=MAX_REDIRECTS, transport=transport, headers={"User-Agent": "mlxr"})
        self._token: str | None = None

    async def __aenter__(self) -> "RegistryClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._http.aclose()

    def url(self, *parts: str) -> str:
        return "/".join([self.base_url, "v2", self.name.repository, *parts])

    def failure(self, what: str, exc: Exception) -> RegistryError:
        """A transport failure while `what` as a RegistryError that says what happened."""
        host = self.name.host
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            return RegistryError(f"{what}: could not connect to the registry {host} in time")
        if isinstance(exc, httpx.TimeoutException) and self.timeout_s:
            return RegistryError(f"{what}: the registry {host} sent nothing for "
                                 f"{self.timeout_s:g}s (MLXR_REGISTRY_TIMEOUT)")
        if isinstance(exc, TimeoutError) and self.timeout_s:
            return RegistryError(f"{what}: the registry {host} took longer than "
                                 f"{self._manifest_deadline_s():g}s (three times "
                                 "MLXR_REGISTRY_TIMEOUT)")
        if isinstance(exc, httpx.TooManyRedirects):
            return RegistryError(f"{what}: the registry {host} redirected more than "
                                 f"{MAX_REDIRECTS} times")
        return RegistryError(f"{what}: registry {host}: {exc.__class__.__name__}: {exc}")

    async def send(self, method: str, url: str, *, headers: dict[str, str] | None = None,
                   content: bytes | None = None, what: str = "") -> httpx.Response:
        """A streaming response, sent with the current token; on a 401, answer the challenge
        and send once more. The caller closes it."""
        what = what or f"{method} {url}"
        for attempt in (0, 1):
            h = dict(headers or {})
            if self._token:
                h["Authorization"] = f"Bearer {self._token}"
            try:
                request = self._http.build_request(method, url, headers=h, content=content)
                resp = await self._http.send(request, stream=True)
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise self.failure(what, exc) from None
            if resp.status_code != 401 or attempt == 1:
                return resp
            challenge = resp.headers.get("www-authenticate", "")
            await resp.aclose()
            if not challenge:
                break
            self._token = await self._fetch_token(parse_challenge(challenge))
        raise RegistryError(f"registry {self.name.host}: unauthorized")

    async def body(self, resp: httpx.Response, what: str) -> AsyncIterator[bytes]:
        """The bytes of a streaming response; transport failures become RegistryErrors. Past
        `timeout_s`, a body that averages under MIN_RATE_BYTES_S fails too: a registry that
        sends a byte just before every timeout would otherwise never end."""
        started, received = time.monotonic(), 0
        try:
            async for chunk in resp.aiter_bytes():
                received += len(chunk)
                elapsed = time.monotonic() - started
                if self.timeout_s and elapsed > self.timeout_s and \
                        received < MIN_RATE_BYTES_S * elapsed:
                    raise RegistryError(
                        f"{what}: the registry {self.name.host} sent only {received} bytes in "
                        f"{elapsed:.0f}s (less than {MIN_RATE_BYTES_S} bytes a second)")
                yield chunk
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self.failure(what, exc) from None

    async def read(self, resp: httpx.Response, what: str, limit: int = MAX_REPLY_BYTES) -> Reply:
        """The whole (closed) answer, its body cut at `limit` bytes."""
        data = bytearray()
        try:
            async with contextlib.aclosing(self.body(resp, what)) as chunks:
                async for chunk in chunks:
                    data += chunk
                    if len(data) >= limit:
                        break
        finally:
            await resp.aclose()
        return Reply(resp.status_code, resp.headers, resp.url, bytes(data[:limit]),
                     resp.reason_phrase)

    async def request(self, method: str, url: str, *, headers: dict[str, str] | None = None,
                      content: bytes | None = None, what: str = "") -> Reply:
        what = what or f"{method} {url}"
        resp = await self.send(method, url, headers=headers, content=content, what=what)
        return await self.read(resp, what)

    async def _fetch_token(self, challenge: dict[str, str]) -> str:
        realm = challenge.get("realm", "")
        if urlsplit(realm).hostname != urlsplit(self.base_url).hostname:
            raise RegistryError(f"token realm {realm!r} is not on the registry's host")
        params = {k: challenge[k] for k in ("service", "scope") if challenge.get(k)}
        what = f"token request to {realm}"
        try:
            request = self._http.build_request("GET", realm, params=params)
            reply = await self.read(await self._http.send(request, stream=True), what)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self.failure(what, exc) from None
        if reply.status_code != 200:
            raise RegistryError(f"{what} failed: {reply.status_code} {_error_text(reply)}")
        try:
            body = json.loads(reply.body)
        except (ValueError, RecursionError):
            raise RegistryError(f"token response from {realm} is not JSON") from None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"token response from {realm} has no token")
        return token

    def _raise(self, reply: Reply, what: str, not_found: bool = False) -> None:
        if reply.status_code == 404 and not_found:
            raise ModelNotFound(f'{what}: "{self.name.display}" not found on {self.name.host}')
        raise RegistryError(f"{what}: {reply.status_code} {_error_text(reply)}")

    def _manifest_deadline_s(self) -> float | None:
        return self.timeout_s * MANIFEST_DEADLINE_FACTOR if self.timeout_s else None

    async def get_manifest(self) -> bytes:
        """The manifest's bytes, at most MAX_MANIFEST_BYTES, whole within the deadline."""
        what = "pull model manifest"
        try:
            async with asyncio.timeout(self._manifest_deadline_s()):
                return await self._get_manifest(what)
        except TimeoutError as exc:
            raise self.failure(what, exc) from None

    async def _get_manifest(self, what: str) -> bytes:
        resp = await self.send("GET", self.url("manifests", self.name.tag),
                               headers={"Accept": MEDIA_MANIFEST}, what=what)
        if resp.status_code != 200:
            self._raise(await self.read(resp, what), what, not_found=True)
        try:
            declared = _declared_length(resp)
            if declared is not None and declared > MAX_MANIFEST_BYTES:
                raise RegistryError(f"{what}: manifest is too large ({declared} bytes, at "
                                    f"most {MAX_MANIFEST_BYTES})")
            data = bytearray()
            async with contextlib.aclosing(self.body(resp, what)) as chunks:
                async for chunk in chunks:
                    data += chunk
                    if len(data) > MAX_MANIFEST_BYTES:
                        raise RegistryError(f"{what}: manifest is too large (more than "
                                            f"{MAX_MANIFEST_BYTES} bytes)")
        finally:
            await resp.aclose()
        digest = resp.headers.get("docker-content-digest", "")
        if digest.startswith("sha256:"):
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if digest.lower() != actual:
                raise RegistryError(f"{what}: the manifest's bytes hash to {actual}, not to the "
                                    f"{digest} the registry says")
        return bytes(data)

    async def has_blob(self, digest: str) -> bool:
        what = f"check blob {digest}"
        reply = await self.request("HEAD", self.url("blobs", digest), what=what)
        if reply.status_code in (200, 307):
            return True
        if reply.status_code == 404:
            return False
        self._raise(reply, what)
        return False

    async def open_blob(self, digest: str, offset: int = 0) -> httpx.Response:
        """A streaming response for the blob from `offset` (status 206 when resumed); read it
        with `body`."""
        what = f"download {digest}"
        # Uncompressed, so that Content-Length counts the blob's own bytes.
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        resp = await self.send("GET", self.url("blobs", digest), headers=headers, what=what)
        if resp.status_code not in (200, 206, 416):
            self._raise(await self.read(resp, what), what)
        return resp

    async def start_upload(self) -> str:
        reply = await self.request("POST", self.url("blobs", "uploads", ""), what="start upload")
        if reply.status_code != 202 or "location" not in reply.headers:
            self._raise(reply, "start upload")
        return str(reply.url.join(reply.headers["location"]))

    async def upload_chunk(self, location: str, data: bytes, start: int) -> str:
        reply = await self.request("PATCH", location, content=data, what="upload chunk",
                                   headers={"Content-Type": "application/octet-stream",
                                            "Content-Range": f"{start}-{start + len(data) - 1}"})
        if reply.status_code != 202:
            self._raise(reply, "upload chunk")
        return str(reply.url.join(reply.headers.get("location", location)))

    async def finish_upload(self, location: str, digest: str, data: bytes = b"") -> None:
        url = httpx.URL(location).copy_merge_params({"digest": digest})
        reply = await self.request("PUT", str(url), content=data, what=f"upload {digest}",
                                   headers={"Content-Type": "application/octet-stream"})
        if reply.status_code not in (201, 204):
            self._raise(reply, f"upload {digest}")

    async def put_manifest(self, data: bytes) -> None:
        reply = await self.request("PUT", self.url("manifests", self.name.tag), content=data,
                                   what="push manifest",
                                   headers={"Content-Type": MEDIA_MANIFEST})
        if reply.status_code not in (200, 201):
            self._raise(reply, "push manifest")

"""One repository on an OCI distribution registry, over httpx.

Manifests by tag, blobs by digest (with HTTP Range for resumes), monolithic or chunked upload
sessions, and the `WWW-Authenticate: Bearer realm=...,service=...,scope=...` challenge: on a
401 the client fetches an anonymous token from the realm (same host only, as Ollama insists)
and retries the request once.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import httpx

from mlxr.shared.errors import ModelNotFound, RegistryError

from .manifest import MEDIA_MANIFEST
from .names import ModelName

MAX_MANIFEST_BYTES = 4 << 20
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


def parse_challenge(header: str) -> dict[str, str]:
    """The parameters of a Bearer challenge ({"realm", "service", "scope"})."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise RegistryError(f"registry asks for unsupported authentication: {header!r}")
    return {k.lower(): v for k, v in _CHALLENGE_PARAM.findall(rest)}


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        errors = body.get("errors") if isinstance(body, dict) else None
        if errors:
            return "; ".join(str(e.get("message") or e.get("code")) for e in errors)
        if isinstance(body, dict) and body.get("error"):
            return str(body["error"])
    except (ValueError, AttributeError):
        pass
    return resp.text[:200] or resp.reason_phrase


class RegistryClient:
    def __init__(self, name: ModelName, *, insecure: bool = False,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.name = name
        self.base_url = f"{'http' if insecure else 'https'}://{name.host}"
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(60.0, connect=15.0), follow_redirects=True,
            transport=transport, headers={"User-Agent": "mlxr"})
        self._token: str | None = None

    async def __aenter__(self) -> "RegistryClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._http.aclose()

    def url(self, *parts: str) -> str:
        return "/".join([self.base_url, "v2", self.name.repository, *parts])

    async def send(self, method: str, url: str, *, headers: dict[str, str] | None = None,
                   content: bytes | None = None, stream: bool = False) -> httpx.Response:
        """Send with the current token; on a 401, answer the challenge and send once more."""
        for attempt in (0, 1):
            h = dict(headers or {})
            if self._token:
                h["Authorization"] = f"Bearer {self._token}"
            request = self._http.build_request(method, url, headers=h, content=content)
            try:
                resp = await self._http.send(request, stream=stream)
            except httpx.HTTPError as exc:
                raise RegistryError(f"registry {self.name.host}: {exc.__class__.__name__}: "
                                    f"{exc}") from None
            if resp.status_code != 401 or attempt == 1:
                return resp
            challenge = resp.headers.get("www-authenticate", "")
            await resp.aclose()
            if not challenge:
                break
            self._token = await self._fetch_token(parse_challenge(challenge))
        raise RegistryError(f"registry {self.name.host}: unauthorized")

    async def _fetch_token(self, challenge: dict[str, str]) -> str:
        realm = challenge.get("realm", "")
        if urlsplit(realm).hostname != urlsplit(self.base_url).hostname:
            raise RegistryError(f"token realm {realm!r} is not on the registry's host")
        params = {k: challenge[k] for k in ("service", "scope") if challenge.get(k)}
        try:
            resp = await self._http.get(realm, params=params)
        except httpx.HTTPError as exc:
            raise RegistryError(f"token request to {realm} failed: {exc}") from None
        if resp.status_code != 200:
            raise RegistryError(f"token request to {realm} failed: {resp.status_code} "
                                f"{_error_text(resp)}")
        body = resp.json()
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"token response from {realm} has no token")
        return token

    def _raise(self, resp: httpx.Response, what: str, not_found: bool = False) -> None:
        if resp.status_code == 404 and not_found:
            raise ModelNotFound(f'{what}: "{self.name.display}" not found on {self.name.host}')
        raise RegistryError(f"{what}: {resp.status_code} {_error_text(resp)}")

    async def get_manifest(self) -> bytes:
        resp = await self.send("GET", self.url("manifests", self.name.tag),
                               headers={"Accept": MEDIA_MANIFEST}, stream=True)
        try:
            if resp.status_code != 200:
                await resp.aread()
                self._raise(resp, "pull model manifest", not_found=True)
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    raise RegistryError("pull model manifest: manifest is too large")
            return bytes(data)
        finally:
            await resp.aclose()

    async def has_blob(self, digest: str) -> bool:
        resp = await self.send("HEAD", self.url("blobs", digest))
        if resp.status_code in (200, 307):
            return True
        if resp.status_code == 404:
            return False
        self._raise(resp, f"check blob {digest}")
        return False

    async def open_blob(self, digest: str, offset: int = 0) -> httpx.Response:
        """A streaming response for the blob from `offset` (status 206 when resumed)."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        resp = await self.send("GET", self.url("blobs", digest), headers=headers, stream=True)
        if resp.status_code not in (200, 206, 416):
            await resp.aread()
            await resp.aclose()
            self._raise(resp, f"download {digest}")
        return resp

    async def start_upload(self) -> str:
        resp = await self.send("POST", self.url("blobs", "uploads", ""))
        if resp.status_code != 202 or "location" not in resp.headers:
            self._raise(resp, "start upload")
        return str(resp.url.join(resp.headers["location"]))

    async def upload_chunk(self, location: str, data: bytes, start: int) -> str:
        resp = await self.send("PATCH", location, content=data, headers={
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{start}-{start + len(data) - 1}"})
        if resp.status_code != 202:
            self._raise(resp, "upload chunk")
        return str(resp.url.join(resp.headers.get("location", location)))

    async def finish_upload(self, location: str, digest: str, data: bytes = b"") -> None:
        url = httpx.URL(location).copy_merge_params({"digest": digest})
        resp = await self.send("PUT", str(url), content=data,
                               headers={"Content-Type": "application/octet-stream"})
        if resp.status_code not in (201, 204):
            self._raise(resp, f"upload {digest}")

    async def put_manifest(self, data: bytes) -> None:
        resp = await self.send("PUT", self.url("manifests", self.name.tag), content=data,
                               headers={"Content-Type": MEDIA_MANIFEST})
        if resp.status_code not in (200, 201):
            self._raise(resp, "push manifest")

"""The command line's HTTP client for the server's Ollama API.

Every call raises a `CliError`: `ServerUnreachable` when nothing answers at the base URL,
`ServerError` for an error reply. Streaming endpoints go through one reader, `stream()`, which
yields the NDJSON lines and raises on a line with an `error` key (an error after the stream
began). Closing a stream early (Ctrl-C) closes the connection, which cancels the request."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import httpx

from mlxr.shared.config import is_loopback_host

CHUNK_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 5.0


class CliError(Exception):
    """An error the command line prints as `Error: <message>`, exiting 1."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ServerUnreachable(CliError):
    def __init__(self, base_url: str):
        super().__init__(f"could not connect to mlxr at {base_url} — is it running? "
                         "Start it with: mlxr serve")


class ServerError(CliError):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def _error_of(resp: httpx.Response) -> ServerError:
    try:
        message = resp.json().get("error")
    except (ValueError, AttributeError):
        message = None
    if not isinstance(message, str) or not message:
        message = resp.text.strip() or f"{resp.status_code} {resp.reason_phrase}"
    return ServerError(message, resp.status_code)


def file_digest(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """"sha256:<hex>" of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return "sha256:" + h.hexdigest()


class ApiClient:
    """With `socket_path`, requests go over that Unix socket (MLXR_HOST=unix:///path) and
    `base_url` only names it in messages."""

    def __init__(self, base_url: str, api_key: str | None = None,
                 transport: httpx.BaseTransport | None = None, socket_path: Path | None = None):
        if socket_path is not None:
            transport = transport or httpx.HTTPTransport(uds=str(socket_path))
            base_url = "http://localhost"
        self.base_url = base_url.rstrip("/")
        self._where = f"unix:{socket_path}" if socket_path is not None else self.base_url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: loading a model or a long reply may take minutes. Proxies from the
        # environment are for remote servers; a loopback server is reached directly.
        local = is_loopback_host(urlsplit(base_url).hostname or "")
        self._http = httpx.Client(base_url=self.base_url, trust_env=not local,
                                  timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                  headers=headers, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ApiClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------
    def _lost(self, exc: httpx.TransportError) -> CliError:
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return ServerUnreachable(self._where)
        return ServerError(f"lost the connection to mlxr at {self._where}: {exc}")

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        """One request; an error status raises `ServerError`."""
        try:
            resp = self._http.request(method, path, json=body, **kwargs)
        except httpx.TransportError as exc:
            raise self._lost(exc) from None
        if resp.status_code >= 400:
            raise _error_of(resp)
        return resp

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST and yield each NDJSON line; a line with an `error` key raises `ServerError`."""
        try:
            with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error_of(resp)
                for line in resp.iter_lines():
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                    except ValueError:
                        raise ServerError(f"unreadable reply from the server: {line[:200]!r}")
                    if isinstance(item, dict) and item.get("error"):
                        raise ServerError(str(item["error"]))
                    yield item
        except httpx.TransportError as exc:
            raise self._lost(exc) from None

    # -- the API -----------------------------------------------------------------------------
    def tags(self) -> dict[str, Any]:
        return self.request("GET", "/api/tags").json()

    def ps(self) -> dict[str, Any]:
        return self.request("GET", "/api/ps").json()

    def show(self, model: str, verbose: bool = False) -> dict[str, Any]:
        return self.request("POST", "/api/show", {"model": model, "verbose": verbose}).json()

    def copy(self, source: str, destination: str) -> None:
        self.request("POST", "/api/copy", {"source": source, "destination": destination})

    def delete(self, model: str) -> None:
        self.request("DELETE", "/api/delete", {"model": model})

    def generate(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.stream("/api/generate", body)

    def chat(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.stream("/api/chat", body)

    def pull(self, name: str, insecure: bool = False) -> Iterator[dict[str, Any]]:
        return self.stream("/api/pull", {"model": name, "insecure": insecure})

    def push(self, name: str, insecure: bool = False) -> Iterator[dict[str, Any]]:
        return self.stream("/api/push", {"model": name, "insecure": insecure})

    def create(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.stream("/api/create", body)

    def has_blob(self, digest: str) -> bool:
        try:
            resp = self._http.head(f"/api/blobs/{digest}")
        except httpx.TransportError as exc:
            raise self._lost(exc) from None
        if resp.status_code not in (200, 404):
            raise _error_of(resp)
        return resp.status_code == 200

    def upload_blob(self, digest: str, path: Path,
                    on_bytes: Callable[[int], None] | None = None) -> None:
        """Stream a file to /api/blobs/<digest> (never all of it in memory)."""
        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    yield chunk
                    if on_bytes:
                        on_bytes(len(chunk))

        size = path.stat().st_size
        self.request("POST", f"/api/blobs/{digest}", content=chunks(),
                     headers={"Content-Length": str(size),
                              "Content-Type": "application/octet-stream"})

"""Ollama's model-management endpoints over the store: tags, show, copy, delete, blobs, create,
pull, push. Handlers parse, call the store, serialize; errors are `shared.errors` types that
the error middleware renders. Streaming endpoints validate before their first line, so bad
input is a 4xx, and an error after streaming began is a final `{"error": ...}` line."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from aiohttp import web

from mlxr.shared.errors import InvalidRequest, MlxrError, PayloadTooLarge
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api.middleware import read_json
from mlxr.supervisor.store.blobs import parse_digest
from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.metadata import chat_template_of
from mlxr.supervisor.store.modelfile import format_parameters, render_modelfile
from mlxr.supervisor.store.store import ModelRecord, Store
from mlxr.supervisor.store.transfer import pull_model, push_model

log = logging.getLogger("mlxr.store")
MAX_BLOB_BYTES = 1 << 40
UPLOAD_FLUSH_BYTES = 4 << 20


def add_store_routes(app: web.Application, store: Store) -> None:
    h = _StoreHandlers(store)
    app.router.add_get("/api/tags", h.tags)
    app.router.add_post("/api/show", h.show)
    app.router.add_post("/api/copy", h.copy)
    app.router.add_delete("/api/delete", h.delete)
    app.router.add_route("HEAD", "/api/blobs/{digest}", h.head_blob)
    app.router.add_post("/api/blobs/{digest}", h.upload_blob)
    app.router.add_post("/api/create", h.create)
    app.router.add_post("/api/pull", h.pull)
    app.router.add_post("/api/push", h.push)


def details(record: ModelRecord) -> dict[str, Any]:
    c = record.config
    return {"parent_model": "", "format": c.get("model_format") or "",
            "family": c.get("model_family") or "", "families": c.get("model_families"),
            "parameter_size": c.get("model_type") or "",
            "quantization_level": c.get("file_type") or ""}


def tags_entry(record: ModelRecord) -> dict[str, Any]:
    return {"name": record.name, "model": record.name,
            "modified_at": record.modified_at.isoformat(), "size": record.size,
            "digest": record.digest, "details": details(record)}


def _model_field(body: dict[str, Any]) -> str:
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("model is required")
    return name


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be true or false")
    return value


class _StoreHandlers:
    def __init__(self, store: Store):
        self.store = store

    async def tags(self, request: web.Request) -> web.Response:
        records = await asyncio.to_thread(self.store.list)
        return web.json_response({"models": [tags_entry(r) for r in records]})

    async def show(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        record = await asyncio.to_thread(self.store.resolve, _model_field(body))
        return web.json_response(await asyncio.to_thread(self._show, record))

    def _show(self, record: ModelRecord) -> dict[str, Any]:
        files = {x.name: self.store.blobs.path(x.hex)
                 for x in self.store.manifest_of(record).files()}
        out: dict[str, Any] = {
            "modelfile": render_modelfile(record.name, template=record.template,
                                          system=record.system, params=record.params,
                                          license=[record.license] if record.license else [],
                                          messages=record.messages),
            "parameters": format_parameters(record.params),
            "template": record.template or chat_template_of(files) or "",
            "system": record.system or "",
            "details": details(record), "model_info": record.model_info,
            "capabilities": record.capabilities,
            "modified_at": record.modified_at.isoformat(),
            "license": record.license or "", "messages": record.messages,
        }
        always = ("details", "model_info", "capabilities", "modified_at")
        return {k: v for k, v in out.items() if k in always or v not in ("", [])}

    async def copy(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        source, destination = body.get("source"), body.get("destination")
        if not isinstance(source, str) or not source:
            raise InvalidRequest("source is required")
        if not isinstance(destination, str) or not destination:
            raise InvalidRequest("destination is required")
        await asyncio.to_thread(self.store.copy, source, destination)
        return web.Response(status=200)

    async def delete(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        await asyncio.to_thread(self.store.delete, _model_field(body))
        return web.Response(status=200)

    async def head_blob(self, request: web.Request) -> web.Response:
        hex_digest = parse_digest(request.match_info["digest"])
        return web.Response(status=200 if self.store.blobs.exists(hex_digest) else 404)

    async def upload_blob(self, request: web.Request) -> web.Response:
        hex_digest = parse_digest(request.match_info["digest"])
        if self.store.blobs.exists(hex_digest):
            return web.Response(status=200)
        if (request.content_length or 0) > MAX_BLOB_BYTES:
            raise PayloadTooLarge(f"blob larger than {MAX_BLOB_BYTES} bytes")
        writer = await asyncio.to_thread(self.store.blobs.writer, hex_digest)
        try:
            buf = bytearray()
            async for chunk in request.content.iter_chunked(1 << 20):
                buf += chunk
                if writer.size + len(buf) > MAX_BLOB_BYTES:
                    raise PayloadTooLarge(f"blob larger than {MAX_BLOB_BYTES} bytes")
                if len(buf) >= UPLOAD_FLUSH_BYTES:
                    await asyncio.to_thread(writer.write, bytes(buf))
                    buf.clear()
            if buf:
                await asyncio.to_thread(writer.write, bytes(buf))
            await asyncio.to_thread(writer.commit)
        except BaseException:
            writer.abort()
            raise
        return web.Response(status=201)

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        req = CreateRequest.from_json(body)
        return await _progress(request, create_model(self.store, req), _flag(body, "stream", True))

    async def pull(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        items = pull_model(self.store, _model_field(body), insecure=_flag(body, "insecure", False))
        return await _progress(request, items, _flag(body, "stream", True))

    async def push(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        items = push_model(self.store, _model_field(body), insecure=_flag(body, "insecure", False))
        return await _progress(request, items, _flag(body, "stream", True))


async def _progress(request: web.Request, items: AsyncIterator[dict[str, Any]],
                    stream: bool) -> web.StreamResponse:
    """Serve progress as NDJSON (or the last item alone when not streaming). The first item is
    awaited before any byte is sent, so validation errors keep their HTTP status."""
    try:
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = None
        if not stream:
            last = first
            async for item in items:
                last = item
            return web.json_response(last or {"status": "success"})
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            if first is not None:
                await resp.write(dumps_line(first))
            async for item in items:
                await resp.write(dumps_line(item))
        except MlxrError as err:
            await resp.write(dumps_line({"error": err.message}))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: report it in the stream, keep serving
            log.exception("error while streaming %s", request.path)
            await resp.write(dumps_line({"error": f"internal error: {exc}"}))
        await resp.write_eof()
        return resp
    finally:
        await items.aclose()

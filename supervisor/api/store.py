"""Ollama's model-management endpoints over the store: tags, show, copy, delete, blobs, create,
pull, push. Handlers parse (body.py), call the store (the app's `keys.STORE`), serialize;
errors are `shared.errors` types that the error middleware renders. Streaming endpoints
validate before their first line, so bad input is a 4xx, and an error after streaming began is
a final `{"error": ...}` line. A full disk is a 507 (or that final line) saying what was kept."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from aiohttp import web

from mlxr.shared.errors import InsufficientStorage, MlxrError, PayloadTooLarge
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api.body import bool_field, model_field, parse_copy, read_json
from mlxr.supervisor.api.keys import SERVICE, STORE
from mlxr.supervisor.store.blobs import parse_digest, removed
from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.files import check_room
from mlxr.supervisor.store.metadata import (chat_template_of, tensor_list,
                                            with_template_capabilities)
from mlxr.supervisor.store.modelfile import format_parameters, render_modelfile
from mlxr.supervisor.store.store import ADAPTER_DIR, ModelRecord, Store, model_details
from mlxr.supervisor.store.transfer import REGISTRY_TIMEOUT_S, pull_model, push_model

log = logging.getLogger("mlxr.store")
MAX_BLOB_BYTES = 1 << 40
UPLOAD_FLUSH_BYTES = 4 << 20


def details(record: ModelRecord) -> dict[str, Any]:
    """Ollama's `details`, with its context_length and embedding_length (omitted if unknown)."""
    out = model_details(record)
    for key in ("context_length", "embedding_length"):
        value = (record.config or {}).get(key)
        if isinstance(value, int) and value > 0:
            out[key] = value
    return out


def capabilities(record: ModelRecord) -> list[str]:
    return with_template_capabilities(record.capabilities, record.template)


def tags_entry(record: ModelRecord) -> dict[str, Any]:
    return {"name": record.name, "model": record.name,
            "modified_at": record.modified_at.isoformat(), "size": record.size,
            "digest": record.digest, "details": details(record),
            "capabilities": capabilities(record)}


async def tags(request: web.Request) -> web.Response:
    records = await asyncio.to_thread(request.app[STORE].list)
    return web.json_response({"models": [tags_entry(r) for r in records]})


async def show(request: web.Request) -> web.Response:
    store = request.app[STORE]
    body = await read_json(request)
    record = await asyncio.to_thread(store.resolve, model_field(body))
    verbose = bool_field(body, "verbose", False)
    return web.json_response(await asyncio.to_thread(_show, store, record, verbose))


def _adapter_paths(store: Store, record: ModelRecord, manifest: Any) -> list[str]:
    """Where the model's adapters are, for ADAPTER lines: a GGUF adapter's blob (as Ollama
    shows it), or the directory of a safetensors adapter's files, which `create` reads back."""
    layers = manifest.adapters()
    paths = [str(store.blobs.path(x.hex)) for x in layers if x.name is None]
    if layers and not paths:
        paths.append(str(store.runner_dir(record) / ADAPTER_DIR))
    return paths


def _show(store: Store, record: ModelRecord, verbose: bool = False) -> dict[str, Any]:
    """Ollama's show; `verbose` adds `tensors` (each tensor's name, type and shape)."""
    manifest = store.manifest_of(record)
    files = {x.name: store.blobs.path(x.hex) for x in manifest.files()}
    out: dict[str, Any] = {
        "modelfile": render_modelfile(record.name, template=record.template,
                                      system=record.system, params=record.params,
                                      license=[record.license] if record.license else [],
                                      messages=record.messages,
                                      adapters=_adapter_paths(store, record, manifest)),
        "parameters": format_parameters(record.params),
        "template": record.template or chat_template_of(files) or "",
        "system": record.system or "",
        "details": details(record), "model_info": record.model_info,
        "capabilities": capabilities(record),
        "modified_at": record.modified_at.isoformat(),
        "license": record.license or "", "messages": record.messages,
    }
    if verbose and files:
        out["tensors"] = tensor_list(files)
    always = ("details", "model_info", "capabilities", "modified_at")
    return {k: v for k, v in out.items() if k in always or v not in ("", [])}


async def copy(request: web.Request) -> web.Response:
    source, destination = parse_copy(await read_json(request))
    await asyncio.to_thread(request.app[STORE].copy, source, destination)
    return web.Response(status=200)


async def delete(request: web.Request) -> web.Response:
    body = await read_json(request)
    await asyncio.to_thread(request.app[STORE].delete, model_field(body))
    return web.Response(status=200)


async def head_blob(request: web.Request) -> web.Response:
    hex_digest = parse_digest(request.match_info["digest"])
    return web.Response(status=200 if request.app[STORE].blobs.exists(hex_digest) else 404)


async def upload_blob(request: web.Request) -> web.Response:
    store = request.app[STORE]
    hex_digest = parse_digest(request.match_info["digest"])
    if store.blobs.exists(hex_digest):
        return web.Response(status=200)
    if (request.content_length or 0) > MAX_BLOB_BYTES:
        raise PayloadTooLarge(f"blob larger than {MAX_BLOB_BYTES} bytes")
    await asyncio.to_thread(check_room, store.blobs.root, request.content_length or 0,
                            f"blob sha256:{hex_digest}")
    writer = await asyncio.to_thread(store.blobs.writer, hex_digest)
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
    except InsufficientStorage as exc:
        writer.abort()
        raise removed(exc) from None
    except BaseException:
        writer.abort()
        raise
    return web.Response(status=201)


async def create(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req = CreateRequest.from_json(body)
    return await _progress(request, create_model(request.app[STORE], req),
                           bool_field(body, "stream", True))


def registry_timeout_s(request: web.Request) -> float:
    """The settings' MLXR_REGISTRY_TIMEOUT (the default for an app built without a service)."""
    service = request.app.get(SERVICE)
    return service.settings.registry_timeout_s if service is not None else REGISTRY_TIMEOUT_S


async def pull(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    items = pull_model(request.app[STORE], model_field(body),
                       insecure=bool_field(body, "insecure", False),
                       timeout_s=registry_timeout_s(request))
    return await _progress(request, items, bool_field(body, "stream", True))


async def push(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    items = push_model(request.app[STORE], model_field(body),
                       insecure=bool_field(body, "insecure", False),
                       timeout_s=registry_timeout_s(request))
    return await _progress(request, items, bool_field(body, "stream", True))


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

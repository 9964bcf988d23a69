"""Pull and push models over the OCI distribution API.

Invariants:
- A download goes to `blobs/sha256-<hex>-partial`, guarded by an flock on that file (two
  processes never append to one partial), resumes with `Range` from the partial's size, is
  verified, then renamed. A killed pull leaves at most that resumable partial.
- The manifest is written only after every blob it names exists; the registry's manifest bytes
  are kept as they are, so the model digest is the registry's.
- Concurrent pulls of one name in one process share one job (see shared_job.py).
- A push uploads blobs the registry lacks (HEAD first) and puts the manifest last.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

from mlxr.shared.errors import InvalidRequest, ModelNotFound, RegistryError

from .blobs import BlobWriter, Blobs
from .registry_client import RegistryClient
from .manifest import Layer, Manifest, ManifestError
from .names import ModelName, parse_name
from .conversions import converting
from .gguf.convert import check_supported
from .shared_job import Emit, SharedJob
from .store import Store

FLUSH_BYTES = 1 << 20
PROGRESS_EVERY_S = 0.1
UPLOAD_CHUNK_BYTES = 32 << 20


async def pull_model(store: Store, name: str, *, insecure: bool = False,
                     hf_endpoint: str | None = None) -> AsyncIterator[dict[str, Any]]:
    """Pull `name` into the store; yields Ollama's pull progress, ending in success.
    `hf.co/org/repo[:revision]` names are fetched from Hugging Face instead."""
    parsed = parse_name(name)
    if parsed.is_huggingface:
        from .hf import pull_huggingface

        async def work(emit: Emit) -> None:
            await pull_huggingface(store, parsed, emit, endpoint=hf_endpoint)
    else:
        async def work(emit: Emit) -> None:
            await _pull(store, parsed, insecure, emit)
    job = SharedJob.join(store.inflight, "pull:" + parsed.key, work)
    async for item in job.stream():
        yield item


async def _pull(store: Store, name: ModelName, insecure: bool, emit: Emit) -> None:
    emit({"status": "pulling manifest"})
    async with RegistryClient(name, insecure=insecure) as client:
        data = await client.get_manifest()
        try:
            m = Manifest.from_bytes(data)
        except ManifestError as exc:
            raise RegistryError(f"pull model manifest: {exc}") from None
        with store.pinned(m.hex_digests()):
            for layer in [*m.layers, m.config]:
                await _download(store.blobs, client, layer, emit)
            emit({"status": "verifying sha256 digest"})
            gguf = m.gguf()
            if gguf is not None:  # Ollama's own format: make its MLX directory now, once
                await asyncio.to_thread(check_supported, store.blobs.path(gguf.hex))
                async for item in converting(store, gguf.hex):
                    emit(item)
            emit({"status": "writing manifest"})
            await asyncio.to_thread(store.write_manifest, name, data)
    emit({"status": "removing any unused layers"})
    emit({"status": "success"})


async def _lock_partial(path: Path) -> int:
    """An fd holding an exclusive flock on the partial file at `path` (polling, so a cancelled
    wait leaves no lock behind)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            await asyncio.sleep(0.1)
            continue
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # renamed or removed while we waited: try again


async def _download(blobs: Blobs, client: RegistryClient, layer: Layer, emit: Emit) -> None:
    status = {"status": f"pulling {layer.hex[:12]}", "digest": layer.digest, "total": layer.size}
    if blobs.exists(layer.hex):
        emit({**status, "completed": layer.size})
        return
    partial = blobs.download_partial(layer.hex)
    fd = await _lock_partial(partial)
    try:
        if blobs.exists(layer.hex):  # another process finished it while we waited
            partial.unlink(missing_ok=True)
            emit({**status, "completed": layer.size})
            return
        for attempt in (0, 1):
            writer = await asyncio.to_thread(BlobWriter(blobs, layer.hex, partial).open, True)
            try:
                if writer.size > layer.size or attempt == 1:
                    writer.restart()
                await _fetch(client, layer, writer, status, emit)
                await asyncio.to_thread(writer.commit)
                return
            except InvalidRequest:  # digest mismatch: start over from byte 0, once
                if attempt == 1:
                    partial.unlink(missing_ok=True)
                    raise RegistryError(f"{layer.digest}: downloaded data does not match its "
                                        "digest") from None
            except BaseException:
                writer.abort(keep=True)
                raise
    finally:
        os.close(fd)


async def _fetch(client: RegistryClient, layer: Layer, writer: BlobWriter,
                 status: dict[str, Any], emit: Emit) -> None:
    resp = await client.open_blob(layer.digest, writer.size)
    try:
        if resp.status_code == 416:  # nothing left to fetch
            return
        if resp.status_code == 200 and writer.size:
            await asyncio.to_thread(writer.restart)  # the server ignored the Range
        emit({**status, "completed": writer.size})
        buf, last = bytearray(), time.monotonic()
        async for chunk in resp.aiter_bytes():
            buf += chunk
            if len(buf) >= FLUSH_BYTES:
                await asyncio.to_thread(writer.write, bytes(buf))
                buf.clear()
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    emit({**status, "completed": writer.size})
                    last = time.monotonic()
        if buf:
            await asyncio.to_thread(writer.write, bytes(buf))
        emit({**status, "completed": writer.size})
    finally:
        await resp.aclose()


async def push_model(store: Store, name: str, *, insecure: bool = False,
                     chunk_bytes: int = UPLOAD_CHUNK_BYTES) -> AsyncIterator[dict[str, Any]]:
    """Push a stored model to the registry its name points at; yields progress."""
    parsed = parse_name(name)
    path = store.manifest_file(parsed)
    if path is None:
        raise ModelNotFound(f'model "{name}" not found')
    data = path.read_bytes()
    m = Manifest.from_bytes(data)
    with store.pinned(m.hex_digests()):
        yield {"status": "retrieving manifest"}
        async with RegistryClient(parsed, insecure=insecure) as client:
            for layer in [*m.layers, m.config]:
                async for item in _upload(store.blobs, client, layer, chunk_bytes):
                    yield item
            yield {"status": "pushing manifest"}
            await client.put_manifest(data)
    yield {"status": "success"}


def _read(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


async def _upload(blobs: Blobs, client: RegistryClient, layer: Layer,
                  chunk_bytes: int) -> AsyncIterator[dict[str, Any]]:
    status = {"status": f"pushing {layer.hex[:12]}", "digest": layer.digest, "total": layer.size}
    if await client.has_blob(layer.digest):
        yield {**status, "completed": layer.size}
        return
    path = blobs.path(layer.hex)
    if not path.is_file():
        raise RegistryError(f"blob {layer.digest} is missing from the store")
    yield {**status, "completed": 0}
    location = await client.start_upload()
    if layer.size <= chunk_bytes:
        await client.finish_upload(location, layer.digest, await asyncio.to_thread(
            _read, path, 0, layer.size))
    else:
        offset = 0
        while offset < layer.size:
            data = await asyncio.to_thread(_read, path, offset, chunk_bytes)
            location = await client.upload_chunk(location, data, offset)
            offset += len(data)
            yield {**status, "completed": offset}
        await client.finish_upload(location, layer.digest)
    yield {**status, "completed": layer.size}


"""Pull and push models over the OCI distribution API.

Invariants:
- A download goes to `blobs/sha256-<hex>-partial`, guarded by an flock on that file (two
  processes never append to one partial), resumes with `Range` from the partial's size, is
  verified, then renamed. A killed pull leaves at most that resumable partial.
- The manifest is written only after every blob it names exists; the registry's manifest bytes
  are kept as they are, so the model digest is the registry's.
- Concurrent pulls of one name in one process share one job (see shared_job.py).
- A push uploads blobs the registry lacks (HEAD first) and puts the manifest last; it only
  reads the store, so a failed push leaves the store as it was.
- The registry is not trusted (see registry_client.py): a manifest with a bad digest, a bad
  size or an unsafe file name fails before any download; a blob is read up to the size the
  manifest declares and no further (more is a failure, and its partial file is dropped, as is
  one that fails its digest twice). A pull that needs more space than is free fails up front.
- A full disk is an InsufficientStorage (507) that says what is kept: a download keeps its
  partial file for the next pull to resume, and blobs already downloaded stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

from mlxr.shared.errors import (InsufficientStorage, InvalidRequest, MlxrError, ModelNotFound,
                                RegistryError)

from . import manifest as mf
from .blobs import BlobWriter, Blobs
from .files import check_room, no_space_in
from .registry_client import RegistryClient
from .manifest import Layer, Manifest, ManifestError
from .names import ModelName, parse_name
from .conversions import converting
from .gguf.convert import check_supported
from .shared_job import Emit, SharedJob
from .sources import check_file_name
from .store import MAX_TEXT_LAYER_BYTES, Store

FLUSH_BYTES = 1 << 20
PROGRESS_EVERY_S = 0.1
UPLOAD_CHUNK_BYTES = 32 << 20
REGISTRY_TIMEOUT_S = 60.0
# Layers the store reads whole (store.py): bounded like it bounds them.
_TEXT_MEDIA = (mf.MEDIA_CONFIG, *mf.METADATA_MEDIA)


class BlobRejected(RegistryError):
    """The registry sent bytes that cannot be the blob: its partial file is dropped."""


async def pull_model(store: Store, name: str, *, insecure: bool = False,
                     hf_endpoint: str | None = None,
                     timeout_s: float | None = REGISTRY_TIMEOUT_S) -> AsyncIterator[dict[str, Any]]:
    """Pull `name` into the store; yields Ollama's pull progress, ending in success.
    `hf.co/org/repo[:revision]` names are fetched from Hugging Face instead. `timeout_s`: how
    long the registry may send nothing (settings.registry_timeout_s)."""
    parsed = parse_name(name)
    if parsed.is_huggingface:
        from .hf import pull_huggingface

        async def work(emit: Emit) -> None:
            await pull_huggingface(store, parsed, emit, endpoint=hf_endpoint)
    else:
        async def work(emit: Emit) -> None:
            await _pull(store, parsed, insecure, emit, timeout_s)
    job = SharedJob.join(store.inflight, "pull:" + parsed.key, work)
    async for item in job.stream():
        yield item


async def _pull(store: Store, name: ModelName, insecure: bool, emit: Emit,
                timeout_s: float | None = REGISTRY_TIMEOUT_S) -> None:
    emit({"status": "pulling manifest"})
    async with RegistryClient(name, insecure=insecure, timeout_s=timeout_s) as client:
        data = await client.get_manifest()
        m = _check_manifest(data)
        with store.pinned(m.hex_digests()):
            await asyncio.to_thread(_check_room, store.blobs, m, name)
            for layer in [*m.layers, m.config]:
                await _download(store.blobs, client, layer, emit)
            emit({"status": "verifying sha256 digest"})
            try:
                gguf = m.gguf()
                if gguf is not None:  # Ollama's own format: make its MLX directory now, once
                    await asyncio.to_thread(check_supported, store.blobs.path(gguf.hex))
                    try:
                        async for item in converting(store, gguf.hex):
                            emit(item)
                    except MlxrError as exc:
                        raise no_space_in(exc, "converting the GGUF model to MLX") from None
                emit({"status": "writing manifest"})
                await asyncio.to_thread(store.write_manifest, name, data)
            except InsufficientStorage as exc:
                raise InsufficientStorage(f"{exc.message}; the downloaded blobs are kept, so "
                                          "pulling again does not download them again") from None
    emit({"status": "removing any unused layers"})
    emit({"status": "success"})


def _check_manifest(data: bytes) -> Manifest:
    """The registry's manifest, if every digest, size and file name in it is one we accept."""
    try:
        m = Manifest.from_bytes(data)
    except ManifestError as exc:
        raise RegistryError(f"pull model manifest: {exc}") from None
    for layer in m.all_layers():
        if layer.name is not None:
            try:
                check_file_name(layer.name)
            except InvalidRequest as exc:
                raise RegistryError(f"pull model manifest: {exc.message}") from None
        if layer.media_type in _TEXT_MEDIA and layer.size > MAX_TEXT_LAYER_BYTES:
            raise RegistryError(f"pull model manifest: the {layer.media_type} layer "
                                f"{layer.digest} declares {layer.size} bytes, more than "
                                f"{MAX_TEXT_LAYER_BYTES}")
    return m


def _check_room(blobs: Blobs, m: Manifest, name: ModelName) -> None:
    """Fail before downloading when the blobs still missing cannot fit on the disk."""
    missing = {x.hex: x.size for x in m.all_layers() if not blobs.exists(x.hex)}
    needed = 0
    for hex_digest, size in missing.items():
        try:
            needed += max(0, size - blobs.download_partial(hex_digest).stat().st_size)
        except FileNotFoundError:
            needed += size
    check_room(blobs.root, needed, f"pulling {name.display}")


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
                    raise RegistryError(f"download {layer.digest}: the registry sent data that "
                                        "does not match its digest, twice") from None
            except BlobRejected:
                writer.abort()
                raise
            except InsufficientStorage as exc:
                writer.abort(keep=True)
                kept = partial.stat().st_size if partial.exists() else 0
                raise InsufficientStorage(
                    f"{exc.message}: the {kept} bytes of it downloaded so far are kept in "
                    f"{partial} and pulling again resumes from there" if kept else
                    f"{exc.message}: nothing of it was kept") from None
            except BaseException:
                writer.abort(keep=True)
                raise
    finally:
        os.close(fd)


async def _fetch(client: RegistryClient, layer: Layer, writer: BlobWriter,
                 status: dict[str, Any], emit: Emit) -> None:
    """Append the rest of the blob to `writer`: exactly up to the declared size."""
    what = f"download {layer.digest}"
    resp = await client.open_blob(layer.digest, writer.size)
    try:
        if resp.status_code == 416:  # nothing left to fetch
            return
        if resp.status_code == 200 and writer.size:
            await asyncio.to_thread(writer.restart)  # the server ignored the Range
        received = writer.size
        length = resp.headers.get("content-length", "")
        encoded = resp.headers.get("content-encoding", "identity") != "identity"
        if length.isdigit() and not encoded and received + int(length) > layer.size:
            raise BlobRejected(f"{what}: the registry would send {length} bytes from byte "
                               f"{received}, past the {layer.size} bytes the manifest declares")
        emit({**status, "completed": writer.size})
        buf, last = bytearray(), time.monotonic()
        try:
            async with contextlib.aclosing(client.body(resp, what)) as chunks:
                async for chunk in chunks:
                    received += len(chunk)
                    if received > layer.size:  # stop here: never store more than declared
                        raise BlobRejected(f"{what}: the registry sent more than the "
                                           f"{layer.size} bytes the manifest declares")
                    buf += chunk
                    if len(buf) >= FLUSH_BYTES:
                        await asyncio.to_thread(writer.write, bytes(buf))
                        buf.clear()
                        if time.monotonic() - last >= PROGRESS_EVERY_S:
                            emit({**status, "completed": writer.size})
                            last = time.monotonic()
        except BlobRejected:
            raise
        except RegistryError:  # stalled or dropped: keep what arrived for the next pull
            if buf:
                await asyncio.to_thread(writer.write, bytes(buf))
            raise
        if buf:
            await asyncio.to_thread(writer.write, bytes(buf))
        if received < layer.size:
            raise RegistryError(f"{what}: the registry ended the blob after {received} of "
                                f"{layer.size} bytes; pulling again resumes from there")
        emit({**status, "completed": writer.size})
    finally:
        await resp.aclose()


async def push_model(store: Store, name: str, *, insecure: bool = False,
                     chunk_bytes: int = UPLOAD_CHUNK_BYTES,
                     timeout_s: float | None = REGISTRY_TIMEOUT_S) -> AsyncIterator[dict[str, Any]]:
    """Push a stored model to the registry its name points at; yields progress."""
    parsed = parse_name(name)
    path = store.manifest_file(parsed)
    if path is None:
        raise ModelNotFound(f'model "{name}" not found')
    data = path.read_bytes()
    m = Manifest.from_bytes(data)
    with store.pinned(m.hex_digests()):
        yield {"status": "retrieving manifest"}
        async with RegistryClient(parsed, insecure=insecure, timeout_s=timeout_s) as client:
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


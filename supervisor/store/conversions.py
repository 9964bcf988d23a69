"""MLX directories derived from GGUF blobs, made once and kept beside the blobs:

    <root>/derived/gguf-v<CONVERTER_VERSION>/<source blob hex>/   config.json, model-*.safetensors,
                                                                 tokenizer.json, tokenizer_config.json

Invariants:
- A derived directory appears only by renaming a complete temporary directory
  (`derived/.tmp-*`), so one that exists is whole; it is keyed by the source blob's digest and
  the converter version, and never changes afterwards.
- At most one conversion per source runs at a time (a shared job); every caller waiting for it
  sees its progress and its one outcome.
- The conversion runs in a child process; the supervisor imports no MLX.
- Garbage collection (store.py) removes a derived directory when no manifest names its source,
  and every directory of another converter version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from mlxr.shared.errors import MlxrError, from_wire

from .files import TEMP_PREFIX
from .gguf.convert import CONVERTER_VERSION
from .shared_job import Emit, SharedJob

log = logging.getLogger("mlxr.store")
DERIVED = "derived"


def version_dir(root: Path) -> Path:
    return root / DERIVED / f"gguf-v{CONVERTER_VERSION}"


def derived_path(root: Path, source_hex: str) -> Path:
    return version_dir(root) / source_hex


def is_converted(root: Path, source_hex: str) -> bool:
    return (derived_path(root, source_hex) / "config.json").is_file()


def stale_dirs(root: Path, live_sources: set[str]) -> list[Path]:
    """Derived directories nobody needs: of other converter versions, of sources no manifest
    names, and temporary leftovers (the caller decides how old those must be)."""
    base = root / DERIVED
    if not base.is_dir():
        return []
    current = version_dir(root)
    out: list[Path] = []
    for version in base.iterdir():
        if version.name.startswith(TEMP_PREFIX):
            continue
        if version != current:
            out.append(version)
            continue
        for d in version.iterdir():
            if not d.name.startswith(TEMP_PREFIX) and d.name not in live_sources:
                out.append(d)
    return out


async def ensure_converted(store: Any, source_hex: str, emit: Emit | None = None) -> Path:
    """The derived directory of a GGUF blob, converting it first if needed."""
    root = store.root
    if is_converted(root, source_hex):
        return derived_path(root, source_hex)

    async def work(job_emit: Emit) -> None:
        await _convert(store, source_hex, job_emit)

    job = SharedJob.join(store.inflight, "convert:" + source_hex, work)
    async for item in job.stream():
        if emit is not None:
            emit(item)
    return derived_path(root, source_hex)


async def converting(store: Any, source_hex: str) -> AsyncIterator[dict[str, Any]]:
    """`ensure_converted` as a stream of progress items (for create and pull)."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(ensure_converted(store, source_hex, queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            yield item
        task.result()
    finally:
        if not task.done():
            task.cancel()


async def _convert(store: Any, source_hex: str, emit: Emit) -> None:
    root = store.root
    if is_converted(root, source_hex):
        return
    source = store.blobs.path(source_hex)
    final = derived_path(root, source_hex)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TEMP_PREFIX}{source_hex[:12]}-{uuid.uuid4().hex[:8]}"
    status = {"status": "converting model to MLX", "digest": f"sha256:{source_hex}"}
    size = source.stat().st_size  # progress is shown against the file's size
    emit({**status, "total": size, "completed": 0})
    log.info("converting GGUF blob %s to MLX", source_hex[:12])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mlxr.supervisor.store.gguf.convert", str(source), str(tmp),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stderr_task = asyncio.ensure_future(proc.stderr.read())
        async for line in proc.stdout:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and item.get("total"):
                done = int(item["completed"]) * size // int(item["total"])
                emit({**status, "total": size, "completed": done})
        err = await stderr_task
        await proc.wait()
    except asyncio.CancelledError:
        proc.kill()
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise
    if proc.returncode != 0:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise _failure(proc.returncode, err.decode(errors="replace"))
    try:
        tmp.rename(final)
    except OSError:  # another process finished the same conversion first
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        if not is_converted(root, source_hex):
            raise
    log.info("converted GGUF blob %s", source_hex[:12])


def _failure(code: int, stderr: str) -> MlxrError:
    """The converter's typed error (a 400 for an unsupported model), else a 500 with its
    last lines."""
    lines = stderr.strip().splitlines()
    for line in reversed(lines):
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("error"), str):
            return from_wire(400, item["error"], item.get("kind"))
    return MlxrError(f"GGUF conversion failed (exit status {code}): "
                     + " | ".join(lines[-5:]))

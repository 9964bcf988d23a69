"""The model store, in Ollama's layout:

    <root>/manifests/<host>/<namespace>/<model>/<tag>   manifest JSON (name lower-cased)
    <root>/blobs/sha256-<hex>                            content-addressed files
    <root>/runners/<manifest digest>/<file name>         symlinks to blobs, for mlx_lm.load
    <root>/runners/<manifest digest>/.adapter/<name>     the model's LoRA adapter, if any
                                                         (ADAPTER_DIR; the runner applies it)
    <root>/derived/gguf-v<N>/<GGUF blob hex>/            MLX directories made from GGUF blobs
                                                         (conversions.py)
    <root>/.lock                                         the inter-process store lock

Invariants:
- A manifest is written last, atomically, and only when every blob it names exists.
- Manifest writes, deletes and garbage collection hold the store lock (thread + flock).
- A blob is removed only when no manifest names it and no operation in this process has pinned
  it (a create or pull between writing its blobs and its manifest). When any manifest cannot
  be read, garbage collection removes nothing.
- Records, parsed manifests and runner directories are kept in memory between requests
  (reading a model was about a quarter of the supervisor's CPU per request): a record for as
  long as its manifest file has the same inode, modification time and size (manifests are
  replaced by rename, never rewritten in place), a parsed manifest and a runner directory
  under the manifest's digest (its content). Records and manifests are shared: read-only.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

from mlxr.shared.errors import InvalidRequest, MlxrError, ModelNotFound

from . import conversions
from . import manifest as mf
from .blobs import Blobs
from .files import TEMP_PREFIX, StoreLock, atomic_write, prune_empty_dirs
from .manifest import Manifest, ManifestError
from .names import ModelName, name_from_manifest_path, parse_name

log = logging.getLogger("mlxr.store")
# Where a runner directory holds the model's adapter (adapters.safetensors, adapter_config.json).
# Model file names never start with a dot (sources.check_file_name), so this cannot collide.
ADAPTER_DIR = ".adapter"
MAX_TEXT_LAYER_BYTES = 16 << 20


@dataclass(slots=True)
class ModelRecord:
    name: str
    digest: str
    size: int
    modified_at: datetime
    manifest: dict
    config: dict
    template: str | None
    system: str | None
    params: dict
    messages: list[dict]
    license: str | None
    capabilities: list[str]
    model_info: dict


def model_details(record: Any) -> dict[str, Any]:
    """Ollama's `details` object from a record's config blob (/api/tags, /api/show, /api/ps)."""
    c = getattr(record, "config", None) or {}
    return {"parent_model": "", "format": c.get("model_format") or "",
            "family": c.get("model_family") or "", "families": c.get("model_families"),
            "parameter_size": c.get("model_type") or "",
            "quantization_level": c.get("file_type") or ""}


class CorruptModel(MlxrError):
    status = 500


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.manifests_dir = self.root / "manifests"
        self.runners_dir = self.root / "runners"
        self.tmp_dir = self.root / "tmp"
        self.manifests_dir.mkdir(parents=True, exist_ok=True)
        self.blobs = Blobs(self.root / "blobs")
        self.lock = StoreLock(self.root / ".lock")
        self._pins: collections.Counter[str] = collections.Counter()
        self._pins_lock = threading.Lock()
        self.inflight: dict[str, Any] = {}  # shared in-flight pulls (see transfer.py)
        # manifest file -> ((inode, mtime_ns, size), record); manifest digest -> parsed
        # manifest, and -> verified runner directory
        self._records: dict[Path, tuple[tuple[int, int, int], ModelRecord]] = {}
        self._manifests: dict[str, Manifest] = {}
        self._runner_dirs: dict[str, Path] = {}

    # ----- reading -----------------------------------------------------------------------
    def manifest_file(self, name: ModelName) -> Path | None:
        """The manifest file for `name` (case-insensitively), or None."""
        exact = self.manifests_dir / name.manifest_path
        if exact.is_file():
            return exact
        current = self.manifests_dir
        for part in name.manifest_path.parts:  # a store written with mixed case
            if not current.is_dir():
                return None
            match = next((p for p in current.iterdir() if p.name.lower() == part), None)
            if match is None:
                return None
            current = match
        return current if current.is_file() else None

    def resolve(self, name: str) -> ModelRecord:
        parsed = parse_name(name)
        path = self.manifest_file(parsed)
        if path is None:
            raise ModelNotFound(f'model "{name}" not found, try pulling it first')
        try:
            return self._record(path)
        except FileNotFoundError:  # deleted while we read it
            raise ModelNotFound(f'model "{name}" not found, try pulling it first') from None

    def list(self) -> list[ModelRecord]:
        records = []
        for path in self._manifest_files():
            try:
                records.append(self._record(path))
            except (OSError, MlxrError, ValueError) as exc:
                log.warning("skipping unreadable manifest %s: %s", path, exc)
        records.sort(key=lambda r: r.modified_at, reverse=True)
        return records

    def _manifest_files(self) -> Iterator[Path]:
        for path in sorted(self.manifests_dir.glob("*/*/*/*")):
            if path.is_file() and not path.name.startswith(TEMP_PREFIX):
                yield path

    def _record(self, path: Path) -> ModelRecord:
        st = path.stat()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._records.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        record = self._read_record(path, st.st_mtime)
        _bounded(self._records)[path] = (key, record)
        return record

    def _read_record(self, path: Path, mtime: float) -> ModelRecord:
        rel = PurePosixPath(path.relative_to(self.manifests_dir).as_posix())
        parsed = name_from_manifest_path(rel)
        if parsed is None:
            raise CorruptModel(f"bad manifest path {rel}")
        data = path.read_bytes()
        try:
            m = Manifest.from_bytes(data)
        except ManifestError as exc:
            raise CorruptModel(f"model {parsed.display}: {exc}") from None
        config = self._read_json(m.config, {})
        texts = {t: [self._read_text(x) for x in m.layers if x.media_type == t]
                 for t in (mf.MEDIA_TEMPLATE, mf.MEDIA_SYSTEM, mf.MEDIA_LICENSE)}
        params_layer, messages_layer = m.first(mf.MEDIA_PARAMS), m.first(mf.MEDIA_MESSAGES)
        info = config.get("model_info") if isinstance(config.get("model_info"), dict) else {}
        if not info and config.get("model_family"):
            info = {"general.architecture": config["model_family"]}
        caps = config.get("capabilities")
        if not isinstance(caps, list):  # Ollama's own config blobs name none
            caps = self._derived_capabilities(m, texts[mf.MEDIA_TEMPLATE])
        return ModelRecord(
            name=parsed.display, digest=mf_digest(data), size=m.total_size,
            modified_at=datetime.fromtimestamp(mtime).astimezone(),
            manifest=json.loads(data), config=config,
            template=(texts[mf.MEDIA_TEMPLATE] or [None])[-1],
            system=(texts[mf.MEDIA_SYSTEM] or [None])[-1],
            params=self._read_json(params_layer, {}) if params_layer else {},
            messages=self._read_json(messages_layer, []) if messages_layer else [],
            license="\n".join(texts[mf.MEDIA_LICENSE]) or None,
            capabilities=list(caps),
            model_info=dict(info))

    def _derived_capabilities(self, m: Manifest, templates: list[str]) -> list[str]:
        """A model whose config blob lists no capabilities (one Ollama made): a GGUF model's
        from its file's header, as Ollama derives them (an embedding model, tools, thinking);
        anything else completes."""
        from .config_blob import gguf_capabilities
        from .gguf.header import read_gguf

        layer = m.gguf()
        if layer is None:
            return ["completion"]
        try:
            kv = read_gguf(self.blobs.path(layer.hex), skip_arrays=True).kv
        except (OSError, MlxrError, ValueError) as exc:
            log.warning("reading the GGUF header of %s: %s", layer.digest, exc)
            return ["completion"]
        return gguf_capabilities(kv, (templates or [None])[-1])

    def _read_text(self, layer: mf.Layer) -> str:
        if layer.size > MAX_TEXT_LAYER_BYTES:
            raise CorruptModel(f"layer {layer.digest} is too large for a {layer.media_type}")
        return self.blobs.path(layer.hex).read_text(encoding="utf-8", errors="replace")

    def _read_json(self, layer: mf.Layer, default: Any) -> Any:
        try:
            value = json.loads(self._read_text(layer))
        except ValueError:
            raise CorruptModel(f"layer {layer.digest} is not valid JSON") from None
        return value if isinstance(value, type(default)) else default

    def manifest_of(self, record: ModelRecord) -> Manifest:
        """The record's manifest, parsed (shared: read-only)."""
        m = self._manifests.get(record.digest)
        if m is None:
            m = Manifest.from_bytes(json.dumps(record.manifest).encode())
            _bounded(self._manifests)[record.digest] = m
        return m

    # ----- files for the runner ---------------------------------------------------------
    def gguf_source(self, record: ModelRecord) -> str | None:
        """The digest (hex) of a model's GGUF weights, for a model in Ollama's own format."""
        layer = self.manifest_of(record).gguf()
        return layer.hex if layer is not None else None

    def runner_dir(self, record: ModelRecord) -> Path:
        """A directory that mlx_lm.utils.load can load: for a GGUF model its converted directory
        (`conversions.ensure_converted` first), else one of symlinks (file name -> blob)."""
        m = self.manifest_of(record)
        gguf = m.gguf()
        if any(x.name is None for x in m.adapters()) or (gguf is not None and m.adapters()):
            raise InvalidRequest(f'model "{record.name}" has a GGUF LoRA adapter, which mlxr '
                                 "cannot apply: recreate it with the adapter in safetensors form")
        if gguf is not None:
            if not conversions.is_converted(self.root, gguf.hex):
                raise MlxrError(f'model "{record.name}" has not been converted to MLX yet')
            return conversions.derived_path(self.root, gguf.hex)
        files = m.files()
        if not any(x.name.endswith(".safetensors") for x in files):
            raise InvalidRequest(f'model "{record.name}" has no safetensors weights; '
                                 f'its format is {record.config.get("model_format") or "unknown"}')
        final = self.runners_dir / record.digest
        if self._runner_dirs.get(record.digest) == final and final.is_dir():
            return final
        links = [(x, x.name) for x in files]
        links += [(x, f"{ADAPTER_DIR}/{x.name}") for x in m.adapters()]
        if final.is_dir():
            if all((final / name).exists() for _, name in links):
                _bounded(self._runner_dirs)[record.digest] = final
                return final
            shutil.rmtree(final, ignore_errors=True)  # left over from an older version
        self.runners_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.runners_dir / f"{TEMP_PREFIX}{uuid.uuid4().hex[:12]}"
        try:
            for layer, name in links:
                rel = PurePosixPath(name)
                if rel.is_absolute() or ".." in rel.parts or "\\" in name:
                    raise CorruptModel(f"unsafe file name {name!r} in {record.name}")
                blob = self.blobs.path(layer.hex)
                if not blob.is_file():
                    raise CorruptModel(f"model {record.name}: blob {layer.digest} is missing")
                link = tmp / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(blob.resolve(), link)
            try:
                os.rename(tmp, final)
            except OSError:  # another caller made it first
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _bounded(self._runner_dirs)[record.digest] = final
        return final

    # ----- writing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def pinned(self, hex_digests: Iterable[str]) -> Iterator[None]:
        """Protect blobs from garbage collection until their manifest is written."""
        digests = list(hex_digests)
        for d in digests:
            self.pin(d)
        try:
            yield
        finally:
            for d in digests:
                self.unpin(d)

    def pin(self, hex_digest: str) -> None:
        """Protect one blob from garbage collection (until `unpin`). Takes only an in-process
        lock, so it is safe to call on the event loop."""
        with self._pins_lock:
            self._pins[hex_digest] += 1

    def unpin(self, hex_digest: str) -> None:
        with self._pins_lock:
            self._pins[hex_digest] -= 1
            if self._pins[hex_digest] <= 0:
                del self._pins[hex_digest]

    def _pinned(self) -> set[str]:
        with self._pins_lock:
            return set(self._pins)

    def _is_pinned(self, hex_digest: str) -> bool:
        with self._pins_lock:
            return self._pins.get(hex_digest, 0) > 0

    def write_manifest(self, name: ModelName, data: bytes) -> str:
        """Write a manifest (raw bytes) for `name`; returns the model digest. Blobs of a
        manifest it replaces that no manifest names any more are removed."""
        m = Manifest.from_bytes(data)
        with self.lock.held():
            missing = [x.digest for x in m.all_layers() if not self.blobs.exists(x.hex)]
            if missing:
                raise CorruptModel(f"cannot write manifest for {name.display}: missing blobs "
                                   + ", ".join(missing))
            old = self.manifest_file(name)
            old_digests = self._digests_of(old) if old else set()
            if old is not None and old != self.manifests_dir / name.manifest_path:
                old.unlink()  # a differently-cased old file: replace it with the canonical one
            atomic_write(self.manifests_dir / name.manifest_path, data)
            self._collect(old_digests - m.hex_digests())
        return mf_digest(data)

    def copy(self, source: str, destination: str) -> None:
        src = parse_name(source)
        dst = parse_name(destination)
        with self.lock.held():
            path = self.manifest_file(src)
            if path is None:
                raise ModelNotFound(f'model "{source}" not found')
            self.write_manifest(dst, path.read_bytes())

    def delete(self, name: str) -> None:
        parsed = parse_name(name)
        with self.lock.held():
            path = self.manifest_file(parsed)
            if path is None:
                raise ModelNotFound(f'model "{name}" not found')
            digests = self._digests_of(path)
            path.unlink()
            prune_empty_dirs(path.parent, self.manifests_dir)
            self._collect(digests)

    def prune(self, stale_s: float = 3600.0) -> int:
        """Remove every unpinned blob no manifest names, and local-write leftovers older than
        `stale_s` (resumable download partials stay); returns how many blobs went."""
        with self.lock.held():
            removed = self._collect(self.blobs.all_digests())
        cutoff = time.time() - stale_s
        version_dir = conversions.version_dir(self.root)
        leftovers = [*self.blobs.root.glob("*-partial-*"),
                     *(self.tmp_dir.iterdir() if self.tmp_dir.is_dir() else []),
                     *(version_dir.glob(TEMP_PREFIX + "*") if version_dir.is_dir() else [])]
        for path in leftovers:
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime < cutoff:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        return removed

    def discard(self, hex_digests: Iterable[str]) -> int:
        """Remove these blobs unless a manifest names them or an operation pins them: what a
        failed create made, so that it gives the space back. Returns how many went."""
        with self.lock.held():
            return self._collect(set(hex_digests))

    def _digests_of(self, path: Path) -> set[str]:
        try:
            return Manifest.from_bytes(path.read_bytes()).hex_digests()
        except (OSError, ManifestError):
            return set()

    def _collect(self, candidates: set[str]) -> int:
        """Remove candidate blobs that no manifest names. Caller holds the lock."""
        referenced: set[str] = set()
        live_models: set[str] = set()
        for path in self._manifest_files():
            try:
                data = path.read_bytes()
                referenced |= Manifest.from_bytes(data).hex_digests()
            except (OSError, ManifestError) as exc:
                log.warning("not collecting garbage: unreadable manifest %s: %s", path, exc)
                return 0
            live_models.add(mf_digest(data))
        removed = 0
        for hex_digest in candidates - referenced:
            if self._is_pinned(hex_digest):
                continue
            self.blobs.remove(hex_digest)
            removed += 1
        if self.runners_dir.is_dir():
            for d in self.runners_dir.iterdir():
                if d.name not in live_models and not d.name.startswith(TEMP_PREFIX):
                    shutil.rmtree(d, ignore_errors=True)
        for d in conversions.stale_dirs(self.root, referenced | self._pinned()):
            shutil.rmtree(d, ignore_errors=True)
        return removed


def mf_digest(data: bytes) -> str:
    """A model's digest: the sha256 of its manifest bytes (64 hex digits)."""
    return hashlib.sha256(data).hexdigest()


def _bounded(cache: dict, limit: int = 256) -> dict:
    """`cache`, emptied first when it holds `limit` entries (the store's in-memory caches
    hold one entry a model, so this only bounds a store with very many)."""
    if len(cache) >= limit:
        cache.clear()
    return cache

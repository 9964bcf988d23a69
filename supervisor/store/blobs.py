"""Content-addressed blobs: `blobs/sha256-<hex>`.

Invariants:
- A file named `sha256-<hex>` holds exactly the bytes whose sha256 is `<hex>`: it only appears
  by `os.replace` of a fully written, fsynced and verified temporary file.
- Temporary files end in `-partial` (downloads: `sha256-<hex>-partial`, resumable; local
  writes: `sha256-<hex>-partial-<id>` or `ingest-<id>-partial`) and are never read as blobs.
- Blobs are immutable; they are removed only by the store's garbage collection.
- A full disk while writing is an `InsufficientStorage` naming the blob; a failed local write
  removes its partial file (the message says so), and only a download keeps its partial file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mlxr.shared.errors import InsufficientStorage, InvalidRequest

from .files import fsync_dir, no_space_as

_DIGEST = re.compile(r"sha256[:\-]([0-9a-fA-F]{64})")
COPY_CHUNK_BYTES = 4 << 20


def parse_digest(text: str) -> str:
    """The 64 lower-case hex digits of "sha256:<hex>" (or "sha256-<hex>"); else a 400."""
    m = _DIGEST.fullmatch(text.strip()) if isinstance(text, str) else None
    if not m:
        raise InvalidRequest(f'invalid digest "{text}": expected "sha256:<64 hex digits>"')
    return m.group(1).lower()


def digest_ref(hex_digest: str) -> str:
    return f"sha256:{hex_digest}"


def hash_file(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


@dataclass(slots=True)
class BlobWriter:
    """Writes one blob through a `-partial` file; `commit` verifies and renames it."""

    blobs: "Blobs"
    expected: str | None
    partial: Path
    size: int = 0
    source: Path | None = None  # the file being copied, if any (for error messages)
    _hash: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    _file: object = None

    def open(self, resume: bool = False) -> "BlobWriter":
        """Open the partial file; with `resume`, keep (and re-hash) bytes already there."""
        if resume and self.partial.exists():
            with open(self.partial, "rb") as f:
                while chunk := f.read(COPY_CHUNK_BYTES):
                    self._hash.update(chunk)
                    self.size += len(chunk)
            self._file = open(self.partial, "ab")
        else:
            self._file = open(self.partial, "wb")
        return self

    def restart(self) -> None:
        """Drop what was written (the server would not resume)."""
        self._file.seek(0)
        self._file.truncate(0)
        self._hash = hashlib.sha256()
        self.size = 0

    def writing(self) -> str:
        """What this writer does, for error messages."""
        if self.expected:
            return f"writing blob {digest_ref(self.expected)}"
        return f"writing a blob of {self.source}" if self.source else "writing a blob"

    def write(self, data: bytes) -> None:
        with no_space_as(self.writing()):
            self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def commit(self) -> str:
        """Verify, fsync and rename into place; returns the hex digest. On a mismatch the
        partial file stays (the caller aborts or restarts it)."""
        f, self._file = self._file, None
        try:
            with no_space_as(self.writing()):
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):  # a full disk fails the flush in close again
                f.close()
        actual = self._hash.hexdigest()
        if self.expected is not None and actual != self.expected:
            raise InvalidRequest(f"digest mismatch: expected sha256:{self.expected}, "
                                 f"got sha256:{actual}")
        final = self.blobs.path(actual)
        if final.exists():
            self.partial.unlink(missing_ok=True)
        else:
            os.replace(self.partial, final)
            fsync_dir(final.parent)
        return actual

    def abort(self, keep: bool = False) -> None:
        """Close; remove the partial file unless `keep` (a resumable download) and it holds
        something to resume from."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # its buffer cannot be flushed to a full disk
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            if not keep or self.partial.stat().st_size == 0:
                self.partial.unlink()


def removed(exc: InsufficientStorage) -> InsufficientStorage:
    """A full disk while writing a blob whose partial file is now gone."""
    return InsufficientStorage(f"{exc.message}: its partial file was removed, so the space "
                               "it took is free again")


class Blobs:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, hex_digest: str) -> Path:
        assert len(hex_digest) == 64, hex_digest
        return self.root / f"sha256-{hex_digest}"

    def exists(self, hex_digest: str) -> bool:
        return self.path(hex_digest).is_file()

    def download_partial(self, hex_digest: str) -> Path:
        return self.root / f"sha256-{hex_digest}-partial"

    def writer(self, expected: str | None = None) -> BlobWriter:
        """A writer with a private partial file (not resumable)."""
        stem = f"sha256-{expected}" if expected else "ingest"
        partial = self.root / f"{stem}-partial-{uuid.uuid4().hex[:12]}"
        return BlobWriter(self, expected, partial).open()

    def add_bytes(self, data: bytes) -> tuple[str, bool]:
        """Store `data`; returns (hex digest, created)."""
        hex_digest = hashlib.sha256(data).hexdigest()
        if self.exists(hex_digest):
            return hex_digest, False
        w = self.writer(hex_digest)
        try:
            w.write(data)
            w.commit()
        except InsufficientStorage as exc:
            w.abort()
            raise removed(exc) from None
        except BaseException:
            w.abort()
            raise
        return hex_digest, True

    def add_file(self, src: Path, move: bool = False) -> tuple[str, int, bool]:
        """Store the file at `src` (copied; renamed into place when `move` and the file is ours).
        Returns (hex digest, size, created)."""
        if move:
            hex_digest, size = hash_file(src)
            if self.exists(hex_digest):
                return hex_digest, size, False
            tmp = self.root / f"sha256-{hex_digest}-partial-{uuid.uuid4().hex[:12]}"
            try:
                try:
                    os.replace(src, tmp)
                except OSError:  # another file system: copy instead
                    with no_space_as(f"writing blob {digest_ref(hex_digest)}"):
                        shutil.copyfile(src, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, self.path(hex_digest))
            except InsufficientStorage as exc:
                tmp.unlink(missing_ok=True)
                raise removed(exc) from None
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(self.root)
            return hex_digest, size, True
        w = self.writer()
        w.source = src
        try:
            with open(src, "rb") as f:
                while chunk := f.read(COPY_CHUNK_BYTES):
                    w.write(chunk)
            size = w.size
            existed = self.exists(w._hash.hexdigest())
            hex_digest = w.commit()
        except InsufficientStorage as exc:
            w.abort()
            raise removed(exc) from None
        except BaseException:
            w.abort()
            raise
        return hex_digest, size, not existed

    def link(self, src: Path, hex_digest: str) -> str:
        """Make `src` (a blob of another store, e.g. Ollama's) our blob `hex_digest` without
        copying it: a hard link, or a symbolic link across file systems. `src` is read once to
        check its digest and never written. Returns "present", "hardlink" or "symlink"."""
        if self.exists(hex_digest):
            return "present"
        actual, _ = hash_file(src)
        if actual != hex_digest:
            raise InvalidRequest(f"{src} does not hold sha256:{hex_digest} (got sha256:{actual})")
        tmp = self.root / f"sha256-{hex_digest}-partial-{uuid.uuid4().hex[:12]}"
        try:
            os.link(src, tmp)
            how = "hardlink"
        except OSError:
            with no_space_as(f"linking blob {digest_ref(hex_digest)}"):
                os.symlink(src.resolve(), tmp)
            how = "symlink"
        try:
            os.replace(tmp, self.path(hex_digest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.root)
        return how

    def remove(self, hex_digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(hex_digest).unlink()

    def all_digests(self) -> set[str]:
        out = set()
        for p in self.root.iterdir():
            name = p.name
            if name.startswith("sha256-") and len(name) == 71:
                out.add(name[7:])
        return out

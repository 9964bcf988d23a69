"""File-system helpers for the store: atomic writes and the store lock.

Invariants:
- `atomic_write` never leaves a half-written file under the final name: the bytes go to a
  temporary file in the same directory, are fsynced, then `os.replace`d, then the directory is
  fsynced. On failure the temporary file is removed.
- A full disk (ENOSPC, EDQUOT) surfaces as `InsufficientStorage` naming what was being
  written, never as a bare OSError.
- `StoreLock` is re-entrant within a process (a `threading.RLock`) and exclusive across processes
  (an `fcntl.flock` on `<root>/.lock`, taken by the outermost holder only).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Iterator

from mlxr.shared.errors import InsufficientStorage, MlxrError

TEMP_PREFIX = ".tmp-"
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How a child process (quantize, GGUF conversion) that hit a full disk says so on stderr.
_NO_SPACE_TEXT = (f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]", "No space left on device",
                  "Disk quota exceeded")


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def says_no_space(text: str) -> bool:
    """Whether a child process's error output reports a full disk."""
    return any(x in text for x in _NO_SPACE_TEXT)


def no_space_in(err: MlxrError, what: str) -> MlxrError:
    """A child process's failure (`err`) as InsufficientStorage when its output reports a full
    disk; else `err` itself."""
    if isinstance(err, InsufficientStorage) or not says_no_space(err.message):
        return err
    return InsufficientStorage(f"no space left on device while {what} (its partial output was "
                               f"removed): {err.message}")


@contextlib.contextmanager
def no_space_as(what: str) -> Iterator[None]:
    """Turn a full disk inside the block into InsufficientStorage: "no space left on device
    while <what>"."""
    try:
        yield
    except OSError as exc:
        if not is_no_space(exc):
            raise
        raise InsufficientStorage(f"no space left on device while {what}") from exc


def check_room(path: Path, needed_bytes: int, what: str) -> None:
    """InsufficientStorage up front when the file system holding `path` has less than
    `needed_bytes` free, rather than a failure after writing most of it."""
    free = shutil.disk_usage(path).free
    if needed_bytes > free:
        raise InsufficientStorage(f"not enough space on device for {what}: it needs "
                                  f"{needed_bytes} bytes, {free} are free in {path}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path, suffix: str = "") -> Path:
    return path.with_name(f"{TEMP_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}{suffix}")


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with no_space_as(f"writing {path} (it was left as it was)"), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def prune_empty_dirs(start: Path, stop: Path) -> None:
    """Remove `start` and its parents while empty, up to (not including) `stop`."""
    current = start
    while current != stop and stop in current.parents:
        try:
            current.rmdir()
        except OSError:
            return
        current = current.parent


class StoreLock:
    """One lock for manifest writes, deletes and garbage collection."""

    def __init__(self, path: Path):
        self._path = path
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._thread_lock:
            if self._depth == 0:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    os.close(self._fd)
                    self._fd = None

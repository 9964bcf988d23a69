"""A full disk without a small file system: the store's own writes go through a fault-injecting
`open` that fails with ENOSPC once the files under the store's root would take more than a
quota. Works unprivileged (no mounts) and in-process (`DiskQuota.install` with pytest's
monkeypatch) or in a real `mlxr serve` (`python -m tests.harness.full_disk QUOTA_FILE serve`,
started by `start_full_disk_server`; the quota file holds the limit in bytes and is read on
every write, so a test can free space by raising it).

The quota counts every regular file under the root (blobs, partial files, manifests,
temporary directories), so removing a file gives its space back, as on a real disk. A write
that does not fit writes what fits, then raises OSError(ENOSPC), as a real full disk does.
"""

from __future__ import annotations

import builtins
import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from tests.harness.server import Server, start_server

# The store modules whose `open` the quota replaces: every file the store itself writes.
PATCHED_MODULES = ("mlxr.supervisor.store.blobs", "mlxr.supervisor.store.files")


def disk_used(root: Path) -> int:
    """Bytes in the regular files under `root` (symbolic links not followed)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


class QuotaFile:
    """A binary file opened for writing whose writes fail once the quota is used up."""

    def __init__(self, quota: "DiskQuota", raw: Any):
        self._quota = quota
        self._raw = raw

    def write(self, data: bytes) -> int:
        with self._quota.lock:
            room = self._quota.limit() - disk_used(self._quota.root)
            if len(data) > room:
                if room > 0:
                    self._raw.write(bytes(data[:room]))
                self._quota.failures += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = self._raw.write(data)
        return n

    def __enter__(self) -> "QuotaFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class DiskQuota:
    def __init__(self, root: Path, limit_bytes: int | Callable[[], int]):
        self.root = Path(root)
        self._limit = limit_bytes
        self.lock = threading.Lock()
        self.failures = 0  # writes refused so far

    def limit(self) -> int:
        return self._limit() if callable(self._limit) else self._limit

    def set_limit(self, limit_bytes: int) -> None:
        self._limit = limit_bytes

    def used(self) -> int:
        return disk_used(self.root)

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        writing = any(c in mode for c in "wax+")
        path = Path(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else None
        if not writing or path is None or self.root not in path.absolute().parents:
            return builtins.open(file, mode, *args, **kwargs)
        assert "b" in mode, mode  # the store writes bytes
        # Unbuffered, so the file's size on disk is what was written (the quota stats it).
        return QuotaFile(self, builtins.open(file, mode, buffering=0))

    def install(self, monkeypatch: Any) -> "DiskQuota":
        for module in PATCHED_MODULES:
            monkeypatch.setattr(sys.modules[module], "open", self.open, raising=False)
        return self


def start_full_disk_server(tmp: Path, base_env: dict[str, str], quota_file: Path,
                           **env: str) -> Server:
    """`mlxr serve` with the quota (bytes, in `quota_file`) over its store."""
    return start_server(tmp, base_env, command=["-m", "tests.harness.full_disk", str(quota_file),
                                                "serve"], **env)


def main() -> None:
    """`python -m tests.harness.full_disk QUOTA_FILE serve ...`: the CLI, over a quota."""
    import importlib

    quota_file = Path(sys.argv[1])
    for module in PATCHED_MODULES:
        importlib.import_module(module)
    quota = DiskQuota(Path(os.environ["MLXR_MODELS"]),
                      lambda: int(quota_file.read_text().strip()))
    for module in PATCHED_MODULES:
        setattr(sys.modules[module], "open", quota.open)
    from mlxr.supervisor.cli.main import main as cli

    sys.argv = ["mlxr", *sys.argv[2:]]
    cli()


if __name__ == "__main__":
    main()

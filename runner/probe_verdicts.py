"""Load-time probe verdicts, kept per model, code and machine.

Before a runner serves, its probes check each host path against the model's own forward
passes (does the body split from the head, do the block pool's rows, the numpy decode and
prefill bodies and the host heads give the model's logits) and time two choices (a
transposed head, the C row kernel against MLX). On the 2-core EPYC they took 1 s of a 30M
model's load, 2.4 s of Qwen3-0.6B's and 5 s of a 1.7B's, and for the same files, the same
code and the same machine they always say the same (the timed ones up to noise). So a load
keeps them in a small JSON file under the supervisor's cache directory, named by a hash of
everything they depend on, and the next load of that model reads them instead of probing.

The key (`key`): every model file's name and size, and its digest where it is a store blob
(named by it, and checked against it at load), else its resolved path and modification
time; the bytes of the runner's own source (mlxr/runner, mlxr/shared); the versions of MLX,
mlx-lm and numpy; the CPU's model name and flags, the core count, the device and the
preloaded BLAS; and what the loader decided about the weights and layout. A change to any of
them is a new file, probed afresh. Delete the directory to make every model probe again.

A file read is touched; a save keeps the `KEEP` most recently used files and deletes the
rest (each is about 150 bytes, but one is made per model per code change, for ever).

`decide(name, probe)` is the probes' one entry: inside `using(verdicts)` it answers from the
file or runs `probe` and records its answer; outside (tests, a runner started by hand, a
distributed rank) it runs `probe`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import platform
import re
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("mlxr.runner")

VERSION = 1  # of the file's layout
KEEP = 256  # files kept in the directory, most recently used first
_BLOB = re.compile(r"sha256-[0-9a-f]{64}")
_CURRENT: contextvars.ContextVar["Verdicts | None"] = contextvars.ContextVar(
    "probe_verdicts", default=None)


class Verdicts:
    """The verdicts of one model, code and machine: read from `path`, added to by probes."""

    def __init__(self, path: Path | None, known: dict[str, bool] | None = None):
        self.path = path
        self.known = dict(known or {})
        self.read = len(self.known)  # verdicts that came from the file
        self._new = False

    @classmethod
    def open(cls, cache_dir: str | Path, key_text: str) -> "Verdicts":
        """The verdicts filed under `key_text`'s hash in `cache_dir` (none yet: empty)."""
        path = Path(cache_dir) / (hashlib.sha256(key_text.encode()).hexdigest()[:32] + ".json")
        try:
            data = json.loads(path.read_text())
            known = data["verdicts"] if data.get("version") == VERSION else {}
            known = {k: v for k, v in known.items() if isinstance(v, bool)}
            os.utime(path)  # used: the last to be pruned
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            known = {}  # none yet, or unreadable: probe again and write it anew
        return cls(path, known)

    def decide(self, name: str, probe: Callable[[], bool]) -> bool:
        if name in self.known:
            return self.known[name]
        verdict = bool(probe())
        self.known[name], self._new = verdict, True
        return verdict

    def save(self) -> None:
        """Write the file if a probe ran (atomically: a reader sees the old file or the new
        one). A failure is logged, never raised: the verdicts are only a shortcut."""
        if not self._new or self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": VERSION, "verdicts": self.known},
                                      sort_keys=True))
            os.replace(tmp, self.path)
            self._new = False
            prune(self.path.parent)
        except OSError as exc:
            log.info("could not keep the probes' verdicts in %s (%s)", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()


def prune(cache_dir: Path, keep: int | None = None) -> None:
    """Delete all but the `keep` most recently used verdict files in `cache_dir` (another
    runner pruning at the same time: each file is deleted once, the misses ignored)."""
    files = []
    for path in cache_dir.glob("*.json"):
        with contextlib.suppress(OSError):
            files.append((path.stat().st_mtime_ns, path))
    files.sort(reverse=True)
    for _, path in files[KEEP if keep is None else keep:]:
        with contextlib.suppress(OSError):
            path.unlink()


def decide(name: str, probe: Callable[[], bool]) -> bool:
    """`probe()`'s verdict, or the one kept for this model, code and machine."""
    verdicts = _CURRENT.get()
    return bool(probe()) if verdicts is None else verdicts.decide(name, probe)


@contextlib.contextmanager
def using(verdicts: Verdicts | None) -> Iterator[Verdicts | None]:
    token = _CURRENT.set(verdicts)
    try:
        yield verdicts
    finally:
        _CURRENT.reset(token)


def key(model_dir: str | Path, context: dict[str, Any]) -> str:
    """Everything the probes' verdicts depend on, as text (see the module's docstring)."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    files = []
    for root, dirs, names in os.walk(model_dir, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            path = Path(root, name)
            real, st = Path(os.path.realpath(path)), path.stat()
            # A store blob is named by its digest (and checked against it at load): the
            # same content in any store, or moved, keeps its verdicts.
            where = [real.name] if _BLOB.fullmatch(real.name) else [str(real), st.st_mtime_ns]
            files.append([str(path.relative_to(model_dir)), st.st_size, *where])
    return json.dumps({
        "files": files, "code": _code_digest(), "context": context,
        "versions": [mx.__version__, mlx_lm.__version__, np.__version__],
        "machine": [platform.machine(), *_cpu(), os.cpu_count(), str(mx.default_device()),
                    os.environ.get("LD_PRELOAD", "")],
    }, sort_keys=True, default=str)


@functools.cache
def _code_digest() -> str:
    """A hash of the runner's and the shared package's source: new code probes again."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent  # mlxr/
    for sub in ("runner", "shared"):
        for path in sorted((package / sub).rglob("*")):
            if path.suffix in (".py", ".c", ".h") and path.is_file():
                digest.update(str(path.relative_to(package)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu() -> tuple[str, str]:
    """The CPU's model name and flags (Linux), else the platform's processor string."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields.get("model name", platform.processor()), fields.get("flags", "")

"""C sources compiled on demand into shared libraries, with the system C compiler.

The wheels we depend on ship no kernel for a few hot spots (shared/assets/*.c), so they are
compiled on the machine that runs them, the first time they are needed, into the cache
directory.

Invariants:
- A library is written to a temporary name and renamed into place, so a reader (another
  runner building the same library at the same time) sees the whole file or none.
- `cached_library`'s file name holds a digest of the source, the flags, the compiler and
  this CPU (`cpu_identity`): a change to any of them builds a new file, and a cache
  directory shared between machines never hands one machine another's build.
- Nothing raises for a missing or failing compiler: the caller gets the reason and keeps its
  fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("mlxr.native")

COMPILE_TIMEOUT_S = 120.0
ROW_KERNEL_SOURCE = Path(__file__).resolve().parent / "assets" / "row_kernel.c"
ROW_KERNEL_FLAGS = ["-O3"]
ATTEND_KERNEL_SOURCE = ROW_KERNEL_SOURCE.with_name("attend_kernel.c")
QUANT_KERNEL_SOURCE = ROW_KERNEL_SOURCE.with_name("quant_kernel.c")
QUANT_KERNEL_FLAGS = ["-O3", "-pthread"]
MXFP4_KERNEL_SOURCE = ROW_KERNEL_SOURCE.with_name("mxfp4_kernel.c")


def cpu_identity() -> list[str]:
    """The machine, and the first processor's model name and feature flags."""
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    lines.append(line.strip())
                elif not line.strip() and len(lines) > 1:
                    break  # the first processor is enough
    except OSError:
        pass
    return lines


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def compile_library(source: Path, target: Path, flags: list[str],
                    link: list[str] = ()) -> str | None:
    """Compile `source` into the shared library `target` unless it exists; None, or why not."""
    if target.exists():
        return None
    cc = compiler()
    if cc is None:
        return "no C compiler"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        done = subprocess.run([cc, *flags, "-shared", "-fPIC", str(source), "-o", str(partial),
                               *link], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        partial.unlink(missing_ok=True)
        return f"compiling {source.name} failed: {exc}"
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return f"compiling {source.name} failed: {done.stderr.strip()[-300:]}"
    os.replace(partial, target)
    return None


def cached_library(source: Path, cache_dir: Path, flags: list[str]) -> tuple[Path | None, str]:
    """`source` built with `flags` in `cache_dir` (built now if need be): (path, "") or
    (None, why not)."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler"
    digest = hashlib.sha256(b"\0".join([
        source.read_bytes(), " ".join(flags).encode(), os.path.realpath(cc).encode(),
        "\n".join(cpu_identity()).encode()])).hexdigest()[:16]
    target = cache_dir / f"{source.stem}-{digest}.so"
    error = compile_library(source, target, flags)
    return (None, error) if error else (target, "")


def row_kernel_library(cache_dir: Path) -> tuple[Path | None, str]:
    """The row kernel's library (runner/row_kernel.py), built if need be: (path, "") or
    (None, why not)."""
    return _cloned_library(ROW_KERNEL_SOURCE, cache_dir)


def attend_kernel_library(cache_dir: Path) -> tuple[Path | None, str]:
    """The one-position attention kernel's library (runner/kv/attend_kernel.py), built if
    need be: (path, "") or (None, why not)."""
    return _cloned_library(ATTEND_KERNEL_SOURCE, cache_dir)


def _cloned_library(source: Path, cache_dir: Path) -> tuple[Path | None, str]:
    """A source whose entry point GCC clones per x86-64 level; a compiler without target
    clones gets the plain C build."""
    path, why = cached_library(source, cache_dir, ROW_KERNEL_FLAGS)
    if path is None and "target_clones" in why:
        path, why = cached_library(source, cache_dir, ROW_KERNEL_FLAGS + ["-DMLXR_NO_CLONES"])
    return path, why


def quant_kernel_library(cache_dir: Path) -> tuple[Path | None, str]:
    """The quantized kernel's library (runner/quant_kernel.py), built if need be: (path, "")
    or (None, why not). It picks its vector width itself, at run time; where the build with
    the x86 copies fails, the plain C one (MLXR_QUANT_GENERIC)."""
    path, why = cached_library(QUANT_KERNEL_SOURCE, cache_dir, QUANT_KERNEL_FLAGS)
    if path is None and why != "no C compiler":  # a compiler without the x86 copies' targets
        path, why = cached_library(QUANT_KERNEL_SOURCE, cache_dir,
                                   QUANT_KERNEL_FLAGS + ["-DMLXR_QUANT_GENERIC"])
    return path, why


def mxfp4_kernel_library(cache_dir: Path) -> tuple[Path | None, str]:
    """The mxfp4 product's library (runner/mxfp4_kernel.py), built if need be. It picks its
    x86 variant at run time; elsewhere it is plain C."""
    return cached_library(MXFP4_KERNEL_SOURCE, cache_dir, ["-O3"])


def built_functions(build, cache_dir: Path | None, names: list[str],
                    what: str) -> list | None:
    """The functions `names` of the library `build(cache_dir)` makes (built if need be; the
    default cache_dir is the settings'), as ctypes functions; None where it cannot be built or
    loaded (logged, `what` naming the library and what the runner does instead)."""
    if cache_dir is None:
        from mlxr.shared.config import Settings

        cache_dir = Settings.from_env().cache_dir
    path, why = build(cache_dir)
    if path is None:
        log.info("%s: not built (%s)", what, why)
        return None
    return library_functions(path, names, what)


def library_functions(path: Path, names: list[str], what: str) -> list | None:
    """The functions `names` of the built library `path`; None where it does not load
    (logged)."""
    try:
        lib = ctypes.CDLL(str(path))
        return [getattr(lib, name) for name in names]
    except (OSError, AttributeError) as exc:
        log.info("%s: did not load (%s)", what, exc)
        return None

"""Which BLAS a runner preloads on Linux CPU, chosen by trying each candidate in a throwaway
process first.

MLX's Linux CPU wheel links a reference BLAS; OpenBLAS runs its float32 matmuls 10-30x
faster. But an OpenBLAS built for one CPU can die on another: the cmeel-openblas wheel is a
SKYLAKEX-only build, and any sgemm through it is SIGILL on a CPU without AVX-512.

Invariants:
- No real process (a runner, a test, a benchmark peer) preloads a library that has not
  passed a probe on this CPU: `python -m mlxr.shared.blas_probe` under LD_PRELOAD, which runs
  MLX's float32/float64 matmuls and the library's sgemv against numpy.
- Verdicts are cached per library file (path, size, mtime), CPU (model name and flags) and
  MLX version, so a new CPU, library or MLX is probed again.
- The fastest passing candidate wins (the decode head at 4-16 rows, within 5% the earlier in
  `candidates` order, newest OpenBLAS first); a library named by
  MLXR_OPENBLAS wins whenever it passes, and when it fails the others are tried.
- Nothing is preloaded off Linux, or where MLX does not run on the CPU (mlx[cuda]).
- A process that preloads the library also gets OPENBLAS_THREAD_TIMEOUT (`preload_env`),
  unless its environment sets it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxr.shared.exits import describe_exit
from mlxr.shared.native import compile_library, cpu_identity

log = logging.getLogger("mlxr.blas")

DEBIAN_PATHS = ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
                "/usr/lib/aarch64-linux-gnu/libopenblas.so.0")
SHIM_SOURCE = Path(__file__).parent / "assets" / "openblas_shim.c"
PROBE_TIMEOUT_S = 120.0
CACHE_FILE = "blas-probes.json"
TIE = 0.05
_ROOT = Path(__file__).resolve().parent.parent  # where `shared` is importable from
# OpenBLAS's threads spin for 2^28 cycles (about 0.1 s) after each threaded call before they
# sleep; 4 is its least, 2^4 cycles. A decode step of one or two rows makes a hundred small
# threaded sgemv calls in its body (runner/host_body.py), then the head's own two threads
# (runner/row_kernel.py) shared the cores with spinning ones: the 147M model's head took
# 24 ms after the body against 12.6 ms alone, and one stream ran 28-31% faster with the
# threads asleep (docs/PERFORMANCE.md, "OpenBLAS's threads after the body").
THREAD_TIMEOUT = "4"


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    path: str  # the library to preload
    forwards_to: str = ""  # for the shim: the scipy_-prefixed OpenBLAS it calls


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str
    config: str = ""  # openblas_get_config()
    device: str = ""  # MLX's default device in the probe ("cpu", "gpu")
    head_ms: float = 0.0  # the decode head through MLX, mean over 4, 8 and 16 rows
    gemv_ms: float = 0.0  # one head row through the library's sgemv

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, slots=True)
class Tried:
    candidate: Candidate
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class BlasChoice:
    path: str | None  # None: nothing preloaded (MLX's own BLAS, or not a Linux CPU)
    name: str
    reason: str
    config: str = ""
    head_ms: float = 0.0
    tried: tuple[Tried, ...] = ()

    def describe(self) -> str:
        """The start-up log line: what was chosen and why, and what failed."""
        if self.path is None:
            text = f"blas: {self.name} ({self.reason})"
        else:
            text = f"blas: {self.name} {self.path} [{self.config}] ({self.reason}"
            text += f", {self.head_ms:.1f} ms head)" if self.head_ms else ")"
        failed = [f"{t.candidate.name}: {t.verdict.reason}" for t in self.tried
                  if not t.verdict.ok]
        return text + (f"; rejected {'; '.join(failed)}" if failed else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def preload_env(env: dict[str, str], library: str) -> dict[str, str]:
    """`env` with `library` preloaded ahead of what it preloads already, and OpenBLAS's
    threads told to sleep as soon as their work is done (THREAD_TIMEOUT) unless `env` says
    otherwise."""
    out = dict(env)
    out["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    out.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    return out


def candidates(cache_dir: Path, explicit: str | None = None) -> list[Candidate]:
    """The libraries worth probing here: the explicit one, then the newest OpenBLAS first
    (scipy-openblas32's DYNAMIC_ARCH build through the shim, cmeel-openblas's single-target
    build, Debian's DYNAMIC_ARCH build)."""
    found = [Candidate("MLXR_OPENBLAS", explicit)] if explicit else []
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is not None and spec.origin:
        source = Path(spec.origin).parent / "lib" / "libscipy_openblas.so"
        if source.exists():
            found.append(Candidate("scipy-openblas32", str(cache_dir / _shim_name(source)),
                                   forwards_to=str(source)))
    for scheme in ("platlib", "purelib"):
        wheel = Path(sysconfig.get_paths()[scheme]) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if wheel.exists():
            found.append(Candidate("cmeel-openblas", str(wheel)))
            break
    found += [Candidate("debian", p) for p in DEBIAN_PATHS if os.path.exists(p)]
    return found


def _shim_name(source: Path) -> str:
    stat = source.stat()
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()
                            + f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"openblas-shim-{digest.hexdigest()[:16]}.so"


def build_shim(candidate: Candidate) -> str | None:
    """Compile the cblas shim over `candidate.forwards_to` unless it exists; an error or None."""
    source = Path(candidate.forwards_to)
    error = compile_library(SHIM_SOURCE, Path(candidate.path), ["-O2"], [
        f"-L{source.parent}", f"-l:{source.name}", f"-Wl,-rpath,{source.parent}"])
    return f"building its cblas shim failed: {error}" if error else None


def probe(library: str, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """Load `library` into a fresh Python with MLX and check it (shared/blas_probe.py)."""
    if not os.path.exists(library):
        return Verdict(False, f"no such file: {library}")
    env = dict(os.environ, LD_PRELOAD=library)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-m", "mlxr.shared.blas_probe"], env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"probe hung for {timeout_s:g} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1][:300]
        return Verdict(False, describe_exit(done.returncode) + (f": {last}" if last else ""))
    try:
        return Verdict.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        return Verdict(False, f"probe printed no verdict: {done.stdout[-200:]!r}")


def cpu_key() -> str:
    """This CPU and MLX, as a short digest: a verdict holds only for the same pair."""
    try:
        mlx = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        mlx = "?"
    machine, *cpu = cpu_identity()
    text = "\n".join([machine, f"mlx {mlx}", *cpu])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class VerdictCache:
    """Probe verdicts in one JSON file, replaced atomically on every write."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._entries: dict[str, dict] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._entries = {}

    @staticmethod
    def key(library: str, cpu: str) -> str:
        stat = os.stat(library)
        return f"{library}|{stat.st_size}|{stat.st_mtime_ns}|{cpu}"

    def get(self, key: str) -> Verdict | None:
        entry = self._entries.get(key)
        return Verdict.from_dict(entry) if isinstance(entry, dict) else None

    def put(self, key: str, verdict: Verdict) -> None:
        self._entries[key] = dataclasses.asdict(verdict)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(self._entries, indent=1))
            os.replace(partial, self.path)
        except OSError as exc:  # a read-only cache only costs a probe next time
            log.warning("cannot save BLAS probe verdicts to %s: %s", self.path, exc)


def choose(preference: str, cache_dir: Path, *, reprobe: bool = False,
           probe_fn: Callable[[str], Verdict] = probe,
           found: list[Candidate] | None = None) -> BlasChoice:
    """The library runners preload. `preference`: "auto", "off", or a library path
    (MLXR_OPENBLAS). `probe_fn` and `found` stand in for the real ones in tests."""
    if not sys.platform.startswith("linux"):
        return BlasChoice(None, "the platform's BLAS", "not Linux: nothing preloaded")
    if preference == "off":
        return BlasChoice(None, "MLX's own BLAS", "MLXR_OPENBLAS=off")
    explicit = None if preference == "auto" else preference
    if found is None:
        found = candidates(cache_dir, explicit)
    cache = VerdictCache(cache_dir / CACHE_FILE)
    cpu = cpu_key()
    tried: list[Tried] = []
    for candidate in found:
        verdict = _verdict(candidate, cache, cpu, reprobe, probe_fn)
        tried.append(Tried(candidate, verdict))
        if verdict.device and verdict.device != "cpu":
            return BlasChoice(None, "the device's own", f"MLX runs on the {verdict.device}: "
                              "nothing preloaded", tried=tuple(tried))
        if verdict.ok and candidate.name == "MLXR_OPENBLAS":
            return _chosen(candidate, verdict, "MLXR_OPENBLAS, probed ok", tried)
    passed = [t for t in tried if t.verdict.ok]
    if not passed:
        why = "no OpenBLAS found" if not tried else "no OpenBLAS passed its probe"
        return BlasChoice(None, "MLX's own BLAS", why, tried=tuple(tried))
    # Within TIE of the fastest, the earlier candidate (the newer OpenBLAS) wins: one noisy
    # median must not pick an older library for a difference that is not there.
    fastest = min(t.verdict.head_ms for t in passed)
    best = next(t for t in passed if t.verdict.head_ms <= fastest * (1 + TIE))
    reason = "probed ok" if len(passed) == 1 else f"probed ok, fastest of {len(passed)}"
    return _chosen(best.candidate, best.verdict, reason, tried)


def _chosen(candidate: Candidate, verdict: Verdict, reason: str,
            tried: list[Tried]) -> BlasChoice:
    return BlasChoice(candidate.path, candidate.name, reason, verdict.config, verdict.head_ms,
                      tuple(tried))


def _verdict(candidate: Candidate, cache: VerdictCache, cpu: str, reprobe: bool,
             probe_fn: Callable[[str], Verdict]) -> Verdict:
    if candidate.forwards_to:
        error = build_shim(candidate)
        if error:
            return Verdict(False, error)
    try:
        key = VerdictCache.key(candidate.path, cpu)
    except OSError:
        return Verdict(False, f"no such file: {candidate.path}")
    cached = None if reprobe else cache.get(key)
    if cached is not None:
        return cached
    verdict = probe_fn(candidate.path)
    log.info("blas probe of %s (%s): %s", candidate.name, candidate.path, verdict.reason)
    cache.put(key, verdict)
    return verdict


@dataclass(frozen=True, slots=True)
class LoadedBlas:
    path: str | None  # None: MLX's own (its wheel loads that privately) or the platform's
    config: str = ""

    def describe(self) -> str:
        if self.path is None:
            return self.config
        return f"{self.path} [{self.config}]" if self.config else self.path


def loaded_blas() -> LoadedBlas:
    """The library that serves cblas_sgemm in this process: what the runner reports, so a
    benchmark can give its peers exactly the same one."""
    if not sys.platform.startswith("linux"):
        return LoadedBlas(None, "the platform's BLAS")
    process = ctypes.CDLL(None)
    try:
        sgemm = process.cblas_sgemm
    except AttributeError:
        return LoadedBlas(None, "MLX's own BLAS")
    info = _DlInfo()
    dladdr = process.dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(ctypes.cast(sgemm, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return LoadedBlas(None, "an unknown BLAS")
    path = os.path.realpath(info.dli_fname.decode())
    try:
        get_config = process.openblas_get_config
    except AttributeError:
        return LoadedBlas(path)
    get_config.restype = ctypes.c_char_p
    return LoadedBlas(path, get_config().decode(errors="replace"))


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def main(argv: list[str] | None = None) -> None:
    """`python -m mlxr.shared.blas [--path] [--reprobe]`: the choice for this machine (scripts
    preload `--path`'s output); the settings come from the environment as the server's do."""
    from mlxr.shared.config import Settings

    args = sys.argv[1:] if argv is None else argv
    settings = Settings.from_env()
    choice = choose(settings.blas, settings.cache_dir, reprobe="--reprobe" in args)
    print(choice.path or "" if "--path" in args else choice.describe())


if __name__ == "__main__":
    main()

"""What `mlxr serve` leaves in the state directory (MLXR_STATE_DIR, default ~/.mlxr) for the
people and tools that look after it:

- a pid file, `serve-<address>.pid`, written when the server starts and removed when it exits
  (only if it is still its own). A second `mlxr serve` on the same address finds a live server
  there and refuses to start with a message naming it; a pid file left by a server that died
  is replaced.
- a log file, `logs/server.log` for the default address (`logs/server-<address>.log` for any
  other), rotated at 10 MiB with 3 old files kept, written beside stderr.

`<address>` is `host-port`, or for a Unix socket `unix-` and a hash of its path.
"""

from __future__ import annotations

import hashlib
import logging
import logging.handlers
import os
from pathlib import Path

import psutil

from mlxr.shared.config import DEFAULT_PORT, Settings

LOG_BYTES = 10 << 20
LOG_BACKUPS = 3


class AlreadyServing(ValueError):
    """Another mlxr server is serving this address."""


def address_key(settings: Settings) -> str:
    if settings.socket_path is not None:
        return "unix-" + hashlib.sha256(str(settings.socket_path).encode()).hexdigest()[:12]
    return f"{settings.host}-{settings.port}".replace(":", "_").replace("/", "_")


def pid_path(settings: Settings) -> Path:
    return settings.state_dir / f"serve-{address_key(settings)}.pid"


def log_path(settings: Settings) -> Path:
    default = settings.socket_path is None and settings.host == "127.0.0.1" and \
        settings.port == DEFAULT_PORT
    name = "server.log" if default else f"server-{address_key(settings)}.log"
    return settings.state_dir / "logs" / name


def _live_server(pid: int) -> bool:
    """Is `pid` a running mlxr server (not a recycled pid of some other program)?"""
    if pid == os.getpid():
        return False
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        return proc.status() != psutil.STATUS_ZOMBIE and \
            any("mlxr" in part for part in cmdline) and "serve" in cmdline
    except (psutil.Error, OSError):
        return False


def claim_pid_file(settings: Settings) -> Path:
    """Write this process's pid file; AlreadyServing when a live server holds it."""
    path = pid_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        pid = 0
    if pid and _live_server(pid):
        where = settings.socket_path or f"{settings.host}:{settings.port}"
        raise AlreadyServing(f"an mlxr server (pid {pid}) is already serving {where}; stop it "
                             f"first, or serve another address (its pid file: {path})")
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)
    return path


def release_pid_file(path: Path) -> None:
    try:
        if int(path.read_text().strip() or 0) == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def add_log_file(settings: Settings) -> Path:
    """Send the root logger's lines to the rotating log file too."""
    path = log_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_BYTES,
                                                   backupCount=LOG_BACKUPS, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return path

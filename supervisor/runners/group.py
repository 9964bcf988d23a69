"""A distributed runner: one logical runner made of N ranks (runner/distributed/lockstep.py).

Rank 0 is a `RunnerClient` like any other (same protocol, same /v1/status); ranks 1..N-1 are
`python -m mlxr.runner --follower` processes that the group starts, watches and stops with it.
The manager sees one runner: `alive` only while every rank is, `wait_exit` returns when the
first rank exits (so one rank's death tears the group down and the next request starts a new
one; rank 0 has already ended its streams with an error line: "connection to a peer was
lost"), and `stop` stops them all.

The ranks find each other as mlx.launch's ring backend does: MLX_RANK and MLX_HOSTFILE (a JSON
list of each rank's "ip:port") in their environment. `MLXR_HOSTFILE` is mlx.launch's own
hostfile format: `[{"ssh": "host", "ips": ["10.0.0.2"]}, ...]`, one entry per rank, rank 0
first. Only hosts that are this machine are started today (several ranks on loopback); a
remote host is refused with a message saying so.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlxr.shared.config import RunnerConfig
from mlxr.shared.errors import InvalidRequest, RunnerFailed
from mlxr.shared.exits import describe_exit

log = logging.getLogger("mlxr.runners")
STOP_GRACE_S = 5.0
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True, slots=True)
class Host:
    ssh: str
    ip: str


def read_hostfile(path: Path) -> list[Host]:
    """The ranks' hosts from an mlx.launch hostfile; a clear error for anything else."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read the hostfile {path}: {exc}") from None
    if not isinstance(data, list) or len(data) < 2:
        raise InvalidRequest(f"the hostfile {path} must list 2 or more hosts (one per rank)")
    hosts = []
    local = LOCAL_NAMES | {socket.gethostname()}
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh"), str):
            raise InvalidRequest(f'the hostfile {path}: entry {i} needs "ssh" (a host name)')
        ips = entry.get("ips") or []
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise InvalidRequest(f'the hostfile {path}: entry {i}\'s "ips" must be strings')
        if entry["ssh"] not in local:
            raise InvalidRequest(f"the hostfile {path}: host {entry['ssh']!r} is not this "
                                 f"machine; ranks on other hosts are not started yet")
        hosts.append(Host(entry["ssh"], ips[0] if ips else "127.0.0.1"))
    return hosts


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def ring_hostfile(hosts: list[Host], folder: Path) -> Path:
    """MLX_HOSTFILE for the ring backend: each rank's address, a fresh port each."""
    path = folder / "ring.json"
    path.write_text(json.dumps([[f"{h.ip}:{_free_port(h.ip)}"] for h in hosts]))
    return path


class Follower:
    """One rank 1..N-1 process and the last lines it wrote."""

    def __init__(self, rank: int, host: Host, process: asyncio.subprocess.Process):
        self.rank = rank
        self.host = host
        self.process = process
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.tail.append(raw.decode(errors="replace").rstrip())

    async def stop(self) -> None:
        proc = self.process
        if proc.returncode is None:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()  # its stdin watch exits it
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                proc.kill()
        await proc.wait()
        self.reader.cancel()


async def spawn_follower(rank: int, host: Host, config: RunnerConfig, module: str,
                         env: dict[str, str], preexec: Any) -> Follower:
    follower_config = RunnerConfig.from_dict({**config.to_dict(), "follower": True,
                                              "token_stdin": False, "port": 0})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "--follower", "--config",
        json.dumps(follower_config.to_dict()),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**env, "MLX_RANK": str(rank)},
        preexec_fn=preexec, start_new_session=True)
    log.info("started rank %d of %s (pid %d)", rank, config.model_name, process.pid)
    return Follower(rank, host, process)


class GroupMixin:
    """What a RunnerClient becomes as rank 0 of a group (mixed in by client.py)."""

    followers: list[Follower]
    hosts: list[Host]
    group_dir: Path | None

    @property
    def alive(self) -> bool:
        return super().alive and all(f.process.returncode is None for f in self.followers)

    async def wait_exit(self) -> int:
        """The first rank to exit ends the group: its exit code."""
        waits = {asyncio.ensure_future(super().wait_exit()): None}
        waits.update({asyncio.ensure_future(f.process.wait()): f for f in self.followers})
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        first = next(iter(done))
        follower = waits[first]
        if follower is not None:
            # Rank 0 may be stuck in a collective with the dead rank: end its streams now
            # rather than when it is stopped.
            self.first_exit = (follower.rank, first.result())
            message = self._rank_exit("while serving")
            self.abort_streams(lambda: RunnerFailed(message))
        return first.result()

    def exit_failure(self, when: str) -> RunnerFailed:
        gone = getattr(self, "first_exit", None)
        if gone is None:
            return super().exit_failure(when)
        return RunnerFailed(self._rank_exit(when),
                            stderr_tail="\n".join(self.followers[gone[0] - 1].tail))

    def _rank_exit(self, when: str) -> str:
        rank, code = self.first_exit
        host = self.followers[rank - 1].host.ssh
        return f"rank {rank} of {self.config.model_name} (on {host}) {describe_exit(code)} {when}"

    def stderr_tail(self) -> str:
        parts = [super().stderr_tail()]
        parts += [f"[rank {f.rank}] {line}" for f in self.followers for line in f.tail]
        return "\n".join(p for p in parts if p)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        await super().stop(grace_s)  # rank 0 says stop to the others as it ends
        await asyncio.gather(*(f.stop() for f in self.followers))
        if self.group_dir is not None:
            shutil.rmtree(self.group_dir, ignore_errors=True)

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank's host, pid and resident memory, for /api/ps."""
        out = []
        for rank, (host, proc) in enumerate(
                [(self.hosts[0], self.process)] + [(f.host, f.process) for f in self.followers]):
            try:
                memory = psutil.Process(proc.pid).memory_info().rss
            except (psutil.Error, ProcessLookupError):
                memory = 0
            out.append({"rank": rank, "host": host.ssh, "pid": proc.pid, "memory": memory})
        return out


def group_env(hosts: list[Host], base: dict[str, str]) -> tuple[dict[str, str], Path]:
    """The environment every rank shares (MLX_HOSTFILE), and the private folder it is in."""
    folder = Path(tempfile.mkdtemp(prefix="mlxr-group-"))
    os.chmod(folder, 0o700)
    return {**base, "MLX_HOSTFILE": str(ring_hostfile(hosts, folder))}, folder


def kill_all(followers: list[Follower]) -> None:
    for f in followers:
        if f.process.returncode is None:
            try:
                f.process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

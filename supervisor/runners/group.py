"""A distributed runner: one logical runner made of N ranks (runner/distributed/lockstep.py).

Rank 0 is a `RunnerClient` like any other (same protocol, same /v1/status); ranks 1..N-1 are
`python -m mlxr.runner --follower` processes that the group starts, watches and stops with it.
The manager sees one runner: `alive` only while every rank is, `wait_exit` returns when the
first rank exits (so one rank's death tears the group down and the next request starts a new
one; rank 0 has already ended its streams with an error line: "connection to a peer was
lost"), and `stop` stops them all.

The ranks find each other as mlx.launch's ring backend does: each rank is told its rank and
every rank's "ip:port" (RunnerConfig.rank and .ring; the rank writes the ring's hostfile
itself). `MLXR_HOSTFILE` is mlx.launch's own hostfile format: `[{"ssh": "host", "ips":
["10.0.0.2"]}, ...]`, one entry per rank, rank 0 first. Rank 0 runs here (the supervisor
talks to it on loopback); a rank on another host is started there through the remote shell
(`MLXR_REMOTE_SHELL`, default `ssh`: `ssh HOST COMMAND`, as mlx.launch does), with the same
Python and the same store paths, and reports its memory on its output.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import shlex
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlxr.shared.config import RunnerConfig
from mlxr.shared.errors import InsufficientMemory, InvalidRequest, RunnerFailed
from mlxr.shared.exits import describe_exit
from mlxr.supervisor.runners.memory import GIB

log = logging.getLogger("mlxr.runners")
STOP_GRACE_S = 5.0
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# What a rank on another host gets from our environment (the rest is its own).
REMOTE_ENV = ("PYTHONPATH", "MLXR_DISTRIBUTED_BACKEND", "MLX_METAL_FAST_SYNCH")


@dataclass(frozen=True, slots=True)
class Host:
    ssh: str
    ip: str
    local: bool = True  # this machine: started directly, else through the remote shell


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
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh"), str) \
                or not entry["ssh"].strip() or entry["ssh"].startswith("-"):
            raise InvalidRequest(f'the hostfile {path}: entry {i} needs "ssh" (a host name)')
        ips = entry.get("ips") or []
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise InvalidRequest(f'the hostfile {path}: entry {i}\'s "ips" must be strings')
        is_local = entry["ssh"] in local
        if not is_local and not ips:
            raise InvalidRequest(f'the hostfile {path}: entry {i} (host {entry["ssh"]!r}) '
                                 f'needs "ips": the address the other ranks reach it at')
        hosts.append(Host(entry["ssh"], ips[0] if ips else "127.0.0.1", is_local))
    if not hosts[0].local:
        raise InvalidRequest(f"the hostfile {path}: the first entry (rank 0) must be this "
                             f"machine, which serves the model's HTTP; {hosts[0].ssh!r} is not")
    return hosts


_READ: dict[Path, tuple[int, tuple[Host, ...]]] = {}


def hostfile_hosts(path: Path) -> tuple[Host, ...]:
    """`read_hostfile`, read again only when the file changes: it is consulted for every
    request's load spec."""
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = -1
    cached = _READ.get(path)
    if cached is None or cached[0] != stamp:
        cached = _READ[path] = (stamp, tuple(read_hostfile(path)))
    return cached[1]


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def ring_addresses(hosts: list[Host]) -> tuple[str, ...]:
    """Each rank's "ip:port" for the ring backend: a free port where the address is ours to
    probe, else one drawn at random from the dynamic range (a rank that cannot bind it fails
    the group's start, and the next request draws again)."""
    out = []
    for h in hosts:
        try:
            port = _free_port(h.ip)
        except OSError:  # an address of another host
            port = random.randrange(40000, 60000)
        out.append(f"{h.ip}:{port}")
    return tuple(out)


class Follower:
    """One rank 1..N-1 process (here, or the remote shell that runs it), the last lines it
    wrote, and the memory it last reported."""

    def __init__(self, rank: int, host: Host, process: asyncio.subprocess.Process):
        self.rank = rank
        self.host = host
        self.process = process
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.memory: dict[str, int] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith('{"event": "memory"'):
                try:
                    self.memory = {k: int(v) for k, v in json.loads(line).items()
                                   if k != "event"}
                except (ValueError, TypeError):
                    pass
                continue
            self.tail.append(line)

    async def stop(self) -> None:
        proc = self.process
        if proc.returncode is None:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()  # its stdin watch exits it (over ssh too)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                proc.kill()
        await proc.wait()
        self.reader.cancel()


def follower_command(rank: int, host: Host, config: RunnerConfig, module: str,
                     env: dict[str, str], remote_shell: str) -> tuple[list[str], dict[str, str]]:
    """How to start rank `rank`: argv and environment. A remote rank runs the same Python
    through the remote shell (`ssh HOST COMMAND`), chooses its own BLAS for its own CPU, and
    gets in its command line the few variables it needs from ours."""
    follower = RunnerConfig.from_dict({
        **config.to_dict(), "follower": True, "token_stdin": False, "port": 0, "rank": rank,
        "blas": config.blas if host.local else "auto"})
    argv = [sys.executable, "-m", module, "--follower", "--config",
            json.dumps(follower.to_dict())]
    if host.local:
        return argv, env
    passed = [f"{k}={env[k]}" for k in REMOTE_ENV if env.get(k)]
    command = shlex.join(["env", *passed, *argv])
    return [*shlex.split(remote_shell), host.ssh, command], env


async def spawn_follower(rank: int, host: Host, config: RunnerConfig, module: str,
                         env: dict[str, str], preexec: Any, remote_shell: str) -> Follower:
    argv, env = follower_command(rank, host, config, module, env, remote_shell)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=env, preexec_fn=preexec,
            start_new_session=True)
    except OSError as exc:
        raise RunnerFailed(f"cannot start rank {rank} of {config.model_name} on "
                           f"{host.ssh}: {exc}") from None
    log.info("started rank %d of %s on %s (pid %d)", rank, config.model_name, host.ssh,
             process.pid)
    return Follower(rank, host, process)


class GroupMixin:
    """What a RunnerClient becomes as rank 0 of a group (mixed in by client.py)."""

    followers: list[Follower]
    hosts: list[Host]

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
        host = self.followers[rank - 1].host
        if not host.local and code > 128:  # the remote shell's status for a signal: 128 + N
            code = 128 - code
        return (f"rank {rank} of {self.config.model_name} (on {host.ssh}) "
                f"{describe_exit(code)} {when}")

    def stderr_tail(self) -> str:
        parts = [super().stderr_tail()]
        parts += [f"[rank {f.rank}] {line}" for f in self.followers for line in f.tail]
        return "\n".join(p for p in parts if p)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        await super().stop(grace_s)  # rank 0 says stop to the others as it ends
        await asyncio.gather(*(f.stop() for f in self.followers))

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank's host, pid and resident memory, for /api/ps: rank 0's from here, the
        others' as they last reported it (the pid is the local process: the rank itself, or
        the remote shell that runs it)."""
        out = []
        try:
            memory = psutil.Process(self.process.pid).memory_info().rss
        except (psutil.Error, ProcessLookupError):
            memory = 0
        out.append({"rank": 0, "host": self.hosts[0].ssh, "pid": self.process.pid,
                    "memory": memory})
        for f in self.followers:
            out.append({"rank": f.rank, "host": f.host.ssh, "pid": f.process.pid,
                        "memory": f.memory.get("rss", 0)})
        return out


def kill_all(followers: list[Follower]) -> None:
    for f in followers:
        if f.process.returncode is None:
            try:
                f.process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass


PROBE_TIMEOUT_S = 30.0
_PROBE = "import psutil; print(psutil.virtual_memory().available)"


async def host_available(host: Host, remote_shell: str) -> int:
    """Another host's available memory, asked through the remote shell."""
    command = shlex.join([sys.executable, "-c", _PROBE])
    try:
        process = await asyncio.create_subprocess_exec(
            *shlex.split(remote_shell), host.ssh, command, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        process.kill()
        raise RunnerFailed(f"host {host.ssh} did not answer within {PROBE_TIMEOUT_S:.0f}s "
                           f"({remote_shell} {host.ssh})") from None
    except OSError as exc:
        raise RunnerFailed(f"cannot reach host {host.ssh} with {remote_shell!r}: {exc}") from None
    try:
        return int(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no answer"]
        raise RunnerFailed(f"cannot reach host {host.ssh} with {remote_shell!r}: "
                           f"{detail[0]}") from None


async def check_remote_memory(spec: Any, remote_shell: str) -> None:
    """Memory planning for the other hosts (this host's share is the manager's to place):
    each remote host must have room for its ranks' shares, else the load is refused with
    the host named, before any rank starts."""
    hosts = list(spec.hosts)
    per_rank = spec.estimate_bytes // max(spec.local_ranks, 1)
    remote: dict[Host, int] = collections.Counter(h for h in hosts if not h.local)
    if not remote:
        return
    available = await asyncio.gather(*(host_available(h, remote_shell) for h in remote))
    for (host, count), free in zip(remote.items(), available):
        if per_rank * count > free:
            raise InsufficientMemory(
                f"model requires more system memory on {host.ssh} ({per_rank * count / GIB:.1f}"
                f" GiB for {count} rank{'s' if count > 1 else ''}) than is available there "
                f"({free / GIB:.1f} GiB)")

"""Stand-in hosts for a distributed runner's ranks, on one machine.

Where the machine allows it (root, `ip netns`, veth, a bridge), each host is a network
namespace joined to this one by a veth pair on a bridge: its own address, its own loopback,
reached only over the veth, as another machine on a LAN would be. Elsewhere (no root, or a
container without those), each host is a name whose address is 127.0.0.1. Either way the
supervisor starts the ranks through a remote shell, as it would with ssh: `SHELL HOST
COMMAND`. The script written here is that shell: `ip netns exec HOST sh -c COMMAND`, or
`sh -c COMMAND` for the loopback stand-ins.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Hosts:
    entries: list[dict]  # the hostfile: rank 0 here, then one entry per stand-in host
    remote_shell: str  # MLXR_REMOTE_SHELL
    netns: bool  # the stand-ins are network namespaces
    _cleanup: list[list[str]] = field(default_factory=list)

    def close(self) -> None:
        for argv in reversed(self._cleanup):
            subprocess.run(argv, capture_output=True)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _netns_works() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"mlxr-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (OSError, subprocess.CalledProcessError):
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True


def _check_reach(entries: list[dict]) -> None:
    """Every stand-in reaches rank 0's address over its veth (a firewall on the bridge
    would stop the ranks' ring): raises CalledProcessError if one cannot."""
    with socket.socket() as listener:
        listener.bind((entries[0]["ips"][0], 0))
        listener.listen(len(entries))
        port = listener.getsockname()[1]
        for entry in entries[1:]:
            _run("ip", "netns", "exec", entry["ssh"], sys.executable, "-c",
                 f"import socket; socket.create_connection(({entries[0]['ips'][0]!r}, "
                 f"{port}), 3).close()")


def make_hosts(folder: Path, count: int) -> Hosts:
    """Rank 0's entry and `count` stand-in hosts with one rank each."""
    shell = folder / "remote-shell"
    if _netns_works():
        try:
            return _namespaces(folder, shell, count)
        except subprocess.CalledProcessError:
            pass  # a container that allows namespaces but not veth or bridges
    shell.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')
    shell.chmod(0o755)
    entries = [{"ssh": "localhost", "ips": ["127.0.0.1"]}]
    entries += [{"ssh": f"standin-{i}", "ips": ["127.0.0.1"]} for i in range(1, count + 1)]
    return Hosts(entries, str(shell), netns=False)


def _namespaces(folder: Path, shell: Path, count: int) -> Hosts:
    tag = os.getpid() % 250 + 1  # one subnet and set of names per test process
    bridge, subnet = f"mlxrbr{tag}", f"10.213.{tag}"
    hosts = Hosts([], str(shell), netns=True)
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        hosts._cleanup.append(["ip", "link", "del", bridge])
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        hosts.entries.append({"ssh": "localhost", "ips": [f"{subnet}.1"]})
        for i in range(1, count + 1):
            name, outside = f"mlxr-{tag}-{i}", f"mx{tag}v{i}"
            _run("ip", "netns", "add", name)
            hosts._cleanup.append(["ip", "netns", "del", name])
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0",
                 "netns", name)
            hosts._cleanup.append(["ip", "link", "del", outside])
            _run("ip", "link", "set", outside, "master", bridge, "up")
            _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{subnet}.{i + 1}/24",
                 "dev", "eth0")
            _run("ip", "netns", "exec", name, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            hosts.entries.append({"ssh": name, "ips": [f"{subnet}.{i + 1}"]})
        _check_reach(hosts.entries)
    except BaseException:
        hosts.close()
        raise
    shell.write_text('#!/bin/sh\nhost="$1"\nshift\nexec ip netns exec "$host" sh -c "$*"\n')
    shell.chmod(0o755)
    return hosts

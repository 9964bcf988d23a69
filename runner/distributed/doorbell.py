"""Idle ranks sleep: a follower waiting in a collective spins a core (MLX's ring backend polls
its sockets), so while rank 0 has nothing to run it tells the followers to park, and each
waits, blocked and using no CPU, on a doorbell: a listening TCP socket on its ring address.
Rank 0 rings every doorbell (connects, one byte) before its next message. The step plans
still travel by collectives; the doorbell carries nothing but "wake up".

The ports are exchanged once, by an all_sum in which each rank fills its own slot.
A connection made before the follower waits is queued by the listening socket, so a ring
that comes right after a park is never lost.
"""

from __future__ import annotations

import socket
from typing import Any

import mlx.core as mx

WAKE_TIMEOUT_S = 10.0


def ring_hosts(config: Any, ranks: int) -> list[str]:
    """Each rank's address, from the ring the rank was given (RunnerConfig.ring), else from
    mlx.launch's MLX_HOSTFILE."""
    if config.ring:
        return [address.rsplit(":", 1)[0] for address in config.ring]
    import json
    import os

    with open(os.environ["MLX_HOSTFILE"]) as f:
        entries = json.load(f)
    hosts = [(e[0] if isinstance(e, list) else e).rsplit(":", 1)[0] for e in entries]
    return hosts[:ranks]


def exchange_ports(group: Any, port: int) -> list[int]:
    """Every rank's doorbell port (rank 0 has none: 0)."""
    slots = mx.zeros((group.size(),), mx.int32)
    slots[group.rank()] = port
    return [int(p) for p in mx.distributed.all_sum(slots, group=group).tolist()]


class Doorbell:
    """A follower's: listen on this rank's ring address, and wait for a ring."""

    def __init__(self, host: str):
        self.socket = socket.create_server((host, 0), backlog=8)
        self.port = self.socket.getsockname()[1]

    def wait(self) -> None:
        connection, _ = self.socket.accept()
        with connection:
            connection.recv(1)


def ring(hosts: list[str], ports: list[int]) -> None:
    """Rank 0's: wake every follower."""
    for host, port in zip(hosts[1:], ports[1:]):
        with socket.create_connection((host, port), timeout=WAKE_TIMEOUT_S) as s:
            s.sendall(b"\x01")

"""A distributed runner's hosts: the hostfile, how a rank on another host is started through
the remote shell, and the memory check of the other hosts (real subprocesses standing in for
ssh; no MLX)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlxr.shared.config import RunnerConfig
from mlxr.shared.errors import InsufficientMemory, InvalidRequest, RunnerFailed
from mlxr.supervisor.runners.group import (GroupMixin, Host, check_remote_memory,
                                           follower_command, hostfile_hosts, read_hostfile,
                                           ring_addresses)


def hostfile(tmp_path: Path, entries) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(entries))
    return path


def test_the_hostfile_names_local_and_remote_hosts(tmp_path):
    hosts = read_hostfile(hostfile(tmp_path, [
        {"ssh": "localhost", "ips": ["10.0.0.1"]}, {"ssh": "mac-2", "ips": ["10.0.0.2"]},
        {"ssh": "127.0.0.1"}]))
    assert hosts == [Host("localhost", "10.0.0.1", True), Host("mac-2", "10.0.0.2", False),
                     Host("127.0.0.1", "127.0.0.1", True)]


@pytest.mark.parametrize("entries, message", [
    ([{"ssh": "localhost"}], "2 or more hosts"),
    ({"ssh": "localhost"}, "2 or more hosts"),
    ([{"ssh": "localhost"}, {"ips": ["10.0.0.2"]}], 'entry 1 needs "ssh"'),
    ([{"ssh": "localhost"}, {"ssh": "-oProxyCommand=x", "ips": ["1.2.3.4"]}], "entry 1 needs"),
    ([{"ssh": "localhost"}, {"ssh": "mac-2", "ips": "10.0.0.2"}], '"ips" must be strings'),
    ([{"ssh": "localhost"}, {"ssh": "mac-2"}], 'needs "ips"'),
    ([{"ssh": "mac-1", "ips": ["10.0.0.1"]}, {"ssh": "localhost"}], "rank 0) must be this machine"),
])
def test_a_bad_hostfile_is_a_clear_error(tmp_path, entries, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_hostfile(hostfile(tmp_path, entries))


def test_ring_addresses_probe_local_ports_and_draw_remote_ones():
    addresses = ring_addresses([Host("localhost", "127.0.0.1"), Host("far", "192.0.2.7", False)])
    local, remote = (a.rsplit(":", 1) for a in addresses)
    assert local[0] == "127.0.0.1" and int(local[1]) > 0
    assert remote[0] == "192.0.2.7" and 40000 <= int(remote[1]) < 60000


def test_a_remote_rank_runs_the_same_argv_through_the_remote_shell(tmp_path):
    config = RunnerConfig(model_dir="/models/it's here", model_name="m:latest", blas="/lib/x.so",
                          rank=0, ring=("10.0.0.1:5000", "10.0.0.2:5001"))
    env = {"PYTHONPATH": "/src dir", "LD_PRELOAD": "/lib/x.so", "SECRET": "no"}
    local_argv, _ = follower_command(1, Host("localhost", "10.0.0.1"), config, "mlxr.runner",
                                     env, "ssh -q")
    remote_argv, _ = follower_command(1, Host("mac-2", "10.0.0.2", False), config,
                                      "mlxr.runner", env, "ssh -q")
    assert local_argv[:4] == [sys.executable, "-m", "mlxr.runner", "--follower"]
    local_config = json.loads(local_argv[-1])
    assert (local_config["rank"], local_config["follower"], local_config["blas"]) == \
        (1, True, "/lib/x.so")
    assert remote_argv[:3] == ["ssh", "-q", "mac-2"]
    # the remote host's shell reads the command line back into the same argv, with only the
    # variables it needs from ours
    words = shlex.split(remote_argv[3])
    assert words[:2] == ["env", "PYTHONPATH=/src dir"]
    assert words[2:] == local_argv[:-1] + [words[-1]]
    remote_config = json.loads(words[-1])
    assert remote_config["blas"] == "auto"  # it chooses for its own CPU
    assert remote_config["model_dir"] == "/models/it's here"
    assert remote_config["ring"] == ["10.0.0.1:5000", "10.0.0.2:5001"]
    printed = subprocess.run(["sh", "-c", shlex.join(["printf", "%s\\n", *words])],
                             capture_output=True, text=True, check=True).stdout
    assert printed.splitlines() == words


def fake_shell(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-ssh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def spec(hosts, estimate: int, local: int = 1):
    return SimpleNamespace(hosts=tuple(hosts), estimate_bytes=estimate, local_ranks=local)


HOSTS = [Host("localhost", "10.0.0.1"), Host("mac-2", "10.0.0.2", False),
         Host("mac-3", "10.0.0.3", False), Host("mac-3", "10.0.0.3", False)]


def test_remote_hosts_with_room_pass_the_memory_check(tmp_path):
    shell = fake_shell(tmp_path, 'test "$1" = mac-2 -o "$1" = mac-3 || exit 255; echo 3000')
    asyncio.run(check_remote_memory(spec(HOSTS, 1000), shell))  # mac-3: 2 ranks, 2000


def test_a_remote_host_without_room_refuses_the_load_naming_it(tmp_path):
    shell = fake_shell(tmp_path, 'if [ "$1" = mac-3 ]; then echo 1500; else echo 9000; fi')
    with pytest.raises(InsufficientMemory, match="on mac-3 .* for 2 ranks"):
        asyncio.run(check_remote_memory(spec(HOSTS, 1000), shell))


def test_an_unreachable_host_is_a_clear_error(tmp_path):
    shell = fake_shell(tmp_path, 'echo "ssh: Could not resolve hostname $1" >&2; exit 255')
    with pytest.raises(RunnerFailed, match="cannot reach host mac-2 .*Could not resolve"):
        asyncio.run(check_remote_memory(spec(HOSTS[:2], 1000), shell))
    with pytest.raises(RunnerFailed, match="cannot reach host mac-2 with '/no/such/ssh'"):
        asyncio.run(check_remote_memory(spec(HOSTS[:2], 1000), "/no/such/ssh"))


def test_only_local_hosts_need_no_remote_shell():
    asyncio.run(check_remote_memory(spec([Host("localhost", "127.0.0.1")] * 2, 1 << 60, 2),
                                    "/no/such/ssh"))


def test_a_remote_ranks_signal_is_named_from_its_shells_status():
    def message(host: Host, code: int) -> str:
        group = SimpleNamespace(first_exit=(1, code), config=SimpleNamespace(model_name="m"),
                                followers=[SimpleNamespace(host=host)])
        return GroupMixin._rank_exit(group, "while serving")

    assert message(Host("mac-2", "10.0.0.2", False), 137) == \
        "rank 1 of m (on mac-2) was killed by SIGKILL (killed) while serving"
    assert message(Host("localhost", "127.0.0.1"), -9) == \
        "rank 1 of m (on localhost) was killed by SIGKILL (killed) while serving"
    assert message(Host("mac-2", "10.0.0.2", False), 1) == \
        "rank 1 of m (on mac-2) exited with code 1 while serving"


def test_the_hostfile_is_read_again_only_when_it_changes(tmp_path):
    path = hostfile(tmp_path, [{"ssh": "localhost"}, {"ssh": "mac-2", "ips": ["10.0.0.2"]}])
    first = hostfile_hosts(path)
    assert hostfile_hosts(path) is first
    path.write_text(json.dumps([{"ssh": "localhost"}] * 3))
    os.utime(path, ns=(1, 1))  # a new stamp, however fast the rewrite
    assert [h.ssh for h in hostfile_hosts(path)] == ["localhost"] * 3


@pytest.mark.parametrize("tail, starts", [("[ring] Couldn't bind socket (error: 98)", 2),
                                          ("RuntimeError: out of memory", 1)])
def test_a_group_whose_ring_port_was_taken_starts_again_with_other_ports(monkeypatch, tail,
                                                                         starts):
    """MLX's ring binds the ports `ring_addresses` drew a moment before; another process may
    take one first (seen under the parallel suite: a restarted group's start failed with
    EADDRINUSE). The group then starts again on ports drawn afresh, as a single runner does
    for its HTTP port; any other failure is the load's error."""
    import dataclasses

    from mlxr.shared.config import Settings
    from mlxr.supervisor.runners import client as runner_client

    made = []

    class Group:
        def __init__(self, config):
            self.config, self.failed = config, not made

        def stderr_tail(self) -> str:
            return tail if self.failed else ""

    async def spawn_group(config, hosts, **_):
        group = Group(config)
        made.append(group)
        return group

    async def ready(client, timeout_s):
        if client.failed:
            raise RunnerFailed("failed to load model", stderr_tail=client.stderr_tail())
        return client

    async def enough_memory(spec, shell):
        return None

    monkeypatch.setattr(runner_client.RunnerGroup, "spawn_group", staticmethod(spawn_group))
    monkeypatch.setattr(runner_client, "_ready", ready)
    monkeypatch.setattr(runner_client, "check_remote_memory", enough_memory)

    class NoBlas:
        async def choice(self):
            return SimpleNamespace(path=None)

    settings = dataclasses.replace(Settings(), load_timeout_s=5.0)
    spec = SimpleNamespace(model_dir="/x", name="m:latest", context_length=2048,
                                 kv_cache_bytes=1 << 30, local_ranks=2, sharding="auto",
                                 hosts=("a", "b"))
    start = runner_client.make_runner_factory(settings, NoBlas())
    if starts == 1:
        with pytest.raises(RunnerFailed, match="out of memory"):
            asyncio.run(start(spec))
    else:
        assert not asyncio.run(start(spec)).failed
        assert made[0].config.port != made[1].config.port
    assert len(made) == starts

"""DNS-rebinding protection (the Host check), the settings that choose the listener, the
graceful-shutdown drain, the Unix socket listener and the runner secret's check: no processes,
the real aiohttp app through aiohttp's in-process test client."""

from __future__ import annotations

import asyncio
import base64
import io
import stat
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mlxr.shared.config import Settings
from mlxr.shared.runner_auth import TokenCheck, read_token_line, token_from_file
from mlxr.shared.config import is_loopback_host
from mlxr.supervisor.api.middleware import HostCheck, host_name
from mlxr.supervisor.app import bind_unix_socket, make_app

CHECK = HostCheck(hostname="Studio-Mac", addresses={"192.0.2.7", "2001:db8::7"})


@pytest.mark.parametrize("host", [
    "", "localhost", "localhost:11434", "LOCALHOST", "127.0.0.1:11434", "127.8.9.1", "[::1]:11434",
    "::1", "0.0.0.0:11434", "10.1.2.3", "172.16.0.1:80", "192.168.1.20", "[fd00::1]:11434",
    "studio-mac", "studio-mac:11434", "app.localhost", "printer.local:631", "api.internal",
    "192.0.2.7:11434", "[2001:db8::7]:11434", "localhost.",
])
def test_hosts_of_this_machine_are_allowed(host):
    assert CHECK.allowed(host)


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:11434", "localhost.evil.example", "evillocalhost",
    "8.8.8.8", "172.32.0.1", "[2001:4860::8888]:11434", "studio-mac.evil.example",
    "local", "internal.example",
])
def test_other_hosts_are_refused(host):
    assert not CHECK.allowed(host)


def test_host_names_and_listen_addresses():
    assert host_name("[::1]:8080") == "::1" and host_name("Example.COM:80") == "example.com"
    assert all(map(is_loopback_host, ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"]))
    assert not any(map(is_loopback_host, ["0.0.0.0", "::", "192.168.1.2", "example.com"]))


async def _get(settings: Settings, host: str, path: str = "/api/tags") -> tuple[int, dict]:
    app = make_app(settings, runner_factory=_no_runner)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get(path, headers={"Host": host})
        return resp.status, await resp.json()


async def _no_runner(spec):
    raise AssertionError("no runner is loaded in these tests")


def test_a_loopback_server_refuses_a_rebound_host_with_403(tmp_path: Path):
    settings = Settings(models_dir=tmp_path)
    status, body = asyncio.run(_get(settings, "attacker.example:11434"))
    assert status == 403 and "attacker.example" in body["error"]
    status, body = asyncio.run(_get(settings, "attacker.example", "/v1/models"))
    assert status == 403 and body["error"]["type"] == "permission_error"
    assert asyncio.run(_get(settings, "localhost:11434"))[0] == 200


def test_no_host_check_off_loopback_or_on_a_unix_socket(tmp_path: Path):
    for settings in (Settings(models_dir=tmp_path, host="0.0.0.0"),
                     Settings(models_dir=tmp_path, socket_path=tmp_path / "mlxr.sock")):
        assert asyncio.run(_get(settings, "attacker.example"))[0] == 200


def test_settings_from_the_environment():
    s = Settings.from_env({"MLXR_HOST": "unix:///run/mlxr/api.sock"})
    assert s.socket_path == Path("/run/mlxr/api.sock") and s.host == "127.0.0.1"
    assert Settings.from_env({"OLLAMA_HOST": "unix://~/mlxr.sock"}).socket_path == \
        Path("~/mlxr.sock").expanduser()
    assert Settings.from_env({"MLXR_HOST": "0.0.0.0:8080"}).socket_path is None
    s = Settings.from_env({"MLXR_SHUTDOWN_GRACE": "1m30s", "MLXR_MAX_LOAD_FAILURES": "5",
                           "MLXR_LOAD_FAILURE_COOLDOWN": "2m"})
    assert (s.shutdown_grace_s, s.max_load_failures, s.load_failure_cooldown_s) == (90, 5, 120)
    assert Settings.from_env({"MLXR_SHUTDOWN_GRACE": "-1"}).shutdown_grace_s == 0
    assert Settings().shutdown_grace_s == 5.0 and Settings().max_load_failures == 3


def test_the_drain_refuses_new_requests_once_shutdown_begins(tmp_path: Path):
    async def main():
        app = make_app(Settings(models_dir=tmp_path), runner_factory=_no_runner)
        async with TestClient(TestServer(app)) as client:
            assert (await client.get("/api/tags")).status == 200
            await app.shutdown()  # what SIGTERM runs first: on_shutdown
            resp = await client.get("/api/tags")
            return resp.status, await resp.json()

    assert asyncio.run(main()) == (503, {"error": "server shutting down"})


def test_the_runner_token_check():
    check = TokenCheck("s3cret")
    basic = "Basic " + base64.b64encode(b"anyone:s3cret").decode()
    assert check("Bearer s3cret") and check(basic) and check("basic " + basic[6:])
    for header in (None, "", "Bearer s3cre", "Bearer s3cret ", "s3cret", "Bearer S3CRET",
                   "Basic " + base64.b64encode(b"s3cret").decode(), "Basic !!!", "Basic "):
        assert not check(header), header


def test_token_files_and_the_stdin_line(tmp_path: Path):
    path = tmp_path / "token"
    made = token_from_file(path)
    assert len(made) >= 40 and path.stat().st_mode & 0o777 == 0o600
    assert token_from_file(path) == made
    assert read_token_line(io.BytesIO(b"abc\nrest")) == "abc"
    assert read_token_line(io.BytesIO(b"")) is None
    assert read_token_line(io.BytesIO(b"abc")) is None  # cut short: the writer went away


def test_the_unix_socket_is_private_and_replaces_only_a_stale_one(tmp_path: Path):
    path = tmp_path / "sub" / "mlxr.sock"
    sock = bind_unix_socket(path)  # makes the missing directory (0700)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        sock.listen()
        with pytest.raises(ValueError, match="another server is listening"):
            bind_unix_socket(path)
    finally:
        sock.close()
    bind_unix_socket(path).close()  # now stale: replaced
    precious = tmp_path / "precious"
    precious.write_text("data")
    with pytest.raises(ValueError, match="exists and is not a socket"):
        bind_unix_socket(precious)
    assert precious.read_text() == "data"

"""The service files `mlxr service install` writes (supervisor/cli/service.py), checked without
installing anything: the systemd unit's contents, the launchd plist through plistlib, and the
install/uninstall file handling in a temporary home."""

from __future__ import annotations

import plistlib
import sys
from pathlib import Path

from mlxr.supervisor.cli import service as svc

ENV = {"MLXR_NUM_PARALLEL": "8", "OLLAMA_HOST": "127.0.0.1:11500", "PATH": "/usr/bin",
       "HOME": "/home/x", "AWS_SECRET_ACCESS_KEY": "nope"}


def test_the_environment_keeps_only_mlxr_ollama_and_path():
    assert svc.service_environment(ENV) == {"MLXR_NUM_PARALLEL": "8",
                                            "OLLAMA_HOST": "127.0.0.1:11500",
                                            "PATH": "/usr/bin"}


def test_systemd_unit_restarts_on_failure_and_carries_the_environment():
    unit = svc.systemd_unit(["/opt/my env/python", "-m", "mlxr.supervisor.cli", "serve"],
                            {"MLXR_API_KEY": 'a"b\\c%d', "PATH": "/usr/bin"})
    lines = unit.splitlines()
    assert "Restart=on-failure" in lines and "WantedBy=default.target" in lines
    assert "ExecStart='/opt/my env/python' -m mlxr.supervisor.cli serve" in lines
    assert 'Environment="MLXR_API_KEY=a\\"b\\\\c%%d"' in lines
    assert lines.index("[Service]") < lines.index("Restart=on-failure") < \
        lines.index("[Install]")


def test_launchd_plist_round_trips_with_the_required_keys(tmp_path):
    data = svc.launchd_plist(["/usr/bin/python3", "-m", "mlxr.supervisor.cli", "serve"],
                             {"MLXR_MODELS": "/Volumes/big/models"}, tmp_path)
    plist = plistlib.loads(data)
    assert plist["Label"] == svc.LAUNCHD_LABEL
    assert plist["ProgramArguments"][-1] == "serve"
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["EnvironmentVariables"] == {"MLXR_MODELS": "/Volumes/big/models"}
    assert plist["StandardErrorPath"] == str(tmp_path / "server.log")


def test_platform_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    linux = svc.Platform.here(tmp_path)
    assert linux.kind == "systemd"
    assert linux.path == tmp_path / "cfg" / "systemd" / "user" / "mlxr.service"
    assert linux.commands("install")[-1] == ["systemctl", "--user", "enable", "--now",
                                             "mlxr.service"]
    monkeypatch.setattr(sys, "platform", "darwin")
    mac = svc.Platform.here(tmp_path)
    assert mac.path == tmp_path / "Library" / "LaunchAgents" / "com.mlxr.serve.plist"
    assert mac.commands("logs") == [["tail", "-n", "200",
                                     str(tmp_path / "Library/Logs/mlxr/server.log")]]


def test_install_writes_and_replaces_and_uninstall_removes(tmp_path):
    platform = svc.Platform("systemd", tmp_path / "user" / "mlxr.service")
    assert svc.install(platform, {"MLXR_NUM_PARALLEL": "4"}, start=False) == platform.path
    assert 'Environment="MLXR_NUM_PARALLEL=4"' in platform.path.read_text()
    svc.install(platform, {"MLXR_NUM_PARALLEL": "2"}, start=False)
    text = platform.path.read_text()
    assert 'MLXR_NUM_PARALLEL=2"' in text and "NUM_PARALLEL=4" not in text
    assert sorted(p.name for p in platform.path.parent.iterdir()) == ["mlxr.service"]
    assert svc.uninstall(platform, stop=False) is True
    assert not platform.path.exists()
    assert svc.uninstall(platform, stop=False) is False


def test_a_missing_service_manager_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to run here
    platform = svc.Platform("systemd", Path(tmp_path / "mlxr.service"))
    assert svc.run_manager(platform, "status") == 1
    assert "systemctl is not available here" in capsys.readouterr().err

"""`mlxr service install --no-start` as a user runs it, in a temporary home: the unit it
writes passes `systemd-analyze verify` (which rejects a broken one), and `uninstall` removes
it. Nothing is started: the tests never touch the machine's service manager."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

MLXR = [sys.executable, "-m", "mlxr.supervisor.cli"]


def verify(path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60)


def test_installed_unit_verifies_and_uninstall_removes_it(tmp_path, subprocess_env):
    env = {**subprocess_env, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
           "MLXR_NUM_PARALLEL": "8", "MLXR_MODELS": str(tmp_path / "models")}
    done = subprocess.run([*MLXR, "service", "install", "--no-start"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "cfg" / "systemd" / "user" / "mlxr.service"
    assert done.stdout.strip() == f"installed {unit}"
    text = unit.read_text()
    assert 'Environment="MLXR_NUM_PARALLEL=8"' in text and "Restart=on-failure" in text
    checked = verify(unit)
    assert checked.returncode == 0 and not (checked.stdout + checked.stderr).strip(), \
        checked.stdout + checked.stderr  # not even a warning
    # the verifier is live: it warns about a bad value and fails on a missing program
    broken = tmp_path / "broken.service"
    broken.write_text(text.replace("Type=simple", "Type=sometimes"))
    assert "Failed to parse service type" in verify(broken).stderr
    broken.write_text(text.replace(f"ExecStart={sys.executable}", "ExecStart=/no/such/python"))
    assert verify(broken).returncode != 0
    gone = subprocess.run([*MLXR, "service", "uninstall"], env={**env, "PATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0 and not unit.exists()
    assert f"removed {unit}" in gone.stdout
    status = subprocess.run([*MLXR, "service", "status"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 1 and "no mlxr service is installed" in status.stderr

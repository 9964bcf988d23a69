"""`mlxr service install|uninstall|status|logs`: run `mlxr serve` as the user's service, started
at login and restarted when it crashes.

- Linux: a systemd user unit, ~/.config/systemd/user/mlxr.service (`Restart=on-failure`),
  enabled and started with `systemctl --user`; logs in the user journal.
- macOS: a launchd agent, ~/Library/LaunchAgents/com.mlxr.serve.plist (`RunAtLoad`,
  `KeepAlive` on a crash), loaded with `launchctl`; logs in ~/Library/Logs/mlxr/.

The environment the server needs (every `MLXR_*` and `OLLAMA_*` variable set when installing,
and PATH) is written into the unit, so the service runs with the settings it was installed
with. The unit and the plist are made by pure functions (`systemd_unit`, `launchd_plist`),
which the tests check without installing anything.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

UNIT_NAME = "mlxr.service"
LAUNCHD_LABEL = "com.mlxr.serve"


def service_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What the service keeps of the installing shell's environment."""
    keep = {k: v for k, v in environ.items() if k.startswith(("MLXR_", "OLLAMA_"))}
    if environ.get("PATH"):
        keep["PATH"] = environ["PATH"]
    return dict(sorted(keep.items()))


def serve_command(python: str = sys.executable) -> list[str]:
    return [python, "-m", "mlxr.supervisor.cli", "serve"]


def _quote_env(value: str) -> str:
    """A value for systemd's Environment="K=V": backslashes and double quotes escaped, and %
    doubled (systemd expands % specifiers)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


def systemd_unit(command: list[str], env: Mapping[str, str]) -> str:
    lines = ["[Unit]", "Description=mlxr: an Ollama-compatible LLM server on MLX",
             "After=network.target", "", "[Service]", "Type=simple",
             "ExecStart=" + " ".join(shlex.quote(c).replace("%", "%%") for c in command),
             "Restart=on-failure", "RestartSec=3",
             # a graceful stop: SIGTERM, running requests get MLXR_SHUTDOWN_GRACE to finish
             "KillSignal=SIGTERM", "TimeoutStopSec=30"]
    lines += [f'Environment="{k}={_quote_env(v)}"' for k, v in env.items()]
    lines += ["", "[Install]", "WantedBy=default.target", ""]
    return "\n".join(lines)


def launchd_plist(command: list[str], env: Mapping[str, str], log_dir: Path) -> bytes:
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": list(command),
        "EnvironmentVariables": dict(env),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restart after a crash, not after a stop
        "ProcessType": "Interactive",
        "StandardOutPath": str(log_dir / "server.log"),
        "StandardErrorPath": str(log_dir / "server.log"),
    })


@dataclass(frozen=True, slots=True)
class Platform:
    """Where the service file goes and the commands that manage it."""

    kind: str  # "systemd" or "launchd"
    path: Path
    log_dir: Path | None = None

    @classmethod
    def here(cls, home: Path | None = None) -> "Platform":
        home = home or Path.home()
        if sys.platform == "darwin":
            return cls("launchd", home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist",
                       home / "Library" / "Logs" / "mlxr")
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        return cls("systemd", config / "systemd" / "user" / UNIT_NAME)

    def render(self, command: list[str], env: Mapping[str, str]) -> bytes:
        if self.kind == "launchd":
            return launchd_plist(command, env, self.log_dir)
        return systemd_unit(command, env).encode()

    def commands(self, action: str) -> list[list[str]]:
        """The service manager's commands for `action` (install, uninstall, status, logs)."""
        if self.kind == "launchd":
            target = f"gui/{os.getuid()}"
            return {"install": [["launchctl", "bootstrap", target, str(self.path)]],
                    "uninstall": [["launchctl", "bootout", f"{target}/{LAUNCHD_LABEL}"]],
                    "status": [["launchctl", "print", f"{target}/{LAUNCHD_LABEL}"]],
                    "logs": [["tail", "-n", "200", str(self.log_dir / "server.log")]]}[action]
        return {"install": [["systemctl", "--user", "daemon-reload"],
                            ["systemctl", "--user", "enable", "--now", UNIT_NAME]],
                "uninstall": [["systemctl", "--user", "disable", "--now", UNIT_NAME]],
                "status": [["systemctl", "--user", "status", "--no-pager", UNIT_NAME]],
                "logs": [["journalctl", "--user", "-u", UNIT_NAME, "-n", "200",
                          "--no-pager"]]}[action]


def run_manager(platform: Platform, action: str) -> int:
    """Run the service manager's commands for `action`; the first failure's status, or 0. A
    manager that is not installed is reported, not raised."""
    for cmd in platform.commands(action):
        if shutil.which(cmd[0]) is None:
            print(f"{cmd[0]} is not available here; run it yourself where it is: "
                  f"{shlex.join(cmd)}", file=sys.stderr)
            return 1
        status = subprocess.run(cmd).returncode
        if status:
            return status
    return 0


def install(platform: Platform, environ: Mapping[str, str], start: bool = True) -> Path:
    """Write the service file (replacing an older one); with `start`, enable and start it."""
    platform.path.parent.mkdir(parents=True, exist_ok=True)
    if platform.log_dir is not None:
        platform.log_dir.mkdir(parents=True, exist_ok=True)
    tmp = platform.path.with_name(platform.path.name + ".tmp")
    tmp.write_bytes(platform.render(serve_command(), service_environment(environ)))
    os.replace(tmp, platform.path)
    if start:
        run_manager(platform, "install")
    return platform.path


def uninstall(platform: Platform, stop: bool = True) -> bool:
    """Stop and remove the service; False when none was installed."""
    if not platform.path.exists():
        return False
    if stop:
        run_manager(platform, "uninstall")
    platform.path.unlink()
    return True

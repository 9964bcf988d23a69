"""The config file: ~/.mlxr/config.toml, or the file MLXR_CONFIG names. It holds the settings
of the README's table, grouped; the environment overrides it, and it overrides the defaults.

    [server]
    host = "127.0.0.1:11434"      # or "unix:///path/to/sock"
    keep_alive = "10m"
    origins = ["https://app.example"]
    [store]
    models = "/Volumes/big/mlxr-models"
    [scheduler]
    num_parallel = 8
    [limits]
    max_request_bytes = "64MiB"

An unknown group or key, or a value of the wrong type, is a ConfigError naming the key and the
file: a typo never silently leaves a default in place. Read with the standard library
(`tomllib`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping

from mlxr.shared.errors import MlxrError

# group -> key -> (Settings field, kind); kinds are checked and converted by _convert.
FILE_KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "server": {
        "host": ("host", "address"), "api_key": ("api_key", "str"),
        "origins": ("origins", "strings"), "keep_alive": ("keep_alive_s", "duration"),
        "shutdown_grace": ("shutdown_grace_s", "duration"), "debug": ("debug", "bool"),
        "blas": ("blas", "str"), "cache_dir": ("cache_dir", "path"),
        "state_dir": ("state_dir", "path"), "allow_image_urls": ("allow_image_urls", "bool"),
    },
    "store": {
        "models": ("models_dir", "path"), "registry_timeout": ("registry_timeout_s", "duration"),
    },
    "scheduler": {
        "max_loaded_models": ("max_loaded_models", "int"), "num_parallel": ("num_parallel", "int"),
        "max_queue": ("max_queue", "int"), "context_length": ("context_length", "int"),
        "load_timeout": ("load_timeout_s", "duration"), "kv_layout": ("kv_layout", "kv_layout"),
        "prefix_cache_bytes": ("prefix_cache_bytes", "size"),
        "max_load_failures": ("max_load_failures", "int"),
        "load_failure_cooldown": ("load_failure_cooldown_s", "duration"),
        "hostfile": ("hostfile", "path"), "sharding": ("sharding", "sharding"),
        "remote_shell": ("remote_shell", "str"),
        "host_attention": ("host_attention", "bool"),
        "attention_buckets": ("attention_buckets", "bool"),
        "float32_weights": ("float32_weights", "float32_weights"),
        "spare_runner": ("spare_runner", "bool"),
    },
    "limits": {
        "memory_margin": ("memory_margin_bytes", "size"),
        "max_request_bytes": ("max_request_bytes", "size"),
    },
}


class ConfigError(ValueError):
    """The config file cannot be used; the message names the file and the key."""


def config_path(env: Mapping[str, str]) -> Path | None:
    """The config file to read: MLXR_CONFIG (which must exist), else ~/.mlxr/config.toml when
    there is one."""
    named = env.get("MLXR_CONFIG")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigError(f"MLXR_CONFIG names {path}, which is not a file")
        return path
    home = env.get("HOME")
    default = (Path(home) if home else Path.home()) / ".mlxr" / "config.toml"
    return default if default.is_file() else None


def read_config(path: Path, parse: Mapping[str, Callable[[str], Any]]) -> dict[str, Any]:
    """Settings fields -> values from the file at `path`. `parse` holds the string parsers the
    environment uses (address, duration, size, kv_layout), so both read a value alike."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for group, table in data.items():
        keys = FILE_KEYS.get(group)
        if keys is None or not isinstance(table, dict):
            raise ConfigError(f"{path}: unknown group [{group}] (the groups are "
                              + ", ".join(f"[{g}]" for g in FILE_KEYS) + ")")
        for key, value in table.items():
            if key not in keys:
                raise ConfigError(f"{path}: unknown key {key!r} in [{group}] (its keys are "
                                  + ", ".join(keys) + ")")
            field, kind = keys[key]
            try:
                values.update(_convert(field, kind, value, parse))
            except (TypeError, ValueError, MlxrError) as exc:
                raise ConfigError(f"{path}: [{group}] {key}: {exc}") from None
    return values


def _convert(field: str, kind: str, value: Any,
             parse: Mapping[str, Callable[[str], Any]]) -> dict[str, Any]:
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"must be an integer, not {value!r}")
        return {field: value}
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"must be true or false, not {value!r}")
        return {field: value}
    if kind == "strings":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise TypeError(f"must be a list of strings, not {value!r}")
        return {field: tuple(value)}
    if kind in ("duration", "size") and isinstance(value, (int, float)) and \
            not isinstance(value, bool):
        return {field: float(value) if kind == "duration" else int(value)}
    if not isinstance(value, str):
        what = {"duration": 'a duration ("5m", or seconds)', "size": 'a size ("1GiB", or '
                'bytes)'}.get(kind, "a string")
        raise TypeError(f"must be {what}, not {value!r}")
    if kind == "str":
        return {field: value}
    if kind == "path":
        return {field: Path(value).expanduser()}
    if kind == "address":  # host and port, or a Unix socket: several fields
        return parse["address"](value)
    return {field: parse[kind](value)}

"""Settings, read from the environment once. Nothing else reads os.environ.

`Settings` is the supervisor's; `RunnerConfig` is what the supervisor hands a runner (as one
JSON argument) and what `python -m mlxr.runner` builds from its flags.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from mlxr.shared.config_file import config_path, read_config
from mlxr.shared.errors import InvalidRequest

DEFAULT_PORT = 11434

_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Seconds from a number of seconds or a Go duration string ("5m", "1h30m", "-1").
    Negative means forever (returned as -1)."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid duration {value!r}")
    if isinstance(value, (int, float)):
        return _duration_s(value, value)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            pos, total = 0, 0.0
            negative = text.startswith("-")
            body = text[1:] if negative else text
            for m in _DURATION.finditer(body):
                if m.start() != pos:
                    break
                total += float(m.group(1)) * _UNIT_S[m.group(2)]
                pos = m.end()
            if pos != len(body) or not body:
                raise InvalidRequest(f'invalid duration "{value}"') from None
            return -1.0 if negative else _duration_s(total, value)
        return _duration_s(number, value)
    raise InvalidRequest(f"invalid duration {value!r}")


# Go's longest time.Duration. A longer one is forever (Ollama's overflowing conversion makes
# it negative, which is forever there too); kept as seconds it would overflow a date here.
MAX_DURATION_S = (1 << 63) / 1e9


def _duration_s(seconds: int | float, value: Any) -> float:
    if seconds != seconds:  # NaN
        raise InvalidRequest(f"invalid duration {value!r}")
    return -1.0 if seconds < 0 or seconds > MAX_DURATION_S else float(seconds)


def parse_host(value: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """OLLAMA_HOST-style "host", "host:port", ":port", "http://host:port"."""
    text = value.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    if text.startswith("["):  # [::1]:port
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if port and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(f"invalid port in host {value!r}")
    return host or "127.0.0.1", int(port) if port else default_port


def parse_socket(value: str) -> Path | None:
    """The path of a "unix:///path/to/sock" address (MLXR_HOST / OLLAMA_HOST), or None for a
    TCP address."""
    text = value.strip()
    if not text.startswith("unix://"):
        return None
    path = text[len("unix://"):]
    if not path:
        raise ValueError(f"invalid unix socket address {value!r}: no path")
    return Path(path).expanduser()


def is_loopback_host(host: str) -> bool:
    """Whether a listen address is a loopback one ("localhost" or a loopback IP)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


KV_LAYOUTS = ("auto", "rows", "padded")


def rows_layout(layout: str, on_cpu: bool) -> bool:
    """Whether a runner holds the KV cache as rows over the block pool (else the padded
    batch). "auto": the rows on a CPU; the padded batch on a GPU, where the rows' per-row
    writes and attention calls, one small kernel each, made decoding 2.3x slower at 16 streams
    and 4x at 64 on an H200 (docs/PERFORMANCE.md, "On a GPU")."""
    return layout == "rows" or (layout == "auto" and on_cpu)


def _parse_kv_layout(text: str) -> str:
    if text not in KV_LAYOUTS:
        raise ValueError(f"MLXR_KV_LAYOUT must be auto, rows or padded, not {text!r}")
    return text


def _parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", text.lower())
    if not m:
        raise ValueError(f"invalid size {text!r}")
    unit = (m.group(2) or "").rstrip("b").rstrip("i")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    value = float(m.group(1)) * scale
    if value >= 2**63:  # infinity too: a 400-digit number
        raise ValueError(f"invalid size {text!r}: too large")
    return int(value)


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    models_dir: Path = Path.home() / ".mlxr" / "models"
    keep_alive_s: float = 300.0
    max_loaded_models: int = 3
    num_parallel: int = 16
    max_queue: int = 512
    load_timeout_s: float = 300.0
    context_length: int = 4096
    prefix_cache_bytes: int = 1 << 30
    # How runners hold the KV cache: "rows" (the block pool, runner/kv/rows.py, where the
    # architecture fits), "padded" (mlx-lm's left-padded batch cache), or "auto": the rows
    # on a CPU, the padded batch on a GPU (`rows_layout`).
    kv_layout: str = "auto"
    # On a CPU, attend float32 rows with many scores with numpy's softmax
    # (runner/kv/host_attention.py), take numpy's SwiGLU in prefill chunks
    # (runner/host_swiglu.py), and run decode steps of 1-2 rows in numpy
    # (runner/host_body.py), and run embedding encoders in numpy (runner/embed/host_encoder.py);
    # MLXR_HOST_ATTENTION=0: always MLX's.
    host_attention: bool = True
    # On a CUDA GPU, read prefill chunks with their attention in bucketed shapes, so that
    # cuDNN builds a few graphs, not one per chunk (runner/kv/bucketed_attention.py);
    # MLXR_ATTENTION_BUCKETS=1. Off by default until it is measured further: on an H200 it
    # read a 2,000-token prompt beside 8 streams in 6.8 s against 11.4, but with one 3.3 s
    # pause (docs/PERFORMANCE.md, "On a GPU").
    attention_buckets: bool = False
    # On a CPU, widen bfloat16, float16 and quantized weights to float32 at load, where MLX's
    # matmuls use BLAS (runner/weights.py): "auto" (when it fits in memory), "on", "off".
    float32_weights: str = "auto"
    memory_margin_bytes: int = 1 << 30
    max_request_bytes: int = 32 << 20
    api_key: str | None = None
    origins: tuple[str, ...] = ()
    # The BLAS runners preload on Linux CPU: "auto" (probe the candidates, shared/blas.py),
    # "off", or a library path to try first (MLXR_OPENBLAS).
    blas: str = "auto"
    cache_dir: Path = Path.home() / ".cache" / "mlxr"  # BLAS probe verdicts, the built shim
    debug: bool = False
    # The module started as `python -m <runner_module>`; tests point it at a fake runner.
    runner_module: str = "mlxr.runner"
    # Keep one runner process started, its imports done, for the next load to take
    # (supervisor/runners/spare.py; about 2 s of each load); MLXR_SPARE_RUNNER=0: no spare.
    spare_runner: bool = True
    # Serve the API on this Unix socket instead of host:port (MLXR_HOST=unix:///path).
    socket_path: Path | None = None
    # On SIGTERM/SIGINT, running requests get this long to finish before their streams end
    # with an error (MLXR_SHUTDOWN_GRACE).
    shutdown_grace_s: float = 5.0
    # A model whose runner fails to load this many times in a row is refused at once (with
    # its last error) until it changes, is unloaded, or the cool-down passes; 0: never.
    max_load_failures: int = 3
    load_failure_cooldown_s: float = 60.0
    # A registry (pull, push) that sends nothing for this long fails the transfer, and a
    # manifest must arrive whole within three times it (MLXR_REGISTRY_TIMEOUT; <= 0: no limit).
    registry_timeout_s: float = 60.0
    # Fetch http(s) image URLs in requests on the client's behalf (MLXR_ALLOW_IMAGE_URLS=1);
    # off by default: the server makes no outbound requests a client asks for.
    allow_image_urls: bool = False
    # The server's pid file and rotating log file go here (MLXR_STATE_DIR), named after the
    # address it serves (supervisor/server_files.py).
    state_dir: Path = Path.home() / ".mlxr"
    # An mlx.launch hostfile (MLXR_HOSTFILE): language models load sharded over its ranks
    # (supervisor/runners/group.py); None: one runner process per model.
    hostfile: Path | None = None
    sharding: str = "auto"  # MLXR_SHARDING: tensor, pipeline or auto (RunnerConfig.sharding)
    # How ranks on other hosts are started (MLXR_REMOTE_SHELL): this command, then the host,
    # then the command line to run there, as `ssh HOST COMMAND` (mlx.launch's way).
    remote_shell: str = "ssh"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """The defaults, then the config file (shared/config_file.py), then the environment,
        then `overrides` (command-line flags; None means not given)."""
        return cls.load(env, **overrides)[0]

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None,
             **overrides: Any) -> tuple["Settings", dict[str, str]]:
        """The settings and where each one that is not a default came from: "file PATH",
        "environment" or "flag"."""
        env = os.environ if env is None else env
        path = config_path(env)
        from_file = read_config(path, _FILE_PARSERS) if path else {}
        from_env = _env_values(env)
        if {"host", "socket_path"} & from_env.keys():  # one address: the environment's
            from_file = {k: v for k, v in from_file.items()
                         if k not in ("host", "port", "socket_path")}
        flags = {k: v for k, v in overrides.items() if v is not None}
        sources = {**{k: f"file {path}" for k in from_file},
                   **{k: "environment" for k in from_env}, **{k: "flag" for k in flags}}
        return cls(**{**from_file, **from_env, **flags}), sources

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """Settings fields -> values from the environment (only the variables that are set)."""
    values: dict[str, Any] = {}
    host = env.get("MLXR_HOST") or env.get("OLLAMA_HOST")
    if host and parse_socket(host) is not None:
        values["socket_path"], host = parse_socket(host), None
    if host:
        values["host"], values["port"] = parse_host(host)
    models = env.get("MLXR_MODELS")
    if models:
        values["models_dir"] = Path(models).expanduser()
    if "MLXR_KEEP_ALIVE" in env or "OLLAMA_KEEP_ALIVE" in env:
        values["keep_alive_s"] = parse_duration(
            env.get("MLXR_KEEP_ALIVE") or env.get("OLLAMA_KEEP_ALIVE"))
    for name, key, conv in (
        ("max_loaded_models", "MAX_LOADED_MODELS", int),
        ("num_parallel", "NUM_PARALLEL", int),
        ("max_queue", "MAX_QUEUE", int),
        ("context_length", "CONTEXT_LENGTH", int),
        ("load_timeout_s", "LOAD_TIMEOUT", parse_duration),
        ("prefix_cache_bytes", "PREFIX_CACHE_BYTES", _parse_bytes),
        ("kv_layout", "KV_LAYOUT", _parse_kv_layout),
        ("memory_margin_bytes", "MEMORY_MARGIN", _parse_bytes),
        ("max_request_bytes", "MAX_REQUEST_BYTES", _parse_bytes),
        ("shutdown_grace_s", "SHUTDOWN_GRACE", lambda v: max(0.0, parse_duration(v))),
        ("max_load_failures", "MAX_LOAD_FAILURES", int),
        ("load_failure_cooldown_s", "LOAD_FAILURE_COOLDOWN", parse_duration),
        ("registry_timeout_s", "REGISTRY_TIMEOUT", parse_duration),
    ):
        raw = env.get("MLXR_" + key) or env.get("OLLAMA_" + key)
        if raw:
            values[name] = conv(raw)
    if env.get("MLXR_API_KEY"):
        values["api_key"] = env["MLXR_API_KEY"]
    origins = env.get("MLXR_ORIGINS") or env.get("OLLAMA_ORIGINS")
    if origins:
        values["origins"] = tuple(o.strip() for o in origins.split(",") if o.strip())
    blas = env.get("MLXR_OPENBLAS")
    if blas is not None:
        values["blas"] = "off" if blas.strip() in ("", "0", "off") else blas.strip()
    cache = env.get("MLXR_CACHE_DIR") or (
        env.get("XDG_CACHE_HOME") and str(Path(env["XDG_CACHE_HOME"]) / "mlxr"))
    if cache:
        values["cache_dir"] = Path(cache).expanduser()
    if env.get("MLXR_STATE_DIR"):
        values["state_dir"] = Path(env["MLXR_STATE_DIR"]).expanduser()
    if env.get("MLXR_RUNNER_MODULE"):
        values["runner_module"] = env["MLXR_RUNNER_MODULE"]
    debug = env.get("MLXR_DEBUG", env.get("OLLAMA_DEBUG"))
    if debug is not None:
        values["debug"] = debug not in ("", "0", "false")
    if env.get("MLXR_HOST_ATTENTION") is not None:
        values["host_attention"] = env["MLXR_HOST_ATTENTION"].strip().lower() not in (
            "", "0", "false", "off", "no")
    if env.get("MLXR_ATTENTION_BUCKETS") is not None:
        values["attention_buckets"] = env["MLXR_ATTENTION_BUCKETS"].strip().lower() not in (
            "", "0", "false", "off", "no")
    if env.get("MLXR_FLOAT32_WEIGHTS"):
        values["float32_weights"] = _parse_float32_weights(env["MLXR_FLOAT32_WEIGHTS"])
    if env.get("MLXR_SPARE_RUNNER") is not None:
        values["spare_runner"] = env["MLXR_SPARE_RUNNER"].strip().lower() not in (
            "", "0", "false", "off", "no")
    if env.get("MLXR_ALLOW_IMAGE_URLS") is not None:
        values["allow_image_urls"] = env["MLXR_ALLOW_IMAGE_URLS"] not in ("", "0", "false")
    if env.get("MLXR_HOSTFILE"):
        values["hostfile"] = Path(env["MLXR_HOSTFILE"]).expanduser()
    if env.get("MLXR_SHARDING"):
        values["sharding"] = _parse_sharding(env["MLXR_SHARDING"])
    if env.get("MLXR_REMOTE_SHELL"):
        values["remote_shell"] = env["MLXR_REMOTE_SHELL"]
    return values


def _address(value: str) -> dict[str, Any]:
    socket_path = parse_socket(value)
    if socket_path is not None:
        return {"socket_path": socket_path}
    host, port = parse_host(value)
    return {"host": host, "port": port}


def _parse_float32_weights(value: str) -> str:
    value = value.strip().lower()
    value = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off",
             "no": "off"}.get(value, value)
    if value not in ("auto", "on", "off"):
        raise ValueError(f"float32_weights must be auto, on or off, not {value!r}")
    return value


def _parse_sharding(value: str) -> str:
    value = value.strip().lower()
    if value not in ("auto", "tensor", "pipeline"):
        raise ValueError(f"sharding must be auto, tensor or pipeline, not {value!r}")
    return value


_FILE_PARSERS: dict[str, Any] = {"address": _address, "duration": parse_duration,
                                 "size": _parse_bytes, "kv_layout": _parse_kv_layout,
                                 "sharding": _parse_sharding,
                                 "float32_weights": _parse_float32_weights}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_dir: str
    model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    num_parallel: int = 16
    context_length: int = 4096
    prefill_chunk: int = 512
    step_token_budget: int = 2048
    prefix_cache_bytes: int = 1 << 30  # the padded layout's copy-based prefix cache
    kv_cache_bytes: int = 0  # 0: derived from the system's available memory
    kv_layout: str = "auto"  # Settings.kv_layout
    host_attention: bool = True  # Settings.host_attention
    attention_buckets: bool = False  # Settings.attention_buckets
    float32_weights: str = "auto"  # Settings.float32_weights
    watch_stdin: bool = False  # exit when stdin closes (the supervisor died)
    # Where the secret every request must carry comes from (never argv, which `ps` shows):
    # the first line of stdin (the supervisor's way), else this file (created with a fresh
    # secret, mode 0600, if missing), else a fresh secret in a new private file.
    token_stdin: bool = False
    token_file: str = ""
    # The library to preload (the supervisor's probed choice), "off", or "auto": choose here,
    # as the supervisor would (a runner started by hand).
    blas: str = "auto"
    # A distributed runner's rank 1..N-1: no HTTP, it follows rank 0's steps.
    follower: bool = False
    # Where load-time probe verdicts are kept per model, code and machine
    # (runner/probe_verdicts.py; the supervisor's cache_dir/probes); "": probe every load.
    probe_cache_dir: str = ""
    # A distributed runner's place in its group: this rank, and every rank's "ip:port" (the
    # ring backend's hostfile, written by the rank itself, so a rank on another host needs
    # no file from us). rank -1: MLX_RANK and MLX_HOSTFILE from the environment, if set (as
    # mlx.launch sets them), else not distributed.
    rank: int = -1
    ring: tuple[str, ...] = ()
    # How a distributed runner's ranks split the model: "tensor", "pipeline", or "auto"
    # (tensor where the heads divide among the ranks, else pipeline).
    sharding: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunnerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        if "ring" in values:
            values["ring"] = tuple(str(a) for a in values["ring"])
        return cls(**values)

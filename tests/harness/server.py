"""Test harness: a real `mlxr serve` subprocess on a free port (or a Unix socket) with its own
model store, and helpers to put models into that store."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import ollama
import psutil
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[2]
QWEN3_CONFIG = ROOT / "shared" / "assets" / "qwen3" / "tokenizer_config.json"


# A tool both APIs are tested with, and the Qwen3-style call of it a forced output writes.
WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
WEATHER_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                '</tool_call>')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    models_dir: Path
    log_path: Path
    socket_path: Path | None = None  # served on this Unix socket (then `url` only names it)

    def _transport(self, kwargs: dict) -> dict:
        if self.socket_path is not None and "transport" not in kwargs:
            kwargs["transport"] = httpx.HTTPTransport(uds=str(self.socket_path))
        return kwargs

    def client(self, **kwargs) -> ollama.Client:
        return ollama.Client(host=self.url, **self._transport(kwargs))

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, trust_env=False,
                            **self._transport({"timeout": 60, **kwargs}))

    def runner_pids(self) -> list[int]:
        """Live child processes (runners being stopped may linger for a moment)."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [p.pid for p in children if pid_alive(p.pid)]

    def ps_names(self) -> list[str]:
        return sorted(m.model for m in self.client().ps().models)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SERVE = ["-m", "mlxr.supervisor.cli", "serve"]


def start_server(tmp: Path, base_env: dict[str, str], models_dir: Path | None = None,
                 socket_path: Path | None = None, command: list[str] = SERVE,
                 **env: str) -> Server:
    """Start `mlxr serve` (as `python <command>`, by default `-m mlxr.supervisor.cli serve`)
    and wait until it answers; on `socket_path` (MLXR_HOST=unix://...) when given."""
    port = free_port()
    models_dir = models_dir or tmp / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    address = f"unix://{socket_path}" if socket_path else f"127.0.0.1:{port}"
    full_env = {**base_env, "MLXR_HOST": address, "MLXR_MODELS": str(models_dir),
                "OLLAMA_HOST": address, "MLXR_STATE_DIR": str(tmp / "state"), **env}
    full_env.pop("HTTP_PROXY", None)
    full_env.pop("http_proxy", None)
    log_path = tmp / f"serve-{port}.log"
    proc = subprocess.Popen([sys.executable, *command], env=full_env,
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=ROOT)
    url = "http://localhost" if socket_path else f"http://127.0.0.1:{port}"
    server = Server(proc, url, models_dir, log_path, socket_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlxr serve exited: {server.log()[-3000:]}")
        try:
            with server.http(timeout=1) as http:
                if http.get("/").status_code == 200:
                    return server
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"mlxr serve did not start: {server.log()[-3000:]}")


def serving(tmp: Path, base_env: dict[str, str], models: dict[str, Path], **env: str):
    """A module fixture's body: `mlxr serve` with `models` (name -> directory) imported through
    its own create API; stopped when the generator closes."""
    server = start_server(tmp, base_env, **env)
    try:
        for name, source in models.items():
            assert server.client().create(model=name, from_=str(source)).status == "success"
        yield server
    finally:
        server.stop()


def write_fake_model(dest: Path) -> Path:
    """The smallest directory the store accepts: config.json, a tiny safetensors file and the
    Qwen3 tokenizer config (for its chat template). Only the fake runner can 'load' it."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "head_dim": 8, "vocab_size": 16, "torch_dtype": "float32"}))
    save_file({"model.embed_tokens.weight": np.zeros((16, 8), np.float32)},
              str(dest / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(QWEN3_CONFIG, dest / "tokenizer_config.json")
    return dest


def serve_in_thread(serve) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """Run `serve(started)` (a coroutine function that sets the event once it listens) on a
    new event loop in a daemon thread; returns (loop, thread) once it has started."""
    started = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(serve(started)), daemon=True)
    thread.start()
    assert started.wait(10), "the test server did not start"
    return loop, thread


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def answers(url: str) -> bool:
    """Does a server answer at `url` (a GET of / with 200)?"""
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

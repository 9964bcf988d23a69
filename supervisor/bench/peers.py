"""Processes a benchmark starts: our runner, our supervisor, and mlx_lm.server, all with the
same model directory and the same BLAS: our runners choose theirs (shared/blas.py), and each
peer gets exactly the file our runner reports serving its sgemm."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlxr.shared.runner_auth import token_from_file



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(blas_path: str = "", **extra: str) -> dict[str, str]:
    """Our environment, less any BLAS preload; `blas_path` preloaded for a peer."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env.pop("LD_PRELOAD", None)
    if blas_path:
        env["LD_PRELOAD"] = blas_path
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Process:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _spawn(name: str, args: list[str], url: str, env: dict[str, str], workdir: Path) -> Process:
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return Process(name, url, proc, log_path)


def wait_until(process: Process, path: str, ready, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited:\n{process.log_tail()}")
        try:
            resp = httpx.get(process.url + path, timeout=2)
            if resp.status_code == 200 and ready(resp):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.stop()
    raise TimeoutError(f"{process.name} not ready after {timeout_s} s:\n{process.log_tail()}")


def start_runner(model_dir: Path, workdir: Path, num_parallel: int, **config) -> Process:
    port = free_port()
    # The runner needs its secret on every request: made here, in a file only we can read; the
    # URL carries it as basic-auth credentials, which httpx sends.
    token_file = workdir / "runner.token"
    token = token_from_file(token_file)
    cfg = {"model_dir": str(model_dir), "port": port, "num_parallel": num_parallel,
           "token_file": str(token_file), **config}
    p = _spawn("runner", [sys.executable, "-m", "mlxr.runner", "--config", json.dumps(cfg)],
               f"http://runner:{token}@127.0.0.1:{port}", child_env(), workdir)
    wait_until(p, "/v1/status", lambda r: r.json().get("status") == "ready")
    status = httpx.get(p.url + "/v1/status", timeout=5).json()
    p.extra["blas"] = {"path": status.get("blas_path", ""), "config": status.get("blas_config", "")}
    return p


def start_mlx_lm_server(model_dir: Path, workdir: Path, blas_path: str) -> Process:
    """mlx_lm.server with `blas_path` (our runner's library) preloaded."""
    port = free_port()
    hf_cache = Path(tempfile.mkdtemp(prefix="hf-cache-", dir=workdir))
    p = _spawn("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                                 "--port", str(port), "--log-level", "WARNING"],
               f"http://127.0.0.1:{port}", child_env(blas_path, HF_HUB_CACHE=str(hf_cache)),
               workdir)
    wait_until(p, "/v1/models", lambda r: True)
    p.extra["model"] = str(model_dir)
    return p


def start_supervisor(model_dir: Path, workdir: Path, num_parallel: int,
                     model: str = "bench") -> Process:
    """`mlxr serve` on a free port with its own store, the model imported as `model` and
    loaded."""
    port = free_port()
    env = child_env(MLXR_HOST=f"127.0.0.1:{port}", MLXR_MODELS=str(workdir / "models"),
                    MLXR_NUM_PARALLEL=str(num_parallel), MLXR_KEEP_ALIVE="-1")
    p = _spawn("mlxr-serve", [sys.executable, "-m", "mlxr.supervisor.cli", "serve"],
               f"http://127.0.0.1:{port}", env, workdir)
    wait_until(p, "/", lambda r: True)
    with httpx.Client(base_url=p.url, timeout=600, trust_env=False) as http:
        lines = http.post("/api/create", json={"model": model, "from": str(model_dir)}).text
        if '"success"' not in lines:
            p.stop()
            raise RuntimeError(f"could not import the model into mlxr serve: {lines[-500:]}")
        http.post("/api/generate", json={"model": model, "keep_alive": -1}).raise_for_status()
        [running] = http.get("/api/ps").json()["models"]
    p.extra["model"] = model
    p.extra["blas"] = running["blas"]
    return p


# llama.cpp's llama-server: a peer built outside this repository (scripts/build_llama_server.sh)
# and fed the bench model as GGUF, written by our own writer.

BUILD_HINT = ("build it with `scripts/build_llama_server.sh SDIST OUT_DIR` (llama.cpp as vendored "
              "in the llama-cpp-python sdist; see docs/PERFORMANCE.md, section llama.cpp), then "
              "pass --llama-server PATH or set MLXR_LLAMA_SERVER")

# Token texts llama.cpp ends a generation on besides the model's EOS (it matches them by text,
# whatever the tokenizer says). In the Qwen3 vocabulary: </s> 128247, <|fim_pad|> 151662,
# <|repo_name|> 151663, <|file_sep|> 151664; <|endoftext|> and <|im_end|> are the EOS ids.
LLAMA_END_TOKENS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                    "<end_of_turn>", "<|end_of_text|>", "<EOT>", "<|fim_pad|>", "<|repo_name|>",
                    "<|file_sep|>", "<|fim_rep|>", "<|fim_sep|>", "<|return|>", "<|call|>")
END_TOKEN_BIAS = -100.0


class PeerNotFound(RuntimeError):
    """A peer the bench was asked to run against is not installed."""


def find_llama_server(path: str = "") -> Path:
    """The llama-server binary: `path` (the flag or MLXR_LLAMA_SERVER), else `llama-server` on
    PATH; a PeerNotFound that says how to build it otherwise."""
    if path:
        binary = Path(path).expanduser()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise PeerNotFound(f"llama-server: {binary} is not an executable file; {BUILD_HINT}")
        return binary
    found = shutil.which("llama-server")
    if found is None:
        raise PeerNotFound(f"llama-server not found on PATH; {BUILD_HINT}")
    return Path(found)


def end_token_bias(tokenizer) -> dict[str, float]:
    """logit_bias (OpenAI's shape: token id string -> bias) that keeps every token llama.cpp
    would stop on from being sampled, so replies run to the length asked on every server."""
    ids = {tokenizer.token_to_id(text) for text in LLAMA_END_TOKENS} - {None}
    return {str(i): END_TOKEN_BIAS for i in sorted(ids)}


def gguf_model(model_dir: Path, cache_dir: Path, file_type: str = "F32") -> Path:
    """`model_dir` as a GGUF file of `file_type`, written once by our writer and cached under
    `cache_dir` (keyed by the model's path and weights, so a changed model is rewritten)."""
    from mlxr.supervisor.store.gguf.write import write_gguf

    weights = sorted(Path(model_dir).glob("*.safetensors"))
    key = hashlib.sha256(str(Path(model_dir).resolve()).encode())
    for w in weights:
        stat = w.stat()
        key.update(f"{w.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    dest = Path(cache_dir) / f"{Path(model_dir).name}-{key.hexdigest()[:12]}-{file_type}.gguf"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        write_gguf(Path(model_dir), partial, file_type)
        partial.rename(dest)
    return dest


def llama_server_args(binary: Path, gguf_path: Path, port: int, num_parallel: int, threads: int,
                      ctx_per_slot: int) -> list[str]:
    """llama-server's command line: `num_parallel` slots with continuous batching, `threads` for
    generation and for prompts, and a KV cache of `ctx_per_slot` tokens for every slot."""
    return [str(binary), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(num_parallel), "--cont-batching", "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx_per_slot * num_parallel), "--no-webui"]


def start_llama_server(gguf_path: Path, workdir: Path, num_parallel: int, threads: int,
                       binary: Path | None = None, ctx_per_slot: int = 1024,
                       name: str = "llama-server") -> Process:
    """llama.cpp's llama-server on a free port, serving `gguf_path`."""
    binary = binary or find_llama_server()
    port = free_port()
    args = llama_server_args(binary, gguf_path, port, num_parallel, threads, ctx_per_slot)
    p = _spawn(name, args, f"http://127.0.0.1:{port}", child_env(), workdir)
    wait_until(p, "/health", lambda r: True)
    p.extra["model"] = gguf_path.name
    return p

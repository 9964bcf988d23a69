"""A GGUF Q4_K_M model against its safetensors original, through a real `mlxr serve`:
conversion time, load time (first: conversion included, as for a model imported from an
Ollama store; second: the converted directory kept), and decode tok/s at 1 and 16 streams.

    .venv/bin/python scripts/bench_gguf.py                 # random "medium" qwen3 (147M)
    .venv/bin/python scripts/bench_gguf.py --preset llama --gen-tokens 64

The same random model is served as float32 safetensors, as MLX 4-bit (`create --quantize
q4`, the same precision made by mlx-lm) and as GGUF Q4_K_M written with the gguf package
(Q4_K matrices, Q6_K output), all in one run on one machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxr.supervisor.store.gguf.write import write_gguf  # noqa: E402
from mlxr.supervisor.store.random_model import write_random_model  # noqa: E402
from tests.harness.server import start_server  # noqa: E402


def cpu() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((x.split(":", 1)[1].strip() for x in flags.splitlines()
                 if x.startswith("model name")), platform.processor())
    return f"{name}, avx512f {'yes' if ' avx512f' in flags else 'no'}, {os.cpu_count()} cores"


def load_seconds(http: httpx.Client, model: str) -> float:
    http.post("/api/generate", json={"model": model, "keep_alive": 0}).raise_for_status()
    start = time.monotonic()
    http.post("/api/generate", json={"model": model}).raise_for_status()
    return time.monotonic() - start


def decode_rate(http: httpx.Client, model: str, streams: int, gen: int) -> float:
    """Aggregate generated tokens per second of `streams` concurrent greedy requests."""
    body = {"model": model, "options": {"temperature": 0, "num_predict": gen}, "raw": True,
            "stream": False}

    def one(i: int) -> tuple[int, float]:
        r = http.post("/api/generate", json={**body, "prompt": f"story number {i}: once"},
                      timeout=600).json()
        return r["eval_count"], r["eval_duration"] / 1e9

    one(0)  # warm
    start = time.monotonic()
    with cf.ThreadPoolExecutor(streams) as pool:
        counts = list(pool.map(one, range(streams)))
    wall = time.monotonic() - start
    return sum(c for c, _ in counts) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,16")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        src = write_random_model(tmp / "src", args.preset)
        t = time.monotonic()
        gguf = write_gguf(src, tmp / "model.gguf", "Q4_K_M")
        print(f"cpu: {cpu()}")
        print(f"model: random {args.preset}; safetensors {sum(p.stat().st_size for p in src.glob('*.safetensors')) / 1e6:.0f} MB, "
              f"GGUF Q4_K_M {gguf.stat().st_size / 1e6:.0f} MB (written in {time.monotonic() - t:.1f} s)")
        server = start_server(tmp, env, MLXR_NUM_PARALLEL="16", MLXR_MAX_LOADED_MODELS="1")
        try:
            client = server.client(timeout=600)
            http = httpx.Client(base_url=server.url, trust_env=False, timeout=600)
            t = time.monotonic()
            client.create(model="st-f32", from_=str(src))
            client.create(model="mlx-q4", from_="st-f32", quantize="q4")
            quantize_s = time.monotonic() - t
            digest = client.create_blob(gguf)
            t = time.monotonic()
            client.create(model="gguf-q4km", files={gguf.name: digest})
            convert_s = time.monotonic() - t
            print(f"conversion: create from the GGUF blob {convert_s:.2f} s "
                  f"(mlx-lm quantization of the float model: {quantize_s:.2f} s)")
            derived = next((server.models_dir / "derived").glob("gguf-v*/*"))
            rows = []
            for model in ("st-f32", "mlx-q4", "gguf-q4km"):
                first = None
                if model == "gguf-q4km":  # as an imported Ollama model: converted on first use
                    shutil.rmtree(derived)
                    first = load_seconds(http, model)
                second = load_seconds(http, model)
                rates = [decode_rate(http, model, int(s), args.gen_tokens)
                         for s in args.streams.split(",")]
                rows.append((model, first, second, rates))
                http.post("/api/generate", json={"model": model, "keep_alive": 0})
            streams = args.streams.split(",")
            print(f"\n| model | first load (s) | load (s) | "
                  + " | ".join(f"tok/s {s} stream{'s' if s != '1' else ''}" for s in streams)
                  + " |")
            print("|---|---|---|" + "---|" * len(streams))
            for model, first, second, rates in rows:
                print(f"| {model} | {'-' if first is None else f'{first:.2f}'} | {second:.2f} | "
                      + " | ".join(f"{r:.1f}" for r in rates) + " |")
        finally:
            server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["true"])


if __name__ == "__main__":
    main()

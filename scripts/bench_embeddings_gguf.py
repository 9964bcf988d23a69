"""A GGUF embedding model through `mlxr serve` against llama.cpp's `llama-server --embedding`
(what Ollama runs for it) on the same file, one server at a time, and the ratios.

    .venv/bin/python scripts/bench_embeddings_gguf.py FILE.gguf \
        --llama-server ~/.cache/mlxr/llama.cpp/build/bin/llama-server [--rounds 3]

Two workloads, each the median of `rounds`: retrieval queries (16 questions of 8-10 words,
one request each, one after another) and indexing (64 chunks of about 205 tokens in one
request). Both servers get the machine's cores (`-t`); llama.cpp keeps its default pooling
and normalization (the file's), as mlxr does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the river runs past old stone walls where lanterns hang and people talk about "
         "weather markets music science history rain light engines gardens").split()
CHUNKS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(200)) + f" chunk {i}"
          for i in range(64)]
QUERIES = [f"what is the history of {w} number {i}?" for i, w in enumerate(WORDS[:16])]


def wait(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    sys.exit(f"no server at {url}")


def measure(post, rounds: int) -> dict[str, float]:
    post(CHUNKS[:2])  # warm
    out = {}
    for name, work in (("queries", None), ("chunks", CHUNKS)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            if work is None:
                for query in QUERIES:
                    post([query])
            else:
                post(work)
            times.append(time.perf_counter() - start)
        out[name] = (len(QUERIES) if work is None else len(CHUNKS)) / statistics.median(times)
    return out


def llama_cpp(binary: Path, gguf: Path, rounds: int, port: int = 11701) -> dict[str, float]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--port", str(port),
                             "-t", str(os.cpu_count()), "--embedding", "-c", "8192",
                             "-b", "8192", "-ub", "2048", "-np", "4"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(f"http://127.0.0.1:{port}/health")
        with httpx.Client(timeout=600) as client:
            return measure(lambda xs: client.post(f"http://127.0.0.1:{port}/v1/embeddings",
                                                  json={"input": xs}).raise_for_status(), rounds)
    finally:
        proc.terminate()
        proc.wait()


def mlxr(gguf: Path, rounds: int, port: int = 11702) -> dict[str, float]:
    import ollama

    home = tempfile.mkdtemp(prefix="mlxr-bench-")
    env = {**os.environ, "MLXR_MODELS": home + "/models", "MLXR_HOST": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([str(ROOT / ".venv/bin/mlxr"), "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(f"http://127.0.0.1:{port}/api/version")
        client = ollama.Client(host=f"http://127.0.0.1:{port}")
        client.create(model="bench", files={gguf.name: client.create_blob(gguf)})
        with httpx.Client(timeout=600) as http:
            return measure(lambda xs: http.post(f"http://127.0.0.1:{port}/api/embed", json={
                "model": "bench", "input": xs}).raise_for_status(), rounds)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {"llama.cpp": llama_cpp(args.llama_server, args.gguf, args.rounds),
               "mlxr": mlxr(args.gguf, args.rounds)}
    for name, r in results.items():
        print(f"{name:10} queries one at a time {r['queries']:7.1f}/s   "
              f"64 chunks of ~205 tokens in one request {r['chunks']:6.2f}/s")
    ours, theirs = results["mlxr"], results["llama.cpp"]
    print(f"mlxr / llama.cpp: queries {ours['queries'] / theirs['queries']:.2f}x, "
          f"chunks {ours['chunks'] / theirs['chunks']:.2f}x")


if __name__ == "__main__":
    main()

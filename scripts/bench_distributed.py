"""What sharding a runner over ranks costs per decode step, behind docs/PERFORMANCE.md
"Distributed runner": the same model served by one runner, and by groups of 2 and 4 ranks on
loopback (mlx.distributed's ring backend, tensor sharding), at 1 and 16 streams; plus the
collectives' own cost on this machine (an all_sum of one step's activations).

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) PYTHONPATH=. \\
        .venv/bin/python scripts/bench_distributed.py [--preset tiny-kv4] [--tokens 64]

Each figure is the median over `--repeats` rounds of the runner's own decode rate
(eval_count / eval_duration of each request, summed over the streams). Prints figures;
nothing is asserted."""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mlxr.shared.runner_auth import make_token
from mlxr.supervisor.store.random_model import write_random_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(model: Path, ranks: int, folder: Path) -> tuple[str, list[subprocess.Popen]]:
    """Rank 0 (HTTP) and ranks-1 followers; returns rank 0's URL (with its secret)."""
    env = dict(os.environ)
    procs = []
    if ranks > 1:
        hostfile = folder / f"ring-{ranks}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        env["MLX_HOSTFILE"] = str(hostfile)
        for rank in range(1, ranks):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "mlxr.runner", "--follower", "--config",
                 json.dumps({"model_dir": str(model), "sharding": "tensor"})],
                env={**env, "MLX_RANK": str(rank)}, stderr=subprocess.DEVNULL))
        env["MLX_RANK"] = "0"
    port, token = free_port(), make_token()
    config = {"model_dir": str(model), "port": port, "token_stdin": True, "sharding": "tensor",
              "num_parallel": 16}
    rank0 = subprocess.Popen([sys.executable, "-m", "mlxr.runner", "--config",
                              json.dumps(config)], env=env, stdin=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    rank0.stdin.write(token.encode() + b"\n")
    rank0.stdin.flush()
    url = f"http://runner:{token}@127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/status", timeout=1).json()["status"] == "ready":
                return url, [rank0, *procs]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{ranks} ranks did not get ready")


def decode_rate(url: str, streams: int, tokens: int) -> float:
    """Generated tokens per second over `streams` concurrent requests."""
    def one(i: int) -> tuple[int, int]:
        with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                "prompt": f"stream {i} says", "options": {
                    "temperature": 0, "num_predict": tokens, "seed": i}}) as r:
            last = None
            for line in r.iter_lines():
                if line:
                    last = json.loads(line)
        return last["eval_count"], last["eval_duration"]

    started = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    wall = time.perf_counter() - started
    return sum(n for n, _ in results) / wall


def layer_times(preset: str, folder: Path) -> None:
    """One decoder layer's time at 1 and 16 rows (context 128), in this process: the compute
    a rank's share of a step is made of (the model of the hosts calculation)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(write_random_model(folder / preset, preset, 0)))
    layer = model.model.layers[0]
    hidden = model.args.hidden_size
    for rows in (1, 16):
        cache = make_prompt_cache(model)[0]
        x = mx.random.normal((rows, 128, hidden))
        mx.eval(layer(x, "causal", cache))  # context of 128 positions
        step = mx.random.normal((rows, 1, hidden))
        times = []
        for _ in range(30):
            started = time.perf_counter()
            mx.eval(layer(step, None, cache))
            times.append(time.perf_counter() - started)
            cache.offset -= 1  # keep the context at 128
            cache.keys, cache.values = cache.keys, cache.values
        print(f"{preset}: one layer, {rows:2d} rows: {1000 * statistics.median(times):.3f} ms "
              f"(hidden {hidden}, {len(model.model.layers)} layers)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny-kv4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--layer-preset", default="medium",
                        help="also time one layer of this preset (the hosts calculation)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-dist-"))
    atexit.register(shutil.rmtree, folder, True)  # the models: 100-300 MB
    if args.layer_preset:
        layer_times(args.layer_preset, folder)
    model = write_random_model(folder / "model", args.preset, 0)
    rows = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        url, procs = start_group(model, ranks, folder)
        try:
            decode_rate(url, 1, 8)  # warm up
            for streams in (1, 16):
                rates = [decode_rate(url, streams, args.tokens) for _ in range(args.repeats)]
                rate = statistics.median(rates)
                step_ms = 1000 * streams / rate
                rows.append((ranks, streams, rate, step_ms))
                print(f"ranks {ranks}  streams {streams:2d}  {rate:7.1f} tok/s  "
                      f"{step_ms:6.2f} ms/step", flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    base = {s: ms for r, s, _, ms in rows if r == 1}
    print("\nper-step overhead against one runner:")
    for ranks, streams, _, ms in rows:
        if ranks > 1 and streams in base:
            print(f"  ranks {ranks}  streams {streams:2d}  +{ms - base[streams]:.2f} ms/step "
                  f"({ms / base[streams]:.2f}x)")


if __name__ == "__main__":
    main()

"""Vision request timings behind docs/PERFORMANCE.md "Vision": time to first token of one image
request alone and inside N text streams, what the image's prefill does to those streams'
inter-token gaps, and mlx-vlm's own time to first token for the same prompt and image (the
peer, in this process, after the server's runs).

    PYTHONPATH=. .venv/bin/python scripts/bench_vision.py [--image-size 448] [--streams 8]

The model is the store's random Qwen2.5-VL with its processor allowed `--image-size` squared
pixels (448: 1,024 patches, 256 image tokens). Prints figures; nothing is asserted."""

from __future__ import annotations

import argparse
import atexit
import base64
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from mlxr.supervisor.store.random_model import write_random_model

QUESTION = "Describe this picture in detail."


def noise(seed: int, size: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


def png(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(url: str, messages: list, num_predict: int, stamps: list | None = None) -> dict:
    """Send a chat; returns {"ttft": s, "stamps": [token arrival times], "prompt": n}."""
    body = {"model": "vl", "messages": messages, "stream": True,
            "options": {"temperature": 0, "num_predict": num_predict}}
    stamps = [] if stamps is None else stamps
    start = time.perf_counter()
    final = {}
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            if chunk.get("message", {}).get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("done"):
                final = chunk
    return {"ttft": stamps[0] - start if stamps else float("nan"), "stamps": stamps,
            "prompt": final.get("prompt_eval_count"), "start": start}


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def disturb(url: str, args, kinds: dict) -> dict:
    """`args.streams` text streams decoding; once each has 20 tokens, one request of
    `kinds[name](seed)`: its TTFT and what it did to the streams' inter-token gaps. The kinds
    take turns within each repeat, so a slow phase of the machine falls on all of them. A
    kind of None sends nothing and watches the streams for `args.quiet_s` (the control: the
    longest gap of a window that long with no new request)."""
    runs = {name: {"ttft": [], "before_p99": [], "during_p99": [], "during_max": [],
                   "base_median": [], "max_at": [], "prompt": 0} for name in kinds}
    for rep in range(args.repeats):
        for name, messages in kinds.items():
            stamps = [[] for _ in range(args.streams)]
            threads = [threading.Thread(target=stream_chat, args=(
                url, [{"role": "user", "content": f"Story {name} {rep} {i}: once upon a time"}],
                160, stamps[i])) for i in range(args.streams)]
            # Made before the streams start: a noise PNG takes the client tens of ms of CPU,
            # which would fall inside the window measured below.
            request = None if messages is None else messages(100 + rep)
            for t in threads:
                t.start()
            while min(len(s) for s in stamps) < 20:
                time.sleep(0.01)
            sent = time.perf_counter()
            if request is None:
                time.sleep(args.quiet_s)
                res = {"ttft": args.quiet_s, "prompt": 0}
            else:
                res = stream_chat(url, request, 8)
            first = sent + res["ttft"]
            for t in threads:
                t.join()
            gaps_before, gaps_during = [], []
            for s in stamps:
                gaps = [(b - a, b) for a, b in zip(s, s[1:])]
                gaps_before += [g for g, at in gaps if at < sent]
                gaps_during += [(g, at) for g, at in gaps if sent <= at <= first + 0.05]
            run = runs[name]
            run["ttft"].append(res["ttft"])
            run["prompt"] = res["prompt"]
            run["before_p99"].append(p99(gaps_before))
            run["during_p99"].append(p99([g for g, _ in gaps_during]))
            worst = max(gaps_during, default=(float("nan"), sent))
            run["during_max"].append(worst[0])
            run["max_at"].append(worst[1] - sent)
            run["base_median"].append(statistics.median(gaps_before))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quiet-s", type=float, default=0.35,
                    help="the control's window: about the image's TTFT inside the streams")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    atexit.register(shutil.rmtree, tmp, True)  # the models: 100-300 MB
    model = write_random_model(tmp / "vl", "qwen2.5-vl")
    cfg_path = model / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_pixels"] = args.image_size * args.image_size
    cfg_path.write_text(json.dumps(cfg))
    port = free_port()
    env = {**os.environ, "MLXR_HOST": f"127.0.0.1:{port}", "MLXR_MODELS": str(tmp / "store"),
           "MLXR_KEEP_ALIVE": "30m"}
    proc = subprocess.Popen([sys.executable, "-m", "mlxr.supervisor.cli", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        httpx.post(url + "/api/create", json={"model": "vl", "from": str(model),
                                              "stream": False}, timeout=300).raise_for_status()
        image_msg = lambda seed: [{"role": "user", "content": QUESTION,  # noqa: E731
                                   "images": [png(noise(seed, args.image_size))]}]
        stream_chat(url, [{"role": "user", "content": "hello"}], 4)  # load
        warm = stream_chat(url, image_msg(999), 4)
        print(f"image prompt: {warm['prompt']} tokens ({args.image_size}x{args.image_size})")
        alone = [stream_chat(url, image_msg(seed), 8)["ttft"] for seed in range(args.repeats)]
        text_alone = [stream_chat(url, [{"role": "user", "content": QUESTION * 4}], 8)["ttft"]
                      for _ in range(args.repeats)]
        # A text prompt of the image prompt's length, for the same disturbance without images.
        # (" hello" is one token; the template adds about 20; the seed comes first so that
        # no run reuses another's prefix)
        same_len = lambda seed: [{"role": "user", "content": f"{seed}:"  # noqa: E731
                                  + " hello" * (warm["prompt"] - 24)}]
        busy = disturb(url, args, {"image": image_msg, "text": same_len, "none": None})
    finally:
        proc.terminate()
        proc.wait(30)
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate

    vlm, processor = load(model)
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "<|vision_start|><|image_pad|><|vision_end|>" + QUESTION +
              "<|im_end|>\n<|im_start|>assistant\n")
    peer = []
    for seed in [999] + list(range(args.repeats)):
        start = time.perf_counter()
        for _ in stream_generate(vlm, processor, prompt, image=[noise(seed, args.image_size)],
                                 max_tokens=1, temperature=0.0):
            break
        peer.append(time.perf_counter() - start)
    peer = peer[1:]
    med = statistics.median
    print(f"TTFT image alone: {med(alone) * 1e3:.0f} ms (mlx-vlm in-process "
          f"{med(peer) * 1e3:.0f} ms, ratio {med(alone) / med(peer):.2f}); text prompt of "
          f"{len(QUESTION * 4)} chars alone: {med(text_alone) * 1e3:.0f} ms")
    for kind, runs in busy.items():
        what = (f"{kind} prompt of {runs['prompt']} tokens" if kind != "none" else
                f"no request, {args.quiet_s * 1e3:.0f} ms watched")
        print(f"{what} inside {args.streams} text streams: "
              f"TTFT {med(runs['ttft']) * 1e3:.0f} ms; the streams' inter-token p99 "
              f"{med(runs['before_p99']) * 1e3:.0f} ms before it, "
              f"{med(runs['during_p99']) * 1e3:.0f} ms while it is read, longest gap "
              f"{med(runs['during_max']) * 1e3:.0f} ms = "
              f"{med(runs['during_max']) / med(runs['base_median']):.1f} median intervals")
        print("    each repeat's longest gap (ms, and when it ended after the request): " +
              ", ".join(f"{g * 1e3:.0f}@{at * 1e3:.0f}"
                        for g, at in zip(runs["during_max"], runs["max_at"])))

if __name__ == "__main__":
    main()

"""Where a decode step's time goes, on the runner's own code paths (issue 10).

Times, for one batch size, each part of a decode step separately: the forward pass; greedy
selection; Ollama-default sampling with a full-vocabulary partition (the obvious way) and with
the block top-k the runner uses; log-probabilities; and the host work per token (streaming
detokenization). Run with the OpenBLAS the runner preloads on Linux CPU:

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \
        .venv/bin/python scripts/profile_step.py --model ~/.cache/mlxr-bench/random-small
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.host_head import MAX_ROWS, HostHead
from mlxr.runner.model_step import split_model
from mlxr.runner.sampling import Sampler, sample
from mlxr.runner.text_stream import TextStream
from mlxr.shared.blas import loaded_blas
from mlxr.shared.protocol import Options


def timed(fn, repeats: int = 30) -> float:
    """Median milliseconds of `repeats` evaluated calls (the median: this machine is shared)."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    print(f"blas: {loaded_blas().describe()}", flush=True)
    model, tokenizer = load(args.model)
    B = args.batch
    cache = [type(c).merge([c] * 1) for c in make_prompt_cache(model)]
    # A batch cache holding `context` tokens for every row.
    caches = make_prompt_cache(model)
    model(mx.array([list(range(1, args.context + 1))]), cache=caches)
    cache = [type(c).merge([c] * B) for c in caches]
    inputs = mx.array([[11]] * B)

    def forward():
        logits = model(inputs, cache=cache)[:, -1, :]
        for c in cache:
            c.trim(1)
        return logits

    logits = forward()
    mx.eval(logits)
    greedy = [Sampler.from_options(Options(temperature=0), 4096) for _ in range(B)]
    ollama = [Sampler.from_options(Options(), 4096) for _ in range(B)]
    rows = {"forward pass": timed(forward)}
    split = split_model(model)
    host_head = HostHead.find(model, split.head) if split.body else None
    if host_head is not None and B <= MAX_ROWS:
        def forward_host_head():
            logits = host_head(split.body(inputs, cache=cache)[:, -1, :])
            for c in cache:
                c.trim(1)
            return logits

        rows["forward pass, head as BLAS matrix-vector products (the runner's, B <= 2)"] = \
            timed(forward_host_head)
    rows |= {
        "greedy, the obvious way: `mx.argmax` over the vocabulary": timed(
            lambda: mx.argmax(logits, axis=-1)),
        "greedy: argmax (grid columns, `argmax_rows`)": timed(
            lambda: sample(logits, greedy, [[]] * B, [-1] * B).tokens),
        "sampled: full-vocabulary argpartition top-40": timed(lambda: mx.argpartition(
            -logits, kth=39, axis=-1)[:, :40]),
        "sampled: runner (grid top-k, temperature, top-p)": timed(
            lambda: sample(logits, ollama, [[]] * B, [-1] * B).tokens),
        "logprobs (top 5) for every row": timed(
            lambda: sample(logits, greedy, [[]] * B, [5] * B).top_logprobs),
    }
    decode = tokenizer._tokenizer._tokenizer
    streams = [TextStream(lambda ids: decode.decode(ids, skip_special_tokens=True), ["</s>"])
               for _ in range(B)]
    start = time.perf_counter()
    for step in range(50):
        for s in streams:
            s.push(1000 + step)
    rows["host: detokenize + stop strings, whole batch"] = (time.perf_counter() - start) / 50 * 1000
    print(f"batch {B}, {args.context} cached tokens per row")
    print("| part of a decode step | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()

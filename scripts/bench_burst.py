"""Bursts of prompts arriving together at a running `mlxr serve`: each round sends 16 short
prompts at once through /api/generate and notes each one's time to first token; prints the
median over the rounds of the burst's median and of its last first token. Behind
docs/PERFORMANCE.md "One stream and bursts (session 15)".

    .venv/bin/python scripts/bench_burst.py [--url http://127.0.0.1:11434] [--model demo]
        [--rounds 8] [--streams 16] [--words 19]

Each prompt is different from its first word (no prefix cache); 19 words are about 123
tokens with the Qwen3 tokenizer. Nothing is asserted."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
import orjson


async def first_token_s(client: httpx.AsyncClient, args, prompt: str) -> tuple[float, int]:
    body = {"model": args.model, "prompt": prompt, "raw": True, "stream": True,
            "options": {"temperature": 0, "num_predict": 32}}
    start, first, prompt_tokens = time.perf_counter(), None, 0
    async with client.stream("POST", args.url + "/api/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            item = orjson.loads(line)
            if first is None and item.get("response"):
                first = time.perf_counter()
            prompt_tokens = item.get("prompt_eval_count", prompt_tokens)
    return (first or time.perf_counter()) - start, prompt_tokens


async def main(args) -> None:
    limits = httpx.Limits(max_connections=args.streams * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await first_token_s(client, args, "warm up")
        medians, lasts, prompt_tokens = [], [], 0
        for round_ in range(args.rounds):
            prompts = [" ".join(f"w{round_}x{i}y{k}" for k in range(args.words))
                       for i in range(args.streams)]
            got = await asyncio.gather(*[first_token_s(client, args, p) for p in prompts])
            times = sorted(t for t, _ in got)
            medians.append(statistics.median(times))
            lasts.append(times[-1])
            prompt_tokens = got[0][1]
            await asyncio.sleep(0.5)
    print(f"{args.streams} prompts of {prompt_tokens} tokens, {args.rounds} bursts: first "
          f"token median {1e3 * statistics.median(medians):.0f} ms, last "
          f"{1e3 * statistics.median(lasts):.0f} ms (medians over the bursts)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:11434")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--words", type=int, default=19)
    asyncio.run(main(parser.parse_args()))

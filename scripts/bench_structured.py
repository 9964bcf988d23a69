"""Decode throughput with structured output (a JSON schema) against free generation, through a
real runner subprocess. Prints figures; asserts nothing.

    .venv/bin/python scripts/bench_structured.py                  # the `small` random preset
    .venv/bin/python scripts/bench_structured.py --streams 1,8,16 --model-dir DIR

Each level runs `streams` closed-loop workers over 2 x streams requests (at least 3), each with
its own prompt, greedy. Schema requests run until their document closes (EOS); then the free
requests generate exactly as many tokens each (the random model never picks EOS), so both
modes do the same token work and differ only by the constraint. tok/s = generated tokens /
wall time of the level; stream tok/s = eval_count / eval_duration of each request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxr.supervisor.bench.peers import start_runner  # noqa: E402
from mlxr.supervisor.store.random_model import write_random_model  # noqa: E402

SCHEMA = {  # documents of about 150-400 tokens from the random model
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                   "verified": {"type": "boolean"}},
                  "required": ["name", "verified"], "additionalProperties": False},
    },
    "required": ["title", "kind", "year", "rating", "tags", "owner"],
    "additionalProperties": False,
}


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    final: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            item = json.loads(line)
            if "error" in item:
                raise RuntimeError(str(item["error"]))
            if item.get("done"):
                final = item
    return final


async def level(url: str, streams: int, mode: str, lengths: list[int], tag: str) -> dict:
    """`lengths`: num_predict of each request (a schema request ends at EOS before it)."""
    bodies = []
    for i, n in enumerate(lengths):
        body = {"prompt": f"#{tag}-{mode}-{streams}-{i}: describe a thing you like as JSON.",
                "options": {"temperature": 0, "num_predict": n}}
        if mode == "schema":
            body["format"] = SCHEMA
        bodies.append(body)
    count = len(bodies)
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    finals: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            finals.append(await one(client, url, queue.get_nowait()))

    async with httpx.AsyncClient(timeout=900) as client:
        start = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(streams)])
        wall = time.perf_counter() - start
    tokens = sum(f["eval_count"] for f in finals)
    per_stream = [f["eval_count"] / (f["eval_duration"] / 1e9) for f in finals
                  if f["eval_duration"] > 0]
    reasons = sorted({f["done_reason"] for f in finals})
    return {"streams": streams, "mode": mode, "requests": count, "tokens": tokens,
            "lengths": [f["eval_count"] for f in finals],
            "tokens_per_request": tokens / count, "tok_s": tokens / wall,
            "stream_tok_s": statistics.median(per_stream), "done": ",".join(reasons)}


def run_levels(url: str, levels: list[int], rounds: int, max_tokens: int) -> list[dict]:
    """Per level and round: schema requests first, then free ones with the same lengths."""
    rows = []
    for streams in levels:
        count = max(2 * streams, 3)
        for r in range(rounds):
            schema = asyncio.run(level(url, streams, "schema", [max_tokens] * count, f"r{r}"))
            free = asyncio.run(level(url, streams, "free", schema["lengths"], f"r{r}"))
            for row in (free, schema):
                row["round"] = r
                print(json.dumps({k: v for k, v in row.items() if k != "lengths"}),
                      file=sys.stderr)
            rows += [free, schema]
    return rows


def print_table(rows: list[dict], levels: list[int]) -> None:
    print("| streams | mode | tokens/request | tok/s, all streams (median of rounds) "
          "| stream tok/s (median) | done |")
    print("|---|---|---|---|---|---|")
    for streams in levels:
        ratios = []
        for mode in ("free", "schema"):
            mine = [r for r in rows if r["streams"] == streams and r["mode"] == mode]
            print(f"| {streams} | {mode} "
                  f"| {statistics.mean(r['tokens_per_request'] for r in mine):.0f} "
                  f"| {statistics.median(r['tok_s'] for r in mine):.1f} "
                  f"| {statistics.median(r['stream_tok_s'] for r in mine):.1f} "
                  f"| {','.join(sorted({r['done'] for r in mine}))} |")
        for free, schema in zip(*[[r for r in rows if r["streams"] == streams
                                   and r["mode"] == m] for m in ("free", "schema")]):
            ratios.append(schema["tok_s"] / free["tok_s"])
        print(f"<!-- {streams} stream(s): schema/free throughput per round "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; median "
              f"{statistics.median(ratios):.2f}x -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: a fresh `small` random model")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="num_predict of a schema request")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or write_random_model(work / "model", "small")
        runner = start_runner(model_dir, work, num_parallel=max(levels), context_length=8192)
        try:
            # Warm up: the grammar tokenizer (about 1 s, once per model) and the schema cache.
            asyncio.run(level(runner.url, 1, "schema", [16], "warm"))
            rows = run_levels(runner.url, levels, args.rounds, args.max_tokens)
        finally:
            runner.stop()
    print_table(rows, levels)


if __name__ == "__main__":
    main()

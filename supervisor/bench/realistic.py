"""Issue 19's realistic-traffic scenarios, run against every target with the same seeded
prompts and arrivals: `mixed` (open-loop Poisson arrivals of log-uniform prompts), `chat`
(16 users resending their whole history, each turn also sent cold) and `long` (2 streams of
8,000-token context beside 14 short ones). The pure parts are in traffic.py."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from mlxr.supervisor.bench import traffic
from mlxr.supervisor.bench.load import make_prompts
from mlxr.supervisor.bench.metrics import RequestRecord, percentile
from mlxr.supervisor.bench.targets import RunnerTarget, Sampling
from mlxr.supervisor.runners import memory

NAMES = ("mixed", "chat", "long")
IN_FLIGHT = 16
LONG_CONTEXT = 8000
CONTEXT_LENGTH = 16384  # what the targets are started with: 8,000 tokens of context and more


@dataclass(slots=True)
class Served:
    """A target and the process tree that serves it (whose RSS is sampled)."""

    target: object
    pid: int
    include_root: bool  # False for `mlxr serve`: count its runners, not the supervisor
    status_url: str = ""  # our runner's /v1/status (kv_bytes); "" where there is none


def served_targets(targets: list, procs: list) -> list[Served]:
    """Ours (the direct runner if there is one, it reports kv_bytes, else `mlxr serve`) and
    every peer, each with the process at its URL."""
    by_url = {p.url: p for p in procs}
    missing = [t.name for t in targets if t.base_url not in by_url]
    if missing:
        raise SystemExit(f"bench: no process serves {', '.join(missing)}; cannot sample RSS")
    pairs = [(t, by_url[t.base_url]) for t in targets]
    ours = next((p for p in pairs if isinstance(p[0], RunnerTarget)), pairs[0])
    chosen = [ours] + [p for p in pairs if not p[0].name.startswith("mlxr")]
    return [Served(t, p.proc.pid, p.name != "mlxr-serve",
                   t.base_url + "/v1/status" if isinstance(t, RunnerTarget) else "")
            for t, p in chosen]


def _prompt(tokenizer, tokens: int, seed: int) -> str:
    return make_prompts(tokenizer, 1, tokens, seed=seed)[0]


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=1800, trust_env=False,
                             limits=httpx.Limits(max_connections=256))


async def _send(target, client, prompt: str, gen: int, record: RequestRecord) -> None:
    record.start_s = time.perf_counter()
    try:
        await target.stream(client, prompt, gen, Sampling(), record)
    except Exception as exc:  # a failed request is counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"
        record.end_s = time.perf_counter()


async def warm_up(served: list[Served], tokenizer) -> None:
    prompt = _prompt(tokenizer, 32, 77_000)
    async with _client() as client:
        for s in served:
            await _send(s.target, client, prompt, 8, RequestRecord(0.0))


# -- mixed -----------------------------------------------------------------------------------
async def mixed_rate(target, tokenizer, scale: float, seed: int = 19) -> tuple[float, float]:
    """Arrivals a second that keep IN_FLIGHT requests in flight on `target`, and its output
    tokens a second at that load: IN_FLIGHT workers send 3 x IN_FLIGHT of the scenario's kind
    of requests back to back, and until the last one starts every worker is busy; the output
    tokens a second over that time, over the mean reply's tokens, is the rate at which
    requests finish with IN_FLIGHT in flight. (IN_FLIGHT over the mean latency, Little's law,
    gave a rate that kept 5.5-6.3 in flight one time and 28 another: 48 requests of such
    different sizes are too few for a steady state.)"""
    reqs = traffic.mixed_requests(seed + 1, 3 * IN_FLIGHT, scale)
    prompts = [_prompt(tokenizer, r.prompt_tokens, 90_000 + i) for i, r in enumerate(reqs)]
    records = [RequestRecord(0.0) for _ in reqs]
    queue = list(range(len(reqs)))

    async def worker(client) -> None:
        while queue:
            i = queue.pop(0)
            await _send(target, client, prompts[i], reqs[i].gen_tokens, records[i])

    async with _client() as client:
        await asyncio.gather(*[worker(client) for _ in range(IN_FLIGHT)])
    return traffic.busy_rate(records, statistics.mean(r.gen_tokens for r in reqs))


async def mixed(s: Served, tokenizer, scale: float, rate_per_s: float, seed: int = 19) -> dict:
    # Enough requests that most of the run is past the ramp from 0 to IN_FLIGHT requests.
    count = traffic.scaled(192, scale, 48)
    reqs = traffic.mixed_requests(seed, count, scale)
    arrivals = traffic.poisson_arrivals(random.Random(seed), count, rate_per_s)
    prompts = [_prompt(tokenizer, r.prompt_tokens, 91_000 + i) for i, r in enumerate(reqs)]
    records = [RequestRecord(0.0) for _ in reqs]

    async def one(client, i: int, start: float) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        await _send(s.target, client, prompts[i], reqs[i].gen_tokens, records[i])

    with traffic.RssSampler(s.pid, s.include_root) as rss:
        async with _client() as client:
            start = time.perf_counter()
            await asyncio.gather(*[one(client, i, start) for i in range(count)])
            wall = time.perf_counter() - start
    out = traffic.traffic_summary(records, wall)
    out.update(rate_per_s=rate_per_s, peak_rss_bytes=rss.peak_bytes,
               prompt_tokens_total=sum(r.prompt_tokens for r in reqs))
    return out


# -- chat ------------------------------------------------------------------------------------
async def chat(s: Served, tokenizer, scale: float, seed: int = 19, users: int = IN_FLIGHT,
               turns: int = 6) -> dict:
    """Every user sends its turns in order, each resending the history with the replies the
    target actually gave. Then the same prompts of turns 2+ again, each with a distinct
    random first token (no prefix to reuse), with the same load shape: the cold figure."""
    q_tokens, reply_tokens = traffic.scaled(96, scale, 16), traffic.scaled(128, scale, 16)
    convs = [traffic.Conversation([traffic.Turn(_prompt(tokenizer, q_tokens,
                                                        seed * 10_000 + u * 10 + k))
                                   for k in range(turns)]) for u in range(users)]
    rng = random.Random(seed)
    markers = [[f"[{rng.randrange(1 << 30)}] " for _ in range(turns)] for _ in range(users)]
    warm: dict[int, list[float]] = {k + 1: [] for k in range(turns)}
    cold: dict[int, list[float]] = {k + 1: [] for k in range(1, turns)}
    records: list[RequestRecord] = []
    replies: list[list[int]] = [[] for _ in range(users)]  # each warm reply's token count

    async def user(client, u: int, send_cold: bool) -> None:
        for k in range(1 if send_cold else 0, turns):
            record = RequestRecord(0.0)
            marker = markers[u][k] if send_cold else ""
            await _send(s.target, client, convs[u].prompt(k, marker), reply_tokens, record)
            if record.error or not record.num_tokens:
                records.append(record)
                return
            (cold if send_cold else warm)[k + 1].append(record.ttft_s)
            if not send_cold:
                convs[u].turns[k].reply = record.text
                records.append(record)
                replies[u].append(record.num_tokens)

    with traffic.RssSampler(s.pid, s.include_root) as rss:
        async with _client() as client:
            start = time.perf_counter()
            await asyncio.gather(*[user(client, u, False) for u in range(users)])
            wall = time.perf_counter() - start
            await asyncio.gather(*[user(client, u, True) for u in range(users)])
    shares: dict[int, list[float]] = {k + 1: [] for k in range(1, turns)}
    for u in range(users):  # counted after the run, so that no turn waits for it
        counts = [len(tokenizer.encode(convs[u].prompt(k)).ids) for k in range(len(replies[u]))]
        for k in range(1, len(counts)):
            shares[k + 1].append(traffic.new_token_share(counts[k], counts[k - 1],
                                                         replies[u][k - 1]))
    out = traffic.traffic_summary(records, wall)
    out.update(peak_rss_bytes=rss.peak_bytes, per_turn=traffic.per_turn_table(warm, cold, shares),
               question_tokens=q_tokens, reply_tokens=reply_tokens)
    return out


# -- long ------------------------------------------------------------------------------------
async def long_context(s: Served, tokenizer, scale: float, kv_bytes_per_token: int,
                       seed: int = 19, num_long: int = 2, num_short: int = 14) -> dict:
    """The short streams' inter-token p99 alone, then with `num_long` streams of 8,000
    tokens of context arriving once every short stream is decoding; our runner's peak
    kv_bytes against the KV the live tokens need."""
    long_tokens = traffic.scaled(LONG_CONTEXT, scale, 512)
    short_gen, long_gen = traffic.scaled(256, scale, 64), traffic.scaled(64, scale, 16)
    out: dict = {"long_tokens": long_tokens, "short_gen": short_gen, "long_gen": long_gen}
    with traffic.RssSampler(s.pid, s.include_root) as rss:
        async with _client() as client:
            for label, with_long in (("alone", False), ("with_long", True)):
                shorts = [_prompt(tokenizer, 64, 95_000 + 100 * with_long + i)
                          for i in range(num_short)]
                longs = [_prompt(tokenizer, long_tokens, 96_000 + i) for i in range(num_long)]
                # counted before any request is sent: encoding 16,000 tokens here would hold up
                # this loop, and the streams' chunks with it, as the long prompts arrive
                tokens = [len(tokenizer.encode(p).ids) for p in shorts + longs]
                records = [RequestRecord(0.0) for _ in shorts]
                tasks = [asyncio.create_task(_send(s.target, client, p, short_gen, r))
                         for p, r in zip(shorts, records)]
                kv = None
                if with_long:
                    while not all(r.num_tokens >= 4 or r.end_s for r in records):
                        await asyncio.sleep(0.01)
                    long_records = [RequestRecord(0.0) for _ in longs]
                    tasks += [asyncio.create_task(_send(s.target, client, p, long_gen, r))
                              for p, r in zip(longs, long_records)]
                    every = records + long_records
                    kv = asyncio.create_task(_watch_kv(client, s.status_url, every, tokens,
                                                       kv_bytes_per_token))
                await asyncio.gather(*tasks)
                itls = [g for r in records if not r.error for g in r.itls_s()]
                out[f"short_itl_p99_s_{label}"] = percentile(itls, 99)
                out[f"short_itl_p50_s_{label}"] = percentile(itls, 50)
                out[f"failed_{label}"] = sum(1 for r in records if r.error)
                errors = [r.error for r in records if r.error]
                if errors:
                    out[f"first_error_{label}"] = errors[0]
                if kv is not None:
                    kv.cancel()
                    out.update(await _kv_result(kv))
                    out["long_ttft_s"] = max((r.ttft_s for r in long_records if r.num_tokens),
                                             default=float("nan"))
                    out["failed_long"] = sum(1 for r in long_records if r.error)
    out["peak_rss_bytes"] = rss.peak_bytes
    return out


async def _watch_kv(client, url: str, records, tokens, bytes_per_token: int) -> dict:
    """Samples every 100 ms until cancelled: the peak kv_bytes (cached blocks too), the peak
    KV held for sequences in flight, and the peak KV the live tokens need."""
    # mlx_lm.server has no such figures
    peak = {"peak_kv_bytes": 0, "peak_kv_live_bytes": 0} if url else {}
    peak["peak_live_kv_bytes"] = 0
    try:
        while True:
            if url:
                try:
                    status = (await client.get(url, timeout=5)).json()
                    peak["peak_kv_bytes"] = max(peak["peak_kv_bytes"], int(status["kv_bytes"]))
                    peak["peak_kv_live_bytes"] = max(peak["peak_kv_live_bytes"],
                                                     int(status.get("kv_live_bytes", 0)))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            live = traffic.live_tokens(records, tokens, time.perf_counter()) * bytes_per_token
            peak["peak_live_kv_bytes"] = max(peak["peak_live_kv_bytes"], live)
            await asyncio.sleep(0.1)
    except asyncio.CancelledError:
        return peak


async def _kv_result(task) -> dict:
    try:
        peak = await task
    except asyncio.CancelledError:
        return {}
    return peak or {}


# -- the run ---------------------------------------------------------------------------------
async def run(names: set[str], served: list[Served], tokenizer, scale: float,
              model_dir: Path, rate_per_s: float = 0.0) -> dict:
    """Each scenario on each target in turn (same prompts, same arrivals)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kv_bytes_per_token = memory.kv_bytes_per_token(config)
    await warm_up(served, tokenizer)
    out: dict = {"scale": scale}
    if "mixed" in names:
        tok_s = 0.0
        if rate_per_s <= 0:
            rate_per_s, tok_s = await mixed_rate(served[0].target, tokenizer, scale)
        out["mixed"] = {"rate_per_s": rate_per_s, "calibration_tok_s": tok_s,
                        "calibrated_on": served[0].target.name}
        for s in served:
            out["mixed"][s.target.name] = await mixed(s, tokenizer, scale, rate_per_s)
            _progress("mixed", s, out["mixed"][s.target.name])
    if "chat" in names:
        out["chat"] = {}
        for s in served:
            out["chat"][s.target.name] = await chat(s, tokenizer, scale)
            _progress("chat", s, out["chat"][s.target.name])
    if "long" in names:
        out["long"] = {}
        for s in served:
            out["long"][s.target.name] = await long_context(s, tokenizer, scale,
                                                            kv_bytes_per_token)
            _progress("long", s, out["long"][s.target.name])
    return out


def _progress(name: str, s: Served, figures: dict) -> None:
    shown = {k: v for k, v in figures.items() if isinstance(v, (int, float))}
    print(f"{name:>6} {s.target.name:>14}: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()),
        flush=True)

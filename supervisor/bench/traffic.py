"""Realistic traffic for `mlxr bench --scenarios mixed,chat,long` (issue 19): the pure parts.

Invariants:
- Everything a target is sent comes from a seeded `random.Random`, so every target in a run
  (and every run with the same seed and scale) gets the same lengths, arrivals and prompts.
- `scale` shrinks token lengths and request counts, never the concurrency the scenario is
  about (16 in flight, 16 users, 2 long + 14 short streams), and never below a floor that
  keeps each figure meaningful.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

import psutil

from mlxr.supervisor.bench.metrics import RequestRecord, distribution, percentile


def scaled(value: int, scale: float, floor: int) -> int:
    return max(floor, round(value * scale))


def log_uniform_ints(rng: random.Random, count: int, lo: int, hi: int) -> list[int]:
    """`count` integers in [lo, hi] whose logarithm is uniform: as many short as long ones
    per octave, the shape of real prompt lengths."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got {lo}, {hi}")
    a, b = math.log(lo), math.log(hi + 1)
    return [min(hi, int(math.exp(rng.uniform(a, b)))) for _ in range(count)]


def uniform_ints(rng: random.Random, count: int, lo: int, hi: int) -> list[int]:
    if not lo <= hi:
        raise ValueError(f"need lo <= hi, got {lo}, {hi}")
    return [rng.randint(lo, hi) for _ in range(count)]


def poisson_arrivals(rng: random.Random, count: int, rate_per_s: float) -> list[float]:
    """Arrival offsets (s, from 0) of a Poisson process: exponential gaps of mean 1/rate."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive, got {rate_per_s}")
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def busy_rate(records: list[RequestRecord], mean_gen_tokens: float) -> tuple[float, float]:
    """From a closed loop (each worker sends its next request as its last one ends): the
    output tokens a second while every worker was busy (up to the last request's start), and
    the requests a second that finish at that pace, replies of `mean_gen_tokens` each."""
    busy_from = min(r.start_s for r in records)
    busy_to = max(r.start_s for r in records)
    tokens = sum(1 for r in records for t in r.token_times_s if t <= busy_to)
    if busy_to <= busy_from or not tokens or mean_gen_tokens <= 0:
        raise ValueError("no tokens while the workers were busy")
    tok_s = tokens / (busy_to - busy_from)
    return tok_s / mean_gen_tokens, tok_s


@dataclass(slots=True)
class MixedRequest:
    prompt_tokens: int
    gen_tokens: int


def mixed_requests(seed: int, count: int, scale: float) -> list[MixedRequest]:
    """Prompts log-uniform over 32-4,000 tokens, outputs uniform over 16-512 (both upper
    bounds scaled)."""
    rng = random.Random(seed)
    prompts = log_uniform_ints(rng, count, 32, scaled(4000, scale, 32))
    gens = uniform_ints(rng, count, 16, scaled(512, scale, 16))
    return [MixedRequest(p, g) for p, g in zip(prompts, gens)]


@dataclass(slots=True)
class Turn:
    question: str
    reply: str = ""


@dataclass(slots=True)
class Conversation:
    """One chat user's history. The prompt of turn n resends every earlier question and the
    model's actual reply to it, then the new question."""

    turns: list[Turn] = field(default_factory=list)

    def prompt(self, turn: int, cold_marker: str = "") -> str:
        """The prompt for 0-based `turn`; `cold_marker` is put first, so that nothing of the
        prompt is in a prefix cache (the same turn sent cold)."""
        parts = [cold_marker] if cold_marker else []
        for t in self.turns[:turn]:
            # The reply exactly as it followed "Assistant:", so the earlier prompt and
            # the tokens the model made for it are this prompt's prefix.
            parts.append(f"User: {t.question}\nAssistant:{t.reply}\n")
        parts.append(f"User: {self.turns[turn].question}\nAssistant:")
        return "".join(parts)


def new_token_share(prompt_tokens: int, earlier_prompt_tokens: int, reply_tokens: int) -> float:
    """The share of a turn's prompt that no earlier turn held: what is left to read when the
    earlier prompt and its reply are cached. Reading costs about the same per token warm or
    cold, so warm/cold cannot go much below it."""
    if prompt_tokens <= 0:
        return math.nan
    return max(0, prompt_tokens - earlier_prompt_tokens - reply_tokens) / prompt_tokens


def per_turn_table(ttfts: dict[int, list[float]], cold: dict[int, list[float]],
                   shares: dict[int, list[float]] | None = None) -> list[dict]:
    """One row per turn number (1-based): warm TTFT p50/p99 and, where the turn was also
    sent cold, the cold p50 and warm/cold of the medians; the median new-token share where
    `shares` has the turn."""
    rows = []
    for turn in sorted(ttfts):
        warm = ttfts[turn]
        row = {"turn": turn, "n": len(warm), "warm_ttft_p50_s": percentile(warm, 50),
               "warm_ttft_p99_s": percentile(warm, 99)}
        if cold.get(turn):
            row["cold_ttft_p50_s"] = percentile(cold[turn], 50)
            row["warm_over_cold"] = row["warm_ttft_p50_s"] / row["cold_ttft_p50_s"]
        if shares and shares.get(turn):
            row["new_token_share"] = percentile(shares[turn], 50)
        rows.append(row)
    return rows


def traffic_summary(records: list[RequestRecord], wall_s: float) -> dict:
    """What issue 19 reports for every scenario: output tok/s, TTFT p50/p99, inter-token
    p99 (plus the mean number in flight, Little's law from the records)."""
    done = [r for r in records if r.error is None and r.num_tokens]
    tokens = sum(r.num_tokens for r in done)
    ttft = distribution([r.ttft_s for r in done])
    itl = distribution([g for r in done for g in r.itls_s()])
    busy = sum(r.e2e_s for r in done)
    out = {"requests": len(records), "failed": len(records) - len(done), "output_tokens": tokens,
           "wall_s": wall_s, "output_tok_s": tokens / wall_s if wall_s > 0 else math.nan,
           "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "itl_p50_s": itl["p50"],
           "itl_p99_s": itl["p99"], "mean_in_flight": busy / wall_s if wall_s > 0 else math.nan}
    errors = [r.error for r in records if r.error]
    if errors:
        out["first_error"] = errors[0]
    return out


def live_tokens(records: list[RequestRecord], prompt_tokens: list[int], at_s: float) -> int:
    """Tokens whose KV a server must hold at `at_s`: prompt plus output so far, for every
    request started and not yet ended."""
    total = 0
    for r, p in zip(records, prompt_tokens):
        if r.start_s <= at_s and not (r.end_s and r.end_s <= at_s):
            total += p + sum(1 for t in r.token_times_s if t <= at_s)
    return total


class RssSampler:
    """Peak resident memory of a serving process tree, sampled every `interval_s` on a
    thread (the event loop is busy streaming). `include_root=False` counts only the
    children (the runners under `mlxr serve`)."""

    def __init__(self, pid: int, include_root: bool = True, interval_s: float = 0.1):
        self.pid, self.include_root, self.interval_s = pid, include_root, interval_s
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_bytes(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = root.children(recursive=True) + ([root] if self.include_root else [])
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.rss_bytes())
            self.samples += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


MIB = 1 << 20
ROWS = {
    "mixed": [("output tok/s", "output_tok_s", 1, ""), ("TTFT p50", "ttft_p50_s", 1000, " ms"),
              ("TTFT p99", "ttft_p99_s", 1000, " ms"), ("ITL p99", "itl_p99_s", 1000, " ms"),
              ("mean in flight", "mean_in_flight", 1, ""),
              ("peak RSS", "peak_rss_bytes", 1 / MIB, " MiB"), ("failed", "failed", 1, "")],
    "long": [("short ITL p50 alone", "short_itl_p50_s_alone", 1000, " ms"),
             ("short ITL p99 alone", "short_itl_p99_s_alone", 1000, " ms"),
             ("short ITL p50 with long", "short_itl_p50_s_with_long", 1000, " ms"),
             ("short ITL p99 with long", "short_itl_p99_s_with_long", 1000, " ms"),
             ("long TTFT (slowest)", "long_ttft_s", 1000, " ms"),
             ("peak kv_bytes (cached blocks too)", "peak_kv_bytes", 1 / MIB, " MiB"),
             ("peak KV held for live sequences", "peak_kv_live_bytes", 1 / MIB, " MiB"),
             ("peak KV of live tokens", "peak_live_kv_bytes", 1 / MIB, " MiB"),
             ("peak RSS", "peak_rss_bytes", 1 / MIB, " MiB")],
}
ROWS["chat"] = ROWS["mixed"]


def _cell(value, scale: float, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value * scale:.1f}{unit}"


def scenario_table(name: str, figures: dict[str, dict]) -> str:
    """A markdown table of one scenario: a column per target (the first is ours) and
    ours / each other's ratio."""
    names = list(figures)
    ours, others = names[0], names[1:]
    lines = [f"| {name} | {ours} |" + "".join(f" {o} | ratio |" for o in others),
             "|---" * (2 + 2 * len(others)) + "|"]
    for label, key, scale, unit in ROWS[name]:
        mine = figures[ours].get(key)
        row = f"| {label} | {_cell(mine, scale, unit)} |"
        for other in others:
            theirs = figures[other].get(key)
            ok = isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) and theirs
            ratio = f"{mine / theirs:.2f}x" if ok and not math.isnan(mine / theirs) else "n/a"
            row += f" {_cell(theirs, scale, unit)} | {ratio} |"
        lines.append(row)
    return "\n".join(lines)


def per_turn_markdown(figures: dict[str, dict]) -> str:
    """TTFT by turn number, warm and cold medians for every target, and the share of the
    prompt that is new (about the least warm/cold can be)."""
    names = list(figures)
    head = "| turn |" + "".join(f" {n} warm p50 | {n} cold p50 | {n} warm/cold | {n} new share |"
                                for n in names)
    lines = [head, "|---" * (1 + 4 * len(names)) + "|"]
    tables = {n: {row["turn"]: row for row in figures[n].get("per_turn", [])} for n in names}
    for turn in sorted({t for rows in tables.values() for t in rows}):
        line = f"| {turn} |"
        for n in names:
            row = tables[n].get(turn, {})
            ratio, share = row.get("warm_over_cold"), row.get("new_token_share")
            line += (f" {_cell(row.get('warm_ttft_p50_s'), 1000, ' ms')} |"
                     f" {_cell(row.get('cold_ttft_p50_s'), 1000, ' ms')} |"
                     f" {'n/a' if ratio is None else f'{ratio:.2f}'} |"
                     f" {'n/a' if share is None else f'{share:.2f}'} |")
        lines.append(line)
    return "\n".join(lines)


def report_markdown(results: dict) -> str:
    parts = [f"scenario scale {results.get('scale')}"]
    for name in ("mixed", "chat", "long"):
        if name not in results:
            continue
        figures = {k: v for k, v in results[name].items() if isinstance(v, dict)}
        if not figures:
            continue
        parts.append(f"\n{name}\n" + scenario_table(name, figures))
        if name == "chat":
            parts.append("\nchat TTFT by turn\n" + per_turn_markdown(figures))
    return "\n".join(parts)

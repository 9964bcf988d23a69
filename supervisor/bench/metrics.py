"""Serving metrics with vLLM `bench serve` definitions, from per-request timestamps.

- TTFT: first output token arrival minus request start.
- ITL: gaps between consecutive token arrivals (a chunk of k tokens counts as k arrivals at
  one time, so its gap is spread evenly over the k tokens).
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), per request.
- Throughput: all output tokens / wall time of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    start_s: float
    token_times_s: list[float] = field(default_factory=list)  # one entry per output token
    end_s: float = 0.0
    error: str | None = None
    text: str = ""  # the reply, for scenarios that send it back (chat)

    @property
    def num_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)

    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


def add_chunk(record: RequestRecord, arrival_s: float, num_tokens: int) -> None:
    """Record `num_tokens` tokens arriving together at `arrival_s`, spread over the gap."""
    if num_tokens <= 0:
        return
    prev = record.token_times_s[-1] if record.token_times_s else None
    if prev is None:
        record.token_times_s.append(arrival_s)
        prev, num_tokens = arrival_s, num_tokens - 1
        if num_tokens == 0:
            return
    step = (arrival_s - prev) / num_tokens
    record.token_times_s.extend(prev + step * (i + 1) for i in range(num_tokens))


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values) if values else math.nan,
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    done = [r for r in records if r.error is None and r.num_tokens]
    tokens = sum(r.num_tokens for r in done)
    return {
        "requests": len(records),
        "failed": len(records) - len(done),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else math.nan,
        "req_s": len(done) / wall_s if wall_s > 0 else math.nan,
        "ttft_s": distribution([r.ttft_s for r in done]),
        "itl_s": distribution([g for r in done for g in r.itls_s()]),
        "tpot_s": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "e2e_s": distribution([r.e2e_s for r in done]),
    }

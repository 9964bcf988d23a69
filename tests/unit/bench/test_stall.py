"""The prefill-stall scenario's arithmetic (supervisor/bench/scenarios.py `prefill_stall`)
against a fake server: streams that make a token every 10 ms, and a long prompt that holds
them all for 200 ms while it is read. No model, no HTTP."""

from __future__ import annotations

import asyncio
import math
import time

from mlxr.supervisor.bench import scenarios
from mlxr.supervisor.bench.metrics import add_chunk

TICK_S = 0.010
HOLD_S = 0.200


class FakeTokenizer:
    def encode(self, text):  # make_prompts sizes its prompts with it
        return type("Encoding", (), {"ids": text.split()})()

    def decode(self, ids):
        return " ".join(ids)


class FakeServer:
    """Every stream gets a token each TICK_S; a long prompt (one with 1 token asked) takes
    300 ms to its first token, and 50 ms after it arrives every stream waits HOLD_S more
    (far longer than a loaded machine's hiccups, so the comparison below holds there too)."""

    def __init__(self):
        self.hold_until = 0.0
        self.holds = 0

    async def stream(self, client, prompt, gen_tokens, sampling, record) -> None:
        if gen_tokens == 1:
            await asyncio.sleep(0.050)
            self.hold_until = time.perf_counter() + HOLD_S
            self.holds += 1
            await asyncio.sleep(0.250)
            add_chunk(record, time.perf_counter(), 1)
        else:
            for _ in range(gen_tokens):
                await asyncio.sleep(TICK_S)
                wait = self.hold_until - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                add_chunk(record, time.perf_counter(), 1)
        record.end_s = time.perf_counter()


def test_the_stall_is_measured_against_a_window_as_long_with_no_prompt():
    server = FakeServer()
    out = asyncio.run(scenarios.prefill_stall(server, FakeTokenizer(), streams=3,
                                              long_tokens=50, gen_tokens=80))
    assert server.holds == 1  # the control round sends no prompt
    assert 0.29 <= out["prefill_s"] < 0.8
    interval = out["median_itl_before_s"]
    assert TICK_S <= interval < 2 * TICK_S
    # the held step: about (TICK + HOLD) / TICK intervals; the control: about one
    assert out["max_gap_in_itls"] >= (HOLD_S + TICK_S) / interval * 0.8
    assert out["control_max_gap_in_itls"] < out["max_gap_in_itls"] / 3
    gap, ended = out["largest_gaps_s"][0]
    assert gap >= HOLD_S and 0.05 <= ended <= 0.5  # it fell where the hold was


class BurstServer(FakeServer):
    """Streams whose tokens all reach the client at once, at the end (as a stream whose text
    a server holds back would)."""

    async def stream(self, client, prompt, gen_tokens, sampling, record) -> None:
        await asyncio.sleep(TICK_S * (1 if gen_tokens == 1 else 6))
        now = time.perf_counter()
        for _ in range(gen_tokens):
            add_chunk(record, now, 1)
        record.end_s = now


def test_streams_that_come_in_one_burst_measure_nothing_not_a_perfect_zero():
    out = asyncio.run(scenarios.prefill_stall(BurstServer(), FakeTokenizer(), streams=2,
                                              long_tokens=50, gen_tokens=60))
    for key in ("max_gap_in_itls", "control_max_gap_in_itls"):
        assert math.isnan(out[key]), (key, out[key])

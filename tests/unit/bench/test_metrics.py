import math

import pytest

from mlxr.supervisor.bench.metrics import RequestRecord, add_chunk, percentile, summarize


def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_chunks_spread_over_the_gap():
    r = RequestRecord(start_s=0.0)
    add_chunk(r, 1.0, 1)
    add_chunk(r, 2.0, 4)
    assert r.token_times_s == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])


def test_summary_on_hand_made_timestamps():
    # Request a: starts at 0, tokens at 0.5, 0.6, 0.7, ends 0.7 -> ttft .5, tpot .1
    # Request b: starts at 0, tokens at 1.0, 1.4, ends 1.4      -> ttft 1.0, tpot .4
    a = RequestRecord(0.0, [0.5, 0.6, 0.7], 0.7)
    b = RequestRecord(0.0, [1.0, 1.4], 1.4)
    failed = RequestRecord(0.0, [], 0.1, error="boom")
    s = summarize([a, b, failed], wall_s=2.0)
    assert s["output_tokens"] == 5 and s["failed"] == 1
    assert s["output_tok_s"] == pytest.approx(2.5)
    assert s["req_s"] == pytest.approx(1.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.75)
    assert s["tpot_s"]["mean"] == pytest.approx(0.25)
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["itl_s"]["p99"] == pytest.approx(0.1 + (0.4 - 0.1) * 0.98)
    assert s["e2e_s"]["p90"] == pytest.approx(0.7 + 0.9 * 0.7)

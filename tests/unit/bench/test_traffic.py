import math
import random
import statistics

import pytest

from mlxr.supervisor.bench import traffic
from mlxr.supervisor.bench.metrics import RequestRecord


def test_log_uniform_lengths_are_seeded_in_range_and_log_spread():
    a = traffic.log_uniform_ints(random.Random(7), 4000, 32, 4000)
    b = traffic.log_uniform_ints(random.Random(7), 4000, 32, 4000)
    assert a == b
    assert min(a) >= 32 and max(a) <= 4000
    # Uniform in log space: about as many in [32, 358) as in [358, 4000] (the geometric
    # midpoint), where a uniform draw would put ~92% above it.
    mid = math.sqrt(32 * 4001)
    below = sum(1 for x in a if x < mid) / len(a)
    assert 0.45 < below < 0.55
    assert traffic.log_uniform_ints(random.Random(1), 50, 9, 9) == [9] * 50
    with pytest.raises(ValueError):
        traffic.log_uniform_ints(random.Random(1), 1, 0, 10)


def test_mixed_requests_scale_their_upper_bounds_only():
    full = traffic.mixed_requests(seed=3, count=500, scale=1.0)
    assert full == traffic.mixed_requests(seed=3, count=500, scale=1.0)
    assert all(32 <= r.prompt_tokens <= 4000 and 16 <= r.gen_tokens <= 512 for r in full)
    assert max(r.prompt_tokens for r in full) > 2000 and max(r.gen_tokens for r in full) > 400
    quarter = traffic.mixed_requests(seed=3, count=500, scale=0.25)
    assert all(32 <= r.prompt_tokens <= 1000 and 16 <= r.gen_tokens <= 128 for r in quarter)
    tiny = traffic.mixed_requests(seed=3, count=20, scale=0.001)  # floors, never empty ranges
    assert all(r.prompt_tokens == 32 and r.gen_tokens == 16 for r in tiny)


def test_poisson_arrivals_have_the_rate_asked():
    arrivals = traffic.poisson_arrivals(random.Random(11), 20_000, rate_per_s=4.0)
    assert arrivals == traffic.poisson_arrivals(random.Random(11), 20_000, rate_per_s=4.0)
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    gaps = [b - a for a, b in zip([0.0] + arrivals, arrivals)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: standard deviation equals the mean (a fixed pace would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)
    with pytest.raises(ValueError):
        traffic.poisson_arrivals(random.Random(1), 3, 0.0)


def test_the_calibrated_rate_is_the_output_pace_while_every_worker_is_busy():
    # Two workers: requests start at 0, 0, 2 and 5 s; tokens after the last start (5 s) are
    # the drain, not counted: 10 tokens in 5 s, 2 a second, replies of 4 tokens: 0.5 a second.
    records = [RequestRecord(0.0, token_times_s=[0.5, 1.0, 1.5, 2.0]),
               RequestRecord(0.0, token_times_s=[1.0, 2.0, 3.0, 4.0, 5.0]),
               RequestRecord(2.0, token_times_s=[6.0, 7.0]),
               RequestRecord(5.0, token_times_s=[5.0, 6.0])]
    rate, tok_s = traffic.busy_rate(records, 4.0)
    assert tok_s == pytest.approx(10 / 5) and rate == pytest.approx(0.5)
    with pytest.raises(ValueError):
        traffic.busy_rate([RequestRecord(0.0), RequestRecord(1.0)], 4.0)


def test_chat_history_resends_questions_and_replies_in_order():
    conv = traffic.Conversation([traffic.Turn("q1"), traffic.Turn("q2"), traffic.Turn("q3")])
    assert conv.prompt(0) == "User: q1\nAssistant:"
    conv.turns[0].reply = " r1"
    conv.turns[1].reply = " r2"
    warm = conv.prompt(2)
    assert warm == "User: q1\nAssistant: r1\nUser: q2\nAssistant: r2\nUser: q3\nAssistant:"
    # Each turn's prompt extends the previous turn's prompt plus its reply: a prefix to reuse.
    assert warm.startswith(conv.prompt(1) + " r2")
    cold = conv.prompt(2, cold_marker="[123] ")
    assert cold == "[123] " + warm  # same text, but no prefix shared with the warm prompt


def test_per_turn_table_medians_and_warm_over_cold():
    warm = {1: [0.5, 0.7, 0.9], 2: [0.1, 0.2, 0.3]}
    cold = {2: [0.8, 0.8, 1.0]}
    rows = traffic.per_turn_table(warm, cold)
    assert [r["turn"] for r in rows] == [1, 2]
    assert rows[0]["warm_ttft_p50_s"] == pytest.approx(0.7) and "cold_ttft_p50_s" not in rows[0]
    assert rows[1]["warm_ttft_p99_s"] == pytest.approx(0.1 + 0.2 * 0.99)
    assert rows[1]["warm_over_cold"] == pytest.approx(0.2 / 0.8)
    assert "new_token_share" not in rows[1]
    shared = traffic.per_turn_table(warm, cold, {2: [0.3, 0.1, 0.2]})
    assert shared[1]["new_token_share"] == pytest.approx(0.2)
    assert "new_token_share" not in shared[0]


def test_new_token_share_is_what_the_earlier_prompt_and_reply_leave():
    # Turn 2: 331 tokens, of which the 100-token first prompt and its 128-token reply were cached.
    assert traffic.new_token_share(331, 100, 128) == pytest.approx(103 / 331)
    assert traffic.new_token_share(200, 150, 128) == 0.0  # a re-tokenized reply ran over
    assert math.isnan(traffic.new_token_share(0, 0, 0))


def test_traffic_summary_on_hand_made_timestamps():
    a = RequestRecord(0.0, [0.5, 0.6, 0.7], 0.7)
    b = RequestRecord(1.0, [2.0, 2.4], 2.4)
    failed = RequestRecord(0.0, [], 0.1, error="boom")
    s = traffic.traffic_summary([a, b, failed], wall_s=2.5)
    assert s["output_tokens"] == 5 and s["failed"] == 1 and s["first_error"] == "boom"
    assert s["output_tok_s"] == pytest.approx(2.0)
    assert s["ttft_p50_s"] == pytest.approx(0.75)
    assert s["itl_p99_s"] == pytest.approx(0.1 + 0.3 * 0.98)
    assert s["mean_in_flight"] == pytest.approx((0.7 + 1.4) / 2.5)


def test_live_tokens_count_prompt_and_output_of_requests_in_flight():
    a = RequestRecord(0.0, [1.0, 2.0, 3.0], 3.0)
    b = RequestRecord(2.5, [4.0], 4.0)
    assert traffic.live_tokens([a, b], [100, 10], at_s=0.5) == 100
    assert traffic.live_tokens([a, b], [100, 10], at_s=2.6) == 102 + 10
    assert traffic.live_tokens([a, b], [100, 10], at_s=3.5) == 10  # a has ended
    running = RequestRecord(0.0, [1.0])  # no end yet
    assert traffic.live_tokens([running], [5], at_s=9.0) == 6


def test_tables_show_ratios_and_n_a_for_figures_a_peer_lacks():
    figures = {"mlxr": {"short_itl_p99_s_alone": 0.02, "peak_kv_bytes": 2 << 20},
               "peer": {"short_itl_p99_s_alone": 0.04}}
    table = traffic.scenario_table("long", figures)
    assert "| short ITL p99 alone | 20.0 ms | 40.0 ms | 0.50x |" in table
    assert "| peak kv_bytes (cached blocks too) | 2.0 MiB | n/a | n/a |" in table
    chat = {"mlxr": {"per_turn": traffic.per_turn_table({1: [0.4], 2: [0.1]}, {2: [0.5]},
                                                        {2: [0.31]})}}
    turns = traffic.per_turn_markdown(chat)
    assert "| 1 | 400.0 ms | n/a | n/a | n/a |" in turns
    assert "| 2 | 100.0 ms | 500.0 ms | 0.20 | 0.31 |" in turns


def test_rss_sampler_sees_this_process():
    import os

    with traffic.RssSampler(os.getpid(), include_root=True, interval_s=0.01) as rss:
        pass
    assert rss.samples >= 1 and rss.peak_bytes > 10 << 20
    # Without the root, a process with no children weighs nothing.
    assert traffic.RssSampler(os.getpid(), include_root=False).rss_bytes() < rss.peak_bytes


def test_served_targets_pair_by_url_ours_first_and_count_runners_under_mlxr_serve():
    from types import SimpleNamespace

    from mlxr.supervisor.bench.realistic import served_targets
    from mlxr.supervisor.bench.targets import OpenAITarget, RunnerTarget

    def proc(name, url, pid):
        return SimpleNamespace(name=name, url=url, proc=SimpleNamespace(pid=pid))

    serve = OpenAITarget("mlxr", "http://127.0.0.1:1", "bench")
    peer = OpenAITarget("mlx_lm.server", "http://127.0.0.1:3", "m")
    runner = RunnerTarget("mlxr-runner", "http://runner:s@127.0.0.1:2")
    procs = [proc("mlx_lm.server", peer.base_url, 30), proc("mlxr-serve", serve.base_url, 10),
             proc("runner", runner.base_url, 20)]
    chosen = served_targets([serve, runner, peer], procs)
    assert [(s.target.name, s.pid, s.include_root) for s in chosen] == [
        ("mlxr-runner", 20, True), ("mlx_lm.server", 30, True)]
    assert chosen[0].status_url == runner.base_url + "/v1/status" and chosen[1].status_url == ""
    [ours, _] = served_targets([serve, peer], procs)
    assert (ours.pid, ours.include_root, ours.status_url) == (10, False, "")
    with pytest.raises(SystemExit):
        served_targets([serve, peer], procs[:1])


def test_cli_takes_the_realistic_scenarios_and_a_scale():
    import asyncio

    from mlxr.supervisor.bench import cli

    args = cli.build_parser().parse_args(["--scenarios", "mixed,chat,long",
                                          "--scenario-scale", "0.25"])
    assert args.scenario_scale == 0.25
    # The realistic names pass the classic scenarios' check (and run none of them).
    assert asyncio.run(cli.run_scenarios("mixed,chat,long", None, None, None, "")) == {}
    with pytest.raises(SystemExit):
        asyncio.run(cli.run_scenarios("mixed,bogus", None, None, None, ""))

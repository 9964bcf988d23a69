"""What the command line prints: Ollama's sizes, counts, times, durations and tables."""

from __future__ import annotations

import datetime as dt

import pytest

from mlxr.supervisor.cli.format import (go_duration, human_bytes, human_number, human_time,
                                   metrics_summary, models_table, processor, running_table,
                                   show_info, table)

NOW = dt.datetime(2025, 6, 1, 12, 0, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (999, "999 B"), (1000, "1 KB"), (1500, "1.5 KB"), (9_950, "9.9 KB"),
    (10_500_000, "10 MB"), (125_000_000, "125 MB"), (4_700_000_000, "4.7 GB"),
    (2 * 10**12, "2 TB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("n, text", [
    (999, "999"), (125_000, "125K"), (7_000_000, "7M"), (19_538_368, "19.54M"),
    (8_000_000_000, "8B"), (1_500_000_000, "1.5B")])
def test_human_number(n, text):
    assert human_number(n) == text


@pytest.mark.parametrize("delta_s, text", [
    (-0.5, "Less than a second ago"), (-1, "1 second ago"), (-30, "30 seconds ago"),
    (-90, "About a minute ago"), (-120, "2 minutes ago"), (-3600, "About an hour ago"),
    (-5 * 3600, "5 hours ago"), (-3 * 86400, "3 days ago"), (-21 * 86400, "3 weeks ago"),
    (-90 * 86400, "3 months ago"), (-800 * 86400, "2 years ago"),
    (270, "4 minutes from now"), (300 * 365 * 86400, "Forever")])
def test_human_time(delta_s, text):
    assert human_time(NOW + dt.timedelta(seconds=delta_s), now=NOW) == text
    assert human_time(None) == "Never"


@pytest.mark.parametrize("ns, text", [
    (0, "0s"), (500, "500ns"), (1_500, "1.5µs"), (2_000_000, "2ms"),
    (97_885_315, "97.885315ms"), (1_000_000_000, "1s"), (18_293_521_648, "18.293521648s"),
    (163_589_481_292, "2m43.589481292s"), (3_600 * 10**9, "1h0m0s"),
    (3_723_500_000_000, "1h2m3.5s")])
def test_go_duration(ns, text):
    assert go_duration(ns) == text


def test_table_aligns_left_with_four_spaces_and_no_trailing_blanks():
    out = table([["a", "bbbb", ""], ["cccccc", "d", "e"]], ["X", "Y", "Z"])
    assert out == "X         Y       Z\na         bbbb\ncccccc    d       e\n"


def test_models_table_filters_by_prefix_case_insensitively():
    tags = {"models": [
        {"name": "Tiny:latest", "digest": "ab" * 32, "size": 89_590_948,
         "modified_at": (dt.datetime.now(dt.timezone.utc)
                         - dt.timedelta(minutes=2)).isoformat()},
        {"name": "other:latest", "digest": "cd" * 32, "size": 10, "modified_at": None}]}
    lines = models_table(tags, "tiny").splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert lines[1].split("    ") == ["Tiny:latest", "abababababab", "89 MB", "2 minutes ago"]
    assert len(lines) == 2


def test_running_table_processor_context_and_until():
    assert [processor(*x) for x in ((100, 0), (100, 100), (100, 25), (0, 5))] == \
        ["100% CPU", "100% GPU", "75%/25% CPU/GPU", "Unknown"]
    soon = (NOW + dt.timedelta(minutes=4, seconds=30)).isoformat()
    models = [{"name": "a:latest", "digest": "1" * 64, "size": 125_000_000, "size_vram": 0,
               "context_length": 4096, "expires_at": soon},
              {"name": "b:latest", "digest": "2" * 64, "size": 1, "size_vram": 1,
               "context_length": 8192, "expires_at": "2318-01-01T00:00:00Z"},
              {"name": "c:latest", "digest": "3" * 64, "size": 1, "size_vram": 0,
               "context_length": 2048, "expires_at": "2020-01-01T00:00:00Z"}]
    rows = [x.split("    ") for x in running_table({"models": models}, now=NOW).splitlines()]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert rows == [["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"],
                    ["a:latest", "1" * 12, "125 MB", "100% CPU", "4096", "4 minutes from now"],
                    ["b:latest", "2" * 12, "1 B", "100% GPU", "8192", "Forever"],
                    ["c:latest", "3" * 12, "1 B", "100% CPU", "2048", "Stopping..."]]


def test_show_info_sections():
    resp = {"details": {"quantization_level": "Q4"},
            "model_info": {"general.architecture": "qwen3", "general.parameter_count": 8e9,
                           "qwen3.context_length": 40960, "qwen3.embedding_length": 4096.0},
            "capabilities": ["completion", "tools"],
            "parameters": 'stop                           "<|im_end|>"\ntemperature 0.6',
            "system": "line one\nline two\nline three", "license": "MIT"}
    assert show_info(resp) == (
        "  Model\n"
        "    architecture        qwen3\n"
        "    parameters          8B\n"
        "    context length      40960\n"
        "    embedding length    4096\n"
        "    quantization        Q4\n\n"
        "  Capabilities\n    completion\n    tools\n\n"
        '  Parameters\n    stop           "<|im_end|>"\n    temperature    0.6\n\n'
        "  System\n    line one\n    line two\n    ...\n\n"
        "  License\n    MIT\n\n")
    assert "  Metadata\n" in show_info(resp, verbose=True)
    resp["model_info"]["general.description"] = "random test model: small"
    assert "    description         random test model: small\n" in show_info(resp)


def test_metrics_summary_matches_ollama():
    final = {"total_duration": 1_234_567_890, "load_duration": 5_000_000,
             "prompt_eval_count": 10, "prompt_eval_duration": 20_000_000,
             "eval_count": 8, "eval_duration": 400_000_000}
    assert metrics_summary(final) == (
        "total duration:       1.23456789s\n"
        "load duration:        5ms\n"
        "prompt eval count:    10 token(s)\n"
        "prompt eval duration: 20ms\n"
        "prompt eval rate:     500.00 tokens/s\n"
        "eval count:           8 token(s)\n"
        "eval duration:        400ms\n"
        "eval rate:            20.00 tokens/s\n")
    assert "load duration" not in metrics_summary({**final, "load_duration": 0})

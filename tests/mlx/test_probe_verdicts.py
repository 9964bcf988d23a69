"""A runner's load with a probe cache (runner/probe_verdicts.py): the second load of the same
files runs none of the probes and makes the same choices; the key changes with the files
and with what the loader decided, not otherwise."""

from __future__ import annotations

import os
import shutil

from mlxr.runner import host_body, host_prefill, loader, probe_verdicts
from mlxr.runner.kv import rows as kv_rows
from mlxr.shared.config import RunnerConfig


def choices(loaded) -> tuple:
    step = loaded.model_step
    return (loaded.weights, step.split.body is not None, step.uses_rows,
            step.host_body is not None, step.host_prefill is not None,
            step.host_head is not None, type(step.device_head).__name__)


def test_a_second_load_reads_the_verdicts_and_makes_the_same_choices(
        tiny_model, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model, model_dir)
    config = RunnerConfig(model_dir=str(model_dir), probe_cache_dir=str(tmp_path / "probes"))
    first = choices(loader.load_model(config, "test", lambda p: None))
    [kept] = (tmp_path / "probes").glob("*.json")
    calls = []

    def counted(original):
        def probe(*args, **kwargs):
            calls.append(original.__qualname__)
            return original(*args, **kwargs)
        return probe

    monkeypatch.setattr(kv_rows, "probe", counted(kv_rows.probe))
    monkeypatch.setattr(host_body.HostBody, "matches", counted(host_body.HostBody.matches))
    monkeypatch.setattr(host_prefill.HostPrefill, "matches",
                        counted(host_prefill.HostPrefill.matches))
    again = loader.load_model(config, "test", lambda p: None)
    assert choices(again) == first and first[2:5] == (True, True, True)
    assert calls == []
    # The same files changed: a new key, so the probes run again.
    weights = next(model_dir.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    # (the head's kind is a timed choice: probed afresh under load it may go either way)
    assert choices(loader.load_model(config, "test", lambda p: None))[:5] == first[:5]
    assert "probe" in calls and len(list((tmp_path / "probes").glob("*.json"))) == 2
    assert kept.exists()


def test_the_key_follows_the_files_and_the_loaders_decisions(tiny_model, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model, model_dir)
    base = probe_verdicts.key(model_dir, {"weights": "float32 as stored"})
    assert probe_verdicts.key(model_dir, {"weights": "float32 as stored"}) == base
    assert probe_verdicts.key(model_dir, {"weights": "4-bit on the quantized kernel"}) != base
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    assert probe_verdicts.key(model_dir, {"weights": "float32 as stored"}) != base

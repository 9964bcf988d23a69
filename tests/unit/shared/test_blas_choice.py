"""Choosing the BLAS runners preload (shared/blas.py), with stand-in probes: no MLX here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from mlxr.shared import blas
from mlxr.shared.blas import Candidate, Verdict, choose
from mlxr.shared.exits import describe_exit

CRASHED = Verdict(False, describe_exit(-signal.SIGILL))


def ok(head_ms: float) -> Verdict:
    return Verdict(True, "probed ok", config="OpenBLAS x", device="cpu", head_ms=head_ms)


@pytest.fixture
def libs(tmp_path) -> dict[str, Candidate]:
    made = {}
    for name in ("fast", "slow", "crashes", "explicit"):
        path = tmp_path / f"lib{name}.so"
        path.write_bytes(name.encode())
        made[name] = Candidate("MLXR_OPENBLAS" if name == "explicit" else name, str(path))
    return made


class Probes:
    """A probe that answers from a table and counts its calls."""

    def __init__(self, verdicts: dict[str, Verdict]):
        self.verdicts = verdicts
        self.calls: list[str] = []

    def __call__(self, path: str) -> Verdict:
        self.calls.append(Path(path).stem)
        return self.verdicts[Path(path).stem]


def test_a_crashing_candidate_is_rejected_and_the_next_one_chosen(tmp_path, libs):
    probes = Probes({"libcrashes": CRASHED, "libslow": ok(20.0)})
    choice = choose("auto", tmp_path / "cache", probe_fn=probes,
                    found=[libs["crashes"], libs["slow"]])
    assert choice.path == libs["slow"].path and choice.name == "slow"
    assert [t.verdict.ok for t in choice.tried] == [False, True]
    assert "rejected crashes: was killed by SIGILL (illegal instruction)" in choice.describe()
    assert "20.0 ms head" in choice.describe()


def test_the_fastest_passing_candidate_wins(tmp_path, libs):
    probes = Probes({"libslow": ok(20.0), "libcrashes": CRASHED, "libfast": ok(11.0)})
    choice = choose("auto", tmp_path, probe_fn=probes,
                    found=[libs["slow"], libs["crashes"], libs["fast"]])
    assert choice.path == libs["fast"].path
    assert choice.reason == "probed ok, fastest of 2" and choice.head_ms == 11.0


def test_within_five_percent_the_earlier_candidate_wins(tmp_path, libs):
    probes = Probes({"libslow": ok(10.4), "libfast": ok(10.0)})
    choice = choose("auto", tmp_path, probe_fn=probes, found=[libs["slow"], libs["fast"]])
    assert choice.name == "slow"


def test_nothing_passes_means_mlx_own_blas(tmp_path, libs):
    probes = Probes({"libcrashes": CRASHED, "libslow": Verdict(False, "wrong float32 matmul")})
    choice = choose("auto", tmp_path, probe_fn=probes, found=[libs["crashes"], libs["slow"]])
    assert choice.path is None and choice.name == "MLX's own BLAS"
    assert "no OpenBLAS passed" in choice.reason
    assert "slow: wrong float32 matmul" in choice.describe()


def test_an_explicit_library_wins_when_it_passes_even_if_slower(tmp_path, libs):
    probes = Probes({"libexplicit": ok(30.0), "libfast": ok(10.0)})
    choice = choose(libs["explicit"].path, tmp_path, probe_fn=probes,
                    found=[libs["explicit"], libs["fast"]])
    assert choice.path == libs["explicit"].path
    assert probes.calls == ["libexplicit"]  # the others are not even probed


def test_an_explicit_library_that_crashes_falls_back(tmp_path, libs):
    probes = Probes({"libexplicit": CRASHED, "libfast": ok(10.0)})
    choice = choose(libs["explicit"].path, tmp_path, probe_fn=probes,
                    found=[libs["explicit"], libs["fast"]])
    assert choice.path == libs["fast"].path
    assert "rejected MLXR_OPENBLAS: was killed by SIGILL" in choice.describe()


def test_off_and_a_gpu_preload_nothing(tmp_path, libs):
    probes = Probes({"libfast": Verdict(True, "probed ok", device="gpu", head_ms=1.0)})
    assert choose("off", tmp_path, probe_fn=probes, found=[libs["fast"]]).path is None
    assert probes.calls == []
    choice = choose("auto", tmp_path, probe_fn=probes, found=[libs["fast"]])
    assert choice.path is None and "MLX runs on the gpu" in choice.reason


def test_verdicts_are_cached_per_library_file_and_cpu(tmp_path, libs, monkeypatch):
    probes = Probes({"libcrashes": CRASHED, "libfast": ok(10.0)})
    found = [libs["crashes"], libs["fast"]]
    first = choose("auto", tmp_path, probe_fn=probes, found=found)
    again = choose("auto", tmp_path, probe_fn=probes, found=found)
    assert probes.calls == ["libcrashes", "libfast"]  # the second choice probed nothing
    assert again == first

    Path(libs["fast"].path).write_bytes(b"a rebuilt library")  # a new file: probed again
    choose("auto", tmp_path, probe_fn=probes, found=found)
    assert probes.calls[2:] == ["libfast"]

    monkeypatch.setattr(blas, "cpu_key", lambda: "another-cpu")  # a new CPU: both again
    choose("auto", tmp_path, probe_fn=probes, found=found)
    assert probes.calls[3:] == ["libcrashes", "libfast"]

    choose("auto", tmp_path, probe_fn=probes, found=found, reprobe=True)
    assert probes.calls[5:] == ["libcrashes", "libfast"]


def test_a_missing_library_is_rejected_without_a_probe(tmp_path, libs):
    probes = Probes({"libfast": ok(10.0)})
    missing = "/nowhere/libopenblas.so"
    found = blas.candidates(tmp_path, missing)
    assert found[0] == Candidate("MLXR_OPENBLAS", missing)  # the explicit one is tried first
    choice = choose(missing, tmp_path, probe_fn=probes, found=[found[0], libs["fast"]])
    assert probes.calls == ["libfast"]
    assert choice.tried[0].verdict.reason == "no such file: /nowhere/libopenblas.so"
    assert choice.path == libs["fast"].path


def test_a_corrupt_cache_file_is_ignored(tmp_path, libs):
    (tmp_path / blas.CACHE_FILE).write_text("{not json")
    probes = Probes({"libfast": ok(10.0)})
    assert choose("auto", tmp_path, probe_fn=probes, found=[libs["fast"]]).path == \
        libs["fast"].path
    assert os.path.getsize(tmp_path / blas.CACHE_FILE) > 10  # rewritten whole


def test_exit_statuses_in_words():
    assert describe_exit(-signal.SIGILL) == "was killed by SIGILL (illegal instruction)"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL (killed)"
    assert describe_exit(3) == "exited with code 3"


def test_a_preloading_environment_puts_the_library_first_and_lets_openblas_threads_sleep():
    env = blas.preload_env({"LD_PRELOAD": "/lib/other.so", "PATH": "/bin"}, "/lib/blas.so")
    assert env["LD_PRELOAD"] == "/lib/blas.so /lib/other.so" and env["PATH"] == "/bin"
    assert env["OPENBLAS_THREAD_TIMEOUT"] == blas.THREAD_TIMEOUT == "4"
    assert blas.preload_env({}, "/lib/blas.so")["LD_PRELOAD"] == "/lib/blas.so"


def test_a_user_set_thread_timeout_is_kept():
    env = blas.preload_env({"OPENBLAS_THREAD_TIMEOUT": "28"}, "/lib/blas.so")
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "28"


def test_runners_get_the_timeout_only_with_a_preload(monkeypatch):
    from mlxr.supervisor.runners.client import runner_env

    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    assert runner_env("/lib/blas.so")["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert "OPENBLAS_THREAD_TIMEOUT" not in runner_env(None)

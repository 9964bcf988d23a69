"""The BLAS choice with real libraries and real processes: a library that dies with SIGILL
(as a SKYLAKEX-only OpenBLAS does on a CPU without AVX-512) or computes wrong results is
rejected by its probe, and a server told to use it still answers, on a library that passed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from mlxr.shared.blas import THREAD_TIMEOUT, choose, probe
from mlxr.shared.config import Settings
from tests.harness.server import serving

pytestmark = pytest.mark.timeout(240)

CRASHES = r"""
#include <signal.h>
void cblas_sgemm(void) { raise(SIGILL); }
char *openblas_get_config(void) { return "OpenBLAS that dies"; }
"""

WRONG = r"""
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            c[order == 101 ? i * ldc + j : j * ldc + i] = 0.0f;
}
"""


def build(directory: Path, name: str, source: str) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "these tests build two small libraries with the system C compiler"
    c_file, library = directory / f"{name}.c", directory / f"lib{name}.so"
    c_file.write_text(source)
    subprocess.run([compiler, "-shared", "-fPIC", str(c_file), "-o", str(library)], check=True)
    return str(library)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("blas-libs")
    return {"crashes": build(directory, "crashes", CRASHES),
            "wrong": build(directory, "wrong", WRONG)}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """An empty BLAS cache, with the C kernels this machine built already (each is named by
    its source's digest): the server's runner would otherwise compile them again, 20-30 s
    that test nothing here."""
    directory = tmp_path_factory.mktemp("blas-cache")
    for built in Settings.from_env().cache_dir.glob("*_kernel-*.so"):
        shutil.copy2(built, directory / built.name)
    return directory


def test_the_probe_names_the_signal_of_a_library_that_crashes(libraries):
    verdict = probe(libraries["crashes"])
    assert not verdict.ok
    assert verdict.reason.startswith("was killed by SIGILL (illegal instruction)")


def test_the_probe_rejects_a_library_with_wrong_results(libraries):
    verdict = probe(libraries["wrong"])
    assert not verdict.ok and verdict.reason.startswith("wrong float32 matmul")


def test_a_crashing_explicit_library_falls_back_to_one_that_passes(libraries, cache_dir):
    choice = choose(libraries["crashes"], cache_dir)
    # `make test` installs Debian's OpenBLAS, which runs on every x86_64 and aarch64 CPU.
    assert choice.path and choice.path != libraries["crashes"]
    assert choice.config.startswith("OpenBLAS") and choice.head_ms > 0
    first = choice.tried[0]
    assert first.candidate.path == libraries["crashes"] and not first.verdict.ok
    assert "rejected MLXR_OPENBLAS: was killed by SIGILL" in choice.describe()


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model, libraries, cache_dir):
    yield from serving(tmp_path_factory.mktemp("blas-serve"), subprocess_env,
                       {"tiny": tiny_model}, MLXR_OPENBLAS=libraries["crashes"],
                       MLXR_CACHE_DIR=str(cache_dir))


def test_a_server_told_to_use_a_crashing_library_still_answers(server, libraries, cache_dir):
    client = server.client()
    reply = client.generate(model="tiny", prompt="hello", options={"num_predict": 4})
    assert reply.done and reply.eval_count == 4
    with server.http() as http:
        [running] = http.get("/api/ps").json()["models"]
    # What the runner itself reports serving cblas_sgemm: a probed library, not the crasher.
    assert running["blas"]["path"] and running["blas"]["path"] != libraries["crashes"]
    assert running["blas"]["config"].startswith("OpenBLAS")
    log = server.log()
    assert "blas: " in log and "rejected MLXR_OPENBLAS: was killed by SIGILL" in log
    expected = choose(libraries["crashes"], cache_dir).path  # the verdicts it cached
    assert Path(running["blas"]["path"]).resolve() == Path(expected).resolve()
    # Preloaded by the supervisor, with OpenBLAS's threads asleep once their work is done.
    [pid] = server.runner_pids()
    env = psutil.Process(pid).environ()
    # (the runner reports the file it found loaded; the preload may name it by a symlink,
    # as Debian's libopenblas.so.0 is)
    preloaded = {Path(p).resolve() for p in env["LD_PRELOAD"].split()}
    assert Path(running["blas"]["path"]).resolve() in preloaded
    assert env["OPENBLAS_THREAD_TIMEOUT"] == THREAD_TIMEOUT

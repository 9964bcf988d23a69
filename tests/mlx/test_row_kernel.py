"""The row kernel (runner/row_kernel.py, shared/assets/row_kernel.c): its products against
numpy's for every lane width, tail and thread split; its build, cached and safe to fail
(shared/native.py); and decoding through it (head and batched body) giving mlx-lm's greedy
tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from mlxr.runner import host_head, host_ops, row_kernel
from mlxr.runner.host_body import HostBody
from mlxr.runner.host_head import HostHead, cpu_head_weight, openblas_sgemm
from mlxr.runner.model_step import ModelStep
from mlxr.runner.request import Sequence
from mlxr.runner.row_kernel import RowKernel
from mlxr.runner.sampling import Sampler
from mlxr.runner.scheduler import Scheduler, SchedulerConfig
from mlxr.shared import native
from mlxr.shared.protocol import Options
from tests.mlx.test_heads import probed_blas
from tests.mlx.test_host_attention import mlx_lm_greedy


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> RowKernel:
    built = RowKernel.load.__wrapped__(RowKernel, tmp_path_factory.mktemp("native"))
    assert built is not None  # `make test` machines have a C compiler (the BLAS shim needs one)
    return built


@pytest.mark.parametrize("width,depth", [(1003, 70), (37, 16), (5, 3), (6007, 200)],
                         ids=["tail", "one-tile", "under-a-tile", "two-threads"])
def test_the_kernel_gives_numpys_product(kernel, width, depth):
    rng = np.random.default_rng(width)
    weight = rng.standard_normal((width, depth), dtype=np.float32)
    for rows in (1, 3, 4, 5, 8, 9, 16, 17, 40):  # lanes 4, 8, 16; several passes
        x = rng.standard_normal((rows, depth), dtype=np.float32)
        out = np.full((rows, width), np.nan, dtype=np.float32)
        kernel.product(weight, x, out)
        assert np.allclose(out, x @ weight.T, rtol=1e-5, atol=1e-4), (rows, width, depth)
    assert width * depth < row_kernel.SPLIT_ELEMENTS or width == 6007


def test_the_library_is_built_once_into_a_name_of_its_source(tmp_path):
    source = tmp_path / "one.c"
    source.write_text("int mlxr_one(void) { return 1; }\n")
    path, why = native.cached_library(source, tmp_path / "cache", ["-O2"])
    assert path is not None and why == ""
    built = path.stat().st_mtime_ns
    assert native.cached_library(source, tmp_path / "cache", ["-O2"])[0] == path
    assert path.stat().st_mtime_ns == built  # not built again
    source.write_text("int mlxr_one(void) { return 2; }\n")
    assert native.cached_library(source, tmp_path / "cache", ["-O2"])[0] != path


def test_a_failed_build_says_why_and_leaves_no_file(tmp_path, monkeypatch):
    source = tmp_path / "bad.c"
    source.write_text("int mlxr_bad(void) { return }\n")
    path, why = native.cached_library(source, tmp_path / "cache", ["-O2"])
    assert path is None and "compiling bad.c failed" in why
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert native.cached_library(source, tmp_path / "cache", ["-O2"]) == (None, "no C compiler")


def test_the_head_keeps_the_kernel_only_where_it_beats_the_rival(tiny_model, monkeypatch,
                                                                 kernel):
    model, _ = load(str(tiny_model))
    step = ModelStep(model, 0, lambda token: "")
    monkeypatch.setattr(row_kernel.RowKernel, "load", classmethod(lambda cls: kernel))
    timings = {}
    monkeypatch.setattr(host_head, "median_ms", lambda head, probe, repeats, best: timings[
        "ours" if isinstance(head, HostHead) else "theirs"])
    timings.update(ours=5.0, theirs=9.0)
    head = HostHead.find(model, step.split.head)
    assert head.kernel is kernel and head.max_rows == host_head.KERNEL_MAX_ROWS
    timings.update(ours=9.0, theirs=9.0)
    head = HostHead.find(model, step.split.head)
    assert head is None or (head.kernel is None and head.max_rows == host_head.MAX_ROWS)


def test_decoding_through_the_kernel_gives_mlx_lms_greedy_tokens(tiny_model, kernel):
    # five greedy rows: the batched numpy body's products and the head through the kernel,
    # then rows finishing at different steps (four, three, ... rows)
    model, _ = load(str(tiny_model))
    step = ModelStep(model, 0, lambda token: "")
    step.host_head = HostHead(cpu_head_weight(model, step.split.head), None, kernel)
    step.host_body = HostBody.find(model, kernel=kernel)
    assert step.host_body is not None and step.host_body.rope_tables is not None
    calls = []
    product = kernel.product
    kernel_spy = type("Spy", (), {"product": lambda self, w, x, o: calls.append(x.shape[0])
                                  or product(w, x, o)})()
    step.host_head.kernel = step.host_body.gemm.kernel = kernel_spy
    serial = set()
    seqs = five_greedy_rows(step, lambda plan: serial.add((bool(plan.decode),
                                                           step.host_body.gemm.serial)))
    assert [s.output_tokens for s in seqs] == [
        mlx_lm_greedy(model, s.prompt_tokens, 6 + i) for i, s in enumerate(seqs)]
    assert 5 in calls and 3 in calls  # a five-row and a three-row step went through it
    assert serial == {(False, False), (True, True)}  # products in pieces while rows decode


def five_greedy_rows(step: ModelStep, after_step=lambda plan: None) -> list[Sequence]:
    """Five greedy sequences (prompts of 9-37 tokens, 6-10 new tokens) run to the end
    through `step`, with the scheduler; `after_step(plan)` after each step."""
    scheduler = Scheduler(SchedulerConfig(), step.make_pool(512, 8), admit=step.admit,
                          eos_token_ids=set())
    seqs = []
    for i in range(5):
        opts = Options(temperature=0.0)
        seq = Sequence(i, [(5 * k + 11 * i) % 400 + 2 for k in range(9 + 7 * i)], opts,
                       max_new_tokens=6 + i, context_length=512)
        seq.sampler = Sampler.from_options(opts, seq.context_length)
        scheduler.add(seq)
        seqs.append(seq)
    while scheduler.has_work:
        plan = scheduler.schedule()
        scheduler.update(plan, step.run(plan))
        after_step(plan)
    return seqs


@pytest.mark.parametrize("transpose_b,wide", [(True, False), (False, False), (True, True)],
                         ids=["scores", "values", "scores-of-a-long-chunk"])
def test_serial_products_are_pieces_openblas_keeps_on_its_thread(transpose_b, wide):
    # while rows decode, an attention product is cut until each sgemm call is under
    # OpenBLAS's threading threshold, and the pieces add up to the whole product
    library = probed_blas()
    sgemm = openblas_sgemm(library)
    calls = []

    def counted(*args):
        calls.append(args[3] * args[4] * args[5])
        sgemm(*args)

    gemm = host_ops.Gemm(counted)
    rng = np.random.default_rng(7)
    m, k, n = 32, 48, 3001  # (m, k) @ (k, n)
    if wide:  # so many queries that one key's column is over the threshold: cut twice
        m, k, n = 2100, 128, 300
    if transpose_b:  # scores: queries (m, d) by keys (positions, d)
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((n, k), dtype=np.float32)
        grid = rng.standard_normal((m, n + 10), dtype=np.float32)
        view = (slice(None), slice(3, 3 + n))  # rows strided, as a piece of the scores
    else:  # values: probabilities (m, positions) by values (positions, d)
        m, k, n = 32, 3001, 48
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        grid = rng.standard_normal((m, n), dtype=np.float32)
        view = (slice(None), slice(None))
    for serial, accumulate in ((True, True), (True, False), (False, True)):
        want = grid[view] * accumulate + 0.5 * (a @ (b.T if transpose_b else b))
        calls.clear()
        got = grid.copy()[view]
        gemm.serial = serial
        gemm.product(a, b, got, transpose_b=transpose_b, alpha=0.5, accumulate=accumulate)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-3)
        if serial:
            assert len(calls) > 1 and max(calls) <= host_ops.SERIAL_MNK
        else:
            assert calls == [m * n * k]

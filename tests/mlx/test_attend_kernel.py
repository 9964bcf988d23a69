"""One decode position's attention in C (runner/kv/attend_kernel.py,
shared/assets/attend_kernel.c): against float64 for groups, head sizes, piece splits and
lengths around its tiles; the same output with its heads split across the quantized kernel's
workers, or Python's threads without them; refusing what it does not read (numpy's attention
then serves); and the numpy decode body reading a shared prefix through it with mlx-lm's
greedy tokens. Its softmax of a prefill tile's rows against float64, causal mask included."""

from __future__ import annotations

import numpy as np
import pytest

from mlxr.runner.host_body import HostBody
from mlxr.runner.kv import attend_kernel
from mlxr.runner.kv.attend_kernel import AttendKernel
from mlxr.runner.kv.host_attention import attend_position
from tests.mlx.test_host_attention import mlx_lm_greedy
from tests.mlx.test_host_body import arch_models, host_greedy  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def kernel() -> AttendKernel:
    # The build the runners use (cached by its source's digest and flags: 22 s to compile on
    # the 2-core EPYC, made once per machine and source).
    built = AttendKernel.load()
    assert built is not None  # `make test` machines have a C compiler (the BLAS shim needs one)
    return built


def pieces_of(rng, kv_heads: int, lengths: list[int], dim: int, spread: float = 1.0):
    """Keys and values pieces as the pool's rows give them: slices of larger arrays, each
    head a stride of the whole capacity apart."""
    keys, values = [], []
    for n in lengths:
        capacity = n + 5
        k = rng.standard_normal((kv_heads, capacity, dim), dtype=np.float32) * spread
        v = rng.standard_normal((kv_heads, capacity, dim), dtype=np.float32)
        keys.append(k[:, 2:2 + n])
        values.append(v[:, 2:2 + n])
    return keys, values


def exact(q, keys, values, group: int) -> np.ndarray:
    kv_heads, dim = keys[0].shape[0], q.shape[-1]
    k = np.concatenate(keys, axis=1).astype(np.float64)
    v = np.concatenate(values, axis=1).astype(np.float64)
    scores = np.einsum("hgd,hpd->hgp", q.reshape(kv_heads, group, dim).astype(np.float64), k)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.einsum("hgp,hpd->hgd", scores, v).reshape(kv_heads * group, dim)


@pytest.mark.parametrize("kv_heads,group,dim,lengths", [
    (2, 2, 64, [1]),  # the first decode position
    (8, 2, 128, [200]),  # Qwen3-0.6B's heads
    (4, 3, 80, [3, 61, 5]),  # three pieces; lengths off the 4-row and 64-row tiles
    (1, 7, 48, [64, 64, 1]),  # a group of 7; whole tiles, then one position
    (2, 1, 8, [129]),  # no grouping; the smallest head size
])
def test_it_gives_the_exact_attention(kernel, kv_heads, group, dim, lengths):
    rng = np.random.default_rng(sum(lengths) + dim)
    keys, values = pieces_of(rng, kv_heads, lengths, dim)
    q = rng.standard_normal((kv_heads * group, dim), dtype=np.float32) / dim ** 0.5
    got = kernel(q, keys, values, group)
    assert got is not None and got.shape == (kv_heads * group, dim)
    want = exact(q, keys, values, group)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.allclose(got, attend_position(q, keys, values, group), rtol=1e-4, atol=1e-5)


def test_scores_far_apart_keep_the_softmax_exact(kernel):
    # scores spread over hundreds: most exponents underflow (the polynomial's lower clamp)
    # and the largest must not overflow
    rng = np.random.default_rng(5)
    keys, values = pieces_of(rng, 2, [90, 40], 32, spread=30.0)
    q = rng.standard_normal((4, 32), dtype=np.float32)
    got = kernel(q, keys, values, 2)
    want = exact(q, keys, values, 2)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_heads_split_on_the_quantized_kernels_workers_give_the_same_output(kernel):
    rng = np.random.default_rng(9)
    keys, values = pieces_of(rng, 8, [300, 21], 64)
    q = rng.standard_normal((16, 64), dtype=np.float32) / 8
    assert kernel._parts is not None  # the quantized kernel's library builds here too
    alone = AttendKernel(kernel._fn)(q, keys, values, 2)  # one call, on this thread
    calls = []
    pool = kernel._parts
    kernel._parts = lambda job, args, n, parts: calls.append((n, parts)) or pool(
        job, args, n, parts)
    try:
        split = kernel(q, keys, values, 2)
    finally:
        kernel._parts = pool
    assert calls == [(8, attend_kernel.host_parallel.workers())]
    assert np.array_equal(split, alone)  # each head is computed the same way either way
    small = pieces_of(rng, 1, [3], 8)  # under POOL_FLOATS: on this thread alone
    assert 2 * 3 * 8 < attend_kernel.POOL_FLOATS
    assert np.allclose(kernel(q[:1, :8], *small, 1), exact(q[:1, :8], *small, 1), atol=1e-6)


def test_without_those_workers_pythons_threads_split_the_heads(kernel, monkeypatch):
    rng = np.random.default_rng(9)
    keys, values = pieces_of(rng, 8, [300, 21], 64)
    q = rng.standard_normal((16, 64), dtype=np.float32) / 8
    threads = AttendKernel(kernel._fn)  # no quantized kernel library
    alone = threads(q, keys, values, 2)
    calls = []
    real = attend_kernel.host_parallel.for_rows
    monkeypatch.setattr(attend_kernel.host_parallel, "for_rows",
                        lambda *a, **k: calls.append(a[:2]) or real(*a, **k))
    monkeypatch.setattr(attend_kernel, "SPLIT_FLOATS", 1)
    monkeypatch.setattr(attend_kernel.host_parallel, "workers", lambda: 2)
    monkeypatch.setattr(attend_kernel.host_parallel, "MIN_ELEMENTS", 1)
    split = threads(q, keys, values, 2)
    assert calls == [(8, 2 * 8 * 321 * 64)]
    assert np.array_equal(split, alone)


def test_a_steps_rows_in_one_call_equal_each_rows_own(kernel):
    # rows of different lengths and piece counts (a shared prefix, then a run of its own)
    rng = np.random.default_rng(11)
    lengths = [[5], [30, 17], [200], [1, 64, 3]]
    rows = [pieces_of(rng, 4, row, 64) for row in lengths]
    q = rng.standard_normal((4, 8, 64), dtype=np.float32) / 8
    got = kernel.rows(q, [k for k, _ in rows], [v for _, v in rows], 2)
    assert got.shape == (4, 8 * 64)
    for r, (keys, values) in enumerate(rows):
        assert np.array_equal(got[r], kernel(q[r], keys, values, 2).reshape(-1))
        want = exact(q[r], keys, values, 2).reshape(-1)
        assert np.abs(got[r] - want).max() <= 1e-5 * np.abs(want).max()
    odd = pieces_of(rng, 4, [9], 64)
    strided = [np.ascontiguousarray(odd[0][0].transpose(0, 2, 1)).transpose(0, 2, 1)]
    assert kernel.rows(q[:2], [rows[0][0], strided], [rows[0][1], odd[1]], 2) is None
    assert AttendKernel(kernel._fn).rows(q, [k for k, _ in rows], [v for _, v in rows],
                                         2) is None  # no workers: row by row


def test_it_refuses_what_it_does_not_read(kernel):
    rng = np.random.default_rng(3)
    keys, values = pieces_of(rng, 2, [10], 36)  # a head size not a multiple of 8
    q = rng.standard_normal((4, 36), dtype=np.float32)
    assert kernel(q, keys, values, 2) is None
    keys, values = pieces_of(rng, 2, [10], 32)
    q = rng.standard_normal((4, 32), dtype=np.float32)
    strided = [np.ascontiguousarray(keys[0].transpose(0, 2, 1)).transpose(0, 2, 1)]
    assert kernel(q, strided, values, 2) is None  # a position's floats not contiguous
    assert kernel(q.astype(np.float64), keys, values, 2) is None
    assert kernel(q, keys, [v.astype(np.float16) for v in values], 2) is None
    assert kernel(q, keys, values, 2) is not None


def test_the_body_reads_a_shared_prefix_through_it(arch_models, monkeypatch):  # noqa: F811
    model = arch_models("qwen3")
    body = HostBody.find(model)
    assert isinstance(body.attend_kernel, AttendKernel)
    served = []
    real = AttendKernel.__call__

    def spy(self, q, keys, values, group):
        out = real(self, q, keys, values, group)
        served.append((len(keys), out is not None))
        return out

    monkeypatch.setattr(AttendKernel, "__call__", spy)
    prefix = [(3 * i + 2) % 400 + 2 for i in range(64)]  # four full blocks
    prompts = [prefix + [5, 6, 7], prefix + [9]]
    got, shared, _ = host_greedy(model, body, prompts, steps=6)
    assert shared == [False, True]
    assert got == [mlx_lm_greedy(model, p, 6) for p in prompts]
    assert served and all(ok for _, ok in served)
    assert max(n for n, _ in served) >= 2  # the second row's prefix pieces, then its own


def test_the_bodys_batched_rows_attend_in_one_call_a_layer(arch_models, monkeypatch):  # noqa: F811
    model = arch_models("qwen3")
    body = HostBody.find(model)
    calls = []
    real = AttendKernel.rows
    monkeypatch.setattr(AttendKernel, "rows", lambda self, q, keys, values, group: calls.append(
        len(keys)) or real(self, q, keys, values, group))
    prefix = [(5 * i + 3) % 400 + 2 for i in range(32)]
    prompts = [prefix + [7], prefix + [8, 9], [4, 5, 6], [(2 * i) % 300 + 2 for i in range(50)]]
    batch_body = type("Batched", (), {"__call__": lambda self, rows: body.batch(rows)})()
    got, _, _ = host_greedy(model, batch_body, prompts, steps=5)
    assert got == [mlx_lm_greedy(model, p, 5) for p in prompts]
    assert calls and set(calls) == {4}  # every layer of every step: the four rows at once


@pytest.mark.parametrize("rows, cols, first, period", [
    (6, 37, 35, 3),      # a causal block of 3 queries, for 2 heads, cols not a multiple of 8
    (4, 16, 16, 1),      # no mask: every row sees every column
    (8, 300, 1, 8),      # the first query of a chunk at position 0 sees one column
    (2, 9, 20, 1),       # more than there is: all of them
])
def test_a_prefill_tiles_softmax_is_numpys_with_the_causal_mask(kernel, rows, cols, first,
                                                                period):
    rng = np.random.default_rng(rows * cols)
    scores = rng.standard_normal((rows, cols + 3), dtype=np.float32)[:, :cols] * 8  # strided
    want = np.zeros((rows, cols))
    for r in range(rows):
        n = min(cols, first + r % period)
        e = np.exp(scores[r, :n].astype(np.float64) - scores[r, :n].max())
        want[r, :n] = e / e.sum()
    kernel.softmax_rows(scores, first, period)
    np.testing.assert_allclose(scores, want, rtol=2e-6, atol=1e-9)
    assert not scores[want == 0].any()  # masked columns are exactly 0

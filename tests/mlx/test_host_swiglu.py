"""The gated MLP's `silu(gate) * up` in numpy (runner/host_swiglu.py): the same values as
mlx-lm's `swiglu`, only inside `active` and only for float32 prefill-sized gates, and greedy
tokens still mlx-lm's when a model's prefill chunks take it."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import activations

from mlxr.runner import host_parallel, host_swiglu
from tests.mlx.test_host_attention import mlx_lm_greedy, rows_greedy
from tests.mlx.test_host_attention import model  # noqa: F401  (the fixture: tiny, on the rows)


def test_it_gives_mlx_lms_swiglu():
    gate = mx.random.normal((1, 40, 768)) * 6
    gate[0, 0, :4] = mx.array([-200.0, -90.0, 90.0, 200.0])  # exp overflows: no NaN
    up = mx.random.normal((1, 40, 768))
    with host_swiglu.active():
        assert host_swiglu.worth_it(gate)
        got = host_swiglu.swiglu(gate, up)
    want = activations.swiglu(gate, up)
    assert got.dtype == mx.float32 and not mx.isnan(got).any().item()
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


def test_split_across_threads_it_gives_the_same_numbers(monkeypatch):
    gate, up = mx.random.normal((1, 41, 768)) * 6, mx.random.normal((1, 41, 768))
    with host_swiglu.active():
        whole = host_swiglu.swiglu(gate, up)
        monkeypatch.setattr(host_parallel, "MIN_ELEMENTS", 0)
        monkeypatch.setattr(host_parallel, "workers", lambda: 4)
        assert mx.array_equal(host_swiglu.swiglu(gate, up), whole).item()


def test_only_inside_active_and_only_for_float32_prefill_sized_gates():
    big = mx.random.normal((1, 64, 512))
    assert not host_swiglu.worth_it(big)  # outside `active`: mlx-lm's own
    with host_swiglu.active():
        assert host_swiglu.worth_it(big)
        assert not host_swiglu.worth_it(mx.random.normal((64, 1, 512)))  # a decode step
        assert not host_swiglu.worth_it(mx.random.normal((1, 8, 512)))  # too few elements
        assert not host_swiglu.worth_it(big.astype(mx.bfloat16))
        with host_swiglu.active(False):  # MLXR_HOST_ATTENTION=0
            assert not host_swiglu.worth_it(big)
        assert host_swiglu.worth_it(big)
    assert not host_swiglu.worth_it(big)


def test_prefill_chunks_take_it_and_the_greedy_tokens_are_mlx_lms(model, monkeypatch):
    assert host_swiglu.install(model) >= 1  # as the model step does
    taken = []
    original = host_swiglu.swiglu
    monkeypatch.setattr(host_swiglu, "worth_it",
                        lambda g, w=host_swiglu.worth_it: taken.append(w(g)) or taken[-1])
    prompts = [[(7 * i + 3) % 500 + 2 for i in range(length)] for length in (300, 45)]
    with host_swiglu.active():
        got, _ = rows_greedy(model, prompts, chunk=128, steps=8)
    assert any(taken) and not all(taken)  # the chunks did, the decode steps did not
    taken.clear()
    want = [mlx_lm_greedy(model, p, 8) for p in prompts]
    assert not any(taken)  # mlx-lm's generation outside `active` never does
    assert got == want
    assert host_swiglu.swiglu is original

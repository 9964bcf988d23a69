"""Prefill chunks attending in bucketed shapes (runner/kv/bucketed_attention.py, for CUDA's
cuDNN graphs): the same outputs as MLX's causal attention over the exact context, a bounded
set of shapes, and a model routed through it giving mlx-lm's greedy tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.kv import bucketed_attention, rows
from mlxr.supervisor.store.random_model import write_random_model
from tests.mlx.test_host_attention import mlx_lm_greedy


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("before,n", [(0, 2), (0, 37), (100, 16), (250, 9), (300, 200),
                                      (513, 64)])
def test_it_gives_causal_attention_over_the_exact_context(heads, kv_heads, before, n):
    mx.random.seed(before + n + heads)
    cache = KVCache()
    if before:  # an earlier chunk, written with a different step so the buffer is uneven
        cache.update_and_fetch(mx.random.normal((1, kv_heads, before, 32)),
                               mx.random.normal((1, kv_heads, before, 32)))
    keys, values = cache.update_and_fetch(mx.random.normal((1, kv_heads, n, 32)),
                                          mx.random.normal((1, kv_heads, n, 32)))
    # the buffer past the context holds junk that must stay masked
    cache.keys[..., cache.offset:, :] = 1e4
    cache.values[..., cache.offset:, :] = 1e4
    q = mx.random.normal((1, heads, n, 32))
    got = bucketed_attention.attend(q, cache, 0.2)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask="causal")
    assert got.shape == want.shape
    # a GPU's float32 products are about 3e-4 off (docs/PERFORMANCE.md, "On a GPU")
    atol = 1e-5 if mx.default_device() == mx.cpu else 5e-3
    assert mx.allclose(got, want, atol=atol).item(), float(mx.abs(got - want).max())


def test_a_prompt_read_in_chunks_takes_a_few_shapes():
    # a 2,000-token prompt read 16 to 48 tokens a chunk: one shape per query size and 256
    # positions, where the exact shapes were one per chunk
    shapes, exact, start = set(), set(), 0
    sizes = [16, 23, 48, 31]
    while start < 2000:
        n = min(sizes[len(exact) % 4], 2000 - start)
        start += n
        capacity = -(-start // 256) * 256
        shapes.add(bucketed_attention.padded_shape(n, start, capacity))
        exact.add((n, start))
    assert len(exact) > 60
    assert len(shapes) <= 3 * 8 + 1  # 16, 32 and 64 queries; 8 buckets of 256
    assert bucketed_attention.padded_shape(17, 300, 512) == (32, 512)
    assert bucketed_attention.padded_shape(3, 300, 300) == (16, 300)  # never past the buffer


def test_it_applies_to_causal_chunks_on_single_sequence_caches_only():
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 8, 32), mx.bfloat16), mx.zeros((1, 2, 8, 32),
                                                                           mx.bfloat16))
    chunk = mx.zeros((1, 4, 8, 32), mx.bfloat16)
    assert bucketed_attention.applies(chunk, cache, "causal")
    assert not bucketed_attention.applies(chunk[:, :, :1], cache, None)  # a decode step
    assert not bucketed_attention.applies(chunk, cache, mx.zeros((8, 8)))  # its own mask
    assert not bucketed_attention.applies(chunk.astype(mx.float32), cache, "causal")
    assert not bucketed_attention.applies(chunk, None, "causal")
    if mx.default_device() == mx.cpu:
        assert not bucketed_attention.wanted()  # only CUDA's cuDNN builds graphs per shape


def bucketed_on_this_cpu(monkeypatch) -> list[int]:
    """Let float32 take the buckets (as 16-bit would on a GPU), with the route reset after
    the test; returns the list each bucketed call's query count is appended to."""
    monkeypatch.setattr(bucketed_attention, "CUDNN_DTYPES", (mx.float32,))
    monkeypatch.setattr(rows, "_buckets", False)
    calls: list[int] = []
    real = bucketed_attention.attend
    monkeypatch.setattr(bucketed_attention, "attend",
                        lambda q, cache, scale: calls.append(q.shape[2]) or real(q, cache, scale))
    return calls


def test_a_model_routed_through_it_gives_mlx_lms_greedy_tokens(tmp_path, monkeypatch):
    model, _ = load(str(write_random_model(tmp_path / "m", preset="tiny")))
    prompt = [(7 * i + 3) % 500 + 2 for i in range(300)]
    want = mlx_lm_greedy(model, prompt, 6)

    calls = bucketed_on_this_cpu(monkeypatch)
    rows.install(model, buckets=True)
    cache = make_prompt_cache(model)
    for start in range(0, len(prompt), 37):  # chunks of 37, then the last 4
        logits = model(mx.array([prompt[start:start + 37]]), cache=cache)
    got = []
    for _ in range(6):
        token = int(mx.argmax(logits[0, -1]))
        got.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    assert got == want
    assert set(calls) == {37, 4}  # every chunk went through the buckets; no decode step did


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_a_gpus_chunking_on_the_padded_batch_gives_mlx_lms_greedy_tokens(tmp_path, monkeypatch,
                                                                         buckets):
    # A GPU's runner, on this CPU: the padded batch, the scheduler's 256-token aligned floor,
    # and (or not) bucketed shapes; two streams decode while longer prompts are read, one of
    # them after a cached prefix of another, so its first chunk starts unaligned.
    from mlxr.runner.loader import scheduler_config
    from mlxr.runner.model_step import ModelStep
    from mlxr.runner.scheduler import Scheduler
    from mlxr.shared.config import RunnerConfig
    from tests.mlx.test_shared_head import sequence

    model, _ = load(str(write_random_model(tmp_path / "m", preset="tiny")))
    calls = bucketed_on_this_cpu(monkeypatch)
    if buckets:
        rows.install(model, buckets=True)
    step = ModelStep(model, 1 << 26, lambda token: "", rows=False)
    assert not step.uses_rows
    config = scheduler_config(RunnerConfig(model_dir="m", num_parallel=8), on_gpu=True)
    scheduler = Scheduler(config, step.make_pool(1024, 16), admit=step.admit,
                          eos_token_ids=set())
    base = [(7 * i + 3) % 500 + 2 for i in range(1200)]
    prompts = [base[:20], base[5:38], base, base[:300] + [(5 * i) % 400 + 2 for i in range(900)]]
    seqs = [sequence(i, p, 8) for i, p in enumerate(prompts)]
    scheduler.add(seqs[0])
    scheduler.add(seqs[1])
    chunks = []
    for number in range(300):
        if number == 3:
            scheduler.add(seqs[2])
        if number == 12:  # after the first prompt's end: its cached prefix is there
            scheduler.add(seqs[3])
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        chunks += [(c.seq.seq_id, c.start, c.end, c.is_last) for c in plan.prefills]
        scheduler.update(plan, step.run(plan))
    assert [s.output_tokens for s in seqs] == [mlx_lm_greedy(model, p, 8) for p in prompts]
    long_chunks = [c for c in chunks if c[0] >= 2]
    assert all(end % 256 == 0 for _, _, end, last in long_chunks if not last)
    # the second long prompt starts after its cached prefix, and its first chunk (512 tokens
    # allowed) ends at the last multiple of 256 it reaches
    assert [c[1:3] for c in long_chunks if c[0] == 3] == [(300, 768), (768, 1200)]
    assert bool(calls) == buckets

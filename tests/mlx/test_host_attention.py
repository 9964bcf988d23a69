"""A row's attention with its softmax in numpy (runner/kv/host_attention.py): the same
outputs as MLX's fused attention, the same greedy tokens as mlx-lm through the rows, only where
it is meant to run, and no decode step run ahead over it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.runner import host_parallel
from mlxr.runner.kv import host_attention, rows
from mlxr.runner.kv.pool import KVPool
from mlxr.supervisor.store.random_model import write_random_model


def reference(q, k, v, scale, causal):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                mask="causal" if causal else None)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("n,positions", [(1, 300), (16, 16), (16, 700), (64, 200)])
def test_it_gives_mlxs_attention(heads, kv_heads, n, positions):
    mx.random.seed(n * positions + heads)
    q = mx.random.normal((1, heads, n, 32))
    # keys and values as the rows hold them: the first positions of a larger run
    k = mx.random.normal((1, kv_heads, positions + 50, 32))[..., :positions, :]
    v = mx.random.normal((1, kv_heads, positions + 50, 32))[..., :positions, :]
    for causal in ([True, False] if n > 1 else [False]):
        got = host_attention.attend(q, k, v, 0.17, causal)
        want = reference(q, k, v, 0.17, causal)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-5).item(), float(mx.abs(got - want).max())


def test_split_across_threads_it_gives_the_same_numbers(monkeypatch):
    q = mx.random.normal((1, 4, 37, 32))
    k = mx.random.normal((1, 2, 300, 32))
    v = mx.random.normal((1, 2, 300, 32))
    whole = host_attention.attend(q, k, v, 0.17, True)
    monkeypatch.setattr(host_parallel, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(host_parallel, "workers", lambda: 3)  # 37 queries: 12, 12, 13
    assert mx.array_equal(host_attention.attend(q, k, v, 0.17, True), whole).item()


def test_the_causal_mask_hides_later_positions():
    q = mx.random.normal((1, 2, 8, 16))
    k = mx.random.normal((1, 2, 8, 16))
    v = mx.random.normal((1, 2, 8, 16))
    first = host_attention.attend(q[:, :, :1], k[:, :, :1], v[:, :, :1], 0.25, False)
    assert mx.allclose(host_attention.attend(q, k, v, 0.25, True)[:, :, :1], first,
                       atol=1e-6).item()
    # without the mask the first query reads every position
    assert not mx.allclose(host_attention.attend(q, k, v, 0.25, False)[:, :, :1], first,
                           atol=1e-3).item()


def test_it_runs_only_for_float32_and_enough_scores():
    enough = host_attention.MIN_SCORES
    assert host_attention.worth_it(enough, mx.float32)
    assert not host_attention.worth_it(enough - 1, mx.float32)
    assert not host_attention.worth_it(enough, mx.bfloat16)
    assert not host_attention.worth_it(enough, mx.float16)


class _Seq:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model, _ = load(str(write_random_model(tmp_path_factory.mktemp("m"), preset="tiny")))
    rows.install(model)
    return model


def rows_greedy(model, prompts: list[list[int]], chunk: int, steps: int,
                host: bool = True) -> tuple[list, bool]:
    """Each prompt prefilled alone in chunks, then all decoded together, greedily; and whether
    the last decode pass would let a step run ahead."""
    num_layers = len(model.layers)
    pool = KVPool(num_blocks=4096, block_size=16)
    batch = rows.RowBatch(num_layers, pool, host_attention=host)
    seqs = [_Seq(i) for i in range(len(prompts))]
    firsts = []
    for seq, tokens in zip(seqs, prompts):
        # as the scheduler does: a prompt starts after what it shares with earlier ones
        cached = batch.admit(seq, pool.admit(seq.seq_id, tokens, len(tokens) + steps + 1))
        for start in range(cached, len(tokens), chunk):
            part = tokens[start:start + chunk]
            logits = model(mx.array([part]), cache=batch.prefill_cache(seq))
            batch.advance([seq], len(part))
            pool.commit(seq.seq_id, tokens, start + len(part))
        firsts.append(mx.argmax(logits[:, -1, :], axis=-1))
        batch.join(seq)
    out = [[int(t.item())] for t in firsts]
    last = mx.concatenate(firsts)
    decode_greedy(model, batch, seqs, last, out, steps - 1)
    rows_greedy.shared = [bool(batch._rows[s.seq_id].shared) for s in seqs]
    return out, batch.can_run_ahead()


def decode_greedy(model, batch, seqs, last: mx.array, out: list[list[int]], steps: int) -> None:
    """`steps` greedy decode passes of all `seqs` together over the rows, from their last
    tokens `last`; each row's tokens are appended to `out`."""
    for _ in range(steps):
        logits = model(last[:, None], cache=batch.decode_cache())
        batch.advance(seqs, 1)
        last = mx.argmax(logits[:, -1, :], axis=-1)
        for i, t in enumerate(last.tolist()):
            out[i].append(t)


def mlx_lm_greedy(model, tokens: list[int], steps: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=steps,
                                             sampler=make_sampler(0.0))]


@pytest.mark.parametrize("minimum", [0, 10**12], ids=["numpy", "mlx"])
def test_rows_give_mlx_lms_greedy_tokens_either_way(model, monkeypatch, minimum):
    monkeypatch.setattr(host_attention, "MIN_SCORES", minimum)
    prompts = [[(7 * i + 3) % 500 + 2 for i in range(length)] for length in (700, 90, 333)]
    got, ahead = rows_greedy(model, prompts, chunk=128, steps=8)
    assert got == [mlx_lm_greedy(model, p, 8) for p in prompts]
    # a decode pass attended in numpy was computed as it was built: nothing to run ahead of
    assert ahead == (minimum == 10**12)


@pytest.mark.parametrize("minimum", [0, 10**12], ids=["numpy", "mlx"])
def test_rows_reading_a_shared_prefix_give_mlx_lms_greedy_tokens(model, monkeypatch, minimum):
    # numpy's softmax reads the shared segments in place, piece by piece; MLX's joins them
    monkeypatch.setattr(host_attention, "MIN_SCORES", minimum)
    prefix = [(5 * i + 1) % 400 + 2 for i in range(300)]
    prompts = [prefix + [(3 * i + k) % 90 + 2 for i in range(20 + 30 * k)] for k in range(3)]
    got, _ = rows_greedy(model, prompts, chunk=64, steps=8)
    assert rows_greedy.shared == [False, True, True]
    assert got == [mlx_lm_greedy(model, p, 8) for p in prompts]


def test_pieces_of_a_context_give_the_whole_contexts_attention():
    q = mx.random.normal((1, 4, 5, 16))
    k = mx.random.normal((1, 2, 90, 16))
    v = mx.random.normal((1, 2, 90, 16))
    cuts = [0, 32, 48, 90]
    ks = [k[..., a:b, :] for a, b in zip(cuts, cuts[1:])]
    vs = [v[..., a:b, :] for a, b in zip(cuts, cuts[1:])]
    for causal in (True, False):
        got = host_attention.attend(q, ks, vs, 0.3, causal)
        assert mx.allclose(got, reference(q, k, v, 0.3, causal), atol=1e-5).item()


def test_the_host_path_is_taken_for_many_scores_only(model, monkeypatch):
    calls = []
    original = host_attention.attend
    monkeypatch.setattr(host_attention, "attend",
                        lambda *a: calls.append((a[0].shape[2], sum(k.shape[2] for k in a[1])))
                        or original(*a))
    heads = model.args.num_attention_heads
    long_row = host_attention.MIN_SCORES // heads + 10
    rows_greedy(model, [list(range(2, 22)), list(range(2, 2 + long_row))], chunk=512, steps=3)
    assert all(n * heads * positions >= host_attention.MIN_SCORES for n, positions in calls)
    # the long row's decode steps came here; the 20-token row never did
    assert (1, long_row + 1) in calls and not any(positions < 30 for _, positions in calls)
    calls.clear()  # the setting (MLXR_HOST_ATTENTION=0) turns it off
    rows_greedy(model, [list(range(2, 2 + long_row))], chunk=512, steps=3, host=False)
    assert calls == []

"""The sampler against exact references computed with numpy (uses MLX, no model)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxr.runner.sampling import Sampler, argmax_rows, sample, top_k_candidates
from mlxr.shared.protocol import Options


def test_grid_argmax_is_argmax_with_its_first_occurrence_rule():
    rng = np.random.default_rng(1)
    for vocab in (151680, 50000, 50257, 3000):  # grid 128 x 1185, 125 x 400, plain argmax
        logits = rng.standard_normal((6, vocab)).astype(np.float32)
        logits[1, [vocab - 1, 5, 777]] = 9.0  # a tie across three columns: the first id wins
        logits[2, :] = -1.0
        logits[2, [vocab // 2, vocab // 2 + 1]] = 3.0  # neighbours: different columns
        logits[3, -3:] = 50.0  # the maximum in the last ids only
        logits[4, 0] = 50.0
        got = np.array(argmax_rows(mx.array(logits))).tolist()
        assert got == np.argmax(logits, axis=-1).tolist(), vocab
    assert argmax_rows(mx.zeros((2, 151680))).dtype == mx.int32


def test_block_top_k_equals_a_full_partition():
    rng = np.random.default_rng(0)
    for vocab in (151680, 50000, 50257, 3000):  # grid, another grid, padded grid, direct
        logits = rng.standard_normal((5, vocab)).astype(np.float32)
        logits[1, :] = 0.0
        logits[1, [7, 9000 % vocab, vocab - 1]] = 5.0  # ties elsewhere, clear winners here
        values, ids = top_k_candidates(mx.array(logits), 40)
        for row in range(5):
            got = sorted(np.array(ids[row]).tolist())
            order = np.argsort(-logits[row], kind="stable")
            expected_values = np.sort(logits[row][order[:40]])
            assert np.allclose(np.sort(np.array(values[row])), expected_values)
            if row != 1:
                assert got == sorted(order[:40].tolist())
        assert {7, 9000 % vocab, vocab - 1} <= set(np.array(ids[1]).tolist())


def expected_distribution(logits: np.ndarray, top_k: int, temperature: float,
                          top_p: float) -> np.ndarray:
    """Ollama's order: top-k, temperature, softmax, top-p (smallest prefix reaching p)."""
    order = np.argsort(-logits)[:top_k]
    scaled = logits[order] / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = (np.cumsum(probs) - probs) < top_p
    probs = np.where(keep, probs, 0.0)
    full = np.zeros_like(logits, dtype=np.float64)
    full[order] = probs / probs.sum()
    return full


def test_seeded_samples_follow_the_filtered_softmax():
    rng = np.random.default_rng(1)
    vocab, draws = 40960, 6000
    row = (rng.standard_normal(vocab) * 2).astype(np.float32)
    options = dict(temperature=0.8, top_k=40, top_p=0.9)
    expected = expected_distribution(row, **options)
    counts = np.zeros(vocab)
    batch = 500
    logits = mx.broadcast_to(mx.array(row), (batch, vocab))
    for start in range(0, draws, batch):
        samplers = [Sampler.from_options(Options(seed=start + i, **options), 4096)
                    for i in range(batch)]
        out = sample(logits, samplers, [[]] * batch, [-1] * batch)
        np.add.at(counts, np.array(out.tokens), 1)
    empirical = counts / draws
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected)), "outside the filter"
    total_variation = 0.5 * np.abs(empirical - expected).sum()
    assert total_variation < 0.04, total_variation


def test_a_seeded_row_is_the_same_in_any_batch_position():
    rng = np.random.default_rng(2)
    logits = mx.array(rng.standard_normal((6, 151680)).astype(np.float32))

    def draw(seed_row: int) -> list[int]:
        samplers = [Sampler.from_options(Options(seed=100 + i, temperature=1.0), 4096)
                    for i in range(6)]
        order = list(range(6))
        order.remove(seed_row)
        order.insert(0, seed_row)  # move the row under test to the front
        out = sample(logits[mx.array(order)], [samplers[i] for i in order], [[]] * 6, [-1] * 6)
        return np.array(out.tokens).tolist()[0]

    assert draw(3) == draw(3)
    first = [Sampler.from_options(Options(seed=103, temperature=1.0), 4096)]
    alone = np.array(sample(logits[3:4], first, [[]], [-1]).tokens).tolist()[0]
    assert alone == draw(3)


def test_greedy_rows_take_the_argmax_and_penalties_touch_only_their_row():
    rng = np.random.default_rng(3)
    raw = rng.standard_normal((3, 1000)).astype(np.float32)
    raw[:, 5] = 10.0
    samplers = [Sampler.from_options(Options(temperature=0), 4096),
                Sampler.from_options(Options(temperature=0, repeat_penalty=100.0), 4096),
                Sampler.from_options(Options(temperature=0, logit_bias={9: 50.0}), 4096)]
    out = sample(mx.array(raw), samplers, [[], [5], []], [-1, -1, -1])
    tokens = np.array(out.tokens).tolist()
    assert tokens[0] == 5
    assert tokens[1] == int(np.argmax(np.where(np.arange(1000) == 5, 0.1, raw[1])))
    assert tokens[2] == 9

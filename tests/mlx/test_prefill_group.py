"""Several sequences' prefill chunks in one forward pass over the rows (`RowBatch.
prefill_group_cache`, used by the model step for a step's chunks): chunks of different
lengths, padded on the right, write only their own positions and give each sequence
mlx-lm's greedy tokens, alone, from a shared prefix, and over several chunks."""

from __future__ import annotations

import mlx.core as mx

from mlxr.runner.kv import rows
from mlxr.runner.kv.pool import KVPool
from tests.mlx.test_host_attention import _Seq, decode_greedy, mlx_lm_greedy
from tests.mlx.test_host_attention import model  # noqa: F401  (the fixture: tiny, on the rows)


def grouped_greedy(model, prompts: list[list[int]], chunk: int, steps: int,
                   waves: list[list[int]] | None = None) -> tuple[list[list[int]], list]:
    """The prompts admitted wave by wave (all at once by default), each wave prefilled
    together, `chunk` tokens of each per pass (so the passes mix rows that end their prompt
    with rows that go on, and rows that have nothing left drop out), then all decoded
    together greedily. Returns the tokens and whether each row read shared blocks."""
    pool = KVPool(num_blocks=4096, block_size=16)
    batch = rows.RowBatch(len(model.layers), pool)
    seqs = [_Seq(i) for i in range(len(prompts))]
    done: dict[int, int] = {}
    first: dict[int, int] = {}
    for wave in waves or [list(range(len(prompts)))]:
        for seq in (seqs[i] for i in wave):
            tokens = prompts[seq.seq_id]
            done[seq.seq_id] = batch.admit(seq, pool.admit(seq.seq_id, tokens,
                                                           len(tokens) + steps))
        while any(seqs[i].seq_id not in first for i in wave):
            group = [seqs[i] for i in wave if done[i] < len(prompts[i])]
            parts = [prompts[s.seq_id][done[s.seq_id]:done[s.seq_id] + chunk] for s in group]
            counts = [len(p) for p in parts]
            width = max(counts)
            hidden = model.model(mx.array([p + [0] * (width - len(p)) for p in parts]),
                                 cache=batch.prefill_group_cache(group, counts))
            for i, (seq, n) in enumerate(zip(group, counts)):
                batch.advance([seq], n)
                done[seq.seq_id] += n
                pool.commit(seq.seq_id, prompts[seq.seq_id], done[seq.seq_id])
                if done[seq.seq_id] == len(prompts[seq.seq_id]):
                    logits = model.lm_head(hidden[i:i + 1, n - 1])  # the body ends normed
                    first[seq.seq_id] = int(mx.argmax(logits, axis=-1).item())
    shared = [bool(batch._rows[s.seq_id].shared) for s in seqs]
    for seq in seqs:
        batch.join(seq)
    out = [[first[s.seq_id]] for s in seqs]
    last = mx.array([first[s.seq_id] for s in seqs])
    decode_greedy(model, batch, seqs, last, out, steps - 1)
    return out, shared


def test_chunks_of_different_lengths_in_one_pass_give_mlx_lms_greedy_tokens(model):
    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(length)]
               for k, length in enumerate((5, 130, 47, 1, 300))]
    got, _ = grouped_greedy(model, prompts, chunk=64, steps=6)
    assert got == [mlx_lm_greedy(model, p, 6) for p in prompts]
    assert len(set(map(tuple, got))) > 1


def test_rows_from_a_shared_prefix_in_one_pass_give_mlx_lms_greedy_tokens(model):
    prefix = [(5 * i + 1) % 400 + 2 for i in range(48)]  # three full blocks
    first = prefix + [9, 8, 7]
    others = [prefix + [(3 * i + k) % 90 + 2 for i in range(10 + 20 * k)] for k in range(3)]
    # the first prompt is read before the others arrive: they start from its blocks
    got, shared = grouped_greedy(model, [first] + others, chunk=32, steps=5,
                                 waves=[[0], [1, 2, 3]])
    assert shared == [False, True, True, True]
    assert got == [mlx_lm_greedy(model, p, 5) for p in [first] + others]


class _Chunk:
    def __init__(self, name: str, n: int):
        self.name, self.start, self.end = name, 100, 100 + n


def _widths(groups) -> list[list[int]]:
    return [[c.end - c.start for c in g] for g in groups]


def test_passes_bound_the_padding_of_chunks_of_different_widths():
    from mlxr.runner.model_step import MAX_PADDING, width_groups

    # a chat burst: 14 histories' new turns and one longer chunk
    chunks = [_Chunk(f"t{i}", 103) for i in range(14)]
    chunks.insert(11, _Chunk("long", 231))
    assert _widths(width_groups(chunks)) == [[231], [103] * 14]
    assert _widths(width_groups([_Chunk("a", 512)] + [_Chunk(str(i), 40) for i in range(3)])) \
        == [[512], [40, 40, 40]]
    assert _widths(width_groups([_Chunk("a", 100), _Chunk("b", 128), _Chunk("c", 120)])) \
        == [[128, 120, 100]]
    # every chunk in exactly one pass, and no pass over the bound
    import random

    rng = random.Random(5)
    for _ in range(200):
        chunks = [_Chunk(str(i), rng.randint(1, 512)) for i in range(rng.randint(1, 16))]
        groups = width_groups(chunks)
        assert sorted(id(c) for g in groups for c in g) == sorted(id(c) for c in chunks)
        for g in groups:
            widths = [c.end - c.start for c in g]
            assert len(g) == 1 or max(widths) * len(g) <= MAX_PADDING * sum(widths)

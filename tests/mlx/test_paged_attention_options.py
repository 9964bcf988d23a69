"""scripts/bench_paged_attention.py: every way of attending over a block table (issue 19's
design measurement) gives the reference attention, on tiny shapes."""

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_paged_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_paged_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# Rows that end inside a block, on a block edge, shorter than one block, and one far longer.
LENGTHS = [1, 5, 8, 13, 40, 9]


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_decode_options_equal_the_reference(bench, block_size):
    shape = bench.Shape("tiny", heads=4, kv_heads=2, head_dim=8)
    # The benchmark rebuilds only the pool for each further block size.
    batch = bench.with_block_size(bench.make_batch(shape, LENGTHS, 8), block_size)
    want = bench.reference(batch, list(range(len(LENGTHS))))
    for name, option in bench.DECODE.items():
        out = option(batch)
        assert out.shape == want.shape, name
        assert mx.max(mx.abs(out - want)).item() <= bench.TOLERANCE, name


@pytest.mark.parametrize("context", [6, 16, 37])
def test_prefill_options_equal_the_reference(bench, context):
    shape = bench.Shape("tiny", heads=4, kv_heads=1, head_dim=8)
    batch = bench.make_batch(shape, [context], block_size=8, query_len=6, seed=context)
    want = bench.reference(batch, [0])
    for name, option in bench.PREFILL.items():
        out = option(batch)
        assert out.shape == want.shape, name
        assert mx.max(mx.abs(out - want)).item() <= bench.TOLERANCE, name


def test_the_reference_sees_each_rows_own_keys_only(bench):
    # A wrong mask (padding counted, or another row's blocks read) moves the output; the check
    # in the script would catch it only if the reference itself ignores what lies past a row.
    shape = bench.Shape("tiny", heads=2, kv_heads=2, head_dim=4)
    batch = bench.make_batch(shape, [3, 10], block_size=4)
    want = bench.reference(batch, [0, 1])
    batch.rows_k[0] = mx.concatenate(
        [batch.rows_k[0][:, :, :3], mx.full((1, 2, 1, 4), 50.0)], axis=2)
    assert mx.allclose(bench.reference(batch, [0, 1]), want)
    unmasked = mx.fast.scaled_dot_product_attention(
        batch.queries, batch.padded_k, batch.padded_v, scale=bench.scale(batch))
    assert mx.max(mx.abs(unmasked - want)).item() > bench.TOLERANCE


def test_buckets_keep_padding_under_half(bench):
    lengths = [8000] + [200] * 14 + [32]
    groups = bench.buckets(lengths, block_size=16)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    assert [0] in groups  # the long row is alone
    for group in groups:
        longest = max(lengths[r] for r in group)
        shortest = min(lengths[r] for r in group)
        assert longest <= 2 * shortest or longest - shortest <= 16

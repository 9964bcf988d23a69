"""Attention over block tables on the CPU (issue 19's design measurement): one layer's attention,
for a batch of decode rows (one query token each) and for a prefill chunk of one row, computed
from a block pool in several ways and from today's left-padded batch cache for reference.

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \
        PYTHONPATH=. .venv/bin/python scripts/bench_paged_attention.py

Options (decode):
  padded      gather each row's blocks (mx.take on the pool), right-padded to the longest row,
              one SDPA with a mask of per-row lengths
  per-row     each row gathers its own blocks and runs its own SDPA over its own length; stacked
  buckets     rows sorted by length and cut into groups whose longest row is at most twice the
              shortest's (and at least one block); one padded SDPA per group
  left-padded today's BatchKVCache: a contiguous (rows, heads, longest, dim) cache, left-padded,
              one SDPA with a mask (no gather: the cache already has this shape)
  contiguous  a contiguous cache per sequence (capacity doubling): per-row SDPA on a slice
Options (prefill chunk of one row, its last `--chunk` tokens against its whole context):
  gather      its blocks taken from the pool, one SDPA with a causal mask
  contiguous  a slice of its contiguous cache, one SDPA with a causal mask

Every option's output is checked against a plain float32 attention (softmax(q k^T / sqrt(d)) v,
row by row) within 1e-4 before it is timed. Prints medians in milliseconds per layer, and the
bytes each option materializes per call (gathered keys and values, masks).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

TOLERANCE = 1e-4


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


# supervisor/store/random_model.py presets "small" and "medium", and Qwen3-0.6B.
SHAPES = {
    "small": Shape("small", 4, 2, 48),
    "medium": Shape("medium", 8, 4, 64),
    "qwen3-0.6b": Shape("qwen3-0.6b", 16, 8, 128),
}


SCENARIOS = ("uniform128", "mixed", "skewed")


def scenario_lengths(name: str, rows: int, seed: int = 0) -> list[int]:
    if name == "uniform128":
        return [128] * rows
    if name == "mixed":
        rng = np.random.default_rng(seed)
        return [int(x) for x in np.exp(rng.uniform(math.log(32), math.log(4000), rows))]
    if name == "skewed":
        return [8000] + [200] * (rows - 1)
    raise ValueError(f"unknown scenario {name!r}")


@dataclass(slots=True)
class Batch:
    """The same keys and values held three ways: a block pool with a block table per row,
    one contiguous cache per row, and a left-padded batch cache."""

    shape: Shape
    block_size: int
    lengths: list[int]
    queries: mx.array  # (rows, heads, 1, dim)
    pool_k: mx.array  # (num_blocks, kv_heads, block_size, dim)
    pool_v: mx.array
    tables: list[list[int]]  # per row: its block ids, in order
    rows_k: list[mx.array]  # per row: (1, kv_heads, capacity, dim), capacity a power of two
    rows_v: list[mx.array]
    padded_k: mx.array  # (rows, kv_heads, longest, dim), left-padded
    padded_v: mx.array
    padded_mask: mx.array  # (rows, 1, 1, longest) bool


def make_batch(shape: Shape, lengths: list[int], block_size: int, query_len: int = 1,
               seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    kvh, d = shape.kv_heads, shape.head_dim
    keys = [rng.standard_normal((kvh, n, d), dtype=np.float32) for n in lengths]
    values = [rng.standard_normal((kvh, n, d), dtype=np.float32) for n in lengths]
    queries = rng.standard_normal((len(lengths), shape.heads, query_len, d), dtype=np.float32)
    pool_k, pool_v, tables = make_pool(keys, values, block_size, rng)
    rows_k, rows_v = [], []
    for k, v, n in zip(keys, values, lengths):
        capacity = 1 << max(0, (n - 1).bit_length())
        ck = np.zeros((1, kvh, capacity, d), np.float32)
        cv = np.zeros_like(ck)
        ck[0, :, :n], cv[0, :, :n] = k, v
        rows_k.append(mx.array(ck))
        rows_v.append(mx.array(cv))
    longest = max(lengths)
    padded_k = np.zeros((len(lengths), kvh, longest, d), np.float32)
    padded_v = np.zeros_like(padded_k)
    mask = np.zeros((len(lengths), 1, 1, longest), bool)
    for r, (k, v, n) in enumerate(zip(keys, values, lengths)):
        padded_k[r, :, longest - n:], padded_v[r, :, longest - n:] = k, v
        mask[r, ..., longest - n:] = True
    batch = Batch(shape, block_size, list(lengths), mx.array(queries), pool_k,
                  pool_v, tables, rows_k, rows_v, mx.array(padded_k),
                  mx.array(padded_v), mx.array(mask))
    mx.eval(batch.queries, batch.pool_k, batch.pool_v, batch.rows_k, batch.rows_v,
            batch.padded_k, batch.padded_v, batch.padded_mask)
    return batch


def make_pool(keys: list[np.ndarray], values: list[np.ndarray], block_size: int,
              rng: np.random.Generator) -> tuple[mx.array, mx.array, list[list[int]]]:
    """A fragmented pool (blocks in no particular order) holding each row's keys and values,
    and each row's block table."""
    kvh, d = keys[0].shape[0], keys[0].shape[2]
    lengths = [k.shape[1] for k in keys]
    num_blocks = sum(-(-n // block_size) for n in lengths)
    order = rng.permutation(num_blocks)
    pool_k = np.zeros((num_blocks, kvh, block_size, d), np.float32)
    pool_v = np.zeros_like(pool_k)
    tables, used = [], 0
    for k, v, n in zip(keys, values, lengths):
        table = [int(b) for b in order[used:used + -(-n // block_size)]]
        used += len(table)
        for i, b in enumerate(table):
            part = slice(i * block_size, min(n, (i + 1) * block_size))
            width = part.stop - part.start
            pool_k[b, :, :width] = k[:, part]
            pool_v[b, :, :width] = v[:, part]
        tables.append(table)
    return mx.array(pool_k), mx.array(pool_v), tables


def with_block_size(b: Batch, block_size: int, seed: int = 0) -> Batch:
    """The same batch with its pool rebuilt at another block size."""
    keys = [np.array(k[0, :, :n]) for k, n in zip(b.rows_k, b.lengths)]
    values = [np.array(v[0, :, :n]) for v, n in zip(b.rows_v, b.lengths)]
    pool_k, pool_v, tables = make_pool(keys, values, block_size, np.random.default_rng(seed))
    mx.eval(pool_k, pool_v)
    return dataclasses.replace(b, block_size=block_size, pool_k=pool_k, pool_v=pool_v,
                               tables=tables)


def scale(b: Batch) -> float:
    return 1.0 / math.sqrt(b.shape.head_dim)


def gather(b: Batch, rows: list[int], num_blocks: int) -> tuple[mx.array, mx.array]:
    """(len(rows), kv_heads, num_blocks * block_size, dim): each row's blocks in table order,
    padded with block 0 past its own (the mask hides those)."""
    table = mx.array([b.tables[r] + [0] * (num_blocks - len(b.tables[r])) for r in rows])
    out = []
    for pool in (b.pool_k, b.pool_v):
        g = mx.take(pool, table, axis=0)  # (rows, blocks, kv_heads, bs, dim)
        g = g.transpose(0, 2, 1, 3, 4).reshape(len(rows), b.shape.kv_heads, -1, b.shape.head_dim)
        out.append(g)
    return out[0], out[1]


def length_mask(lengths: list[int], width: int) -> mx.array:
    return (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]


def decode_padded(b: Batch) -> mx.array:
    rows = list(range(len(b.lengths)))
    k, v = gather(b, rows, max(len(t) for t in b.tables))
    return mx.fast.scaled_dot_product_attention(
        b.queries, k, v, scale=scale(b), mask=length_mask(b.lengths, k.shape[2]))


def decode_per_row(b: Batch) -> mx.array:
    outs = []
    for r, n in enumerate(b.lengths):
        k, v = gather(b, [r], len(b.tables[r]))
        outs.append(mx.fast.scaled_dot_product_attention(
            b.queries[r:r + 1], k[:, :, :n], v[:, :, :n], scale=scale(b)))
    return mx.concatenate(outs, axis=0)


def buckets(lengths: list[int], block_size: int) -> list[list[int]]:
    """Rows grouped so that a group's longest row is at most twice its shortest (or within
    one block): the padding each group carries stays under half its work."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    groups: list[list[int]] = []
    for r in order:
        if groups and (lengths[r] <= 2 * lengths[groups[-1][0]]
                       or lengths[r] - lengths[groups[-1][0]] <= block_size):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def decode_buckets(b: Batch) -> mx.array:
    outs, order = [], []
    for group in buckets(b.lengths, b.block_size):
        k, v = gather(b, group, max(len(b.tables[r]) for r in group))
        lengths = [b.lengths[r] for r in group]
        mask = None if len(set(lengths)) == 1 and lengths[0] == k.shape[2] \
            else length_mask(lengths, k.shape[2])
        q = b.queries[mx.array(group)]
        outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale(b), mask=mask))
        order += group
    out = mx.concatenate(outs, axis=0)
    return out[mx.array(np.argsort(order))]


def decode_left_padded(b: Batch) -> mx.array:
    return mx.fast.scaled_dot_product_attention(
        b.queries, b.padded_k, b.padded_v, scale=scale(b), mask=b.padded_mask)


def decode_contiguous(b: Batch) -> mx.array:
    outs = []
    for r, n in enumerate(b.lengths):
        outs.append(mx.fast.scaled_dot_product_attention(
            b.queries[r:r + 1], b.rows_k[r][:, :, :n], b.rows_v[r][:, :, :n], scale=scale(b)))
    return mx.concatenate(outs, axis=0)


def prefill_gather(b: Batch) -> mx.array:
    """Row 0's last `query_len` tokens against its whole context, from the pool."""
    n = b.lengths[0]
    k, v = gather(b, [0], len(b.tables[0]))
    return mx.fast.scaled_dot_product_attention(
        b.queries[:1], k[:, :, :n], v[:, :, :n], scale=scale(b), mask="causal")


def prefill_contiguous(b: Batch) -> mx.array:
    n = b.lengths[0]
    return mx.fast.scaled_dot_product_attention(
        b.queries[:1], b.rows_k[0][:, :, :n], b.rows_v[0][:, :, :n], scale=scale(b),
        mask="causal")


DECODE: dict[str, Callable[[Batch], mx.array]] = {
    "left-padded": decode_left_padded,
    "contiguous": decode_contiguous,
    "padded": decode_padded,
    "per-row": decode_per_row,
    "buckets": decode_buckets,
}
PREFILL: dict[str, Callable[[Batch], mx.array]] = {
    "contiguous": prefill_contiguous,
    "gather": prefill_gather,
}
# Options that read the pool, and so depend on the block size.
PAGED = {"padded", "per-row", "buckets", "gather"}


def reference(b: Batch, rows: list[int]) -> mx.array:
    """Plain attention, row by row, from the contiguous per-row caches; the last query token
    sits at the row's last position (causal within the queries)."""
    outs = []
    group = b.shape.heads // b.shape.kv_heads
    for r in rows:
        n = b.lengths[r]
        k = mx.repeat(b.rows_k[r][:, :, :n], group, axis=1)
        v = mx.repeat(b.rows_v[r][:, :, :n], group, axis=1)
        q = b.queries[r:r + 1]
        scores = (q * scale(b)) @ k.swapaxes(-1, -2)  # (1, heads, query_len, n)
        query_len = q.shape[2]
        positions = mx.arange(n - query_len, n)[:, None]
        scores = mx.where(mx.arange(n)[None, :] <= positions, scores, -mx.inf)
        outs.append(mx.softmax(scores, axis=-1) @ v)
    return mx.concatenate(outs, axis=0)


def materialized_bytes(option: str, b: Batch, query_len: int) -> int:
    """Bytes an option builds per call beyond the cache it reads: gathered keys and values
    and the mask (the scores are the same for every option over the same padded width)."""
    kv = 2 * b.shape.kv_heads * b.shape.head_dim * 4  # keys and values, float32, per token
    blocks = [len(t) for t in b.tables]
    if option == "padded":
        width = max(blocks) * b.block_size
        return len(blocks) * width * (kv + 1)
    if option == "per-row":
        return sum(blocks) * b.block_size * kv
    if option == "buckets":
        return sum(len(g) * max(blocks[r] for r in g) * b.block_size * (kv + 1)
                   for g in buckets(b.lengths, b.block_size))
    if option == "gather":
        return blocks[0] * b.block_size * kv
    return 0


def cache_bytes(option: str, b: Batch) -> int:
    """Resident bytes of the cache the option reads, per layer."""
    kv = 2 * b.shape.kv_heads * b.shape.head_dim * 4
    if option in PAGED:
        return sum(len(t) for t in b.tables) * b.block_size * kv
    if option == "left-padded":
        return len(b.lengths) * max(b.lengths) * kv
    return sum(int(k.shape[2]) for k in b.rows_k) * kv


def timed_ms(fn: Callable[[], mx.array], want: mx.array, name: str, min_repeats: int,
             budget_s: float) -> float:
    """The first call is the warm-up and the correctness check; then the median of at least
    `min_repeats` calls (two when one call takes over a second), each with its mx.eval."""
    start = time.perf_counter()
    out = fn()
    mx.eval(out)
    check(name, out, want)
    del out
    if time.perf_counter() - start > 1.0:
        min_repeats, budget_s = min(min_repeats, 2), 0.0
    times: list[float] = []
    spent = 0.0
    while len(times) < min_repeats or (spent < budget_s and len(times) < 200):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times) * 1000


def check(option: str, out: mx.array, want: mx.array) -> float:
    error = mx.max(mx.abs(out - want)).item()
    if not error <= TOLERANCE:
        raise SystemExit(f"{option}: max error {error:.2e} against the reference attention")
    return error


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def measure(table: dict, first: Any, want: mx.array, query_len: int,
            block_sizes: list[int], options: list[str], args) -> dict[str, tuple]:
    """Time each option of `table` on `first` (re-blocked for each block size where the option
    reads the pool): key -> (ms or None when skipped, bytes materialized, cache bytes)."""
    results: dict[str, tuple[float | None, int, int]] = {}
    for bs in block_sizes:
        b = first if bs == block_sizes[0] else with_block_size(first, bs)
        for option in options:
            if option not in PAGED and bs != block_sizes[0]:
                continue
            key = option if option not in PAGED else f"{option} bs={bs}"
            made = materialized_bytes(option, b, query_len)
            if made > args.max_gather_mib * 2**20:
                results[key] = (None, made, cache_bytes(option, b))
                continue
            ms = timed_ms(lambda: table[option](b), want, key, args.repeats, args.budget)
            results[key] = (ms, made, cache_bytes(option, b))
    return results


def print_rows(kind: str, shape: Shape, case: str, results: dict, base_key: str) -> None:
    base = results.get(base_key, (None,))[0]
    for key, (ms, made, resident) in results.items():
        if ms is None:
            ms_text, rel = "skipped (over --max-gather-mib)", ""
        else:
            ms_text, rel = f"{ms:.3f}", (f"{ms / base:.2f}x" if base else "")
        print(f"| {kind} | {shape.name} | {case} | {key} | {ms_text} | {rel} | "
              f"{mib(made)} | {mib(resident)} |", flush=True)


def run_decode(shape: Shape, scenario: str, rows: int, block_sizes: list[int],
               options: list[str], args) -> None:
    first = make_batch(shape, scenario_lengths(scenario, rows), block_sizes[0])
    want = reference(first, list(range(rows)))
    mx.eval(want)
    results = measure(DECODE, first, want, 1, block_sizes, options, args)
    print_rows("decode", shape, scenario, results, "left-padded")


def run_prefill(shape: Shape, context: int, chunk: int, block_sizes: list[int],
                options: list[str], args) -> None:
    first = make_batch(shape, [context], block_sizes[0], query_len=chunk)
    want = reference(first, [0])
    mx.eval(want)
    results = measure(PREFILL, first, want, chunk, block_sizes, options, args)
    print_rows(f"prefill {chunk}", shape, f"ctx {context}", results, "contiguous")


def loaded_library() -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    return preload or "none (MLX's own BLAS)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="small,medium,qwen3-0.6b")
    parser.add_argument("--scenarios", default="uniform128,mixed,skewed")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--block-sizes", default="16,32,64,128,256")
    parser.add_argument("--decode-options", default=",".join(DECODE))
    parser.add_argument("--prefill-options", default=",".join(PREFILL))
    parser.add_argument("--prefill-contexts", default="256,2048,8000")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--max-gather-mib", type=float, default=256,
                        help="skip a cell that would materialize more than this per call")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="at least this many timed calls")
    parser.add_argument("--budget", type=float, default=0.2,
                        help="seconds of timed calls per cell, past --repeats")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    for flag, given, known in (("--shapes", args.shapes, SHAPES),
                               ("--scenarios", args.scenarios, SCENARIOS),
                               ("--decode-options", args.decode_options, DECODE),
                               ("--prefill-options", args.prefill_options, PREFILL)):
        unknown = [x for x in split(given) if x not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    try:
        block_sizes = [int(x) for x in split(args.block_sizes)]
        contexts = [int(x) for x in split(args.prefill_contexts)]
    except ValueError as e:
        parser.error(str(e))
    if not block_sizes or min(block_sizes + contexts + [args.rows, args.chunk]) < 1:
        parser.error("block sizes, contexts, --rows and --chunk must be positive")
    started = time.perf_counter()
    print(f"mlx {mx.__version__}; LD_PRELOAD: {loaded_library()}; load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| step | shape | context | option | ms per layer (median) | vs baseline | "
          "MiB materialized per call | MiB cache per layer |")
    print("|---|---|---|---|---|---|---|---|")
    for name in split(args.shapes):
        shape = SHAPES[name]
        if not args.no_decode:
            for scenario in split(args.scenarios):
                run_decode(shape, scenario, args.rows, block_sizes,
                           split(args.decode_options), args)
        if not args.no_prefill:
            for context in contexts:
                run_prefill(shape, max(context, args.chunk), args.chunk, block_sizes,
                            split(args.prefill_options), args)
    print(f"all options within {TOLERANCE:g} of the reference; "
          f"{time.perf_counter() - started:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

"""Token sampling for a batch where every request has its own parameters.

Greedy rows take argmax of the raw logits (`argmax_rows`). Sampled rows are cut to their
top-k candidates first; temperature, top-p and min-p then work on those few (Ollama's
order). Each request's random draws come from its own seeded host generator, one uniform per
step, so a seeded request gives the same tokens alone or inside any batch. Penalties and
logit bias touch only the requests that set them; log-probabilities are computed only for
requests that ask. A `Sampler` holds MLX arrays (its logit bias), so it is built and used on
the engine thread only (Engine._accept).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import mlx.core as mx
import numpy as np

from mlxr.shared.protocol import Options

# Rows with top_k above this (or top_k <= 0) sample from the whole vocabulary.
MAX_TOP_K = 1024

# A per-request hook on one row of logits, given the tokens so far (grammar masks use it).
# A hook may also have `prepare(tokens)`: host work the engine runs during the forward pass.
LogitsProcessor = Callable[[list[int], mx.array], mx.array]


@dataclass(slots=True)
class Sampler:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    bias_ids: mx.array | None
    bias_values: mx.array | None
    rng: np.random.Generator
    processors: list[LogitsProcessor]

    @classmethod
    def from_options(cls, options: Options, context_length: int) -> "Sampler":
        bias_ids = bias_values = None
        if options.logit_bias:
            bias_ids = mx.array(list(options.logit_bias.keys()), dtype=mx.int32)
            bias_values = mx.array(list(options.logit_bias.values()), dtype=mx.float32)
        last_n = options.repeat_last_n
        return cls(
            temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
            min_p=options.min_p, repeat_penalty=options.repeat_penalty,
            repeat_last_n=context_length if last_n < 0 else last_n,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            bias_ids=bias_ids, bias_values=bias_values,
            rng=np.random.default_rng(options.seed), processors=[])

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0
                                            or self.frequency_penalty != 0)

    @property
    def needs_processing(self) -> bool:
        return self.has_penalty or self.bias_ids is not None or bool(self.processors)

    def process(self, tokens: list[int], row: mx.array) -> mx.array:
        """Penalties over the last `repeat_last_n` tokens, logit bias, then the hooks."""
        if self.has_penalty and tokens:
            recent = tokens[-self.repeat_last_n:]
            ids, counts = np.unique(np.asarray(recent, dtype=np.int32), return_counts=True)
            ids_mx = mx.array(ids)
            vals = row[ids_mx]
            if self.repeat_penalty != 1.0:
                vals = mx.where(vals > 0, vals / self.repeat_penalty, vals * self.repeat_penalty)
            vals = vals - self.frequency_penalty * mx.array(counts.astype(np.float32)) \
                - self.presence_penalty
            row[ids_mx] = vals
        if self.bias_ids is not None:
            row[self.bias_ids] = row[self.bias_ids] + self.bias_values
        for hook in self.processors:
            row = hook(tokens, row)
        return row

    def prepare(self, tokens: list[int]) -> None:
        """Host-side work of the hooks that can run before the logits exist (grammar masks),
        so the engine overlaps it with the forward pass."""
        for hook in self.processors:
            prepare = getattr(hook, "prepare", None)
            if prepare is not None:
                prepare(tokens)


@dataclass(slots=True)
class SampleOutput:
    tokens: mx.array  # (B,) int32
    logprobs: mx.array | None  # (B,) chosen-token log-probabilities, rows that asked
    top_ids: mx.array | None  # (B, K) top alternatives
    top_logprobs: mx.array | None


def sample(logits: mx.array, samplers: Seq[Sampler], histories: Seq[list[int]],
           want_logprobs: Seq[int]) -> SampleOutput:
    """Sample one token per row of `logits` (B, V). `want_logprobs[i]` is -1 for no
    log-probabilities, else the number of top alternatives wanted."""
    logits = logits.astype(mx.float32)
    if any(s.needs_processing for s in samplers):
        logits = mx.stack([s.process(h, logits[i]) if s.needs_processing else logits[i]
                           for i, (s, h) in enumerate(zip(samplers, histories))])
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if not sampled:
        tokens = argmax_rows(logits)
    elif len(sampled) == len(samplers):
        tokens = _sample_rows(logits, list(samplers))
    else:
        tokens = argmax_rows(logits)
        rows = mx.array(sampled, dtype=mx.int32)
        tokens[rows] = _sample_rows(logits[rows], [samplers[i] for i in sampled])
    out = SampleOutput(tokens, None, None, None)
    if any(n >= 0 for n in want_logprobs):
        _add_logprobs(out, logits, want_logprobs)
    return out


@functools.cache  # a vocabulary size's answer never changes; every step asks
def _grid_rows(vocab: int) -> int | None:
    """A row count R in [32, 512] dividing `vocab`, nearest 128, for viewing each logit row as
    an (R, vocab / R) grid; None for small vocabularies or when no such divisor exists.

    Why a grid: on a CPU, MLX reduces along a strided axis with vector instructions but along
    the contiguous last axis one element at a time. Over 16 x 151,680 logits, the maximum of
    each grid column (a strided reduction over R rows) takes 0.6 ms; `argmax` or a maximum per
    contiguous block takes 3.5-4 ms (docs/PERFORMANCE.md)."""
    if vocab < 8192:
        return None
    return min((r for r in range(32, 513) if vocab % r == 0), key=lambda r: abs(r - 128),
               default=None)


def _grid(logits: mx.array) -> tuple[mx.array, int]:
    """`logits` (B, V) as a (B, R, C) grid (padded with -inf when V has no divisor to use)."""
    rows, vocab = logits.shape
    grid_rows = _grid_rows(vocab)
    if grid_rows is None:
        grid_rows = 128
        pad = mx.full((rows, -vocab % grid_rows), -math.inf, dtype=logits.dtype)
        logits = mx.concatenate([logits, pad], axis=1)
    return logits.reshape(rows, grid_rows, -1), grid_rows


def _column_ids(best: mx.array, grid_rows: int, cols: int) -> mx.array:
    """Flat ids (B, R * k) of every entry in the grid columns `best` (B, k)."""
    return (mx.arange(grid_rows, dtype=mx.int32)[None, :, None] * cols
            + best[:, None, :].astype(mx.int32)).reshape(best.shape[0], -1)


def argmax_rows(logits: mx.array, ties: int = 4) -> mx.array:
    """`mx.argmax(logits, axis=-1)` as int32: the same tokens, faster on a CPU.

    Each grid column's maximum is taken (a strided reduction); the `ties` columns with the
    largest maxima are searched in full, and the smallest id holding the row's maximum wins,
    which is argmax's first-occurrence rule. It can differ from argmax only if more than `ties`
    columns hold the row's maximum value exactly."""
    rows, vocab = logits.shape
    if _grid_rows(vocab) is None:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    grid, grid_rows = _grid(logits)
    best = mx.argpartition(-grid.max(axis=1), kth=ties - 1, axis=-1)[:, :ties]
    ids = _column_ids(best, grid_rows, grid.shape[-1])
    values = mx.take_along_axis(logits, ids, axis=-1)
    top = values.max(axis=-1, keepdims=True)
    return mx.where(values == top, ids, vocab).min(axis=-1).astype(mx.int32)


def top_k_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest logits of each row and their ids (unordered), exactly.

    A partition over the whole vocabulary is slow on a CPU (26 ms for 16 x 151,680). Instead,
    view each row as a grid (`_grid`), take each column's maximum, keep the k columns with the
    largest maxima, and partition only their k x R entries. Exact: an entry in the top k lies
    in a column whose maximum is at least that entry, and at most k - 1 other columns can have
    a larger maximum."""
    rows, vocab = logits.shape
    if vocab < 8192 or k * 512 >= vocab:
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
        return mx.take_along_axis(logits, ids, axis=-1), ids.astype(mx.int32)
    grid, grid_rows = _grid(logits)
    best = mx.argpartition(-grid.max(axis=1), kth=k - 1, axis=-1)[:, :k]
    cand_ids = _column_ids(best, grid_rows, grid.shape[-1])
    cand = mx.take_along_axis(grid.reshape(rows, -1), cand_ids, axis=-1)
    pick = mx.argpartition(-cand, kth=k - 1, axis=-1)[:, :k]
    return mx.take_along_axis(cand, pick, axis=-1), mx.take_along_axis(cand_ids, pick, axis=-1)


def _sample_rows(logits: mx.array, samplers: list[Sampler]) -> mx.array:
    vocab = logits.shape[-1]
    ks = [s.top_k if 0 < s.top_k <= MAX_TOP_K else vocab for s in samplers]
    k_max = min(max(ks), vocab)
    if k_max < vocab:
        cand, cand_ids = top_k_candidates(logits, k_max)
    else:
        cand_ids = mx.broadcast_to(mx.arange(vocab, dtype=mx.int32), logits.shape)
        cand = logits
    order = mx.argsort(-cand, axis=-1)
    cand = mx.take_along_axis(cand, order, axis=-1)
    cand_ids = mx.take_along_axis(cand_ids, order, axis=-1)

    k_arr = mx.array(ks, dtype=mx.int32)[:, None]
    temp = mx.array([max(s.temperature, 1e-6) for s in samplers], dtype=mx.float32)[:, None]
    top_p = mx.array([s.top_p if 0 < s.top_p < 1 else 1.0 for s in samplers])[:, None]
    min_p = mx.array([max(s.min_p, 0.0) for s in samplers], dtype=mx.float32)[:, None]
    position = mx.arange(cand.shape[-1])[None]
    cand = mx.where(position < k_arr, cand, -math.inf)
    probs = mx.softmax(cand / temp, axis=-1)
    cum = mx.cumsum(probs, axis=-1)
    keep = ((cum - probs) < top_p) & (probs >= min_p * probs[:, :1])
    probs = mx.where(keep, probs, 0.0)
    cdf = mx.cumsum(probs, axis=-1)
    uniforms = mx.array([s.rng.random() for s in samplers], dtype=mx.float32)[:, None]
    choice = mx.sum(cdf < uniforms * cdf[:, -1:], axis=-1, keepdims=True)
    choice = mx.minimum(choice, cand.shape[-1] - 1)
    return mx.take_along_axis(cand_ids, choice, axis=-1)[:, 0].astype(mx.int32)


def _add_logprobs(out: SampleOutput, logits: mx.array, want: Seq[int]) -> None:
    """Log-probabilities of the chosen tokens and the top alternatives, for the rows that ask.
    Only the log-normalizer touches the whole vocabulary; the rest works on k values."""
    rows = [i for i, n in enumerate(want) if n >= 0]
    idx = mx.array(rows, dtype=mx.int32)
    sub = logits[idx] if len(rows) < logits.shape[0] else logits
    lse = mx.logsumexp(sub, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(sub, out.tokens[idx][:, None], axis=-1) - lse
    full = mx.zeros((logits.shape[0],), dtype=mx.float32)
    full[idx] = chosen[:, 0]
    out.logprobs = full
    k = max(want)
    if k > 0:
        top_vals, top = top_k_candidates(sub, k)
        order = mx.argsort(-top_vals, axis=-1)
        ids = mx.zeros((logits.shape[0], k), dtype=mx.int32)
        vals = mx.zeros((logits.shape[0], k), dtype=mx.float32)
        ids[idx] = mx.take_along_axis(top, order, axis=-1).astype(mx.int32)
        vals[idx] = mx.take_along_axis(top_vals, order, axis=-1) - lse
        out.top_ids, out.top_logprobs = ids, vals

"""Runs a StepPlan on the model: one decode pass for the running batch plus at most one
prefill chunk. All MLX work happens here, on the engine thread.

Invariants:
- The cache backend (`self.kv`: runner/kv/rows.py's RowBatch over the block pool, or
  runner/kv/padded.py's PaddedBatch where the rows do not fit the model) keeps `kv.rows`
  equal to the scheduler's `running` list: a sequence joins when its last prefill chunk ran
  and leaves when the plan releases it.
- Decode runs one step ahead when it can: after a pure decode step, the next step's forward
  pass is queued on the device (from the still-lazy sampled tokens) before the host reads this
  step's tokens, so host work overlaps device work. The step ahead has already written one
  position of every row: it is always either consumed (for the rows still running) or
  taken back (`kv.untake`), never recomputed on top.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxr.runner import host_swiglu, probe_verdicts
from mlxr.runner.architectures import logit_transform
from mlxr.runner.host_body import BATCH_MAX_ROWS as HOST_BATCH_MAX_ROWS
from mlxr.runner.host_body import MAX_ROWS as HOST_BODY_MAX_ROWS, HostBody
from mlxr.runner.host_prefill import GROUP_TOKENS as HOST_PREFILL_GROUP_TOKENS
from mlxr.runner.host_prefill import MAX_TOKENS as HOST_PREFILL_MAX_TOKENS, Chunk, HostPrefill
from mlxr.runner.host_head import HostHead
from mlxr.runner.kv import bucketed_attention
from mlxr.runner.kv import rows as kv_rows
from mlxr.runner.kv.padded import PaddedBatch
from mlxr.runner.kv.pool import KVPool
from mlxr.runner.kv.prefix_cache import PrefixCache
from mlxr.runner.logits_match import logits_match
from mlxr.runner.transposed_head import TransposedHead
from mlxr.runner.request import Sequence
from mlxr.runner.row_kernel import RowKernel
from mlxr.runner.sampling import SampleOutput, sample
from mlxr.runner.scheduler import StepPlan, StepResult

log = logging.getLogger("mlxr.runner")


@dataclass(slots=True)
class SplitModel:
    """The model as body (tokens -> hidden states) and head (hidden -> the output projection),
    so a prefill computes logits for its last position only. `post`, where set, turns the
    projection into the logits (runner/architectures.py). `None` body and head mean: call the
    whole model."""

    body: Any
    head: Any
    post: Any = None

    def logits(self, projected: mx.array) -> mx.array:
        return projected if self.post is None else self.post(projected)


def split_model(model) -> SplitModel:
    """Find body and head and check on a tiny input that body+head equals the whole model."""
    body = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if head is None and body is not None:
        embed = getattr(body, "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    if body is None or head is None:
        return SplitModel(None, None)
    split = SplitModel(body, head, logit_transform(model))

    def splits() -> bool:
        try:
            probe = mx.array([[1, 2, 3]])
            whole = model(probe, cache=make_prompt_cache(model))
            mx.eval(whole)  # alone: a distributed rank's passes hold collectives, in order
            parts = split.logits(head(body(probe, cache=make_prompt_cache(model))))
            mx.eval(parts)
            if logits_match(parts, whole):
                return True
            log.info("model does not split into body and head; using whole-model calls")
        except Exception as exc:  # any mismatch in signatures means the generic path
            log.info("model does not split into body and head (%s); using whole-model calls",
                     exc)
        return False

    return split if probe_verdicts.decide("split", splits) else SplitModel(None, None)


@dataclass(slots=True)
class _Ahead:
    rows: list[Sequence]
    out: SampleOutput


class ModelStep:
    def __init__(self, model, prefix_cache_bytes: int, detok_top, rows: bool = True,
                 vision=None, host_attention: bool = True, distributed: bool = False,
                 attention_buckets: bool = False, host_body: HostBody | None = None):
        """`rows`: use the block pool's rows where the model fits them (False: always the
        padded batch, for comparisons). `vision`: a vision model's image side
        (runner/vision/model.py), which gives image prompts their embeddings and positions.
        `host_attention`: the rows may attend with numpy's softmax on a CPU
        (runner/kv/host_attention.py), prefill chunks take numpy's SwiGLU
        (runner/host_swiglu.py), decode steps run their body in numpy (runner/host_body.py),
        and so do single prefill chunks (runner/host_prefill.py).
        `distributed`: one rank of a sharded model (no numpy body: its probe is a forward
        pass, whose collectives only the model step's own passes may hold).
        `attention_buckets`: on a CUDA GPU, prefill chunks attend in bucketed shapes
        (runner/kv/bucketed_attention.py). `host_body`: one `HostBody.find(model)` gave
        already (the loader's, probed), used where this step would find one without a row
        kernel too, rather than probed again."""
        self.model = model
        self.vision = vision
        self.split = split_model(model)
        # The head for more rows than the host head takes: MLX's, or a transposed copy of its
        # weight where that is faster on this CPU.
        self.device_head = self.split.head and (
            TransposedHead.find(model, self.split.head) or self.split.head)
        self.host_head = HostHead.find(model, self.split.head, rival=self.device_head) \
            if self.split.body else None
        self._detok_top = detok_top  # token id -> text, for top_logprobs
        self._prefix_cache_bytes = prefix_cache_bytes
        self._host_attention = host_attention
        if host_attention:
            host_swiglu.install(model)
        if attention_buckets and bucketed_attention.wanted():
            kv_rows.install(model, buckets=True)
        self.num_layers = len(make_prompt_cache(model))
        if rows:  # (the probe routes the attention too; a kept verdict does not probe)
            kv_rows.install(model)
        self.uses_rows = rows and probe_verdicts.decide(
            "rows", lambda: kv_rows.probe(model, self.num_layers))
        row_kernel = self.host_head and self.host_head.kernel
        if not isinstance(row_kernel, RowKernel):  # (a quantized head's kernel is not one)
            row_kernel = None
        self.host_body = (host_body if host_body is not None and row_kernel is None else
                          HostBody.find(model, kernel=row_kernel)) if (
            host_attention and self.uses_rows and vision is None and not distributed
            and self.split.body is not None) else None
        self.host_prefill = HostPrefill.find(model, self.host_body)
        self.kv = None
        self._ahead: _Ahead | None = None
        # One of a distributed runner's ranks (runner/distributed/lockstep.py): each forward
        # pass is evaluated alone, in plan order, and no decode step runs ahead, so every
        # rank's collectives come in the same order.
        self.lockstep = False

    def make_pool(self, num_blocks: int, block_size: int) -> KVPool:
        """The block pool the scheduler accounts with, and this step's cache over it."""
        pool = KVPool(num_blocks, block_size, share=self.uses_rows)
        if self.uses_rows:
            self.kv = kv_rows.RowBatch(self.num_layers, pool, self._host_attention)
        else:
            self.kv = PaddedBatch(self.model, PrefixCache(max_bytes=self._prefix_cache_bytes))
        return pool

    @property
    def rows(self) -> list[Sequence]:
        return self.kv.rows

    # -- cache bookkeeping -------------------------------------------------------------
    def admit(self, seq: Sequence, admission) -> int:
        """Give a newly admitted sequence its cache; returns the positions already computed
        (a prefix found in the cache)."""
        return self.kv.admit(seq, admission)

    def release(self, seqs: list[Sequence]) -> None:
        self.kv.release(seqs)
        if not self.kv.rows:
            self._ahead = None

    def reset(self) -> None:
        """Forget all state after a failed step (e.g. out of memory)."""
        self.kv.reset()
        self._ahead = None

    def kv_bytes(self) -> int:
        return self.kv.kv_bytes()

    def kv_live_bytes(self) -> int:
        return self.kv.live_bytes()

    # -- compute ------------------------------------------------------------------------
    def run(self, plan: StepPlan) -> StepResult:
        self.release(plan.release)
        result = StepResult()
        outputs: list[tuple[list[Sequence], SampleOutput]] = []
        if self.host_body is not None:  # no OpenBLAS threads while rows decode (host_ops.py)
            self.host_body.gemm.serial = bool(plan.decode)
        # The decode rows' hidden states, when their head waits for the prompts this step's
        # chunks end: one pass over the head's weights for all of them (`_shared_head`).
        pending = None
        if plan.decode:
            assert [s.seq_id for s in plan.decode] == [s.seq_id for s in self.rows], \
                "batch rows out of step with the scheduler"
            out = self._decode(defer_head=self._shares_head(plan))
            if isinstance(out, SampleOutput):
                outputs.append((self.rows, out))
                if not plan.prefills and not self.lockstep:
                    self._run_ahead(out)
            else:
                pending = out
            if plan.prefills and self.host_prefill is not None and not self.lockstep:
                # The decode pass computes on MLX's stream while this thread runs the chunks
                # in numpy (which lets go of the interpreter lock): a 16-token chunk at
                # position 7,000 added 8.6-12.1 ms to a 14-row step instead of 10.8-18.0.
                mx.async_eval(out.tokens if pending is None else pending)
        elif self._ahead is not None:
            self._drop_ahead()
        ends: list[tuple[Sequence, mx.array]] | None = [] if pending is not None else None
        with host_swiglu.active(self._host_attention):
            self._prefill(plan, outputs, ends)
        if pending is not None:
            self._shared_head(pending, ends, outputs)
        chunk_seqs = [c.seq for c in plan.prefills]
        mx.eval(self.kv.arrays(chunk_seqs) + [o.tokens for _, o in outputs])
        for seqs, out in outputs:
            self._collect(seqs, out, result)
        merged = [chunk.seq for chunk in plan.prefills if chunk.is_last]
        for seq in merged:
            self.kv.join(seq)
        if merged:  # in this step, so the next decode step is not held up by the copies
            mx.eval(self.kv.arrays(merged))
        return result

    def _shares_head(self, plan: StepPlan) -> bool:
        """Does a prompt end in this step beside decode rows, so that one head can serve
        both? Not on a distributed rank 0 (its passes are evaluated one by one, in the
        followers' order). An image prompt too: its own head call was a third of its last
        step beside 8 streams (docs/PERFORMANCE.md, session 23)."""
        return (any(c.is_last for c in plan.prefills) and not self.lockstep
                and self.split.body is not None)

    def _shared_head(self, hidden: mx.array, ends: list, outputs: list) -> None:
        """The decode rows' logits and those of the prompts ending beside them, through one
        head call. On a CPU the head of a 152k-token vocabulary is a read of all its weights
        per call (116 MB for the 30M model, about 8 ms here), so a prompt's last chunk added
        that read to its step; sharing it keeps the running streams' interval
        (docs/PERFORMANCE.md, "The prefill stall (session 13)")."""
        seqs = list(self.rows) + [seq for seq, _ in ends]
        if ends:
            hidden = mx.concatenate([hidden] + [h for _, h in ends])
        logits = self._head(hidden)
        self._prepare_hooks(logits, self.rows)
        outputs.append((seqs, self._sample(logits, seqs)))

    def _prefill(self, plan: StepPlan, outputs: list, ends: list | None) -> None:
        """Build (and, where it attends in numpy, compute) the plan's prefill chunks. With
        `ends` (a list), a prompt's last chunk leaves its final hidden state there for
        `_shared_head`, instead of taking its own head and sampling."""
        if len(plan.prefills) > 1 and self.host_body is not None and \
                self.host_body.quantized and self._host_prefill(plan.prefills, outputs, ends):
            return
        if not self._can_group(plan.prefills):
            for chunk in plan.prefills:
                self._prefill_one(chunk, outputs, ends)
            return
        for group in width_groups(plan.prefills):
            if len(group) > 1:
                self._prefill_group(group, outputs, ends)
            else:
                self._prefill_one(group[0], outputs, ends)

    def _prefill_one(self, chunk, outputs: list, ends: list | None) -> None:
        seq = chunk.seq
        if self._host_prefill([chunk], outputs, ends):
            return
        caches = self.kv.prefill_cache(seq)
        inputs = mx.array([seq.all_tokens[chunk.start:chunk.end]], dtype=mx.int32)
        extra, rope = {}, contextlib.nullcontext()
        if seq.vision is not None:
            extra, rope = self.vision.prefill_inputs(seq.vision, chunk.start, chunk.end)
        with rope:
            if chunk.is_last and ends is not None:  # (`_shares_head`)
                ends.append((seq, self.split.body(inputs, cache=caches, **extra)[:, -1, :]))
            elif chunk.is_last:
                logits = self._logits(inputs, caches, **extra)
                if self.lockstep:
                    mx.eval(logits)
                outputs.append(([seq], self._sample(logits, [seq])))
            elif self.split.body is not None:
                hidden = self.split.body(inputs, cache=caches, **extra)
                if self.lockstep:
                    mx.eval(hidden)
            else:
                self.model(inputs, cache=caches, **extra)
        self.kv.advance([seq], chunk.end - chunk.start)

    def _host_prefill(self, chunks: list, outputs: list, ends: list | None) -> bool:
        """Run text chunks' bodies in numpy, in one pass (runner/host_prefill.py) where that
        applies; False where it does not (the caller builds the MLX pass). Several chunks
        go together only for weights on the quantized kernel: each pass over many positions
        dequantizes every weight, and sixteen prompts arriving at once paid that sixteen
        times (MLX's own grouped pass serves float32 weights)."""
        counts = [c.end - c.start for c in chunks]
        if self.host_prefill is None or self.lockstep or max(counts) > HOST_PREFILL_MAX_TOKENS \
                or sum(counts) > HOST_PREFILL_GROUP_TOKENS or \
                any(c.seq.vision is not None for c in chunks):
            return False
        body = self.host_body
        layer = body.layers[0]
        parts = []
        for chunk, count in zip(chunks, counts):
            context = self.kv.host_chunk(chunk.seq, count, layer.kv_heads, body.head_dim)
            if context is None:
                return False
            parts.append(Chunk(chunk.seq.all_tokens[chunk.start:chunk.end], chunk.start,
                               *context))
        hidden = self.host_prefill.chunks(parts)
        for chunk, count in zip(chunks, counts):
            self.kv.advance([chunk.seq], count)
        done = [j for j, chunk in enumerate(chunks) if chunk.is_last]
        if ends is not None:
            ends.extend((chunks[j].seq, mx.array(hidden[j][None])) for j in done)
        elif done:  # one head call for every prompt these chunks end
            seqs = [chunks[j].seq for j in done]
            outputs.append((seqs, self._sample(self._head(mx.array(hidden[done])), seqs)))
        return True

    def _can_group(self, chunks: list) -> bool:
        """Several text chunks on the rows, outside a distributed group (whose followers
        replay chunk by chunk), with the model split into body and head. Not where the
        weights are on the quantized kernel: one chunk after another through the numpy body
        beats one pass through MLX's quantized CPU products."""
        return (len(chunks) > 1 and self.uses_rows and not self.lockstep
                and self.split.body is not None
                and not (self.host_body is not None and self.host_body.quantized)
                and all(c.seq.vision is None for c in chunks))

    def _prefill_group(self, chunks: list, outputs: list, ends: list | None) -> None:
        """Several sequences' prefill chunks in one forward pass through the body (one set of
        matmuls over all their positions, each row attending over its own context), then
        the head for the rows whose prompt this chunk ends. Measured: docs/PERFORMANCE.md
        "Prefill chunks in one pass"."""
        counts = [c.end - c.start for c in chunks]
        width = max(counts)
        tokens = [c.seq.all_tokens[c.start:c.end] + [0] * (width - n)
                  for c, n in zip(chunks, counts)]
        seqs = [c.seq for c in chunks]
        hidden = self.split.body(mx.array(tokens, dtype=mx.int32),
                                 cache=self.kv.prefill_group_cache(seqs, counts))
        last = [i for i, c in enumerate(chunks) if c.is_last]
        if last:
            flat = hidden.reshape(len(chunks) * width, hidden.shape[-1])
            rows = flat[mx.array([i * width + counts[i] - 1 for i in last])]
            ended = [seqs[i] for i in last]
            if ends is not None:
                ends.extend((seq, rows[j:j + 1]) for j, seq in enumerate(ended))
            else:
                outputs.append((ended, self._sample(self._head(rows), ended)))
        for seq, n in zip(seqs, counts):
            self.kv.advance([seq], n)

    def follow(self, release: list, decode_tokens: list[int], prefills: list) -> None:
        """A follower rank's part of a step that rank 0 runs with `run`: the same forward
        passes through the model body (this rank's shard of it), in the same order, on the
        same cache layout; no head, no sampling. `prefills`: (sequence, start, end, is_last,
        token ids)."""
        self.release(release)
        if decode_tokens:
            inputs = mx.array([[t] for t in decode_tokens], dtype=mx.int32)
            mx.eval(self.split.body(inputs, cache=self.kv.decode_cache()))
            self.kv.advance(self.rows, 1)
        for seq, start, end, is_last, tokens in prefills:
            caches = self.kv.prefill_cache(seq)
            with host_swiglu.active(self._host_attention):
                mx.eval(self.split.body(mx.array([tokens], dtype=mx.int32), cache=caches))
            self.kv.advance([seq], end - start)
        mx.eval(self.kv.arrays([seq for seq, *_ in prefills]))
        for seq, _, _, is_last, _ in prefills:
            if is_last:
                self.kv.join(seq)

    def _decode(self, defer_head: bool = False) -> SampleOutput | mx.array:
        """This step's tokens for the batch rows: from the step run ahead, or computed now.
        `defer_head`: where the step is computed now (in MLX or numpy), return its last
        hidden states (rows, D) instead, for `_shared_head`."""
        ahead = self._ahead
        if ahead is not None:
            index = {s.seq_id: i for i, s in enumerate(ahead.rows)}
            if all(s.seq_id in index for s in self.rows):
                self._ahead = None
                pick = [index[s.seq_id] for s in self.rows]
                return ahead.out if pick == list(range(len(ahead.rows))) else \
                    _select(ahead.out, pick)
            self._drop_ahead()
        logits = None
        hidden = self._host_hidden()
        if hidden is None:
            inputs = mx.array([[s.output_tokens[-1]] for s in self.rows], dtype=mx.int32)
            with self._decode_rope():
                if defer_head:
                    hidden = self.split.body(inputs, cache=self.kv.decode_cache())[:, -1, :]
                else:
                    logits = self._logits(inputs, self.kv.decode_cache())
        if defer_head:
            self.kv.advance(self.rows, 1)
            return hidden
        if logits is None:
            greedy = self._host_greedy(hidden)
            if greedy is not None:
                return greedy
            logits = self._head(hidden)
        if self.lockstep:
            mx.eval(logits)
        self.kv.advance(self.rows, 1)
        self._prepare_hooks(logits, self.rows)
        return self._sample(logits, self.rows)

    def _run_ahead(self, out: SampleOutput) -> None:
        """Queue the next decode step from this step's lazy tokens, when every row's sampling
        needs nothing from the host (penalties and grammars need the token first) and the
        head runs on the device (the host head needs the hidden states first)."""
        if any(s.sampler.needs_processing for s in self.rows) or \
                self._host_head_for(len(self.rows)) or self._host_body_for(len(self.rows)) or \
                not self.kv.can_run_ahead():
            return
        with self._decode_rope():
            logits = self._logits(out.tokens[:, None], self.kv.decode_cache())
        nxt = self._sample(logits, self.rows)
        self.kv.advance(self.rows, 1)
        mx.async_eval([a for a in (nxt.tokens, nxt.logprobs, nxt.top_ids, nxt.top_logprobs)
                       if a is not None])
        self._ahead = _Ahead(list(self.rows), nxt)

    def _host_hidden(self) -> mx.array | None:
        """This decode step's last hidden states with the body in numpy, where it applies
        (the rows' arrays have room; row by row for one or two, else batched); else None."""
        if not self._host_body_for(len(self.rows)):
            return None
        host_rows = self.kv.host_rows(self.rows, [s.output_tokens[-1] for s in self.rows])
        if host_rows is None:
            return None
        if len(host_rows) <= HOST_BODY_MAX_ROWS:
            return mx.array(self.host_body(host_rows))
        return mx.array(self.host_body.batch(host_rows))

    def _host_body_for(self, rows: int) -> bool:
        """Does a decode step of this many rows take the numpy body (runner/host_body.py)?
        Then no step is run ahead: the body needs the last tokens on the host."""
        body = self.host_body
        return body is not None and (rows <= HOST_BODY_MAX_ROWS or (
            rows <= HOST_BATCH_MAX_ROWS and body.rope_tables is not None))

    def _host_greedy(self, hidden: mx.array) -> SampleOutput | None:
        """The rows' tokens as numpy's argmax of the host head's logits, where that head
        serves them, the logits need no transform and every row is plain greedy (no
        penalties, bias, hooks or log-probabilities): the logits never become an MLX array
        (0.5 ms of an 11 ms token at one stream). numpy's argmax takes the first of tied
        maxima, as `argmax_rows` does. Else None."""
        if not self._host_head_for(hidden.shape[0]) or self.split.post is not None or \
                self.lockstep or any(not s.sampler.greedy or s.sampler.needs_processing
                                     or s.logprobs for s in self.rows):
            return None
        logits = self.host_head.host_logits(np.asarray(hidden.astype(mx.float32)))
        self.kv.advance(self.rows, 1)
        return SampleOutput(mx.array(logits.argmax(axis=-1).astype(np.int32)), None, None,
                            None)

    def _host_head_for(self, rows: int) -> bool:
        return self.host_head is not None and rows <= self.host_head.max_rows

    def _decode_rope(self):
        return contextlib.nullcontext() if self.vision is None else \
            self.vision.decode_rope(self.rows)

    def _logits(self, inputs: mx.array, cache: list[Any], **extra) -> mx.array:
        """Logits (B, V) for the last position of each row of `inputs` (B, L). `extra`: an
        image prompt's `input_embeddings`."""
        if self.split.body is None:
            return self.model(inputs, cache=cache, **extra)[:, -1, :]
        return self._head(self.split.body(inputs, cache=cache, **extra)[:, -1, :])

    def _head(self, hidden: mx.array) -> mx.array:
        """Logits (B, V) for hidden states (B, D)."""
        if self._host_head_for(hidden.shape[0]):
            return self.split.logits(self.host_head(hidden))
        return self.split.logits(self.device_head(hidden))

    def _drop_ahead(self) -> None:
        """Undo the position the step ahead appended to the batch cache."""
        self._ahead = None
        self.kv.untake()

    @staticmethod
    def _prepare_hooks(logits: mx.array, seqs: list[Sequence]) -> None:
        """Start the forward pass on the device, then do the hooks' host work (grammar masks
        for the token chosen last step) while it runs. Rows without hooks: nothing changes."""
        hooked = [s for s in seqs if s.sampler.processors]
        if not hooked:
            return
        mx.async_eval(logits)
        for seq in hooked:
            seq.sampler.prepare(seq.history)

    def _sample(self, logits: mx.array, seqs: list[Sequence]) -> SampleOutput:
        return sample(logits, [s.sampler for s in seqs],
                      [s.history if s.sampler.needs_processing else [] for s in seqs],
                      [s.top_logprobs if s.logprobs else -1 for s in seqs])

    def _collect(self, seqs: list[Sequence], out: SampleOutput, result: StepResult) -> None:
        tokens = out.tokens.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_vals = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for i, seq in enumerate(seqs):
            result.tokens[seq.seq_id] = tokens[i]
            if seq.logprobs and logprobs is not None:
                entry = {"id": tokens[i], "token": self._detok_top(tokens[i]),
                         "logprob": logprobs[i], "top_logprobs": []}
                if top_ids is not None and seq.top_logprobs:
                    entry["top_logprobs"] = [
                        {"id": t, "token": self._detok_top(t), "logprob": v}
                        for t, v in zip(top_ids[i][:seq.top_logprobs], top_vals[i])]
                result.logprobs[seq.seq_id] = entry


# A pass over several chunks pads them on the right to the widest: every matmul, norm and
# MLP runs over the padding too. Chunks go in one pass only while its padded positions are
# at most this many times their real ones (a burst of 103-token chunks of chat histories
# with one 231-token chunk among them took 540 ms as one pass over 15 x 231 positions).
MAX_PADDING = 1.25


def width_groups(chunks: list) -> list[list]:
    """The chunks in passes: widest first, each pass taking the next-widest chunks while its
    padded size stays within MAX_PADDING of its real tokens."""
    ordered = sorted(chunks, key=lambda c: c.end - c.start, reverse=True)
    groups: list[list] = []
    for chunk in ordered:
        n = chunk.end - chunk.start
        if groups:
            group = groups[-1]
            width = group[0].end - group[0].start
            real = sum(c.end - c.start for c in group) + n
            if width * (len(group) + 1) <= MAX_PADDING * real:
                group.append(chunk)
                continue
        groups.append([chunk])
    return groups


def _select(out: SampleOutput, rows: list[int]) -> SampleOutput:
    idx = mx.array(rows, dtype=mx.int32)
    pick = lambda a: None if a is None else a[idx]  # noqa: E731
    return SampleOutput(out.tokens[idx], pick(out.logprobs), pick(out.top_ids),
                        pick(out.top_logprobs))


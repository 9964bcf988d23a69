"""A prefill chunk's body in numpy (runner/host_prefill.py): which architectures take it,
mlx-lm's greedy tokens after prompts read in numpy chunks of any size (also after a shared
prefix, and with the products through OpenBLAS), the keys and values it writes equal to MLX's,
its RoPE tables equal to the rope's own rotation, and no numpy prefill where it must not run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr.runner.host_body import HostBody, _Rotations
from mlxr.runner.host_ops import RopeTables
from mlxr.runner.host_prefill import HostPrefill
from mlxr.runner.kv import rows
from mlxr.runner.kv.pool import KVPool
from mlxr.runner.model_step import ModelStep, split_model
from mlxr.runner.scheduler import Scheduler, SchedulerConfig
from mlxr.supervisor.store.random_model import ARCH_NAMES
from tests.mlx.test_heads import probed_blas
from tests.mlx.test_host_attention import _Seq, mlx_lm_greedy
from tests.mlx.test_host_body import TAKES_IT, arch_models, decode_greedy  # noqa: F401


def prefill_greedy(model, prompts: list[list[int]], steps: int, chunk: int,
                   host: HostPrefill | None):
    """Each prompt read in `chunk`-token chunks through the rows (in numpy with `host`, else
    MLX's pass), then all decoded together greedily with MLX. Returns the tokens, whether each
    row read shared blocks, and the batch."""
    pool = KVPool(num_blocks=4096, block_size=16)
    batch = rows.RowBatch(len(model.layers), pool)
    head = split_model(model).head
    seqs = [_Seq(i) for i in range(len(prompts))]
    for seq, tokens in zip(seqs, prompts):
        at = batch.admit(seq, pool.admit(seq.seq_id, tokens, len(tokens) + steps + 1))
        while at < len(tokens):
            end = min(at + chunk, len(tokens))
            if host is None:
                hidden = model.model(mx.array([tokens[at:end]]),
                                     cache=batch.prefill_cache(seq))[0, -1]
            else:
                layer = host.body.layers[0]
                context = batch.host_chunk(seq, end - at, layer.kv_heads, host.body.head_dim)
                assert context is not None
                hidden = mx.array(host(tokens[at:end], at, *context))
            batch.advance([seq], end - at)
            mx.eval(hidden, batch.arrays([seq]))
            pool.commit(seq.seq_id, tokens, end)
            at = end
        seq.last = int(mx.argmax(head(hidden[None])[0]).item())
        batch.join(seq)
    return decode_greedy(model, batch, seqs, steps), \
        [bool(batch._rows[s.seq_id].shared) for s in seqs], batch


def find(model, library: str | None = None) -> HostPrefill | None:
    return HostPrefill.find(model, HostBody.find(model, library))


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_the_architectures_it_fits_give_mlx_lms_greedy_tokens(arch, arch_models):
    model = arch_models(arch)
    host = find(model)
    assert (host is not None) == (arch in TAKES_IT)
    if host is None:
        return  # the decode body's probe found another shape
    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(n)] for k, n in enumerate((90, 37))]
    for chunk in (1, 16, 29, 512):  # token by token, chunks across blocks, whole prompts
        got, _, _ = prefill_greedy(model, prompts, 6, chunk, host)
        assert got == [mlx_lm_greedy(model, p, 6) for p in prompts], chunk


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
def test_the_products_through_openblas_give_the_same_tokens(arch_models, arch):
    model = arch_models(arch)
    library = probed_blas()
    assert library is not None
    host = find(model, library)
    assert host is not None and host._gemm._sgemm is not None
    prompts = [[(5 * i + 2) % 400 + 2 for i in range(n)] for n in (130, 61)]
    got, _, _ = prefill_greedy(model, prompts, 6, 48, host)
    assert got == [mlx_lm_greedy(model, p, 6) for p in prompts]


def test_a_chunk_after_a_shared_prefix_gives_mlx_lms_greedy_tokens(arch_models):
    model = arch_models("qwen3")
    prefix = [(5 * i + 1) % 400 + 2 for i in range(48)]  # three full blocks
    prompts = [prefix + [9, 8, 7], prefix + [4, 5, 6, 7, 8, 9, 10]]
    got, shared, _ = prefill_greedy(model, prompts, 6, 5, find(model, probed_blas()))
    assert shared == [False, True]
    assert got == [mlx_lm_greedy(model, p, 6) for p in prompts]


def test_it_writes_the_keys_and_values_mlx_writes(arch_models):
    model = arch_models("llama")
    prompts = [[(3 * i + 1) % 300 + 2 for i in range(n)] for n in (70, 33)]
    host = prefill_greedy(model, prompts, 3, 20, find(model, probed_blas()))
    device = prefill_greedy(model, prompts, 3, 20, None)
    assert host[0] == device[0]
    for a, b in zip(host[2].arrays(host[2].rows), device[2].arrays(device[2].rows)):
        assert a.shape == b.shape
        assert np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("rope", [nn.RoPE(48, base=10_000.0),
                                  nn.RoPE(48, traditional=True, base=10_000.0),
                                  nn.RoPE(32, base=1_000_000.0)],  # 16 coordinates not rotated
                         ids=["halves", "traditional", "partial"])
def test_the_rope_tables_rotate_as_the_rope_does(rope, request):
    rotations = _Rotations(rope, 48)
    tables = RopeTables(rotations)
    layout = request.node.callspec.id  # the first two read the partners by slices
    assert (tables._halves, tables._neighbours) == {"halves": (True, False),
                                                    "traditional": (False, True),
                                                    "partial": (False, False)}[layout]
    x = np.random.default_rng(0).standard_normal((40, 3, 48)).astype(np.float32)
    for start in (0, 37, 5_000):
        diag, off = tables.tables(start, 40)
        want = np.einsum("nhd,nde->nhe", x, rotations.make(start, 40))
        assert np.allclose(tables.apply(x, diag, off), want, atol=1e-5)


class _LengthRope(nn.Module):
    """A rope whose angles depend on the call's length (as a dynamic scaling would)."""

    def __call__(self, x, offset=0):
        length = offset + x.shape[-2]
        return mx.fast.rope(x, 48, traditional=False, base=10_000.0 * (1 + length / 1000),
                            scale=1.0, offset=offset)


def test_the_rope_tables_are_made_once_for_many_chunks_unless_the_rope_forbids(monkeypatch):
    calls = []
    for rope, kept in ((nn.RoPE(48, base=10_000.0), True), (_LengthRope(), False)):
        rotations = _Rotations(rope, 48)
        tables = RopeTables(rotations)
        made = tables._make
        monkeypatch.setattr(tables, "_make", lambda s, c: calls.append((s, c)) or made(s, c))
        x = np.random.default_rng(1).standard_normal((16, 3, 48)).astype(np.float32)
        calls.clear()
        for start in range(0, 3000, 16):
            diag, off = tables.tables(start, 16)
            want = np.einsum("nhd,nde->nhe", x, rotations.make(start, 16))
            assert np.allclose(tables.apply(x, diag, off), want, atol=1e-4)
        if kept:  # 1,024 positions, then 2,048, then 4,096: a check and a table each time
            assert [c for _, c in calls if c > 16] == [1024, 2048, 4096]
            assert len(calls) == 6
        else:  # one chunk's call each, after the first growth showed the difference
            assert len(calls) == 2 + 3000 // 16


def test_no_numpy_prefill_where_the_decode_body_does_not_apply(arch_models, monkeypatch):
    model = arch_models("qwen3")
    assert HostPrefill.find(model, None) is None
    host = find(model)
    # a model whose forward pass it does not reproduce: the probe refuses it
    monkeypatch.setattr(host.body.layers[1], "scale", host.body.layers[1].scale * 2)
    assert not host.matches(model)


@pytest.mark.parametrize("max_tokens", [1024, 40], ids=["every-chunk", "long-chunks-mlx"])
def test_the_model_step_reads_chunks_in_numpy_beside_decoding_rows(arch_models, monkeypatch,
                                                                    max_tokens):
    # two streams decode (their pass evaluated on MLX's stream meanwhile) while two longer
    # prompts are read in 64-token chunks; chunks over the limit take MLX's pass
    from mlxr.runner import model_step as model_step_module
    from tests.mlx.test_shared_head import sequence

    monkeypatch.setattr(model_step_module, "HOST_PREFILL_MAX_TOKENS", max_tokens)
    model = arch_models("qwen3")
    step = ModelStep(model, 0, lambda token: "")
    assert step.host_prefill is not None
    read: list[int] = []
    real = step.host_prefill.chunks
    monkeypatch.setattr(step.host_prefill, "chunks", lambda parts, *rest: read.extend(
        len(p.tokens) for p in parts) or real(parts, *rest))
    scheduler = Scheduler(SchedulerConfig(prefill_chunk=64, min_prefill_chunk=64),
                          step.make_pool(512, 16), admit=step.admit, eos_token_ids=set())
    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(length)]
               for k, length in enumerate((20, 33, 300, 150))]
    seqs = [sequence(i, p, 12) for i, p in enumerate(prompts)]
    scheduler.add(seqs[0])
    scheduler.add(seqs[1])
    for number in range(200):
        if number == 3:
            scheduler.add(seqs[2])
            scheduler.add(seqs[3])
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        scheduler.update(plan, step.run(plan))
    assert [s.output_tokens for s in seqs] == [mlx_lm_greedy(model, p, 12) for p in prompts]
    assert read and all(n <= max_tokens for n in read)
    assert (64 in read) == (max_tokens >= 64)

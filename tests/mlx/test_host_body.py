"""A decode step's body in numpy (runner/host_body.py): which architectures take it, mlx-lm's
greedy tokens for one and two rows (also rows reading a shared prefix, and a mixture of
experts quantized as a GGUF import is), the keys and values it writes into the rows' arrays
equal to MLX's, and no host body where it must not run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load

from mlxr.runner.architectures import fix_model
from mlxr.runner.host_body import HostBody, _Bound
from mlxr.runner.kv import rows
from mlxr.runner.kv.pool import KVPool
from mlxr.runner.quant_kernel import QuantizedWeight
from mlxr.runner.weights import widen_around_kernel
from mlxr.runner.model_step import split_model
from mlxr.supervisor.store.random_model import ARCH_NAMES, write_random_model
from tests.mlx.test_heads import probed_blas
from tests.mlx.test_host_attention import _Seq, mlx_lm_greedy

TAKES_IT = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    made = {}

    def make(arch: str):
        if arch not in made:
            model, _, config = load(str(write_random_model(
                tmp_path_factory.mktemp(arch), arch=arch)), return_config=True)
            fix_model(model, config)
            rows.install(model)
            made[arch] = model
        return made[arch]

    return make


def host_greedy(model, body: HostBody | None, prompts: list[list[int]], steps: int,
                waves: list[list[int]] | None = None):
    """Each prompt prefilled alone through the rows (MLX), then all decoded together greedily:
    with `body` in numpy, else with MLX. Returns the tokens, whether each row read shared
    blocks, and the batch."""
    pool = KVPool(num_blocks=4096, block_size=16)
    batch = rows.RowBatch(len(model.layers), pool)
    seqs = [_Seq(i) for i in range(len(prompts))]
    for seq, tokens in zip(seqs, prompts):
        cached = batch.admit(seq, pool.admit(seq.seq_id, tokens, len(tokens) + steps + 1))
        logits = model(mx.array([tokens[cached:]]), cache=batch.prefill_cache(seq))
        batch.advance([seq], len(tokens) - cached)
        pool.commit(seq.seq_id, tokens, len(tokens))
        mx.eval(batch.arrays([seq]))
        seq.last = int(mx.argmax(logits[0, -1]).item())
        batch.join(seq)
    return decode_greedy(model, batch, seqs, steps, body), \
        [bool(batch._rows[s.seq_id].shared) for s in seqs], batch


def decode_greedy(model, batch, seqs, steps: int, body=None) -> list[list[int]]:
    """Each sequence's last token (`seq.last`) and `steps - 1` more, decoded together
    greedily over `batch`: the body in numpy with `body`, else MLX's pass."""
    out = [[s.last] for s in seqs]
    head = split_model(model).head
    for _ in range(steps - 1):
        last = [s.last for s in seqs]
        if body is None:
            logits = model(mx.array([[t] for t in last]), cache=batch.decode_cache())[:, -1]
        else:
            host_rows = batch.host_rows(seqs, last)
            assert host_rows is not None
            logits = head(mx.array(body(host_rows)))
        batch.advance(seqs, 1)
        mx.eval(logits, batch.arrays(seqs))
        for seq, t, o in zip(seqs, mx.argmax(logits, axis=-1).tolist(), out):
            seq.last = t
            o.append(t)
    return out


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_the_architectures_it_fits_give_mlx_lms_greedy_tokens(arch, arch_models):
    model = arch_models(arch)
    body = HostBody.find(model)
    assert (body is not None) == (arch in TAKES_IT)
    if body is None:
        return  # the probe found another shape (norm offsets, scaled embeddings, gelu)
    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(n)] for k, n in enumerate((40, 75))]
    for batch in ([prompts[0]], prompts):  # the runner's one and two rows
        got, _, _ = host_greedy(model, body, batch, steps=8)
        assert got == [mlx_lm_greedy(model, p, 8) for p in batch]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; none (buffers returned)
def test_the_products_through_openblas_give_the_same_tokens(arch_models, arch):
    # the runner preloads OpenBLAS, and the body's products then go through it, as the head's,
    # each layer bound once (its own output buffers, which each product overwrites)
    model = arch_models(arch)
    library = probed_blas()
    assert library is not None
    body = HostBody.find(model, library)
    assert body is not None and body._project.sgemv is not None
    assert all(isinstance(layer.gate, _Bound) for layer in body.layers)
    prompts = [[(5 * i + 2) % 400 + 2 for i in range(n)] for n in (30, 61)]
    got, _, _ = host_greedy(model, body, prompts, steps=8)
    assert got == [mlx_lm_greedy(model, p, 8) for p in prompts]


def test_rows_reading_a_shared_prefix_give_mlx_lms_greedy_tokens(arch_models):
    model = arch_models("qwen3")
    prefix = [(5 * i + 1) % 400 + 2 for i in range(48)]  # three full blocks
    prompts = [prefix + [9, 8, 7], prefix + [4, 5]]
    got, shared, _ = host_greedy(model, HostBody.find(model), prompts, steps=6)
    assert shared == [False, True]
    assert got == [mlx_lm_greedy(model, p, 6) for p in prompts]


def test_it_writes_the_keys_and_values_mlx_writes(arch_models):
    # a step after the host ones may run on MLX (a third row joins) and read what it wrote
    model = arch_models("llama")
    prompts = [[(3 * i + 1) % 300 + 2 for i in range(n)] for n in (20, 33)]
    host = host_greedy(model, HostBody.find(model), prompts, steps=5)
    device = host_greedy(model, None, prompts, steps=5)
    assert host[0] == device[0]
    for a, b in zip(host[2].arrays(host[2].rows), device[2].arrays(device[2].rows)):
        assert a.shape == b.shape
        assert np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_no_host_body_for_16_bit_weights_or_quantized_ones_the_kernel_does_not_take(tmp_path):
    # (4- and 8-bit layers with float32 scales it takes: tests/mlx/test_quant_kernel.py)
    path = write_random_model(tmp_path / "bf", preset="tiny", dtype="bfloat16")
    model, _ = load(str(path))
    assert HostBody.find(model) is None
    nn.quantize(model, group_size=32, bits=8)  # bfloat16 scales
    assert HostBody.find(model) is None
    model, _ = load(str(write_random_model(tmp_path / "q", preset="tiny")))
    nn.quantize(model, group_size=32, bits=6)
    assert HostBody.find(model) is None


@pytest.mark.parametrize("bits", [4, 5])
def test_a_quantized_mixture_reads_its_chosen_experts_on_the_kernel(tmp_path, bits):
    # in groups of 32 with float32 scales, as a GGUF Q4_K (4 bits) or Q5_K (5 bits, held in 8
    # for the kernel: runner/repack.py) import holds its experts; mlx-lm's reference reads
    # them through MLX's own gather_qmm
    model, _, config = load(str(write_random_model(tmp_path / "moe", arch="qwen3_moe")),
                            return_config=True)
    nn.quantize(model, group_size=32, bits=bits)
    # 5 bits: every layer repacked, each of 2 layers' 4 attention products, router and 3
    # stacked experts, and the embedding and head
    assert widen_around_kernel(model) == (0 if bits == 4 else 2 * (4 + 1 + 3) + 2)
    fix_model(model, config)
    rows.install(model)
    body = HostBody.find(model)
    assert body is not None
    experts = body.layers[0].experts
    assert len(experts.gate) == 8 and experts.top_k == 2
    assert all(isinstance(w, QuantizedWeight) and w.shape == (256, 256) and
               w.bits == (4 if bits == 4 else 8)
               for w, _ in experts.gate + experts.up + experts.down)
    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(n)] for k, n in enumerate((40, 75, 9))]
    for batch in ([prompts[0]], prompts[:2]):  # one row, two rows (row by row)
        got, _, _ = host_greedy(model, body, batch, steps=8)
        assert got == [mlx_lm_greedy(model, p, 8) for p in batch]
    assert len(experts._on_kernel.kept[0]) == 8  # every expert compacted at load
    batched = _Batched(body)  # three rows: each expert's rows through the kernel at once
    got, _, _ = host_greedy(model, batched, prompts, steps=6)
    assert batched.calls == 5 and got == [mlx_lm_greedy(model, p, 6) for p in prompts]


def test_no_host_body_off_the_cpu(arch_models, monkeypatch):
    model = arch_models("qwen3")
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert HostBody.find(model) is None


def test_a_row_whose_run_has_no_block_for_its_next_position_is_left_to_mlx(arch_models):
    model = arch_models("qwen3")
    pool = KVPool(num_blocks=64, block_size=16)
    batch = rows.RowBatch(len(model.layers), pool)
    seq = _Seq(0)
    tokens = list(range(2, 18))  # exactly one block, reserved for itself only
    batch.admit(seq, pool.admit(0, tokens, len(tokens)))
    model(mx.array([tokens]), cache=batch.prefill_cache(seq))
    batch.advance([seq], len(tokens))
    mx.eval(batch.arrays([seq]))
    batch.join(seq)
    assert batch.host_rows([seq], [5]) is None


def test_a_row_whose_run_has_a_block_past_its_arrays_grows_them_on_the_host(arch_models):
    # The scheduler reserves blocks as a row grows; the arrays follow in the decode step.
    # Before, that step took MLX's path for every row, 2.5x as long as the host's.
    model = arch_models("qwen3")
    pool = KVPool(num_blocks=64, block_size=16)
    batch = rows.RowBatch(len(model.layers), pool)
    seq = _Seq(0)
    tokens = list(range(2, 18))  # exactly one block
    batch.admit(seq, pool.admit(0, tokens, len(tokens)))
    logits = model(mx.array([tokens]), cache=batch.prefill_cache(seq))
    batch.advance([seq], len(tokens))
    pool.commit(0, tokens, len(tokens))
    mx.eval(batch.arrays([seq]))
    batch.join(seq)
    seq.last = int(mx.argmax(logits[0, -1]).item())
    run = batch._rows[0].run
    assert batch.store.arrays[run.run_id].keys[0].shape[2] == 16
    assert pool.reserve(0, len(tokens) + 20)
    got = decode_greedy(model, batch, [seq], 20, HostBody.find(model))
    assert got == [mlx_lm_greedy(model, tokens, 20)]
    assert all(a.shape[2] == run.capacity * 16 for a in batch.store.arrays[run.run_id].keys)


class _Batched:
    """A body that takes every step's rows at once (`HostBody.batch`)."""

    def __init__(self, body: HostBody):
        self.body = body
        self.calls = 0

    def __call__(self, host_rows):
        self.calls += 1
        return self.body.batch(host_rows)


@pytest.mark.parametrize("arch", sorted(TAKES_IT))
def test_many_rows_at_once_give_mlx_lms_greedy_tokens(arch, arch_models):
    model = arch_models(arch)
    body = HostBody.find(model, probed_blas())
    assert body is not None and body.rope_tables is not None
    prompts = [[(7 * i + 3 * k) % 500 + 2 for i in range(n)]
               for k, n in enumerate((40, 75, 9, 600, 17))]  # 600: products through `gemm`
    batched = _Batched(body)
    got, _, _ = host_greedy(model, batched, prompts, steps=8)
    assert batched.calls == 7
    assert got == [mlx_lm_greedy(model, p, 8) for p in prompts]


def test_many_rows_at_once_equal_row_by_row_and_read_shared_prefixes(arch_models):
    model = arch_models("qwen3")
    body = HostBody.find(model)
    prefix = [(5 * i + 1) % 400 + 2 for i in range(48)]  # three full blocks
    prompts = [prefix + [9, 8, 7], prefix + [4, 5], [3] * 20, prefix + [1]]
    got, shared, batch = host_greedy(model, _Batched(body), prompts, steps=6)
    assert shared == [False, True, False, True]
    assert got == [mlx_lm_greedy(model, p, 6) for p in prompts]
    seqs = [s for s in batch.rows]
    tokens = [5, 6, 7, 8]
    at_once = body.batch(batch.host_rows(seqs, tokens))
    one_by_one = body(batch.host_rows(seqs, tokens))
    assert np.allclose(at_once, one_by_one, atol=1e-5)

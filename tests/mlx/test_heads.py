"""The CPU decode heads: BLAS matrix-vector products (runner/host_head.py) and the product
against a transposed copy of the weight (runner/transposed_head.py)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load

from mlxr.runner import host_head, transposed_head
from mlxr.runner.host_head import HostHead
from mlxr.runner.quant_kernel import QuantKernel
from mlxr.runner.transposed_head import TransposedHead
from mlxr.runner.model_step import ModelStep, split_model
from mlxr.runner.request import Sequence
from mlxr.runner.sampling import Sampler
from mlxr.runner.scheduler import Scheduler, SchedulerConfig
from mlxr.shared.blas import choose
from mlxr.shared.config import Settings
from mlxr.shared.protocol import Options
from tests.mlx.test_host_attention import mlx_lm_greedy


def probed_blas() -> str | None:
    settings = Settings.from_env()
    return choose(settings.blas, settings.cache_dir).path


def test_the_host_head_gives_the_model_head_logits_and_the_same_argmax(tiny_model):
    model, _ = load(str(tiny_model))
    split = split_model(model)
    # This suite runs on Linux CPU, where `make test` installs OpenBLAS; the test process does
    # not preload it, so the test names the library a runner would preload (probed first).
    library = probed_blas()
    assert library is not None
    head = HostHead.find(model, split.head, library)
    assert head is not None
    hidden = model.model(mx.array([[5, 17, 300, 41]]))[0]  # (4, D): four positions as rows
    for rows in (1, 2, 3):  # the runner uses 1-2; the products are right for any
        ours, theirs = head(hidden[:rows]), split.head(hidden[:rows])
        assert ours.shape == theirs.shape == (rows, head.vocab)
        assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-5).item()
        assert mx.argmax(ours, axis=-1).tolist() == mx.argmax(theirs, axis=-1).tolist()


def test_a_quantized_head_is_the_quantized_kernels_or_none(tiny_model):
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=8)  # float32 scales: the kernel takes it
    head = HostHead.find(model, split_model(model).head, probed_blas())
    assert isinstance(head.kernel, QuantKernel) and head.max_rows == host_head.KERNEL_MAX_ROWS
    hidden = mx.random.normal((3, head.hidden), key=mx.random.key(5))
    assert mx.allclose(head(hidden), split_model(model).head(hidden), rtol=1e-4,
                       atol=1e-4).item()
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=6)  # a layout it does not take
    assert HostHead.find(model, split_model(model).head, probed_blas()) is None


def test_the_transposed_head_gives_the_model_head_logits(tiny_model):
    model, _ = load(str(tiny_model))
    split = split_model(model)
    head = TransposedHead(model.lm_head.weight)
    assert head.weight_t.shape == tuple(reversed(model.lm_head.weight.shape))
    hidden = model.model(mx.array([[5, 17, 300, 41, 7, 9]]))[0]
    ours, theirs = head(hidden), split.head(hidden)
    assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-5).item()
    assert mx.argmax(ours, axis=-1).tolist() == mx.argmax(theirs, axis=-1).tolist()


def test_the_transposed_head_is_kept_only_where_it_is_faster(tiny_model, monkeypatch):
    model, _ = load(str(tiny_model))
    split = split_model(model)
    timings = {}
    monkeypatch.setattr(transposed_head, "median_ms",
                        lambda head, probe: timings["ours" if isinstance(head, TransposedHead)
                                                    else "theirs"])
    timings.update(ours=8.0, theirs=10.0)
    assert isinstance(TransposedHead.find(model, split.head), TransposedHead)
    timings.update(ours=9.5, theirs=10.0)  # under the 10% it must win by
    assert TransposedHead.find(model, split.head) is None
    nn.quantize(model, group_size=32, bits=8)
    timings.update(ours=1.0, theirs=10.0)
    assert TransposedHead.find(model, split_model(model).head) is None


def decode_with_host_head(model, library, rows: list[tuple[Options, bool]], steps: int):
    """Decoding of a prompt per (options, log-probabilities wanted) through a ModelStep whose
    host head is the BLAS one; returns the sequences and how many steps took numpy's argmax
    of the host logits."""
    step = ModelStep(model, 0, lambda token: "")
    step.host_head = HostHead.find(model, step.split.head, library)
    assert step.host_head is not None
    scheduler = Scheduler(SchedulerConfig(), step.make_pool(256, 16), admit=step.admit,
                          eos_token_ids=set())
    on_host, host_bodies = [], []
    greedy, body = step._host_greedy, step._host_hidden
    step._host_greedy = lambda hidden: on_host.append(greedy(hidden)) or on_host[-1]
    step._host_hidden = lambda: host_bodies.append(body()) or host_bodies[-1]
    seqs = []
    for i, (opts, logprobs) in enumerate(rows):
        seq = Sequence(i, [(5 * k + 11 * i) % 400 + 2 for k in range(9 + 7 * i)], opts,
                       max_new_tokens=steps, context_length=4096)
        seq.sampler = Sampler.from_options(opts, seq.context_length)
        seq.logprobs = logprobs
        scheduler.add(seq)
        seqs.append(seq)
    while scheduler.has_work:
        plan = scheduler.schedule()
        scheduler.update(plan, step.run(plan))
    return (seqs, sum(h is not None for h in host_bodies),
            sum(out is not None for out in on_host))


def test_plain_greedy_rows_take_numpys_argmax_of_the_host_logits(tiny_model):
    model, _ = load(str(tiny_model))
    library = probed_blas()
    greedy = (Options(temperature=0.0), False)
    seqs, host_bodies, on_host = decode_with_host_head(model, library, [greedy, greedy],
                                                       steps=10)
    assert [s.output_tokens for s in seqs] == [mlx_lm_greedy(model, s.prompt_tokens, 10)
                                               for s in seqs]
    assert on_host == host_bodies > 0  # every step whose body ran in numpy


@pytest.mark.parametrize("other", [(Options(temperature=0.0, repeat_penalty=1.3), False),
                                   (Options(temperature=0.0), True),
                                   (Options(temperature=0.7, seed=3), False)],
                         ids=["penalty", "logprobs", "sampled"])
def test_a_row_that_is_not_plain_greedy_keeps_the_mlx_sampler(tiny_model, other):
    model, _ = load(str(tiny_model))
    seqs, host_bodies, on_host = decode_with_host_head(
        model, probed_blas(), [(Options(temperature=0.0), False), other], steps=6)
    assert host_bodies > 0 and on_host == 0
    assert seqs[0].output_tokens == mlx_lm_greedy(model, seqs[0].prompt_tokens, 6)
    assert len(seqs[1].output_tokens) == 6

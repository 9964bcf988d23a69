"""The CPU decode heads: BLAS matrix-vector products (runner/host_head.py) and the product
against a transposed copy of the weight (runner/transposed_head.py)."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load

from mlxr.runner import transposed_head
from mlxr.runner.host_head import HostHead
from mlxr.runner.transposed_head import TransposedHead
from mlxr.runner.model_step import split_model
from mlxr.shared.blas import choose
from mlxr.shared.config import Settings


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


def test_no_host_head_for_a_quantized_head(tiny_model):
    model, _ = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=8)
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
    monkeypatch.setattr(transposed_head, "_median_ms",
                        lambda head, probe: timings["ours" if isinstance(head, TransposedHead)
                                                    else "theirs"])
    timings.update(ours=8.0, theirs=10.0)
    assert isinstance(TransposedHead.find(model, split.head), TransposedHead)
    timings.update(ours=9.5, theirs=10.0)  # under the 10% it must win by
    assert TransposedHead.find(model, split.head) is None
    nn.quantize(model, group_size=32, bits=8)
    timings.update(ours=1.0, theirs=10.0)
    assert TransposedHead.find(model, split_model(model).head) is None

"""The decode head as BLAS matrix-vector products (runner/host_head.py)."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load

from runner.host_head import HostHead
from runner.model_step import split_model
from shared.blas import choose
from shared.config import Settings


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

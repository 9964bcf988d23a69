"""append_row: a finished prompt's cache joins the batch cache (runner/kv/batch_cache.py)."""

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.kv.batch_cache import append_row


def prompt_cache(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    return cache


def test_append_row_decodes_like_mlx_lm_merge_and_extend(tiny_model):
    model, _ = load(str(tiny_model))
    prompts = [list(range(5, 5 + n)) for n in (7, 12)]
    # A short row joins a longer batch, then a longer row joins: both paddings change.
    for joining in ([3, 9, 4], list(range(40, 70))):
        ours = [BatchKVCache.merge([a, b]) for a, b in
                zip(*(prompt_cache(model, p) for p in prompts))]
        stock = [BatchKVCache.merge([a, b]) for a, b in
                 zip(*(prompt_cache(model, p) for p in prompts))]
        for batch, new in zip(ours, prompt_cache(model, joining)):
            append_row(batch, new)
        for batch, new in zip(stock, prompt_cache(model, joining)):
            batch.extend(BatchKVCache.merge([new]))
        assert [c._idx for c in ours] == [c._idx for c in stock]
        assert ours[0].left_padding.tolist() == stock[0].left_padding.tolist()
        assert ours[0].offset.tolist() == stock[0].offset.tolist()
        assert ours[0].keys.shape[2] > ours[0]._idx, "room for the next token"
        inputs = mx.array([[11], [12], [13]])
        for _ in range(3):  # decode steps over both caches give the same logits
            a, b = model(inputs, cache=ours), model(inputs, cache=stock)
            assert mx.allclose(a, b, atol=1e-5).item()
            inputs = mx.argmax(a[:, -1, :], axis=-1)[:, None]

"""The /v1/embeddings wire type, the sub-batch plan and the request service
(runner.embeddings.embed) with a fake embedder and a fake engine call: no mlx."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

from mlxr.shared.errors import ContextOverflow, InvalidRequest
from mlxr.shared.protocol import MAX_EMBED_INPUTS, EmbedRequest, EmbedResponse
from mlxr.runner.embed.embeddings import embed, pad_batch, plan_batches


class FakeEmbedder:
    """Text -> one token per character (code point mod 50); a vector is a function of the
    token ids, so order mix-ups show."""

    dim, max_length, vocab_size = 4, 10, 50

    def __init__(self):
        self.batches: list[list[list[int]]] = []

    def encode(self, texts, truncate):
        out = []
        for text in texts:
            ids = [ord(c) % 50 for c in text]
            if len(ids) > self.max_length:
                if not truncate:
                    raise ContextOverflow("input length exceeds maximum context length")
                ids = ids[:self.max_length]
            out.append(ids)
        return out

    def forward(self, batch):
        self.batches.append(batch)
        rows = [[sum(ids), len(ids), ids[0], 1.0] for ids in batch]
        v = np.array(rows, dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def run(req: EmbedRequest, embedder: FakeEmbedder) -> EmbedResponse:
    def call(fn):
        future = concurrent.futures.Future()
        future.set_result(fn())
        return future

    return asyncio.run(embed(req, embedder, call))


def test_request_shapes_normalize_to_a_list():
    assert EmbedRequest.from_dict({"input": "hi"}).input == ["hi"]
    assert EmbedRequest.from_dict({"input": ["a", "b"]}).input == ["a", "b"]
    assert EmbedRequest.from_dict({"input": [[1, 2], [3]]}).input == [[1, 2], [3]]
    assert EmbedRequest.from_dict({"input": [1, 2, 3]}).input == [[1, 2, 3]]
    assert EmbedRequest.from_dict({"input": ""}).input == []
    req = EmbedRequest.from_dict({"input": "x", "truncate": False, "dimensions": 8})
    assert (req.truncate, req.dimensions) == (False, 8)
    assert EmbedRequest.from_dict(req.to_dict()) == req


@pytest.mark.parametrize("body", [
    [], {"input": 5}, {"input": [1.5]}, {"input": [["a"]]}, {"input": [True]},
    {"input": "x", "truncate": "no"}, {"input": "x", "dimensions": 0},
    {"input": "x", "dimensions": "8"}, {"input": ["x"] * (MAX_EMBED_INPUTS + 1)},
    {"input": "x" * ((1 << 22) + 1)},
])
def test_bad_requests_are_invalid(body):
    with pytest.raises(InvalidRequest):
        EmbedRequest.from_dict(body)


def test_plan_sorts_by_length_and_bounds_batch_tokens_and_padding():
    lengths = [6, 9, 5, 9, 8, 7]
    assert plan_batches(lengths, max_batch=2, max_tokens=100) == [[1, 3], [4, 5], [0, 2]]
    assert plan_batches(lengths, max_batch=8, max_tokens=30) == [[1, 3, 4], [5, 0, 2]]
    assert plan_batches([50, 40], max_batch=8, max_tokens=20) == [[0], [1]]  # alone when too long
    # No input shares a sub-batch with one over twice its length.
    assert plan_batches([256, 37, 18, 19, 3, 6]) == [[0], [1, 3], [2], [5, 4]]


def test_pad_batch_pads_right_and_masks():
    ids, mask = pad_batch([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_results_come_back_in_input_order_across_sub_batches():
    embedder = FakeEmbedder()
    texts = ["x" * (i % 7 + 1) + chr(65 + i % 26) for i in range(70)]
    resp = run(EmbedRequest(input=texts), embedder)
    alone = [run(EmbedRequest(input=[t]), FakeEmbedder()).embeddings[0] for t in texts]
    assert np.allclose(resp.embeddings, alone)
    assert len(embedder.batches) == 3 and all(len(b) <= 32 for b in embedder.batches)
    assert resp.prompt_eval_count == sum(len(t) for t in texts)
    assert resp.total_duration > 0


def test_token_arrays_are_used_as_given_and_checked():
    embedder = FakeEmbedder()
    resp = run(EmbedRequest(input=["ab", [ord("a") % 50, ord("b") % 50]]), embedder)
    assert np.allclose(resp.embeddings[0], resp.embeddings[1])
    with pytest.raises(InvalidRequest, match="out of range"):
        run(EmbedRequest(input=[[1, 50]]), embedder)
    with pytest.raises(InvalidRequest, match="no tokens"):
        run(EmbedRequest(input=[[]]), embedder)


def test_truncation_cuts_or_refuses():
    embedder = FakeEmbedder()
    long_text, long_ids = "y" * 25, [3] * 25
    resp = run(EmbedRequest(input=[long_text, long_ids]), embedder)
    assert resp.prompt_eval_count == 20
    for item in (long_text, long_ids):
        with pytest.raises(ContextOverflow, match="exceeds maximum context length"):
            run(EmbedRequest(input=[item], truncate=False), embedder)


def test_dimensions_truncate_and_renormalize_or_refuse():
    embedder = FakeEmbedder()
    full = np.array(run(EmbedRequest(input=["abc"]), embedder).embeddings[0])
    cut = np.array(run(EmbedRequest(input=["abc"], dimensions=2), embedder).embeddings[0])
    assert np.allclose(cut, full[:2] / np.linalg.norm(full[:2]))
    with pytest.raises(InvalidRequest, match="dimensions"):
        run(EmbedRequest(input=["abc"], dimensions=5), embedder)


def test_empty_input_gives_no_embeddings():
    resp = run(EmbedRequest(input=[]), FakeEmbedder())
    assert len(resp.embeddings) == 0 and resp.prompt_eval_count == 0

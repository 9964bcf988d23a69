"""EmbeddingGemma (runner/embed/bidirectional.py) on the `embeddinggemma` random preset: its
vectors against transformers' (tests/fixtures/embeddings/embeddinggemma_reference.json, made
with transformers and torch from the same preset), alone and in padded batches, and through
GGUF files in the layout llama.cpp and Ollama write."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxr.runner.embed import host_gemma
from mlxr.runner.embed.bidirectional import attention_masks, load_bidirectional_embedder
from mlxr.runner.embed.embeddings import embed
from mlxr.runner.kernel_layers import Host
from mlxr.shared.protocol import EmbedRequest
from mlxr.supervisor.store.gguf.convert import convert
from mlxr.supervisor.store.gguf.write import write_gguf

REFERENCE = (Path(__file__).resolve().parent.parent / "fixtures" / "embeddings"
             / "embeddinggemma_reference.json")


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def source(model_factory) -> Path:
    return model_factory("embeddinggemma")


@pytest.fixture(scope="module")
def embedder(source):
    return load_bidirectional_embedder(source, 4096, widen=True)


def test_vectors_match_transformers_alone_and_in_a_padded_batch(embedder, reference):
    ids, expected = reference["token_ids"], np.array(reference["embeddings"])
    # the inputs are 7, 76 and 152 tokens: past the sliding layers' 32 either side
    assert max(len(x) for x in ids) > 2 * embedder.half_window + 1
    together = embedder.forward(ids)
    np.testing.assert_allclose(together, expected, atol=1e-5)
    for tokens, row in zip(ids, expected):
        np.testing.assert_allclose(embedder.forward([tokens])[0], row, atol=1e-5)
    assert embedder.dim == 256 and len(embedder.dense) == 2


def test_the_numpy_pass_gives_the_mlx_pass_vectors(source, embedder, reference):
    """runner/embed/host_gemma.py (a CPU's path) against the MLX modules: the fixture's inputs
    packed together, and one long enough for several query blocks, each with its band of keys
    on the sliding layers."""
    host = load_bidirectional_embedder(source, 4096, widen=True, host=True)
    assert host.host is not None
    ids = reference["token_ids"]
    np.testing.assert_allclose(host.forward(ids), np.array(reference["embeddings"]), atol=1e-5)
    long = [[1] + [int(t) for t in np.random.default_rng(3).integers(3, 2040, 700)], ids[0]]
    assert len(long[0]) > host_gemma.QUERY_BLOCK * 2 + embedder.half_window
    np.testing.assert_allclose(host.forward(long), embedder.forward(long), atol=1e-5)


def test_every_token_sees_both_ways_and_the_sliding_window_is_symmetric(embedder, reference):
    """Changing the last token moves the vector of a prefix-equal input (a causal model's first
    positions would not see it), and the masks are what both runtimes use."""
    tokens = reference["token_ids"][1]
    other = tokens[:-2] + [tokens[-2] + 1, tokens[-1]]
    a, b = embedder.forward([tokens, other])
    assert np.abs(a - b).max() > 1e-3
    full, sliding = attention_masks(np.array([[1, 1, 1, 1, 0]]), half_window=1)
    assert full[0, 0].tolist() == [[True] * 4 + [False]] * 4 + [[True] * 5]
    assert sliding[0, 0].tolist() == [[True, True, False, False, False],
                                      [True, True, True, False, False],
                                      [False, True, True, True, False],
                                      [False, False, True, True, False],
                                      [False, False, False, True, True]]  # padding: itself


def test_embed_requests_truncate_and_serve_dimensions(embedder, reference):
    import asyncio
    import concurrent.futures

    def call(fn):
        future = concurrent.futures.Future()
        future.set_result(fn())
        return future

    ids = reference["token_ids"]
    req = EmbedRequest.from_dict({"model": "m", "input": ids[:2], "dimensions": 64})
    out = asyncio.run(embed(req, embedder, call))
    vectors = np.asarray(out.embeddings)
    assert vectors.shape == (2, 64)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    full = np.array(reference["embeddings"][:2])[:, :64]
    np.testing.assert_allclose(vectors, full / np.linalg.norm(full, axis=1, keepdims=True),
                               atol=1e-5)
    assert out.prompt_eval_count == len(ids[0]) + len(ids[1])


def test_a_gguf_in_llama_cpps_layout_gives_the_same_vectors(source, reference, tmp_path):
    ids, expected = reference["token_ids"], np.array(reference["embeddings"])
    f32 = convert(write_gguf(source, tmp_path / "f32.gguf", "F32"), tmp_path / "f32")
    assert f32["architectures"] == ["Gemma3TextModel"] and f32["use_bidirectional_attention"]
    assert sorted(p.name for p in (tmp_path / "f32" / "2_Dense").iterdir()) == [
        "config.json", "model.safetensors"]
    np.testing.assert_allclose(load_bidirectional_embedder(tmp_path / "f32", 4096, True)
                               .forward(ids), expected, atol=1e-5)
    convert(write_gguf(source, tmp_path / "q8.gguf", "Q8_0"), tmp_path / "q8")
    q8 = load_bidirectional_embedder(tmp_path / "q8", 4096, True).forward(ids)
    # the numpy pass keeps the 8-bit layers packed, on the quantized kernel
    packed = load_bidirectional_embedder(tmp_path / "q8", 4096, True, host=True)
    assert isinstance(packed.host.layers[0].out, Host)
    np.testing.assert_allclose(packed.forward(ids), q8, atol=1e-5)
    cosines = (q8 * expected).sum(axis=1)
    # 8-bit weights through 6 random layers: 0.999, 0.995, 0.988 (llama-server on llama.cpp's
    # own Q8_0 file of this model: 0.998 and 0.994 on the first two)
    assert cosines.min() > 0.98, cosines

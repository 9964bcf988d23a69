"""GGUF embedding models converted and run: the real all-MiniLM-L6-v2 written as a GGUF (the
layout llama.cpp's converter gives it) embeds as its safetensors directory does, and a random
Nomic BERT matches a numpy forward pass both from its Hugging Face directory and from GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxr.runner.embed.embeddings import is_encoder_dir, load_encoder_embedder
from mlxr.supervisor.store.gguf.convert import check_supported, convert
from mlxr.supervisor.store.gguf.write import write_gguf
from tests.harness.encoders import minilm_dir, nomic_reference, write_random_nomic

TEXTS = ["The sky is blue because of Rayleigh scattering.", "Café déjà vu, naïve résumé?",
         "search_query: what is a mixture of experts", "short",
         " ".join(f"word{i}" for i in range(120))]


def _import(source: Path, tmp_path: Path, file_type: str):
    gguf_path = write_gguf(source, tmp_path / f"model-{file_type}.gguf", file_type)
    dest = tmp_path / f"converted-{file_type}"
    convert(gguf_path, dest)
    return gguf_path, dest


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def minilm():
    return load_encoder_embedder(minilm_dir(), 8192)


@pytest.mark.parametrize("file_type, floor", [("F32", 0.999999), ("F16", 0.99999),
                                               ("Q8_0", 0.999)])
def test_minilm_from_gguf_embeds_as_its_safetensors(file_type, floor, minilm, tmp_path):
    gguf_path, dest = _import(minilm_dir(), tmp_path, file_type)
    summary = check_supported(gguf_path)
    assert summary.architecture == "bert" and summary.kv["bert.pooling_type"] == 1
    assert is_encoder_dir(dest)
    ours = load_encoder_embedder(dest, 8192)
    assert ours.max_length == 512 and ours.dim == 384
    texts = TEXTS[:4]  # (the safetensors directory cuts at 256 tokens, the GGUF at 512)
    ids = ours.encode(texts, True)
    assert ids == minilm.encode(texts, True)
    cosines = _cosines(ours.forward(ids), minilm.forward(ids))
    assert cosines.min() >= floor, cosines


def test_nomic_bert_matches_a_numpy_forward_pass_from_both_forms(tmp_path):
    source = write_random_nomic(tmp_path / "nomic", seed=3)
    hf = load_encoder_embedder(source, 8192)
    ids = hf.encode(TEXTS, True)
    assert [i[0] for i in ids] == [101] * len(TEXTS) and all(i[-1] == 102 for i in ids)
    vectors = hf.forward(ids)
    for row, tokens in zip(vectors, ids):
        np.testing.assert_allclose(row, nomic_reference(source, tokens), atol=2e-6)
    _, dest = _import(source, tmp_path, "F32")
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "nomic_bert" and config["n_positions"] == 2048
    converted = load_encoder_embedder(dest, 8192)
    assert converted.max_length == 2048
    assert converted.encode(TEXTS, True) == ids
    np.testing.assert_allclose(converted.forward(ids), vectors, atol=1e-6)


def test_a_padded_batch_gives_each_input_its_own_vector(tmp_path):
    source = write_random_nomic(tmp_path / "nomic", seed=4)
    model = load_encoder_embedder(source, 8192)
    ids = model.encode(TEXTS, True)
    batch = model.forward(ids)
    alone = np.concatenate([model.forward([i]) for i in ids])
    np.testing.assert_allclose(batch, alone, atol=2e-6)


@pytest.mark.parametrize("kind", ["bert", "nomic"])
@pytest.mark.parametrize("kernels", [True, False])
def test_the_numpy_forward_pass_gives_mlxs_vectors(kind, kernels, tmp_path, monkeypatch):
    """runner/embed/host_encoder.py (a CPU's path) against the MLX modules: a padded batch of
    mixed lengths (BLAS products, keys masked per row) and one short input (the row kernel),
    with the C element-wise steps and with numpy's."""
    from mlxr.runner.embed import host_encoder

    source = minilm_dir() if kind == "bert" else write_random_nomic(tmp_path / "n", seed=6)
    mlx_side = load_encoder_embedder(source, 8192)
    if not kernels:
        monkeypatch.setattr(host_encoder.RowOps, "load", classmethod(lambda cls: None))
        monkeypatch.setattr(host_encoder.RowKernel, "load", classmethod(lambda cls: None))
    numpy_side = load_encoder_embedder(source, 8192, host=True)
    assert (numpy_side.host.ops is not None) is kernels
    ids = mlx_side.encode(TEXTS[:4], True)  # (MLX's own CPU products are slow in tests)
    assert len(ids) * max(map(len, ids)) > host_encoder.ROW_KERNEL_ROWS >= len(ids[3])
    np.testing.assert_allclose(numpy_side.forward(ids), mlx_side.forward(ids), atol=1e-6)
    np.testing.assert_allclose(numpy_side.forward(ids[3:4]), mlx_side.forward(ids[3:4]),
                               atol=1e-6)


def test_erf_is_within_a_few_float32_roundings():
    import math

    from mlxr.runner.embed.host_encoder import erf

    x = np.linspace(-6, 6, 20001, dtype=np.float32)
    exact = np.array([math.erf(float(v)) for v in x])
    assert np.abs(erf(x) - exact).max() < 6e-7  # A&S's 1.5e-7, then float32 arithmetic


def test_the_c_element_wise_steps_match_their_definitions():
    import math

    from mlxr.runner.embed.host_encoder import RowOps, layer_norm, silu

    ops = RowOps.load()
    assert ops is not None, "the attention kernel's library did not build"
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 67)) * 3).astype(np.float32)  # (a tail past 8 lanes)
    bias = rng.standard_normal(67).astype(np.float32)
    v = (x + bias).astype(np.float64)
    exact = 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))
    np.testing.assert_allclose(ops.gelu(x.copy(), bias), exact, atol=2e-6)
    up = rng.standard_normal((37, 67)).astype(np.float32)
    np.testing.assert_allclose(ops.silu_times(x.copy(), up), silu(x) * up, rtol=1e-5, atol=1e-6)
    y = rng.standard_normal((37, 67)).astype(np.float32)
    w, b = rng.standard_normal(67).astype(np.float32), rng.standard_normal(67).astype(np.float32)
    np.testing.assert_allclose(ops.add_layer_norm(x.copy(), y, bias, (w, b), 1e-12),
                               layer_norm(x + y + bias, w, b, 1e-12), atol=3e-6)
    scores = x.copy()
    ops.softmax(scores, 50)  # the first 50 columns are keys, the rest padding
    expected = np.exp(x[:, :50] - x[:, :50].max(axis=1, keepdims=True))
    np.testing.assert_allclose(scores[:, :50], expected / expected.sum(axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-7)
    assert not scores[:, 50:].any()


def test_a_cls_pooled_gguf_gives_the_first_tokens_state(tmp_path):
    """mxbai-embed-large and snowflake-arctic-embed pool the [CLS] token (pooling type 2): a
    GGUF saying so embeds as the normalized first hidden state of the same weights."""
    import shutil

    import mlx.core as mx

    from mlxr.runner.embed.encoder import load_bert
    from mlxr.supervisor.store.gguf.header import read_gguf

    source = tmp_path / "cls"
    shutil.copytree(minilm_dir(), source)
    (source / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": True}))
    gguf_path, dest = _import(source, tmp_path, "F32")
    assert read_gguf(gguf_path, skip_arrays=True).kv["bert.pooling_type"] == 2
    model = load_encoder_embedder(dest, 8192, host=True)
    ids = model.encode(TEXTS[:3], True)
    bert = load_bert(minilm_dir())
    for row, tokens in zip(model.forward(ids), ids):
        first = np.array(bert(mx.array([tokens]), mx.ones((1, len(tokens))))[0, 0])
        np.testing.assert_allclose(row, first / np.linalg.norm(first), atol=1e-6)


@pytest.mark.parametrize("file_type, floor", [("F32", 0.9999999), ("F16", 0.9999)])
def test_xlm_roberta_from_its_directory_and_gguf_matches_a_numpy_forward_pass(
        file_type, floor, tmp_path):
    # bge-m3's layout: XLM-RoBERTa, a SentencePiece Unigram tokenizer, CLS pooling
    from tests.harness.encoders import bert_reference, write_random_xlmr, xlmr_ids

    source = write_random_xlmr(tmp_path / "xlmr")
    texts = ["Le café naïve 敏捷的狐狸  runs ①", "  leading and   inner  spaces ",
             "быстрая лиса 日本語のテキスト " * 20]
    want = [xlmr_ids(source, t) for t in texts]
    gguf_path, dest = _import(source, tmp_path, file_type)
    summary = check_supported(gguf_path)
    assert summary.kv["tokenizer.ggml.model"] == "t5" and summary.kv["bert.pooling_type"] == 2
    for model_dir, cosine_floor in ((source, 0.9999999), (dest, floor)):
        for host in (False, True):
            embedder = load_encoder_embedder(model_dir, 8192, host=host)
            assert embedder.max_length == 512
            ids = embedder.encode(texts, True)
            assert ids == want
            cosines = _cosines(embedder.forward(ids),
                               np.array([bert_reference(source, i) for i in ids]))
            assert cosines.min() >= cosine_floor, (model_dir.name, host, cosines)

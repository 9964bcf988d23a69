"""Anthropic's Messages API on a real `mlxr serve`, driven by the official `anthropic` client:
the real runner with a random tiny Qwen3 model, and (for thinking, which a random model does
not write) the fake runner with a forced output through the same supervisor parsing."""

from __future__ import annotations

import base64
import json

import anthropic
import jsonschema
import psutil
import pytest

from tests.harness.server import kill9, serving, start_server, write_fake_model

pytestmark = pytest.mark.timeout(180)

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
THOUGHT = "The user greets.\n"
# The client (2.x) has no sampling parameters any more; the API and this server still take them.
GREEDY = {"extra_body": {"temperature": 0, "top_k": 1}}
# A forced call is held to its schema once thinking ends; a random model may never end it.
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("anthropic"), subprocess_env,
                       {"tiny": tiny_model}, MLXR_KEEP_ALIVE="10m")


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def fake(tmp_path_factory, subprocess_env):
    """The fake runner's server, with an API key (which Anthropic's client sends as x-api-key):
    `thinker` writes a thinking section and an answer, `slow` words at 20 a second."""
    tmp = tmp_path_factory.mktemp("anthropic-fake")
    knobs = {"models": {"thinker:latest": {"output": f"<think>\n{THOUGHT}</think>\n\nHello!"},
                        "slow:latest": {"delay_s": 0.05}}}
    server = start_server(tmp, subprocess_env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                          FAKE_RUNNER=json.dumps(knobs), MLXR_API_KEY="sesame")
    try:
        admin = server.client(headers={"Authorization": "Bearer sesame"})
        for name in ("thinker", "slow"):
            admin.create(model=name, from_=str(write_fake_model(tmp / name)))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def thinker(fake) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.url, api_key="sesame", max_retries=0)


def test_create_text_with_system_blocks_runs_to_max_tokens(client):
    msg = client.messages.create(
        model="tiny", max_tokens=7, **GREEDY, messages=ASK,
        system=[{"type": "text", "text": "You answer briefly."},
                {"type": "text", "text": "You are polite.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "someone"})
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.id.startswith("msg_")
    [block] = msg.content
    assert block.type == "text" and block.text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 7
    # The system blocks were rendered: the same question alone is a shorter prompt.
    alone = client.messages.count_tokens(model="tiny", messages=ASK)
    assert msg.usage.input_tokens > alone.input_tokens + 5


def test_count_tokens_is_the_prompt_the_model_reads(client):
    counted = client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
    msg = client.messages.create(model="tiny", max_tokens=1, messages=ASK, system="Be brief.")
    assert counted.input_tokens == msg.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.",
                                              tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + 20


def test_stop_sequence_ends_the_reply_and_is_named(client):
    free = client.messages.create(model="tiny", max_tokens=12, **GREEDY, messages=ASK)
    text = free.content[0].text
    # A stop sequence the greedy reply is known to contain, a few characters in.
    stop = text[3:6]
    assert stop.strip() and len(text) > 6
    msg = client.messages.create(model="tiny", max_tokens=12, **GREEDY, messages=ASK,
                                 stop_sequences=["\x00never", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    kept = msg.content[0].text if msg.content else ""
    assert kept == text[:text.index(stop)]
    assert 1 <= msg.usage.output_tokens < 12
    assert msg.usage.input_tokens == free.usage.input_tokens


def test_stream_events_in_order_and_the_final_message(client, server):
    whole = client.messages.create(model="tiny", max_tokens=10, **GREEDY, messages=ASK)
    with client.messages.stream(model="tiny", max_tokens=10, **GREEDY,
                                messages=ASK) as stream:
        seen = [e for e in stream if e.type not in ("text",)]
        final = stream.get_final_message()
    events = [e.type for e in seen]
    # message_start counts the prompt already, as Anthropic's does.
    assert seen[0].message.usage.input_tokens == whole.usage.input_tokens > 0
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    body = events[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    assert final.content[0].type == "text" and final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert final.usage.input_tokens == whole.usage.input_tokens
    # The client drops pings; on the wire one follows message_start.
    with server.http() as http, http.stream("POST", "/v1/messages", json={
            "model": "tiny", "max_tokens": 2, "messages": ASK, "stream": True}) as resp:
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_forced_tool_call_then_a_tool_result_turn(client):
    msg = client.messages.create(model="tiny", max_tokens=200, **GREEDY, messages=ASK,
                                 tools=[WEATHER], thinking=NO_THINKING,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    [call] = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": call.id,
                          "content": [{"type": "text", "text": "sunny, 21 degrees"}]}]}]
    follow = client.messages.create(model="tiny", max_tokens=3, **GREEDY, tools=[WEATHER],
                                    messages=history)
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The call and its result were rendered into the prompt.
    assert follow.usage.input_tokens > msg.usage.input_tokens + 10


def test_forced_tool_call_streams_as_input_json(client):
    with client.messages.stream(model="tiny", max_tokens=200, **GREEDY, messages=ASK,
                                tools=[WEATHER], tool_choice={"type": "any"},
                                thinking=NO_THINKING) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    [call] = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_enabled_gives_a_thinking_block(thinker, stream):
    args = dict(model="thinker", max_tokens=200, messages=[{"role": "user", "content": "hi"}],
                thinking={"type": "enabled", "budget_tokens": 1024})
    if stream:
        with thinker.messages.stream(**args) as s:
            kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
            msg = s.get_final_message()
        assert "thinking_delta" in kinds and "text_delta" in kinds
    else:
        msg = thinker.messages.create(**args)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == THOUGHT and msg.content[1].text == "Hello!"
    assert msg.stop_reason == "end_turn"
    off = thinker.messages.create(**{**args, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]


def test_errors_are_typed(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", cast_to=object,
                    body={"model": "tiny", "messages": ASK})  # no max_tokens
    assert info.value.status_code == 400
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=5, messages=ASK)
    assert info.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": info.value.body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError, match="role"):
        client.messages.create(model="tiny", max_tokens=5,
                               messages=[{"role": "system", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ASK)
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    with pytest.raises(anthropic.BadRequestError, match="does not support images"):
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": png}}]}])
    # A streamed request that fails before streaming is an HTTP error too.
    with pytest.raises(anthropic.NotFoundError):
        with client.messages.stream(model="nope", max_tokens=5, messages=ASK) as s:
            list(s)


def test_api_key_as_x_api_key(fake):
    wrong = anthropic.Anthropic(base_url=fake.url, api_key="guess", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="thinker", max_tokens=5, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_an_error_mid_stream_is_an_error_event(fake, thinker):
    with pytest.raises(anthropic.APIStatusError, match="runner") as info:
        with thinker.messages.stream(model="slow", max_tokens=400, messages=ASK) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    [pid] = [p for p in fake.runner_pids()
                             if "slow:latest" in " ".join(psutil.Process(p).cmdline())]
                    kill9(pid)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "api_error"


OPENS_THINKING = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ if .Thinking }}<think>"
                  "{{ .Thinking }}</think>\n{{ end }}{{ .Content }}<|im_end|>\n{{ end }}"
                  "<|im_start|>assistant\n{{ if .Think }}<think>\n{{ end }}")


def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows(client, server):
    """The tiny model never ends its thinking; with a budget the runner writes `</think>`
    after that many tokens, and the model answers after it."""
    server.client().create(model="opener", from_="tiny", template=OPENS_THINKING)
    free = client.messages.create(model="opener", max_tokens=6, **GREEDY, messages=ASK,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in free.content] == ["thinking"]
    held = client.messages.create(model="opener", max_tokens=20, **GREEDY, messages=ASK,
                                  thinking={"type": "enabled", "budget_tokens": 6})
    thought, answer = held.content
    assert thought.type == "thinking" and answer.type == "text" and answer.text.strip()
    assert thought.thinking.strip() == free.content[0].thinking.strip()
    assert held.usage.output_tokens == 20


def test_a_thinking_budget_forces_nothing_into_an_answer_that_did_not_think(client):
    """The tiny model's template leaves the `<think>` to the model, and its first greedy
    token is another: it answered without thinking, so there is no thinking to end (the
    runner once wrote `</think>` into the answer at the budget)."""
    free = client.messages.create(model="tiny", max_tokens=20, **GREEDY, messages=ASK,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    held = client.messages.create(model="tiny", max_tokens=20, **GREEDY, messages=ASK,
                                  thinking={"type": "enabled", "budget_tokens": 6})
    assert [b.type for b in free.content] == ["text"]  # no thinking opened
    assert [b.type for b in held.content] == ["text"]
    assert held.content[0].text == free.content[0].text
    assert held.usage.output_tokens == free.usage.output_tokens == 20

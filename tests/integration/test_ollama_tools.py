"""Tool calls and thinking parsed out of model output, end to end through `mlxr serve` and the
`ollama` client. The fake runner forces the model's output (a random model cannot be made to
write a tool call), so what is tested is the supervisor's rendering and parsing."""

from __future__ import annotations

import json

import pytest

from tests.harness.server import WEATHER_CALL, WEATHER_TOOLS, start_server, write_fake_model

pytestmark = pytest.mark.timeout(120)
CALL = WEATHER_CALL
TOOLS = WEATHER_TOOLS
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, subprocess_env):
    tmp = tmp_path_factory.mktemp("tools")
    knobs = {"models": {"caller:latest": {"output": "Checking. " + CALL},
                        "thinker:latest": {"output": "<think>\nThe user greets.\n</think>\n\n"
                                                     "Hello!"}}}
    server = start_server(tmp, subprocess_env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                          FAKE_RUNNER=json.dumps(knobs))
    c = server.client()
    model_dir = write_fake_model(tmp / "model")
    for name in ("caller", "thinker"):
        c.create(model=name, from_=str(model_dir))
    yield c
    server.stop()


def test_tool_call_parsed_not_streamed(client):
    reply = client.chat(model="caller", messages=ASK, tools=TOOLS, think=False,
                        options={"num_predict": 500})
    assert reply.message.content == "Checking. "
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"}
    assert reply.done_reason == "stop"


def test_tool_call_parsed_streamed(client):
    parts = list(client.chat(model="caller", messages=ASK, tools=TOOLS, think=False,
                             stream=True, options={"num_predict": 500}))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    text = "".join(p.message.content for p in parts)
    assert text == "Checking. " and "<tool_call>" not in text


def test_without_tools_the_text_is_left_alone(client):
    reply = client.chat(model="caller", messages=ASK, think=False, options={"num_predict": 500})
    assert reply.message.content == "Checking. " + CALL and not reply.message.tool_calls


def test_tool_results_go_back_into_the_prompt(client):
    history = ASK + [{"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather",
                                                   "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": "sunny, 21C", "tool_name": "get_weather"}]
    with_results = client.chat(model="caller", messages=history, tools=TOOLS, think=False,
                               options={"num_predict": 1})
    without = client.chat(model="caller", messages=ASK, tools=TOOLS, think=False,
                          options={"num_predict": 1})
    # The fake runner counts prompt characters: the call and its result were rendered.
    grown = with_results.prompt_eval_count - without.prompt_eval_count
    assert grown >= len('<tool_response>\nsunny, 21C\n</tool_response>')


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_goes_to_its_own_field(client, stream):
    reply = client.chat(model="thinker", messages=[{"role": "user", "content": "hi"}],
                        think=True, stream=stream, options={"num_predict": 500})
    parts = list(reply) if stream else [reply]
    assert "".join(p.message.thinking or "" for p in parts) == "The user greets.\n"
    assert "".join(p.message.content for p in parts) == "Hello!"
    generated = client.generate(model="thinker", prompt="hi", think=True,
                                options={"num_predict": 500})
    assert generated.thinking == "The user greets.\n" and generated.response == "Hello!"


def test_think_false_leaves_the_tags_in_the_content(client):
    reply = client.chat(model="thinker", messages=[{"role": "user", "content": "hi"}],
                        think=False, options={"num_predict": 500})
    assert reply.message.thinking is None
    assert reply.message.content.startswith("<think>")

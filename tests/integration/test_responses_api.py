"""OpenAI's Responses API (/v1/responses) on a real `mlxr serve`, driven by the official
`openai` client: the real runner with the tiny random qwen3 model, and a fake runner whose
forced output makes the model think and call tools (a random model cannot be made to)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.harness.server import WEATHER_CALL, serving, start_server, write_fake_model

pytestmark = pytest.mark.timeout(180)

# Bounded so that the grammar closes the document well within the output limit.
ANSWER = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "sunny": {"type": "boolean"},
                         "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
          "required": ["city", "sunny", "temp"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
# The tiny model can think: a format or a forced call would only apply after a thinking
# section, which a random model never closes, so constrained requests turn thinking off.
NO_THINKING = {"effort": "none"}
THOUGHT = "The user greets.\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("responses"), subprocess_env,
                       {"tiny": tiny_model}, MLXR_KEEP_ALIVE="10m")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def forced(tmp_path_factory, subprocess_env) -> openai.OpenAI:
    """A server whose (fake) runner writes a fixed text: a thought, or a tool call."""
    tmp = tmp_path_factory.mktemp("responses-fake")
    knobs = {"models": {"thinker:latest": {"output": f"<think>\n{THOUGHT}</think>\n\nHello!"},
                        "caller:latest": {"output": "Checking. " + WEATHER_CALL}}}
    srv = start_server(tmp, subprocess_env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                       FAKE_RUNNER=json.dumps(knobs))
    try:
        model_dir = write_fake_model(tmp / "model")
        for name in ("thinker", "caller"):
            srv.client().create(model=name, from_=str(model_dir))
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    finally:
        srv.stop()


def test_string_input_stops_at_max_output_tokens(client):
    resp = client.responses.create(model="tiny", input=ASK, max_output_tokens=6, temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and resp.output_text
    assert resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6


def test_items_with_instructions_run_as_the_same_chat(client):
    resp = client.responses.create(
        model="tiny", instructions="Answer briefly.", temperature=0, max_output_tokens=10,
        input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    chat = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=10,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": ASK}])
    # One inference path: the same prompt, and greedy decoding writes the same text.
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content
    assert resp.instructions == "Answer briefly."


def test_json_schema_format_gives_a_valid_document(client):
    resp = client.responses.create(
        model="tiny", input=ASK, max_output_tokens=200, temperature=0, reasoning=NO_THINKING,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                         "strict": True}})
    assert resp.status == "completed", resp.output_text
    jsonschema.validate(json.loads(resp.output_text), ANSWER)
    assert resp.text.format.type == "json_schema"


def test_forced_function_call_and_its_output_round_trip(client):
    ask = [{"role": "user", "content": ASK}]
    resp = client.responses.create(model="tiny", input=ask, tools=[WEATHER], temperature=0,
                                   tool_choice={"type": "function", "name": "get_weather"},
                                   max_output_tokens=200, reasoning=NO_THINKING)
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    history = ask + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id,
                      "output": "sunny, 21 degrees"}]
    follow = client.responses.create(model="tiny", input=history, tools=[WEATHER],
                                     max_output_tokens=3, temperature=0, reasoning=NO_THINKING)
    assert follow.output[-1].type in ("message", "function_call")
    # The call and its result were rendered into the prompt.
    assert follow.usage.input_tokens > resp.usage.input_tokens + 5


def test_stream_events_in_order_and_the_final_response(client):
    with client.responses.stream(
            model="tiny", input=ASK, max_output_tokens=200, temperature=0, reasoning=NO_THINKING,
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == text
    jsonschema.validate(json.loads(text), ANSWER)
    assert final.usage.output_tokens > 0 and final.id == events[0].response.id


def test_a_stream_cut_at_the_limit_ends_incomplete(client):
    events = list(client.responses.create(model="tiny", input=ASK, max_output_tokens=5,
                                          temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 5


def test_reasoning_effort_none_turns_thinking_off(client, forced):
    high = forced.responses.create(model="thinker", input="hi", reasoning={"effort": "high"},
                                   max_output_tokens=500)
    reasoning, message = high.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text == THOUGHT
    assert high.output_text == "Hello!" and high.reasoning.effort == "high"
    off = forced.responses.create(model="thinker", input="hi", reasoning={"effort": "none"},
                                  max_output_tokens=500)
    assert [item.type for item in off.output] == ["message"]
    assert off.output_text.startswith("<think>")
    # The tiny qwen3 model: "none" renders the empty thinking block of its template.
    on = client.responses.create(model="tiny", input="hi", max_output_tokens=1,
                                 reasoning={"effort": "high"})
    none = client.responses.create(model="tiny", input="hi", max_output_tokens=1,
                                   reasoning={"effort": "none"})
    assert none.usage.input_tokens > on.usage.input_tokens
    # The fake runner's tokens are characters: the thought's are reasoning tokens, the
    # answer's are not (the tags' own may fall either side).
    reasoning = high.usage.output_tokens_details.reasoning_tokens
    assert len(THOUGHT) - 2 <= reasoning <= len(f"<think>\n{THOUGHT}</think>")
    assert high.usage.output_tokens - reasoning >= len("Hello!")
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_reasoning_and_tool_call_items(forced):
    events = list(forced.responses.create(model="thinker", input="hi", stream=True,
                                          reasoning={"effort": "medium"}, max_output_tokens=500))
    types = [e.type for e in events]
    assert types.index("response.reasoning_summary_text.delta") \
        < types.index("response.reasoning_summary_text.done") \
        < types.index("response.output_text.delta")
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    with forced.responses.stream(model="caller", input=ASK, reasoning=NO_THINKING,
                                 tools=[WEATHER], max_output_tokens=500) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in types
    message, call = final.output
    assert message.type == "message" and final.output_text == "Checking. "
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}


def test_errors_raise_the_clients_typed_exceptions(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="missing", input="hi")
    assert info.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", reasoning={"effort": "extreme"})
    assert info.value.body["param"] == "reasoning.effort"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert "not supported" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "launch_rocket"})
    assert info.value.body["param"] == "tool_choice"

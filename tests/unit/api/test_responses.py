"""The Responses API without a server: requests translated into the service's ChatRequest, and
the output items and stream events built from hand-made completion events."""

import json

import pytest

from mlxr.shared.errors import InvalidRequest, RunnerFailed
from mlxr.supervisor.api.responses import parse_responses
from mlxr.supervisor.api.responses_events import ResponseBuilder
from mlxr.supervisor.inference.tool_calls import ForcedCall
from mlxr.supervisor.inference.types import Delta, Final

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_string_input_and_sampling_fields():
    call = parse_responses({"model": "m", "input": "hi", "max_output_tokens": 7,
                            "temperature": 0, "top_p": 0.5, "stream": True})
    assert call.chat.messages == [{"role": "user", "content": "hi"}]
    assert call.chat.options == {"temperature": 0, "top_p": 0.5, "num_predict": 7}
    assert call.stream and call.chat.think is None and call.chat.format is None
    # Ollama's defaults: temperature 1.0, top_p left to the model.
    assert parse_responses({"model": "m", "input": "hi"}).chat.options == {"temperature": 1.0}


def test_items_with_instructions_parts_and_a_tool_round_trip():
    png = "data:image/png;base64,iVBORw0KGgo="
    call = parse_responses({"model": "m", "instructions": "be brief", "input": [
        {"role": "developer", "content": "no jokes"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is "}, {"type": "input_text", "text": "this?"},
            {"type": "input_image", "image_url": png}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                         "text": "look it up"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
    ], "tools": [TOOL]})
    assert call.chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "no jokes"},
        {"role": "user", "content": "what is this?", "images": ["iVBORw0KGgo="]},
        {"role": "assistant", "content": "", "thinking": "look it up",
         "tool_calls": [{"id": "c1", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "tool_name": "get_weather"},
        {"role": "assistant", "content": "It is sunny."}]
    assert call.chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": TOOL["parameters"]}}]


def test_a_replayed_message_between_a_call_and_its_output_joins_the_call():
    call = parse_responses({"model": "m", "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "sunny"}]}]})
    assert [m["role"] for m in call.chat.messages] == ["user", "assistant", "tool"]
    assert call.chat.messages[1]["content"] == "Checking."
    assert call.chat.messages[2]["content"] == "sunny"


@pytest.mark.parametrize("effort, think", [
    ("none", False), ("minimal", "low"), ("low", "low"), ("high", "high"), ("xhigh", "max")])
def test_reasoning_effort_maps_to_think_as_ollama_maps_it(effort, think):
    call = parse_responses({"model": "m", "input": "x", "reasoning": {"effort": effort}})
    assert call.chat.think == think
    assert call.echo["reasoning"]["effort"] == effort


def test_text_format_and_tool_choice():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call = parse_responses({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})
    assert call.chat.format == schema and call.echo["text"]["format"]["name"] == "thing"
    assert parse_responses({"model": "m", "input": "x", "text": {
        "format": {"type": "json_object"}}}).chat.format == "json"
    forced = parse_responses({"model": "m", "input": "x", "tools": [TOOL],
                              "tool_choice": {"type": "function", "name": "get_weather"}})
    assert forced.chat.force_call == ForcedCall("get_weather")
    assert parse_responses({"model": "m", "input": "x", "tools": [TOOL],
                            "tool_choice": "required"}).chat.force_call == ForcedCall()
    assert parse_responses({"model": "m", "input": "x", "tools": [TOOL],
                            "tool_choice": "none"}).chat.tools == []


def test_namespaces_expand_to_qualified_functions():
    call = parse_responses({"model": "m", "input": "x", "tools": [
        {"type": "namespace", "name": "crm", "tools": [TOOL]}]})
    assert call.chat.tools[0]["function"]["name"] == "crm.get_weather"


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
    ({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file_1"}]}]}, "input"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                               "arguments": "{oops"}]}, "input"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "input": "x", "tools": [TOOL], "tool_choice": {"type": "file_search"}},
     "tool_choice"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}},
     "text.format.schema"),
])
def test_bad_fields_are_400s_naming_the_param(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse_responses(body)
    assert info.value.status == 400 and info.value.param == param


def _build(*events, echo=None):
    builder = ResponseBuilder("m", echo or {"reasoning": None}, created_at=1)
    for e in events:
        builder.feed(e)
    return builder


def _types(builder):
    return [kind for kind, _ in builder.take_events()]


def test_text_events_in_order_with_sequence_numbers():
    b = _build(Delta(content="Hel"), Delta(content="lo"),
               Final("stop", prompt_eval_count=5, eval_count=2))
    events = b.take_events()
    assert [k for k, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == k for k, d in events)
    [item] = b.response["output"]
    assert item["content"][0]["text"] == "Hello" and item["status"] == "completed"
    assert b.response["status"] == "completed"
    assert b.response["usage"]["total_tokens"] == 7


def test_thinking_then_text_makes_a_reasoning_item_first():
    b = _build(Delta(thinking="hmm"), Delta(content="\n\n"), Delta(content="Hi"),
               Final("stop"))
    types = _types(b)
    assert types.index("response.reasoning_summary_text.delta") < types.index(
        "response.output_item.done") < types.index("response.output_text.delta")
    reasoning, message = b.response["output"]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "hmm"}]
    assert reasoning["encrypted_content"] == "hmm"
    assert message["content"][0]["text"] == "\n\nHi"


def test_function_calls_follow_text_and_drop_held_whitespace():
    b = _build(Delta(content="\n"), Delta(tool_calls=[
        {"function": {"name": "f", "arguments": {"x": 1}}}]), Final("stop"))
    types = _types(b)
    assert "response.function_call_arguments.done" in types
    assert "response.output_text.delta" not in types
    [call] = b.response["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"x": 1}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")


def test_length_makes_an_incomplete_response():
    b = _build(Delta(content="a b"), Final("length", eval_count=2))
    assert _types(b)[-1] == "response.incomplete"
    assert b.response["status"] == "incomplete"
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert b.response["output"][0]["status"] == "incomplete"


def test_an_empty_reply_still_has_a_message():
    b = _build(Final("stop"))
    [item] = b.response["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ""


def test_a_failure_ends_with_response_failed():
    b = _build(Delta(content="a"))
    b.fail(RunnerFailed("runner died"))
    kind, data = b.take_events()[-1]
    assert kind == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"]["message"] == "runner died"

"""Anthropic's Messages API: the request translation and the event builder, as pure functions
(no server, no model)."""

from __future__ import annotations

import base64
import json

import pytest

from mlxr.shared.errors import InvalidRequest, ModelNotFound, ServerBusy
from mlxr.supervisor.api.anthropic import MessageBuilder, StopMatcher
from mlxr.supervisor.api.anthropic_body import parse_count_tokens, parse_messages
from mlxr.supervisor.api.middleware import anthropic_error_body
from mlxr.supervisor.inference.tool_calls import ForcedCall
from mlxr.supervisor.inference.types import Delta

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


def body(**fields):
    return {"model": "m", "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}], **fields}


def test_sampling_fields_map_to_options_and_metadata_is_ignored():
    call = parse_messages(body(temperature=0.2, top_p=0.9, top_k=5, stream=True,
                               metadata={"user_id": "u1"}))
    assert call.chat.options == {"num_predict": 16, "temperature": 0.2, "top_p": 0.9,
                                 "top_k": 5}
    assert call.stream and call.chat.model == "m" and call.chat.think is None
    assert call.chat.messages == [{"role": "user", "content": "hi"}]
    assert "stop" not in call.chat.options and not call.chat.logprobs


def test_stop_sequences_stay_in_the_skin_and_ask_for_token_counts():
    call = parse_messages(body(stop_sequences=["END", "##", "END"]))
    assert call.stop_sequences == ["END", "##"]
    assert "stop" not in call.chat.options and call.chat.logprobs


def test_system_as_string_or_text_blocks():
    assert parse_messages(body(system="be brief")).chat.messages[0] == {
        "role": "system", "content": "be brief"}
    blocks = [{"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "two"}]
    assert parse_messages(body(system=blocks)).chat.messages[0] == {
        "role": "system", "content": "one\ntwo"}


def test_content_blocks_text_and_base64_image():
    call = parse_messages(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "text", "text": "this?"}]}]))
    assert call.chat.messages == [{"role": "user", "content": "what is\nthis?", "images": [PNG]}]


def test_url_image_source_is_kept_for_the_service_to_fetch_or_refuse():
    call = parse_messages(body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        {"type": "text", "text": "this?"}]}]))
    assert call.chat.messages == [{"role": "user", "content": "this?",
                                   "images": ["https://x/y.png"]}]


def test_a_tool_round_trip_becomes_calls_then_tool_messages():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2",
                                           "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": "no such city", "is_error": True}]}]
    chat = parse_messages(body(messages=messages, tools=[TOOL])).chat
    assert chat.messages[1:] == [
        {"role": "assistant", "content": "Checking.", "thinking": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "function": {"name": "get_weather",
                                                        "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "tool_name": "get_weather",
         "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "toolu_2", "function": {"name": "get_weather",
                                                        "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "tool_name": "get_weather",
         "content": "Error: no such city"}]
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL["input_schema"],
        "description": "Weather for a city"}}]


@pytest.mark.parametrize("choice,force,num_tools", [
    ({"type": "auto"}, None, 1),
    ({"type": "any"}, ForcedCall(), 1),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     ForcedCall("get_weather"), 1),
    ({"type": "none"}, None, 0),
])
def test_tool_choice_maps_onto_forced_calls(choice, force, num_tools):
    chat = parse_messages(body(tools=[TOOL], tool_choice=choice)).chat
    assert chat.force_call == force and len(chat.tools) == num_tools


@pytest.mark.parametrize("value,think", [
    ({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "disabled"}, False),
    ({"type": "adaptive"}, None), (None, None)])
def test_thinking_config_maps_to_think(value, think):
    assert parse_messages(body(thinking=value)).chat.think is think


def test_count_tokens_needs_no_max_tokens():
    chat = parse_count_tokens({"model": "m", "system": "s", "tools": [TOOL],
                               "messages": [{"role": "user", "content": "hi"}]})
    assert chat.messages[0]["role"] == "system" and len(chat.tools) == 1
    assert "num_predict" not in chat.options


@pytest.mark.parametrize("fields,words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": ""}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f_1"}}]}]}, "base64 and url"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "file:///etc/passwd"}}]}]}, "base64 and url"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "data": "not base64!"}}]}]}, "base64"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t",
                                                  "name": "n", "input": {}}]}]}, "tool_use"),
    ({"system": [{"type": "image"}]}, "system"),
    ({"tools": [{"name": "t"}]}, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "other"),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "budget_tokens"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_fields_are_invalid_requests(fields, words):
    with pytest.raises(InvalidRequest, match=words):
        parse_messages({k: v for k, v in body(**fields).items() if v is not None})


def test_error_bodies_have_anthropic_types():
    assert anthropic_error_body(InvalidRequest("bad")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert anthropic_error_body(ModelNotFound("x"))["error"]["type"] == "not_found_error"
    assert anthropic_error_body(ServerBusy("x"))["error"]["type"] == "overloaded_error"


# -- the event builder -------------------------------------------------------------------------

def types(events):
    return [e["type"] for e in events]


def test_stop_matcher_holds_back_a_possible_start_and_cuts_at_the_match():
    m = StopMatcher(["STOP", "##"])
    assert m.feed("one ST") == ("one ", None)
    assert m.feed("ring #") == ("STring ", None)
    assert m.feed("# two") == ("", "##")
    m = StopMatcher(["STOP"])
    assert m.feed("a S") == ("a ", None) and m.flush() == "S"
    assert StopMatcher([]).feed("STOP") == ("STOP", None)


def test_builder_orders_blocks_and_counts():
    b = MessageBuilder("msg_1", "m")
    events = b.start()
    assert types(events) == ["message_start", "ping"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    events = b.feed(Delta(thinking="hmm")) + b.feed(Delta(thinking=" ok", content="Hi"))
    events += b.feed(Delta(content=" there", tool_calls=[
        {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]))
    events += b.finish("stop", 11, 7)
    assert types(events) == [
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert [e["index"] for e in events if "index" in e] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    tool_start = events[8]["content_block"]
    assert tool_start["type"] == "tool_use" and tool_start["id"].startswith("toolu_")
    assert tool_start["input"] == {}
    assert json.loads(events[9]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    msg = b.message()
    assert msg["content"] == [
        {"type": "thinking", "thinking": "hmm ok", "signature": ""},
        {"type": "text", "text": "Hi there"},
        {"type": "tool_use", "id": tool_start["id"], "name": "get_weather",
         "input": {"city": "Paris"}}]
    assert msg["usage"] == {"input_tokens": 11, "output_tokens": 7}


@pytest.mark.parametrize("done,reason", [("stop", "end_turn"), ("length", "max_tokens")])
def test_stop_reasons(done, reason):
    b = MessageBuilder("msg_1", "m")
    b.feed(Delta(content="x"))
    b.finish(done, 1, 1)
    assert b.message()["stop_reason"] == reason and b.message()["stop_sequence"] is None


def test_a_stop_sequence_ends_the_text_and_is_reported():
    b = MessageBuilder("msg_1", "m", ["END"])
    lp = [{"token": "t", "logprob": 0.0}]
    events = b.feed(Delta(content="one E", logprobs=lp)) + b.feed(Delta(content="ND two",
                                                                       logprobs=lp))
    assert b.stopped and b.feed(Delta(content="more", logprobs=lp)) == []
    assert b.num_tokens == 3
    events += b.finish("stop", 5, b.num_tokens)
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") \
        == "one "
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert b.message()["content"] == [{"type": "text", "text": "one "}]


def test_an_empty_reply_has_no_blocks():
    b = MessageBuilder("msg_1", "m")
    assert types(b.finish("stop", 3, 0)) == ["message_delta", "message_stop"]
    assert b.message()["content"] == []


def test_output_config_effort_and_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = parse_messages(body(output_config={"effort": "xhigh", "format": {
        "type": "json_schema", "schema": schema}})).chat
    assert chat.think == "high" and chat.format == schema
    chat = parse_messages(body(output_config={"effort": "low"}, thinking={"type": "disabled"})).chat
    assert chat.think is False
    with pytest.raises(InvalidRequest, match="effort"):
        parse_messages(body(output_config={"effort": "extreme"}))

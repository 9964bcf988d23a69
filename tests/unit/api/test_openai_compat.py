import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.api import openai as oa
from mlxr.supervisor.api.openai_body import (message_to_ollama, parse_openai_chat,
                                             parse_openai_completion, parse_response_format)


def test_chat_parameters_map_to_ollama_options():
    common, messages, tools = parse_openai_chat({
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "temperature": 0, "stop": "END", "seed": 3, "n": 2,
        "presence_penalty": 0.5, "logit_bias": {"42": -100}, "stream": True,
        "stream_options": {"include_usage": True}})
    assert common.options == {"temperature": 0, "top_p": 1.0, "num_predict": 7, "stop": ["END"],
                              "seed": 3, "presence_penalty": 0.5, "logit_bias": {"42": -100}}
    assert messages == [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hi"}]
    assert common.stream and common.include_usage and common.n == 2
    assert oa.choice_options(common, 1)["seed"] == 4, "each choice gets its own seed"


def test_assistant_tool_calls_are_translated_back():
    m = message_to_ollama({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
    assert m == {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}},
                                 "id": "call_1"}]}
    out = oa.tool_calls_to_openai(m["tool_calls"])
    assert out[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out[0]["type"] == "function" and out[0]["id"].startswith("call_")


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_chat_requests_name_the_parameter(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse_openai_chat(body)
    assert info.value.param == param and info.value.status == 400


def test_response_format_becomes_ollama_format():
    assert parse_response_format({"response_format": {"type": "json_object"}}) == "json"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    assert parse_response_format(body) == schema
    assert parse_response_format({"response_format": {"type": "text"}}) is None


def test_completion_prompts_and_logprobs():
    common, prompts, suffix = parse_openai_completion({"model": "m", "prompt": ["a", "b"],
                                                       "logprobs": 2, "max_tokens": 5})
    assert prompts == ["a", "b"] and common.logprobs and common.top_logprobs == 2
    req = oa.generate_request(common, "a", "", 0)
    assert req.raw and req.options["num_predict"] == 5
    with pytest.raises(InvalidRequest):
        parse_openai_completion({"model": "m", "prompt": 5})

"""Gemma 4's output: the thought channel and its tool calls (`<|"|>` strings, bare keys), read
as they stream, whatever the pieces; and how a Gemma 4 template is recognised."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxr.supervisor.inference import gemma4
from mlxr.supervisor.inference.prepare import output_parser
from mlxr.supervisor.inference.prompt import JinjaRenderer
from mlxr.supervisor.inference.tool_calls import (OutputParser, ThinkingParser, thinking_tags_for,
                                                  tool_parser_for)
from mlxr.supervisor.store.metadata import capabilities_for

TEMPLATE = (Path(gemma4.__file__).parents[1] / "store" / "gemma4_template.jinja").read_text()
Q = gemma4.STRING_MARK
THOUGHT = "<|channel>thought\nThe user wants the weather.<channel|>"
CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris, France{Q},days:3}}<tool_call|>"


def feed_all(parser, pieces):
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    thinking = "".join(o[0] for o in outs)
    content = "".join(o[1] for o in outs)
    return thinking, content, [c for o in outs for c in o[2]]


def by_chars(text):
    return list(text)


def by_tokens(text):  # the special tokens arrive whole, text in small pieces
    pieces, i = [], 0
    marks = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", Q)
    while i < len(text):
        mark = next((m for m in marks if text.startswith(m, i)), None)
        step = len(mark) if mark else 3
        pieces.append(text[i:i + step])
        i += step
    return pieces


@pytest.mark.parametrize("args, expected", [
    (f"{{city:{Q}Paris{Q}}}", {"city": "Paris"}),
    (f"{{n:3,x:-1.5e2,ok:true,no:false,none:null}}",
     {"n": 3, "x": -150.0, "ok": True, "no": False, "none": None}),
    (f"{{q:{Q}a, b: {{c}} [d] \"e\"{Q}}}", {"q": 'a, b: {c} [d] "e"'}),
    (f"{{tags:[{Q}x{Q},{Q}y{Q}],opts:{{deep:{{k:1}}}}}}",
     {"tags": ["x", "y"], "opts": {"deep": {"k": 1}}}),
    ('{"already": "json", "n": [1, {"m": 2}]}', {"already": "json", "n": [1, {"m": 2}]}),
    (f"{{ spaced : {Q}v{Q} , other_key.v2 : 1 }}", {"spaced": "v", "other_key.v2": 1}),
    ("{}", {}),
])
def test_arguments_become_json(args, expected):
    assert gemma4.parse_call(f"call:tool{args}") == ("tool", expected)


@pytest.mark.parametrize("body", [
    f"call:tool{{city:{Q}Paris}}",  # the string never ends
    "call:tool{city:Paris}",  # a bare word is not a value
    "call:tool",  # no arguments
    "tool{}",  # not a call
    "call:tool[1, 2]",  # arguments must be an object
])
def test_what_is_not_a_call_is_none(body):
    assert gemma4.parse_call(body) is None


@pytest.mark.parametrize("split", [lambda t: [t], by_chars, by_tokens])
def test_thinking_and_a_call_stream_apart_from_the_content(split):
    parser = OutputParser(ThinkingParser(gemma4.THINK_TAGS), tool_parser_for(TEMPLATE))
    thinking, content, calls = feed_all(parser, split(THOUGHT + CALL))
    assert thinking == "The user wants the weather." and content == ""
    [call] = calls
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Paris, France", "days": 3}
    assert call["id"].startswith("call_")


@pytest.mark.parametrize("split", [lambda t: [t], by_chars, by_tokens])
def test_two_calls_and_text_around_them(split):
    second = f"<|tool_call>call:get_time{{zone:{Q}CET{Q}}}<tool_call|>"
    parser = OutputParser(None, tool_parser_for(TEMPLATE))
    _, content, calls = feed_all(parser, split("Checking. " + CALL + second))
    assert content == "Checking. "
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [c["function"]["index"] for c in calls] == [0, 1]


def test_a_block_that_does_not_parse_stays_content():
    broken = "<|tool_call>call:x{a:b}<tool_call|>"
    _, content, calls = feed_all(OutputParser(None, tool_parser_for(TEMPLATE)), [broken])
    assert (content, calls) == (broken, [])


def test_with_thinking_off_an_empty_thought_block_is_dropped():
    renderer = JinjaRenderer(TEMPLATE, {"bos_token": "<bos>"})
    prompt = renderer.chat([{"role": "user", "content": "hi"}], None, False)
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    parser = output_parser(renderer, prompt, False)
    assert feed_all(parser, by_tokens("<|channel>thought\n<channel|>Hello!")) == \
        ("", "Hello!", [])
    parser = output_parser(renderer, prompt, False)  # and a block the model fills anyway
    assert feed_all(parser, by_tokens(THOUGHT + "Hi.")) == ("", "Hi.", [])


def test_with_thinking_on_the_system_turn_asks_for_it():
    renderer = JinjaRenderer(TEMPLATE, {"bos_token": "<bos>"})
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object"}}}]
    prompt = renderer.chat([{"role": "user", "content": "hi"}], tools, True)
    assert prompt.startswith("<bos><|turn>system\n<|think|>\n<|tool>declaration:get_weather{")
    assert prompt.endswith("<|turn>user\nhi<turn|>\n<|turn>model\n")
    thinking, content, _ = feed_all(output_parser(renderer, prompt, True), [THOUGHT + "Sunny."])
    assert (thinking, content) == ("The user wants the weather.", "Sunny.")


def test_a_conversation_with_calls_and_responses_renders_in_gemma4s_tags():
    renderer = JinjaRenderer(TEMPLATE, {"bos_token": "<bos>"})
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {
                    "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    prompt = renderer.chat(messages, None, False)
    assert prompt == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nWeather in Paris?"
                      f"<turn|>\n<|turn>model\n<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}"
                      f"<tool_call|><turn|>\n<|tool_response>response:get_weather{{value:"
                      f"{Q}sunny{Q}}}<tool_response|><|turn>model\n<|channel>thought\n<channel|>")


def test_gemma4_templates_are_recognised():
    assert gemma4.is_gemma4(TEMPLATE)
    assert thinking_tags_for(TEMPLATE) == gemma4.THINK_TAGS
    assert thinking_tags_for("{{ '<think>' }}{{ '</think>' }}") == ("<think>", "</think>")
    assert not gemma4.is_gemma4("<|channel|>analysis")  # harmony's tag is another
    config = {"model_type": "gemma4_text"}
    assert capabilities_for(config, TEMPLATE, {}) == ["completion", "tools", "thinking"]

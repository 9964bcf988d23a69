"""Thinking and tool-call parsing of streamed model output."""

from __future__ import annotations

import pytest

from mlxr.supervisor.inference.tool_calls import (JsonToolCallParser, OutputParser, ThinkingParser,
                                   ToolCallParser, parse_tool_call)

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def feed_all(parser, pieces):
    """Feed pieces one by one; return the joined outputs per channel."""
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return tuple(_join([o[i] for o in outs]) for i in range(len(outs[0])))


def _join(values):
    if values and isinstance(values[0], list):
        return [x for v in values for x in v]
    return "".join(values)


def chars(text):
    return list(text)


@pytest.mark.parametrize("split", [lambda t: [t], chars])
def test_thinking_then_content(split):
    text = "<think>\nLet me see.\n</think>\n\nThe answer is 4."
    thinking, content = feed_all(ThinkingParser(), split(text))
    assert thinking == "Let me see.\n"
    assert content == "The answer is 4."


def test_no_thinking_block_is_all_content_and_streams_at_once():
    parser = ThinkingParser()
    assert parser.feed("  Hello") == ("", "  Hello")
    assert parser.feed(" <think> not a tag here") == ("", " <think> not a tag here")


def test_partial_opening_tag_is_held_back():
    parser = ThinkingParser()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>hm") == ("hm", "")
    assert parser.feed("</th") == ("", "")
    assert parser.feed("ink>ok") == ("", "ok")


def test_prompt_that_opened_thinking():
    thinking, content = feed_all(ThinkingParser(in_thinking=True), ["a", "b</think>", "c"])
    assert (thinking, content) == ("ab", "c")


def test_unterminated_thinking_stays_thinking():
    assert feed_all(ThinkingParser(), ["<think>still going"]) == ("still going", "")


@pytest.mark.parametrize("split", [lambda t: [t], chars])
def test_qwen3_tool_call(split):
    content, calls = feed_all(ToolCallParser(), split("Sure. " + QWEN_CALL))
    assert content == "Sure. "
    assert [c["function"] for c in calls] == [
        {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}]
    assert calls[0]["id"].startswith("call_")


def test_two_tool_calls_and_whitespace_between():
    second = QWEN_CALL.replace("get_weather", "get_time").replace("Paris", "Tokyo")
    content, calls = feed_all(ToolCallParser(), [QWEN_CALL + "\n" + second])
    assert content == ""
    assert [(c["function"]["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"), (1, "get_time")]


def test_text_that_only_looks_like_a_tag_is_content():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box> b") == ("<toolbox> b", [])


def test_bad_json_in_a_block_is_passed_through():
    block = "<tool_call>{not json}</tool_call>"
    assert feed_all(ToolCallParser(), [block]) == (block, [])


def test_unterminated_block_with_complete_json_is_a_call():
    content, calls = feed_all(ToolCallParser(), [QWEN_CALL.removesuffix("</tool_call>")])
    assert content == "" and calls[0]["function"]["name"] == "get_weather"


def test_arguments_as_a_json_string_and_parameters_key():
    call = parse_tool_call('{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert call["function"]["arguments"] == {"x": 1}
    call = parse_tool_call('{"name": "f", "parameters": {"y": 2}}')
    assert call["function"]["arguments"] == {"y": 2}
    assert parse_tool_call('{"arguments": {}}') is None
    assert parse_tool_call("[1, 2]") is None


def test_json_tool_calls_without_tags():
    content, calls = feed_all(JsonToolCallParser(), ['{"name": "f", ', '"arguments": {"a": 1}}'])
    assert content == "" and calls[0]["function"]["name"] == "f"
    content, calls = feed_all(JsonToolCallParser(), ["Hello ", "{x}"])
    assert (content, calls) == ("Hello {x}", [])
    content, calls = feed_all(JsonToolCallParser(), ["{oops"])
    assert (content, calls) == ("{oops", [])


def test_output_parser_thinking_then_tool_call():
    parser = OutputParser(ThinkingParser(), ToolCallParser())
    thinking, content, calls = feed_all(parser, chars("<think>weather?</think>\n" + QWEN_CALL))
    assert thinking == "weather?"
    assert content == ""
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}


def test_model_output_nested_past_the_stack_is_content_not_a_crash():
    from mlxr.supervisor.inference.tool_calls import JsonToolCallParser, parse_tool_call

    deep = "[" * 100_000 + "]" * 100_000
    assert parse_tool_call('{"name": "f", "arguments": "' + deep + '"}') is None
    assert parse_tool_call(deep) is None
    parser = JsonToolCallParser()
    out, calls = parser.feed(deep)
    tail, more = parser.finish()
    assert calls == more == [] and out + tail == deep

"""Request parsing for Ollama's details: think values, reasoning efforts, roles, tool results."""

from __future__ import annotations

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.api.body import parse_chat, think_field
from mlxr.supervisor.api.openai_body import parse_openai_chat

USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("value", [None, True, False, "low", "medium", "high", "max"])
def test_think_values_ollama_accepts(value):
    assert think_field(value) == value


@pytest.mark.parametrize("value", ["none", "HIGH", "", 1, [True]])
def test_other_think_values_are_400s(value):
    with pytest.raises(InvalidRequest, match="think"):
        think_field(value)


@pytest.mark.parametrize("body,think", [
    ({}, None), ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "minimal"}, "low"),
    ({"reasoning_effort": "xhigh"}, "max"), ({"reasoning": {"effort": "high"},
                                             "reasoning_effort": "none"}, "high")])
def test_reasoning_effort_becomes_think(body, think):
    common, _, _ = parse_openai_chat({"model": "m", "messages": USER, **body})
    assert common.think == think


def test_roles_are_lower_cased_and_stream_type_checked():
    req = parse_chat({"model": "m", "messages": [{"role": "User", "content": "x"}]})
    assert req.messages[0]["role"] == "user" and req.truncate is True
    with pytest.raises(InvalidRequest, match="stream"):
        parse_chat({"model": "m", "messages": USER, "stream": "no"})
    with pytest.raises(InvalidRequest, match="truncate"):
        parse_chat({"model": "m", "messages": USER, "truncate": "no"})


def test_a_tool_result_is_named_by_its_call_id():
    _, messages, _ = parse_openai_chat({"model": "m", "messages": [
        *USER, {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "TOOL", "tool_call_id": "b", "content": "1"}]})
    assert messages[-1] == {"role": "tool", "content": "1", "tool_name": "g", "tool_call_id": "b"}

"""Structured output in the supervisor, without a model: `format` validation, thinking off for
constrained requests, forced tool calls (their schema and how their output is read back), and
the OpenAI translation. Requests go through the real aiohttp app to in-process fake runners
that record what they are sent and answer with scripted text."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mlxr.shared.config import Settings
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import Chunk
from mlxr.supervisor.api.openai_body import parse_openai_chat, parse_response_format
from mlxr.supervisor.app import make_app
from mlxr.supervisor.inference.prepare import wire_format
from mlxr.supervisor.inference.tool_calls import ForcedCall, ForcedCallParser, forced_call_schema
from tests.unit.inference.test_service import InProcessRunner, StubStore

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
USER = [{"role": "user", "content": "hi"}]


# -- pure pieces -----------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ({}, None), ("json", "json"),
    ({"type": "object"}, {"type": "object"}),
    ({"type": "regex", "pattern": "a+"}, {"type": "regex", "pattern": "a+"}),
])
def test_wire_format_accepts_json_and_objects(value, expected):
    assert wire_format(value) == expected


@pytest.mark.parametrize("value", ["yaml", 3, True, ["json"]])
def test_wire_format_refuses_anything_else(value):
    with pytest.raises(InvalidRequest, match='expected "json" or a JSON schema object'):
        wire_format(value)


def test_forced_call_schema_for_one_tool_and_for_several():
    one = forced_call_schema([WEATHER, CLOCK], ForcedCall("get_weather"))
    assert one == {"type": "object",
                   "properties": {"name": {"const": "get_weather"},
                                  "arguments": WEATHER["function"]["parameters"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
    both = forced_call_schema([WEATHER, CLOCK], ForcedCall())
    assert [alt["properties"]["name"] for alt in both["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    # no parameters: the call takes none
    assert both["anyOf"][1]["properties"]["arguments"] == {
        "type": "object", "properties": {}, "additionalProperties": False}


def test_forced_call_schema_refuses_an_unknown_name_and_no_tools():
    with pytest.raises(InvalidRequest, match="'nope', which is not in tools") as info:
        forced_call_schema([WEATHER], ForcedCall("nope"))
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequest, match="needs at least one function"):
        forced_call_schema([], ForcedCall())


def test_forced_call_parser_gives_the_call_when_the_object_closes():
    parser = ForcedCallParser()
    text = '{"name": "get_weather", "arguments": {"city": "a \\"}\\" b", "n": [1, {}]}}'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    seen = [parser.feed(p) for p in pieces]
    assert all(out == ("", []) for out in seen[:-1]), "nothing before the object closes"
    content, [call] = seen[-1]
    assert content == "" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": 'a "}" b', "n": [1, {}]}
    assert call["id"].startswith("call_")
    assert parser.feed("\n") == ("", []) and parser.finish() == ("", [])


def test_forced_call_parser_returns_a_cut_document_as_content():
    parser = ForcedCallParser()
    assert parser.feed('{"name": "get_weather", "argu') == ("", [])
    assert parser.finish() == ('{"name": "get_weather", "argu', [])


def test_openai_tool_choice():
    base = {"model": "m", "messages": USER, "tools": [WEATHER]}
    assert parse_openai_chat({**base, "tool_choice": "auto"})[0].force_call is None
    assert parse_openai_chat({**base, "tool_choice": "none"})[2] == []
    assert parse_openai_chat({**base, "tool_choice": "required"})[0].force_call == ForcedCall()
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_openai_chat({**base, "tool_choice": named})[0].force_call == \
        ForcedCall("get_weather")
    for bad in ("always", {"type": "function"}, {"type": "custom", "custom": {"name": "x"}}):
        with pytest.raises(InvalidRequest) as info:
            parse_openai_chat({**base, "tool_choice": bad})
        assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequest, match="needs tools"):
        parse_openai_chat({"model": "m", "messages": USER, "tool_choice": "required"})


def test_openai_format_sources():
    assert parse_response_format({"format": "json"}) == "json"
    schema = {"type": "object"}
    strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                     "strict": True}}
    assert parse_response_format({"response_format": strict}) == schema
    with pytest.raises(InvalidRequest, match="not both"):
        parse_response_format({"response_format": strict, "format": "json"})
    with pytest.raises(InvalidRequest, match="strict must be a boolean"):
        parse_response_format({"response_format": {
            "type": "json_schema", "json_schema": {"schema": schema, "strict": "yes"}}})


# -- through the app ---------------------------------------------------------------------------

class ScriptedRunner(InProcessRunner):
    """Answers every completion with `pieces`, one chunk each."""

    def __init__(self, sent: list, pieces: list[str]):
        super().__init__(sent)
        self.pieces = pieces

    async def complete(self, request):
        self.sent.append(request)
        return ScriptedStream(self.pieces)


class ScriptedStream:
    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    async def __aiter__(self):
        for i, piece in enumerate(self.pieces):
            yield Chunk(content=piece, tokens=[100 + i])
        yield Chunk(done=True, done_reason="stop", prompt_eval_count=7,
                    eval_count=len(self.pieces))

    async def aclose(self) -> None:
        pass


@pytest.fixture
def env(tmp_path):
    store = StubStore(tmp_path)
    store.add("m")  # a thinking, tool-calling qwen3 chat template
    sent: list = []
    script = {"pieces": ["Hel", "lo"]}

    async def factory(spec):
        return ScriptedRunner(sent, script["pieces"])

    settings = dataclasses.replace(Settings(), context_length=2048)

    def app():
        return make_app(settings, store=store, runner_factory=factory,
                        available_memory=lambda: 1 << 40)
    return SimpleNamespace(sent=sent, script=script, app=app)


def post(env, path: str, body: dict, stream: bool = False):
    """(status, JSON body) or, with `stream`, (status, the raw body's lines)."""
    async def main():
        async with TestClient(TestServer(env.app())) as client:
            resp = await client.post(path, json={"stream": stream, **body})
            if stream:
                return resp.status, (await resp.text()).splitlines()
            return resp.status, await resp.json()
    return asyncio.run(main())


def test_ollama_format_with_thinking_constrains_only_after_the_thinking(env):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for think in (None, True, "low"):  # Ollama: think first, then the constrained answer
        status, body = post(env, "/api/chat", {"model": "m", "messages": USER, "format": schema,
                                               "think": think})
        assert status == 200
        assert env.sent[-1].format == schema and env.sent[-1].format_after == "</think>"
        assert env.sent[-1].prompt.endswith("<|im_start|>assistant\n")
        # the model opens its thinking itself: output that does not is held at once
        assert env.sent[-1].think_open == "<think>"
    post(env, "/api/chat", {"model": "m", "messages": USER, "format": schema, "think": False})
    assert env.sent[-1].format_after is None  # thinking off: constrained from the first token
    assert env.sent[-1].think_open is None
    assert env.sent[-1].prompt.endswith("<think>\n\n</think>\n\n")
    post(env, "/api/generate", {"model": "m", "prompt": "hi", "format": "json"})
    assert env.sent[-1].format == "json"
    post(env, "/api/generate", {"model": "m", "prompt": "hi", "format": ""})
    assert env.sent[-1].format is None


def test_ollama_format_with_tools_is_content_not_a_call(env):
    env.script["pieces"] = [CALL_TEXT]
    status, body = post(env, "/api/chat", {"model": "m", "messages": USER, "format": "json",
                                           "tools": [WEATHER]})
    assert body["message"]["content"] == CALL_TEXT and "tool_calls" not in body["message"]


@pytest.mark.parametrize("fmt", ["yaml", 7, ["json"]])
def test_a_bad_format_type_is_a_400_before_any_runner(env, fmt):
    for path, extra in (("/api/chat", {"messages": USER}), ("/api/generate", {"prompt": "x"})):
        status, body = post(env, path, {"model": "m", "format": fmt, **extra})
        assert status == 400 and body["error"].startswith("invalid format: ")
    assert env.sent == []


def test_openai_forced_call_not_streamed(env):
    env.script["pieces"] = [CALL_TEXT[:20], CALL_TEXT[20:]]
    status, body = post(env, "/v1/chat/completions", {
        "model": "m", "messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": "required"})
    assert status == 200, body
    sent = env.sent[-1]
    assert [a["properties"]["name"]["const"] for a in sent.format["anyOf"]] == [
        "get_weather", "get_time"]
    assert sent.format_after is None  # a forced call is constrained from the first token
    assert sent.prompt.endswith("<think>\n\n</think>\n\n")
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_openai_forced_call_streamed_comes_before_the_finish(env):
    env.script["pieces"] = [CALL_TEXT[:30], CALL_TEXT[30:], ""]
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, lines = post(env, "/v1/chat/completions", {
        "model": "m", "messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": named,
        "response_format": {"type": "json_object"}}, stream=True)
    assert status == 200
    assert env.sent[-1].format["properties"]["name"] == {"const": "get_weather"}
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events]
    calls = [i for i, d in enumerate(deltas) if d["delta"].get("tool_calls")]
    finishes = [i for i, d in enumerate(deltas) if d["finish_reason"]]
    assert len(calls) == 1 and finishes == [len(deltas) - 1] and calls[0] < finishes[0]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not any(d["delta"].get("content") for d in deltas)


def test_openai_unknown_function_is_a_400_naming_tool_choice(env):
    named = {"type": "function", "function": {"name": "nope"}}
    status, body = post(env, "/v1/chat/completions", {
        "model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": named})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    assert env.sent == []


def test_openai_completions_take_format_and_response_format(env):
    post(env, "/v1/completions", {"model": "m", "prompt": "x", "format": {"type": "object"}})
    assert env.sent[-1].format == {"type": "object"}
    post(env, "/v1/completions", {"model": "m", "prompt": "x",
                                  "response_format": {"type": "json_object"}})
    assert env.sent[-1].format == "json"

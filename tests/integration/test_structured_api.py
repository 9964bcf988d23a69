"""Structured output through the public APIs: a real `mlxr serve`, the real runner, the tiny
random model, and the official `ollama` and `openai` clients.

The model's free output is gibberish, so the schemas bound what the grammar leaves open (short
strings, few items, number ranges) and every document closes well within `num_predict`. For
"any JSON object" nothing is bounded, so those requests bias the tokens that close a key or a
string (as tests/integration/test_structured_runner.py does).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import ollama
import openai
import pytest

from tests.harness.server import serving

pytestmark = pytest.mark.timeout(180)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "history": {"type": "array", "maxItems": 2,
                    "items": {"type": "object",
                              "properties": {"year": {"type": "integer", "minimum": 1900,
                                                      "maximum": 2100},
                                             "kind": {"enum": ["born", "moved", "hired"]}},
                              "required": ["year", "kind"], "additionalProperties": False}},
    },
    "required": ["name", "age", "score", "role", "active", "tags", "address", "history"],
    "additionalProperties": False,
}
# Qwen3 token ids of '":"' and '"}': biased so a free-form object's keys and strings close.
CLOSE_STRING_BIAS = {"3252": 6, "9207": 6}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"enum": ["c", "f"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm",
        "parameters": {"type": "object",
                       "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                      "minute": {"type": "integer", "minimum": 0,
                                                 "maximum": 59},
                                      "label": {"type": "string", "maxLength": 8}},
                       "required": ["hour", "minute"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
THINK_OPEN = "151667"  # Qwen3's <think>
ASK = [{"role": "user", "content": "Wake me at seven, and what is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("structured"), subprocess_env,
                       {"tiny": tiny_model}, MLXR_KEEP_ALIVE="10m")


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return server.client()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _person(client: ollama.Client, i: int) -> tuple[str, str]:
    """(done_reason, text) of one schema request; greedy or seeded, chat or generate."""
    options = {"num_predict": 300} | ({"temperature": 0} if i % 2 else
                                      {"temperature": 0.9, "seed": i})
    if i % 4 < 2:
        r = client.chat(model="tiny", messages=[{"role": "user", "content": f"Person {i}"}],
                        format=PERSON, options=options, think=False)
        return r.done_reason, r.message.content
    r = client.generate(model="tiny", prompt=f"Person {i} as JSON:", format=PERSON,
                        options=options, think=False)
    return r.done_reason, r.response


# -- Ollama ------------------------------------------------------------------------------------

def test_20_concurrent_schema_requests_validate(client):
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: _person(client, i), range(20)))
    docs = []
    for done_reason, text in results:
        assert done_reason == "stop", text
        docs.append(json.loads(text))
        jsonschema.validate(docs[-1], PERSON)
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 10, "prompts and seeds matter"


def test_json_format_on_chat_gives_an_object_and_no_thinking(client):
    # think=False with a format: the grammar starts at token one. (With thinking on, it starts
    # after </think>: tests/integration/test_ollama_details.py.)
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "An object"}],
                        format="json", think=False,
                        options={"num_predict": 300, "temperature": 0.9, "seed": 3,
                                 "logit_bias": CLOSE_STRING_BIAS})
    assert reply.done_reason == "stop" and not reply.message.thinking
    assert isinstance(json.loads(reply.message.content), dict)


def test_a_thinking_model_that_does_not_open_its_thinking_is_held_to_the_format(client, oai):
    # Thinking on (unset: Ollama's default for a thinking model) and no <think> as the first
    # token: the format holds from that token, as Ollama applies it once the content begins.
    # (It waited for a </think> that never came, and answered free text.)
    no_thinking = {THINK_OPEN: -100} | CLOSE_STRING_BIAS
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "Person 7"}],
                        format=PERSON, options={"num_predict": 300, "temperature": 0,
                                                "logit_bias": no_thinking})
    assert reply.done_reason == "stop" and not reply.message.thinking
    jsonschema.validate(json.loads(reply.message.content), PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = oai.chat.completions.create(model="tiny", messages=ASK, response_format=fmt,
                                        max_tokens=300, temperature=0, logit_bias=no_thinking)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_a_schema_the_runner_cannot_compile_is_a_400(client):
    unsupported = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="tiny", prompt="x", format=unsupported)
    assert info.value.status_code == 400 and "Unimplemented keys" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="tiny", messages=[{"role": "user", "content": "x"}],
                    format={"type": "object", "properties": {"a": {"type": "foo"}}})
    assert info.value.status_code == 400 and "Invalid type: foo" in info.value.error


@pytest.mark.parametrize("fmt", [5, ["json"], "yaml", True])
def test_a_format_that_is_not_json_or_an_object_is_a_400(server, fmt):
    with server.http() as http:
        for path, extra in (("/api/generate", {"prompt": "x"}),
                            ("/api/chat", {"messages": [{"role": "user", "content": "x"}]})):
            resp = http.post(path, json={"model": "tiny", "format": fmt, "stream": False,
                                         **extra})
            assert resp.status_code == 400
            assert resp.json()["error"].endswith('expected "json" or a JSON schema object')


def test_free_greedy_requests_are_unchanged_next_to_constrained_ones(client):
    prompts = [f"Tell me about the number {i}" for i in range(3)]

    def free(prompt: str) -> str:
        return client.chat(model="tiny", messages=[{"role": "user", "content": prompt}],
                           think=False, options={"temperature": 0, "num_predict": 24}
                           ).message.content

    alone = [free(p) for p in prompts]
    with ThreadPoolExecutor(9) as pool:
        constrained = [pool.submit(_person, client, 100 + i) for i in range(6)]
        together = list(pool.map(free, prompts))
        assert all(f.result()[0] == "stop" for f in constrained)
    assert together == alone


# -- OpenAI ------------------------------------------------------------------------------------

def test_openai_json_schema_and_json_object(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    # reasoning_effort "none": a thinking model would otherwise think first (as in Ollama),
    # and the format would apply only after its </think>, which a random model rarely writes.
    reply = oai.chat.completions.create(model="tiny", messages=ASK, response_format=fmt,
                                        max_tokens=300, temperature=0, reasoning_effort="none")
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = oai.chat.completions.create(model="tiny", messages=ASK,
                                        response_format={"type": "json_object"},
                                        max_tokens=300, temperature=0.9, seed=1,
                                        logit_bias=CLOSE_STRING_BIAS, reasoning_effort="none")
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    text = oai.completions.create(model="tiny", prompt="Person:", max_tokens=300,
                                  temperature=0, extra_body={"format": PERSON})
    jsonschema.validate(json.loads(text.choices[0].text), PERSON)


def _check_call(call, name: str | None) -> None:
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("choice, name", [
    ("required", None),
    ({"type": "function", "function": {"name": "set_alarm"}}, "set_alarm"),
])
def test_openai_forced_tool_call(oai, choice, name):
    reply = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                        tool_choice=choice, max_tokens=300, temperature=0)
    [only] = reply.choices
    assert only.finish_reason == "tool_calls" and not only.message.content
    [call] = only.message.tool_calls
    _check_call(call, name)
    chunks = list(oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                              tool_choice=choice, max_tokens=300,
                                              temperature=0.9, seed=2, stream=True))
    choices = [c.choices[0] for c in chunks if c.choices]
    calls = [tc for c in choices for tc in (c.delta.tool_calls or [])]
    assert len(calls) == 1 and not any(c.delta.content for c in choices)
    _check_call(calls[0], name)
    assert choices[-1].finish_reason == "tool_calls" and not choices[-1].delta.tool_calls
    assert all(c.finish_reason is None for c in choices[:-1])


def test_openai_bad_tool_choice_and_schema_are_400s(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "launch_rocket"}})
    assert info.value.body["param"] == "tool_choice" and "launch_rocket" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "uniqueItems": True}}})
    assert "Unimplemented keys" in info.value.message

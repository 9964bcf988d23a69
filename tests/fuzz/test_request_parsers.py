"""Every request parser, fuzzed in process: Ollama's, OpenAI's, Anthropic's and the Responses
API's bodies, each followed as far as it goes without a runner (prepare: options merged, the
format checked, the prompt rendered with a real chat template), and the runner request it
would make written and read back as the runner reads it.

The property: a parser returns, or raises one of our typed 4xx errors (shared/errors.py);
nothing else (no TypeError, no RecursionError), and what it accepts can be sent on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import event, example, given

from mlxr.shared.errors import MlxrError
from mlxr.shared.protocol import CompletionRequest, EmbedRequest, Options
from mlxr.supervisor.api.anthropic_body import parse_count_tokens, parse_messages
from mlxr.supervisor.api.body import (check_depth, model_field, parse_chat, parse_copy,
                                      parse_embed, parse_embeddings_legacy, parse_generate)
from mlxr.supervisor.api.openai import chat_request, generate_request
from mlxr.supervisor.api.openai_body import (parse_openai_chat, parse_openai_completion,
                                             parse_openai_embeddings)
from mlxr.supervisor.api.responses import parse_responses
from mlxr.supervisor.inference.options import check_options
from mlxr.supervisor.inference.prepare import merge_options, prepare_chat, prepare_generate
from mlxr.supervisor.inference.types import ChatRequest, GenerateRequest
from mlxr.supervisor.store.create_request import CreateRequest
from mlxr.supervisor.store.names import parse_name
from tests.fuzz import strategies as s
from tests.harness.server import write_fake_model

SETTINGS = s.SETTINGS


def refused_or(fn, *args) -> Any:
    """`fn(*args)`, or None when it raised a typed client error (which must say why)."""
    try:
        result = fn(*args)
    except MlxrError as err:
        assert 400 <= err.status < 500, (err.status, err.message)
        assert isinstance(err.message, str) and err.message
        event(f"{getattr(fn, '__name__', fn)}: refused")
        return None
    event(f"{getattr(fn, '__name__', fn)}: accepted")
    return result


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A record and a store as prepare sees them: Qwen3's chat template (Jinja) in the model
    directory, and thinking and tools among its capabilities."""
    directory = write_fake_model(tmp_path_factory.mktemp("fuzz-model"))
    record = SimpleNamespace(name="tiny:latest", messages=[], system="", template=None,
                             params={"num_ctx": 2048}, capabilities=["completion", "tools",
                                                                     "thinking"])
    store = SimpleNamespace(runner_dir=lambda _record: Path(directory))
    return record, store


def sent_to_runner(request: CompletionRequest) -> None:
    """The request as the runner client writes it, and as the runner reads it back."""
    wire = orjson.dumps(request.to_dict())
    refused_or(CompletionRequest.from_dict, orjson.loads(wire))


def run_prepared(p: Any) -> None:
    if p is not None:
        sent_to_runner(CompletionRequest(prompt=p.prompt, options=p.options, format=p.format,
                                         format_after=p.format_after, tokens=p.context or None))


def prepare_chat_request(req: ChatRequest, model) -> None:
    record, store = model
    if req.messages:
        run_prepared(refused_or(prepare_chat, req, record, store, 4096))
    else:  # a load request: only the options are read
        refused_or(merge_options, record, req.options, 4096)


# -- Ollama ------------------------------------------------------------------------------------

@SETTINGS
@given(body=s.GENERATE)
def test_ollama_generate(body, model):
    req = refused_or(parse_generate, body)
    if req is not None:
        run_prepared(refused_or(prepare_generate, req, *model, 4096))


@SETTINGS
@given(body=s.CHAT)
@example(body={"model": "tiny", "messages": [  # was a TypeError in the template's tojson
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]})
def test_ollama_chat(body, model):
    req = refused_or(parse_chat, body)
    if req is not None:
        prepare_chat_request(req, model)


@SETTINGS
@given(body=s.EMBED)
def test_ollama_embed(body, model):
    for parse in (parse_embed, parse_embeddings_legacy):
        call = refused_or(parse, body)
        if call is None:
            continue
        wire = refused_or(EmbedRequest.from_dict, {"input": call.input, "truncate": call.truncate,
                                                   "dimensions": call.dimensions})
        if wire is not None:
            refused_or(EmbedRequest.from_dict, orjson.loads(orjson.dumps(wire.to_dict())))
        refused_or(merge_options, model[0], call.options, 4096)


@SETTINGS
@given(body=s.CREATE)
def test_ollama_create(body):
    req = refused_or(CreateRequest.from_json, body)
    if req is not None:
        refused_or(parse_name, req.model)
        if req.parameters:
            refused_or(check_options, req.parameters)


@SETTINGS
@given(body=s.SHOW | s.PULL | s.DELETE | s.COPY)
def test_ollama_store_bodies(body):
    name = refused_or(model_field, body)
    if name is not None:
        refused_or(parse_name, name)
    names = refused_or(parse_copy, body)
    for name in names or ():
        refused_or(parse_name, name)


@SETTINGS
@given(options=s.OPTIONS, params=s.OPTIONS)
def test_options_merge_and_reach_the_runner(options, params):
    record = SimpleNamespace(params=params if isinstance(params, dict) else {})
    merged = refused_or(merge_options, record, options if isinstance(options, dict) else {},
                        4096)
    if merged is not None:
        sent_to_runner(CompletionRequest(prompt="x", options=merged))
    refused_or(Options.from_dict, options)


# -- OpenAI ------------------------------------------------------------------------------------

@SETTINGS
@given(body=s.OPENAI_CHAT)
@example(body={"model": "tiny", "messages": [  # was a TypeError
    {"role": "user", "content": "x", "tool_calls": 1}]})
def test_openai_chat(body, model):
    parsed = refused_or(parse_openai_chat, body)
    if parsed is not None:
        common, messages, tools = parsed
        for i in range(common.n):
            prepare_chat_request(chat_request(common, messages, tools, i), model)


@SETTINGS
@given(body=s.OPENAI_COMPLETION)
def test_openai_completions(body, model):
    parsed = refused_or(parse_openai_completion, body)
    if parsed is not None:
        common, prompts, suffix = parsed
        for i in range(common.n):
            req: GenerateRequest = generate_request(common, prompts[0], suffix, i)
            run_prepared(refused_or(prepare_generate, req, *model, 4096))


@SETTINGS
@given(body=s.OPENAI_EMBEDDINGS)
def test_openai_embeddings(body):
    parsed = refused_or(parse_openai_embeddings, body)
    if parsed is not None:
        call, _encoding = parsed
        refused_or(EmbedRequest.from_dict, {"input": call.input, "truncate": call.truncate,
                                            "dimensions": call.dimensions})


# -- Anthropic and Responses -------------------------------------------------------------------

@SETTINGS
@given(body=s.ANTHROPIC)
def test_anthropic_messages(body, model):
    call = refused_or(parse_messages, body)
    if call is not None:
        prepare_chat_request(call.chat, model)
    refused_or(parse_count_tokens, body)


@SETTINGS
@given(body=s.RESPONSES)
def test_responses(body, model):
    call = refused_or(parse_responses, body)
    if call is not None:
        json.dumps(call.echo)  # the response echoes it (web.json_response)
        prepare_chat_request(call.chat, model)


# -- any body at all ---------------------------------------------------------------------------

PARSERS = (parse_generate, parse_chat, parse_embed, parse_copy, model_field,
           parse_openai_chat, parse_openai_completion, parse_openai_embeddings, parse_messages,
           parse_responses, CreateRequest.from_json)


@SETTINGS
@given(body=s.obj({}) | s.json_values(max_leaves=30).filter(lambda v: isinstance(v, dict)))
def test_any_object_to_every_parser(body):
    for parse in PARSERS:
        refused_or(parse, body)


def test_depth_is_bounded_before_any_parser():
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(MlxrError, match="deeper than"):
        check_depth({"messages": deep})
    shallow: Any = list(range(100_000))
    check_depth({"input": [shallow, {"a": [[[1]]]}]}, b"[" * 100)  # returns: 4 levels

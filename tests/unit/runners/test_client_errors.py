"""Errors crossing the runner wire: the runner renders them with their `kind`
(shared.protocol.error_body / error_line) and the client rebuilds exactly that class; with no
kind, or one it does not know, it goes by the status."""

from __future__ import annotations

import orjson
import pytest

from mlxr.shared import errors
from mlxr.shared.errors import (ContextOverflow, InvalidRequest, KINDS, MlxrError, RunnerFailed,
                                ServerBusy)
from mlxr.shared.protocol import error_body, error_line
from mlxr.supervisor.runners.client import _chunk, _http_error


def over_http(err: MlxrError) -> MlxrError:
    return _http_error(err.status, orjson.dumps(error_body(err)))


def in_stream(err: MlxrError) -> MlxrError:
    with pytest.raises(MlxrError) as info:
        _chunk(orjson.loads(orjson.dumps(error_line(err))))
    return info.value


def test_every_class_has_its_own_kind():
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, MlxrError)]
    assert sorted(c.kind for c in classes) == sorted(KINDS)
    assert all(KINDS[c.kind] is c for c in classes)


@pytest.mark.parametrize("rebuild", [over_http, in_stream])
def test_each_class_round_trips_whatever_its_message_says(rebuild):
    for cls in KINDS.values():
        err = rebuild(cls("something went wrong"))
        assert type(err) is cls and err.message == "something went wrong"
        assert err.status == cls.status


@pytest.mark.parametrize("rebuild", [over_http, in_stream])
def test_context_overflow_needs_no_words_in_its_message(rebuild):
    err = rebuild(ContextOverflow("prompt too long (9000 > 4096 tokens)"))
    assert type(err) is ContextOverflow and err.code == "context_length_exceeded"
    assert (err.status, err.message) == (400, "prompt too long (9000 > 4096 tokens)")
    # ... and a message that mentions it does not make an InvalidRequest one
    err = rebuild(InvalidRequest("num_ctx exceeds the context length"))
    assert type(err) is InvalidRequest and err.code is None


def test_the_wire_shapes():
    assert error_body(ContextOverflow("too long")) == {"error": "too long",
                                                       "kind": "context_overflow"}
    assert error_line(RunnerFailed("inference failed: boom")) == {
        "error": {"message": "inference failed: boom", "status": 500, "kind": "runner_failed"}}


def test_an_unknown_or_missing_kind_falls_back_by_status():
    body = {"error": "input length exceeds the context length", "kind": "from_the_future"}
    err = _http_error(400, orjson.dumps(body))
    assert type(err) is InvalidRequest and err.message == body["error"]
    err = _http_error(503, orjson.dumps({"error": "model is still loading"}))
    assert type(err) is ServerBusy and err.message == "model is still loading"
    err = _http_error(500, b"500 Internal Server Error")  # not JSON: aiohttp's own reply
    assert type(err) is RunnerFailed and err.message == "500 Internal Server Error"
    with pytest.raises(InvalidRequest) as info:
        _chunk({"error": {"message": "input length exceeds the context length", "status": 400,
                          "kind": "from_the_future"}})
    assert type(info.value) is InvalidRequest
    with pytest.raises(MlxrError) as info:
        _chunk({"error": {"message": "gone", "status": 507}})
    assert type(info.value) is errors.InsufficientMemory
    with pytest.raises(RunnerFailed, match="^oops$"):
        _chunk({"error": "oops"})


def test_a_status_sent_with_a_kind_is_kept():
    err = _http_error(422, orjson.dumps({"error": "bad", "kind": "invalid_request"}))
    assert type(err) is InvalidRequest and err.status == 422


@pytest.mark.parametrize("status", ["teapot", None, 99, 1000, 2.5, [500]])
def test_a_malformed_status_on_an_error_line_is_a_runner_failure(status):
    with pytest.raises(MlxrError) as info:
        _chunk({"error": {"message": "boom", "status": status}})
    assert info.value.status == 500 and "boom" in info.value.message

"""shared/: durations and hosts (the settings read from the environment), NDJSON, and the
runner protocol's decoders, against any input. Each returns a value of its type or raises its
documented error: InvalidRequest for a duration (a request's keep_alive), ValueError for a
setting (the server does not start), InvalidRequest from a request the runner is sent,
RunnerFailed from a reply a runner sent; and what they accept goes back on the wire and reads
the same."""

from __future__ import annotations

import math

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from mlxr.shared.config import MAX_DURATION_S, Settings, parse_duration, parse_host
from mlxr.shared.errors import InvalidRequest, MlxrError, RunnerFailed, from_wire
from mlxr.shared.ndjson import dumps_line, loads
from mlxr.shared.protocol import (Chunk, CompletionRequest, EmbedRequest, EmbedResponse, Options,
                                  RunnerStatus)
from tests.fuzz import strategies as s

SETTINGS = s.SETTINGS

DURATIONS = st.one_of(s.ANY, st.sampled_from(
    ["5m", "1h30m", "-1", "0", "500ms", "1.5h", "nan", "-nan", "inf", "-inf", "1e400",
     "9" * 400 + "h", "9" * 5000, "1_000", " 5m ", "5m-3s", "µs", "1µs", "-", "", "h"]),
    st.text(alphabet="0123456789.-+eEhmsuµn_ ", max_size=12))
HOSTS = st.one_of(st.sampled_from(
    ["", ":", ":0", ":65535", ":65536", "h:-1", "h:1e3", "[::1]", "[::1]:80", "[::1", "::1",
     "http://h:1/", "https://[::1]:2/", "h:٣", "a:b:c", "unix:///tmp/x.sock", "h: 80"]),
    st.text(alphabet="ab:[]/0123456789.-", max_size=16), s.TEXT)


@SETTINGS
@given(value=DURATIONS)
@example("nan")  # was NaN seconds
@example(1e300)  # was a keep-alive /api/ps could not show (a date overflow)
@example(10**400)  # was an OverflowError
def test_durations(value):
    try:
        seconds = parse_duration(value)
    except InvalidRequest as err:
        assert err.status == 400
        return
    assert isinstance(seconds, float) and math.isfinite(seconds)
    assert seconds == -1.0 or 0 <= seconds <= MAX_DURATION_S


@SETTINGS
@given(value=HOSTS)
@example(":65536")  # was accepted, to fail at bind
def test_hosts(value):
    try:
        host, port = parse_host(value)
    except ValueError:
        return
    assert isinstance(host, str) and host and 0 <= port <= 65535


ENV_KEYS = ("MLXR_HOST", "OLLAMA_HOST", "MLXR_KEEP_ALIVE", "MLXR_LOAD_TIMEOUT",
            "MLXR_MAX_QUEUE", "MLXR_MAX_REQUEST_BYTES", "MLXR_PREFIX_CACHE_BYTES",
            "MLXR_ORIGINS", "MLXR_DEBUG", "MLXR_OPENBLAS")
ENV_VALUES = st.one_of(DURATIONS.filter(lambda v: isinstance(v, str)), HOSTS,
                       st.sampled_from(["1GiB", "10 mb", "9" * 400, "1.5k", "-1", "0x10"]))


@SETTINGS
@given(env=st.dictionaries(st.sampled_from(ENV_KEYS), ENV_VALUES, max_size=4))
@example({"MLXR_MAX_REQUEST_BYTES": "9" * 400})  # was an OverflowError
def test_settings_from_the_environment(env):
    """A bad setting stops the server with a ValueError (or the duration's InvalidRequest)
    that names it, never another exception."""
    env = {k: v.replace("\x00", "") for k, v in env.items()}
    try:
        settings = Settings.from_env(env)
    except (ValueError, InvalidRequest):
        return
    assert 0 <= settings.port <= 65535 and settings.max_request_bytes >= 0


# -- NDJSON ------------------------------------------------------------------------------------

WIRE = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


@SETTINGS
@given(value=WIRE)
def test_ndjson_round_trip(value):
    line = dumps_line(value)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert loads(line) == value


@SETTINGS
@given(data=st.one_of(st.binary(max_size=40), s.TEXT,
                      st.sampled_from([b"[" * 2000, b'"\\ud800"', b"NaN", b"1e999", b""])))
def test_ndjson_reads_or_raises_a_value_error(data):
    try:
        loads(data)
    except ValueError:
        pass


# -- the runner protocol -----------------------------------------------------------------------

def round_trip(cls, obj) -> None:
    again = cls.from_dict(orjson.loads(orjson.dumps(obj.to_dict())))
    assert again.to_dict() == obj.to_dict()


COMPLETION = s.obj({"prompt": s.either(s.TEXT), "tokens": s.either(st.lists(s.NUMBER, max_size=3)),
                    "options": s.OPTIONS, "logprobs": s.BOOL, "top_logprobs": s.NUMBER,
                    "format": s.FORMAT, "add_special": s.BOOL,
                    "return_prompt_tokens": s.BOOL, "format_after": s.either(s.TEXT)})


@SETTINGS
@given(data=s.ANY | COMPLETION)
def test_completion_requests(data):
    """What the runner reads from the supervisor."""
    try:
        request = CompletionRequest.from_dict(data)
    except InvalidRequest:
        return
    round_trip(CompletionRequest, request)


@SETTINGS
@given(data=s.ANY | s.OPTIONS)
def test_options(data):
    try:
        options = Options.from_dict(data)
    except InvalidRequest:
        return
    assert Options.from_dict(orjson.loads(orjson.dumps(options.to_dict()))) == options


@SETTINGS
@given(data=s.ANY | s.obj({"input": s.EMBED_INPUT, "truncate": s.BOOL,
                           "dimensions": s.NUMBER}))
@example({"input": "x", "dimensions": 10**30})  # was accepted, and orjson cannot write it
def test_embed_requests(data):
    try:
        request = EmbedRequest.from_dict(data)
    except InvalidRequest:
        return
    round_trip(EmbedRequest, request)


IDS = s.either(st.lists(s.NUMBER, max_size=3))
LOGPROBS = s.either(st.lists(s.either(s.obj(required={"token": s.either(s.TEXT)},
                                            optional={"logprob": s.NUMBER,
                                                      "top_logprobs": s.ANY})), max_size=2))
CHUNK = s.obj({"content": s.either(s.TEXT), "done": s.BOOL,
               "done_reason": s.either(st.sampled_from(["stop", "length"])), "tokens": IDS,
               "logprobs": LOGPROBS, "prompt_eval_count": s.NUMBER, "eval_count": s.NUMBER,
               "prompt_tokens": IDS})
STATUS = s.obj(required={"status": s.either(st.sampled_from(["loading", "ready", "error"])),
                         "model": s.either(s.TEXT)},
               optional={"progress": s.NUMBER, "memory": s.NUMBER, "error": s.either(s.TEXT),
                         "capabilities": s.either(st.lists(s.TEXT, max_size=2))})
EMBEDDINGS = s.obj(required={"embeddings": s.either(st.lists(st.lists(
    st.floats(allow_nan=False, allow_infinity=False), max_size=3), max_size=2))},
    optional={"prompt_eval_count": s.NUMBER, "total_duration": s.NUMBER})


@SETTINGS
@given(data=s.ANY | CHUNK | STATUS | EMBEDDINGS)
@example({"tokens": "ab"})  # was a Chunk whose tokens were characters
@example({"status": "ready"})  # was a TypeError (no model)
@example([1])  # was a TypeError
def test_what_a_runner_sends(data):
    """What the supervisor reads from a runner: a reply that is not what its type says is a
    RunnerFailed naming the field, never a TypeError or a KeyError later."""
    for cls in (Chunk, RunnerStatus, EmbedResponse):
        try:
            obj = cls.from_dict(data)
        except RunnerFailed as err:
            assert "runner sent" in err.message
            continue
        if cls is Chunk:
            assert isinstance(obj.content, str) and isinstance(obj.done, bool)
            assert all(isinstance(t, int) for t in obj.tokens)
            for entry in obj.logprobs or []:
                entry["token"].encode()  # what the service does with each (with_bytes)
        round_trip(cls, obj)


@SETTINGS
@given(status=st.integers(min_value=0, max_value=999), message=s.TEXT, kind=s.ANY)
def test_errors_from_the_wire(status, message, kind):
    err = from_wire(status, message, kind)
    assert isinstance(err, MlxrError) and err.message == message

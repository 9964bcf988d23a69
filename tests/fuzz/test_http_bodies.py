"""Hostile bodies POSTed to a real `mlxr serve` over HTTP: generated JSON with wrong types
for every known field, huge numbers, NaN, deep nesting, lone surrogates, bytes that are not
UTF-8 and text that is not JSON, to every route that reads a body.

The property: never a 5xx (but a pull's 502, a registry failure: its names are moved to a
closed local port, so no test reaches a network), and every error in its API's shape:
Ollama's `{"error": "..."}`, OpenAI's error object, Anthropic's. A request that is valid
runs for real, on the fake runner (a few tokens, no weights), so a 2xx is checked too: no
stream carries an internal error.

One server for the module; its store holds `tiny` (the fake model: Qwen3's chat template,
thinking and tools), which the generated bodies name most of the time. Nothing generated
may replace or delete it: create and copy write other names."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.fuzz import strategies as s
from tests.harness.server import start_server, write_fake_model

pytestmark = pytest.mark.timeout(300)


def not_tiny(body: dict[str, Any]) -> dict[str, Any]:
    """The body with any name of `tiny` (names are case-insensitive) as "fuzzed", and no
    quantization (the quantizer is not a parser, and takes seconds)."""
    return {k: "fuzzed" if k in ("model", "name") and isinstance(v, str)
            and v.lower().startswith("tiny") else v
            for k, v in body.items() if k not in ("quantize", "quantization")}


def local(body: dict[str, Any]) -> dict[str, Any]:
    """A pull's names on a registry at a closed local port: refused at once, no network."""
    def moved(name: str) -> str:
        parts = name.split("/")
        parts = ["library", *parts] if len(parts) == 1 else parts[-2:] if len(parts) == 3 \
            else parts
        return "/".join(["127.0.0.1:9", *parts])
    return {k: moved(v) if k in ("model", "name") and isinstance(v, str) else v
            for k, v in body.items()}


ROUTES = dict(s.BODIES)
# Names create and copy may write: `tiny` stays as it is for every other example.
ROUTES["/api/create"] = s.CREATE.map(not_tiny)
ROUTES["/api/copy"] = s.obj(required={"source": s.MODEL, "destination": s.either(
    st.sampled_from(["fuzzed", "fuzzed:v2", "", "bad name", "a/b/c/d"]))})
ROUTES["/api/pull"] = s.PULL.map(local)
ROUTES["/api/delete"] = s.DELETE.map(not_tiny)
METHODS = {"/api/delete": "DELETE"}
EXAMPLES = 75  # per route: 13 routes


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env):
    tmp = tmp_path_factory.mktemp("fuzz-http")
    # No proxy: a pull from the closed local port fails at once.
    env = {k: v for k, v in subprocess_env.items() if "proxy" not in k.lower()}
    srv = start_server(tmp, env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                       MLXR_MAX_REQUEST_BYTES="1MiB", MLXR_REGISTRY_TIMEOUT="2s")
    try:
        model = write_fake_model(tmp / "tiny")
        config = json.loads((model / "config.json").read_text())  # a known context length
        (model / "config.json").write_text(json.dumps({**config,
                                                       "max_position_embeddings": 4096}))
        srv.client().create(model="tiny", from_=str(model))
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


# -- payloads ----------------------------------------------------------------------------------

def _deep(depth: int) -> bytes:
    return b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"


@st.composite
def payloads(draw, bodies: st.SearchStrategy[dict[str, Any]]) -> bytes:
    """A body as JSON text (NaN and Infinity where the body has them), or broken: cut short,
    with bytes that are not UTF-8, with a lone surrogate escape, nested too deep, not an
    object at all."""
    body = draw(bodies)
    raw = json.dumps(body).encode()
    how = draw(st.integers(0, 99))  # hypothesis leans to 0: mostly the body as it is
    if how < 80:
        return raw
    if how < 84:
        return raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    if how < 88:
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00",
                                                 b"\xf4\x90\x80\x80"])) + raw[at:]
    if how < 92:
        escape = draw(st.sampled_from([rb"\ud800", rb"\udfff", rb"\ud83d", rb"\u0000"]))
        return raw[:-1] + b', "s": "' + escape + b'"}' if raw.endswith(b"}") else raw
    if how < 96:
        return _deep(draw(st.integers(60, 5000)))
    return draw(st.sampled_from([b"", b" ", b"null", b"[]", b'"x"', b"1e999", b"NaN", b"{",
                                 b'{"model": "tiny"} trailing', b"\xef\xbb\xbf{}"]))


# -- the shape of an answer --------------------------------------------------------------------

def check_error(path: str, data: Any) -> None:
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and isinstance(data["error"]["type"], str)
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    elif path.startswith("/v1/"):
        err = data["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)
        assert set(err) == {"message", "type", "param", "code"}
    else:
        assert set(data) == {"error"} and isinstance(data["error"], str) and data["error"]


def check(path: str, resp: httpx.Response) -> None:
    status = resp.status_code
    allowed = status < 500 or (path == "/api/pull" and status == 502)
    assert allowed, f"{path} answered {status}: {resp.text[:500]}"
    if status >= 400:
        check_error(path, resp.json())
        return
    assert "internal error" not in resp.text, resp.text[:500]
    kind = resp.headers.get("content-type", "")
    if "ndjson" in kind:  # an error after the first line is the stream's last line
        lines = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
        for line in lines[:-1]:
            assert "error" not in line, line
    elif "json" in kind:
        resp.json()


def post(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.request(METHODS.get(path, "POST"), path, content=raw,
                        headers={"Content-Type": "application/json"})


# -- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", list(ROUTES))
@settings(s.SETTINGS, max_examples=EXAMPLES, deadline=30_000)
@given(data=st.data())
def test_no_body_is_a_server_error(http, path, data):
    raw = data.draw(payloads(ROUTES[path]), label="body")
    resp = post(http, path, raw)
    event(f"status {resp.status_code}")
    check(path, resp)


# Regressions: each was a 500 (or a hang) before its fix.
REFUSED = {
    "deep nesting (a RecursionError in json.loads)": ("/api/chat", _deep(3000)),
    "a lone surrogate (orjson cannot write it to the runner)": (
        "/api/generate", b'{"model": "tiny", "prompt": "\\ud800"}'),
    "NaN": ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"top_p": NaN}}'),
    "an integer option past 64 bits (orjson cannot write it)": ("/api/chat", json.dumps(
        {"model": "tiny", "options": {"num_predict": 1e30},
         "messages": [{"role": "user", "content": "x"}]}).encode()),
    "a range of a billion (a list of a billion items: out of memory)": ("/api/generate", json.dumps(
        {"model": "tiny", "prompt": "x", "template": "{{ range 1000000000 }}x{{ end }}"}).encode()),
    "2000 nested ifs (a RecursionError)": ("/api/generate", json.dumps(
        {"model": "tiny", "prompt": "x", "template": "{{ if 1 }}" * 2000}).encode()),
    "tool_calls not a list (a TypeError)": ("/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x", "tool_calls": 1}]}
    ).encode()),
    "tool call arguments nested 5000 deep (a RecursionError)": ("/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]}).encode()),
}
ANSWERED = {
    "a tool call without arguments (the chat template's tojson met Undefined)": (
        "/api/chat", json.dumps({"model": "tiny", "think": False, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
            {"role": "user", "content": "y"}], "options": {"num_predict": 2},
            "stream": False}).encode()),
    "a keep-alive past Go's longest duration (/api/ps overflowed a date)": (
        "/api/generate", json.dumps({"model": "tiny", "keep_alive": 1e300}).encode()),
    "a num_ctx past the model's (it asked for exabytes: a 507)": (
        "/api/generate", json.dumps({"model": "tiny", "prompt": "x", "stream": False,
                                     "options": {"num_ctx": 2**62, "num_predict": 2}}).encode()),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_a_400(http, case):
    path, raw = REFUSED[case]
    resp = post(http, path, raw)
    check(path, resp)
    assert resp.status_code == 400, resp.text[:300]


@pytest.mark.parametrize("case", list(ANSWERED))
def test_answered(http, case):
    path, raw = ANSWERED[case]
    resp = post(http, path, raw)
    check(path, resp)
    assert resp.status_code == 200, resp.text[:300]
    assert http.get("/api/ps").status_code == 200

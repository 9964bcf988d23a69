"""The interactive chat's line handling and the client's stream reader, with a fake server."""

from __future__ import annotations

import copy
import io
import json
import socket

import httpx
import pytest

from mlxr.supervisor.cli.chat import ChatSession, ReplyWriter, RunOptions, set_parameter
from mlxr.supervisor.cli.client import ApiClient, ServerError, ServerUnreachable


class FakeClient:
    """Records chat requests; replies "Hi!" (or raises what `fail` holds)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.fail: BaseException | None = None

    def chat(self, body):
        self.bodies.append(copy.deepcopy(body))
        yield {"message": {"role": "assistant", "content": "Hi"}, "done": False}
        if self.fail:
            raise self.fail
        yield {"message": {"role": "assistant", "content": "!"}, "done": True,
               "eval_count": 2, "eval_duration": 1_000_000}


@pytest.fixture
def session():
    return ChatSession(FakeClient(), RunOptions("m", options={"num_predict": 8}))


def test_turns_keep_the_conversation(session, capsys):
    session.handle("Hello")
    session.handle("")  # an empty line sends nothing
    session.handle("Again")
    first, second = session.client.bodies
    assert first == {"model": "m", "messages": [{"role": "user", "content": "Hello"}],
                     "options": {"num_predict": 8}}
    assert second["messages"] == [{"role": "user", "content": "Hello"},
                                  {"role": "assistant", "content": "Hi!"},
                                  {"role": "user", "content": "Again"}]
    assert capsys.readouterr().out == "Hi!\n\nHi!\n\n"


def test_multi_line_messages(session):
    assert session.handle('"""First line') and session.multiline == "prompt"
    session.handle("  middle")
    session.handle('last"""')
    session.handle('"""one line"""')
    sent = [b["messages"][-1]["content"] for b in session.client.bodies]
    assert sent == ["First line\n  middle\nlast", "one line"]
    assert session.multiline is None


def test_set_commands(session, capsys):
    session.handle("/set parameter num_predict 5")
    session.handle("/set parameter temperature 0.5")
    session.handle("/set parameter stop <a> <b>")
    session.handle("/set parameter stop <c>")
    session.handle("/set parameter top_k many")
    assert session.opts.options == {"num_predict": 5, "temperature": 0.5,
                                    "stop": ["<a>", "<b>", "<c>"]}
    out = capsys.readouterr().out
    assert "Set parameter 'stop' to '<a>, <b>'" in out
    assert "Couldn't set parameter: \"invalid int value for parameter top_k: 'many'\"" in out
    session.handle("/set system You are terse.")
    session.handle('/set system """Really')
    session.handle('terse."""')
    assert session.opts.system == "Really\nterse."
    assert session.opts.messages == [{"role": "system", "content": "Really\nterse."}]
    session.handle("/set format json")
    session.handle("/set think")
    session.handle("/set verbose")
    session.handle("Hi")
    body = session.client.bodies[-1]
    assert body["format"] == "json" and body["think"] is True
    assert body["messages"][0] == {"role": "system", "content": "Really\nterse."}
    assert "eval count:           2 token(s)" in capsys.readouterr().err


def test_clear_keeps_the_system_message(session, capsys):
    session.handle("/set system Be kind.")
    session.handle("Hello")
    session.handle("/clear")
    assert session.opts.messages == [{"role": "system", "content": "Be kind."}]
    assert "Cleared session context" in capsys.readouterr().out


def test_a_failed_or_interrupted_turn_is_dropped(session, capsys):
    session.client.fail = ServerError("runner crashed")
    session.handle("Hello")
    assert session.opts.messages == []
    assert "Error: runner crashed" in capsys.readouterr().err
    session.client.fail = KeyboardInterrupt()
    session.handle("Hello")
    assert session.opts.messages == []
    session.client.fail = None
    session.handle("Hello")
    assert len(session.opts.messages) == 2


def test_commands_that_end_or_are_unknown(session, capsys):
    assert session.handle("/bye") is False and session.handle("/exit") is False
    assert session.handle("/nope") is True
    assert "Unknown command '/nope'. Type /? for help" in capsys.readouterr().out
    session.handle("/?")
    assert 'Use """ to begin a multi-line message.' in capsys.readouterr().err


def test_set_parameter_types_like_a_modelfile():
    options: dict = {}
    set_parameter(options, "seed", ["42"])
    set_parameter(options, "top_p", ["1"])
    assert options == {"seed": 42, "top_p": 1.0}


def ndjson(*lines: dict) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def test_stream_raises_on_an_error_line_and_on_error_status():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/generate":
            return httpx.Response(200, content=ndjson({"response": "a", "done": False},
                                                      {"error": "runner crashed"}))
        return httpx.Response(404, json={"error": 'model "x" not found'})

    client = ApiClient("http://127.0.0.1:1", transport=httpx.MockTransport(handler))
    stream = client.generate({"model": "x"})
    assert next(stream)["response"] == "a"
    with pytest.raises(ServerError, match="runner crashed"):
        next(stream)
    with pytest.raises(ServerError, match='model "x" not found') as err:
        client.show("x")
    assert err.value.status == 404


def test_the_api_key_is_sent_as_a_bearer_token():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"models": []})

    ApiClient("http://127.0.0.1:1", api_key="k", transport=httpx.MockTransport(handler)).tags()
    ApiClient("http://127.0.0.1:1", transport=httpx.MockTransport(handler)).tags()
    assert seen == ["Bearer k", None]


def test_nothing_listening_is_server_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ServerUnreachable, match=f"could not connect to mlxr at {url}"):
        ApiClient(url).tags()
    with pytest.raises(ServerUnreachable):
        next(ApiClient(url).generate({"model": "x"}))


def test_reply_writer_frames_thinking():
    out = io.StringIO()
    writer = ReplyWriter(out, hide_thinking=False, plain=True)
    for content, thinking in (("", "Let me"), ("", " think"), ("Answer", ""), (".", "")):
        writer.write(content, thinking)
    assert out.getvalue() == "Thinking...\nLet me think\n...done thinking.\n\nAnswer."
    hidden = io.StringIO()
    writer = ReplyWriter(hidden, hide_thinking=True, plain=True)
    writer.write("", "secret")
    writer.write("Answer", "")
    assert hidden.getvalue() == "Answer"

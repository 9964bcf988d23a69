"""The service through the real aiohttp app, with a stand-in store and in-process fake runners
that record what they are sent: Modelfile defaults, prompts, options and validation."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mlxr.shared.config import Settings
from mlxr.shared.errors import ModelNotFound
from mlxr.shared.protocol import Chunk, RunnerStatus
from mlxr.supervisor.app import make_app

QWEN3_CONFIG = Path(__file__).resolve().parents[3] / "shared/assets/qwen3/tokenizer_config.json"


class Stream:
    def __init__(self, pieces: list[str], prompt_tokens: list[int] | None = None):
        self.pieces = pieces
        self.prompt_tokens = prompt_tokens

    async def __aiter__(self):
        for i, piece in enumerate(self.pieces):
            yield Chunk(content=piece, tokens=[100 + i])
        yield Chunk(done=True, done_reason="stop", prompt_eval_count=7, eval_count=len(self.pieces),
                    eval_duration=1000, prompt_tokens=self.prompt_tokens)


    async def aclose(self) -> None:
        pass


def fake_tokenize(content: str, add_special: bool) -> list[int]:
    return [len(content), int(add_special)]


class InProcessRunner:
    """Records each request and the prompt ids it makes, by the runner's rule (runner/server.py):
    `tokens`, then `prompt` tokenized, with the specials as `add_special` says (by default,
    unless `tokens` are given)."""

    def __init__(self, sent: list, encoded: list | None = None, calls: list | None = None):
        self.sent = sent
        self.encoded = [] if encoded is None else encoded
        self.calls = [] if calls is None else calls
        self.alive = True
        self.exited = asyncio.Event()

    async def status(self) -> RunnerStatus:
        return RunnerStatus("ready", "m", memory=1000, context_length=4096)

    async def tokenize(self, content: str, add_special: bool = False) -> list[int]:
        self.calls.append("tokenize")  # the service must not need it (a round trip)
        return fake_tokenize(content, add_special)

    async def complete(self, request) -> Stream:
        self.calls.append("complete")
        self.sent.append(request)
        ids = list(request.tokens or [])
        if request.prompt:
            add = request.add_special if request.add_special is not None else not ids
            ids += fake_tokenize(request.prompt, add)
        self.encoded.append(ids)
        return Stream(["Hel", "lo"], list(ids) if request.return_prompt_tokens else None)

    async def wait_exit(self) -> int:
        await self.exited.wait()
        return 0

    async def stop(self) -> None:
        self.alive = False
        self.exited.set()

    def stderr_tail(self) -> str:
        return ""


class StubStore:
    def __init__(self, root: Path):
        self.root = root
        self.records: dict[str, SimpleNamespace] = {}

    def add(self, name: str, chat_template: bool = True, **fields) -> None:
        d = self.root / name
        d.mkdir()
        if chat_template:
            shutil.copy(QWEN3_CONFIG, d / "tokenizer_config.json")
        defaults = dict(name=f"{name}:latest", digest="d" * 64, template=None, system=None,
                        params={}, messages=[], capabilities=["completion", "tools", "thinking"],
                        config={}, dir=d)
        self.records[name] = SimpleNamespace(**{**defaults, **fields})

    def resolve(self, name: str):
        try:
            return self.records[name.removesuffix(":latest")]
        except KeyError:
            raise ModelNotFound(f'model "{name}" not found, try pulling it first') from None

    def runner_dir(self, record) -> Path:
        return record.dir

    def gguf_source(self, record) -> None:
        return None

    def list(self):
        return list(self.records.values())


@pytest.fixture
def env(tmp_path):
    store = StubStore(tmp_path)
    sent: list = []
    encoded: list = []
    calls: list = []

    async def factory(spec):
        return InProcessRunner(sent, encoded, calls)

    settings = dataclasses.replace(Settings(), context_length=2048)

    def app():
        return make_app(settings, store=store, runner_factory=factory,
                        available_memory=lambda: 1 << 40)
    return SimpleNamespace(store=store, sent=sent, encoded=encoded, calls=calls, app=app)


def call(env, path: str, body: dict):
    """One request to a fresh app (an aiohttp app belongs to the loop that started it)."""
    async def main():
        async with TestClient(TestServer(env.app())) as client:
            resp = await client.post(path, json={"stream": False, **body})
            return resp.status, await resp.json()
    return asyncio.run(main())


def test_modelfile_parameters_are_defaults_that_requests_override(env):
    env.store.add("m", params={"temperature": 0.1, "num_predict": 3, "stop": ["END"]})
    status, body = call(env, "/api/chat", {"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "options": {"temperature": 0.7}, "think": False})
    assert status == 200 and body["message"]["content"] == "Hello"
    options = env.sent[0].options
    assert (options.temperature, options.num_predict, options.stop) == (0.7, 3, ["END"])
    assert options.num_ctx == 2048


def test_modelfile_system_and_messages(env):
    env.store.add("m", system="You are terse.",
                  messages=[{"role": "user", "content": "Q0"}, {"role": "assistant", "content": "A0"}])
    call(env, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "Q1"}],
                            "think": False})
    prompt = env.sent[0].prompt
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert prompt.index("Q0") < prompt.index("A0") < prompt.index("Q1")
    call(env, "/api/chat", {"model": "m", "think": False, "messages": [
        {"role": "system", "content": "Mine."}, {"role": "user", "content": "Q1"}]})
    assert "You are terse." not in env.sent[1].prompt and "Mine." in env.sent[1].prompt


def test_generate_prompt_paths(env):
    env.store.add("m")
    status, body = call(env, "/api/generate", {"model": "m", "prompt": "hi", "think": False})
    assert env.encoded[-1][1] == 0  # a chat template writes its own specials: no BOS
    assert body["context"] == env.encoded[-1] + [100, 101]
    call(env, "/api/generate", {"model": "m", "prompt": "more", "context": [1, 2, 3]})
    assert env.encoded[-1][:3] == [1, 2, 3]
    call(env, "/api/generate", {"model": "m", "prompt": "as is", "raw": True})
    assert env.sent[-1].prompt == "as is" and env.sent[-1].tokens is None
    status, body = call(env, "/api/generate", {"model": "m", "prompt": "x", "raw": True})
    assert "context" not in body
    call(env, "/api/generate", {"model": "m", "prompt": "P", "system": "S",
                                "template": "[{{ .System }}|{{ .Prompt }}]"})
    assert env.encoded[-1][1] == 1  # a Go template: the tokenizer adds BOS


def test_generate_context_comes_back_on_the_final_chunk_with_no_tokenize_call(env):
    """The reply's `context` is the prompt ids the runner sends back and the output's; the
    runner gets the same ids as tokenizing first and sending `context + ids` would give."""
    env.store.add("m")
    status, body = call(env, "/api/generate", {"model": "m", "prompt": "hi", "think": False})
    sent = env.sent[-1]
    assert status == 200 and env.calls == ["complete"]
    assert (sent.tokens, sent.add_special, sent.return_prompt_tokens) == (None, False, True)
    assert sent.prompt.endswith("<think>\n\n</think>\n\n")
    assert body["context"] == fake_tokenize(sent.prompt, False) + [100, 101]
    status, body = call(env, "/api/generate", {"model": "m", "prompt": "more",
                                               "context": body["context"]})
    sent = env.sent[-1]
    assert env.calls == ["complete", "complete"]
    assert sent.tokens == env.encoded[-2] + [100, 101] and sent.add_special is False
    assert body["context"] == sent.tokens + fake_tokenize(sent.prompt, False) + [100, 101]
    call(env, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert env.calls[-1] == "complete" and "tokenize" not in env.calls
    sent = env.sent[-1]
    assert (sent.tokens, sent.add_special, sent.return_prompt_tokens) == (None, None, False)


def test_suffix_needs_a_template_that_has_one(env):
    env.store.add("m")
    env.store.add("fim", chat_template=False, template="<PRE>{{ .Prompt }}<SUF>{{ .Suffix }}<MID>")
    status, body = call(env, "/api/generate", {"model": "m", "prompt": "a", "suffix": "b"})
    assert (status, body) == (400, {"error": '"m" does not support insert'})
    status, _ = call(env, "/api/generate", {"model": "fim", "prompt": "a", "suffix": "b"})
    assert status == 200 and env.encoded[-1][0] == len("<PRE>a<SUF>b<MID>")


def test_capability_and_input_checks(env):
    env.store.add("plain", capabilities=["completion"])
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "plain", "messages": user, "think": True}, '"plain" does not support thinking'),
        ({"model": "plain", "messages": user, "tools": [{"type": "function"}]},
         '"plain" does not support tools'),
        ({"model": "plain", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
         '"plain" does not support images'),
        ({"model": "plain", "messages": user, "options": {"temperature": "hot"}},
         'option "temperature" must be of type float32'),
        ({"model": "plain", "messages": "hi"}, "messages must be a list"),
        ({"messages": user}, "model is required"),
    ]
    for body, message in cases:
        status, reply = call(env, "/api/chat", body)
        assert (status, reply) == (400, {"error": message}), body
    status, reply = call(env, "/api/generate", {"model": "plain", "prompt": "x", "raw": True,
                                                "system": "s"})
    assert reply == {"error": "raw mode does not support template, system, or context"}
    status, reply = call(env, "/api/chat", {"model": "ghost", "messages": user})
    assert (status, reply["error"]) == (404, 'model "ghost" not found, try pulling it first')
    assert env.sent == []


def test_thinking_model_thinks_unless_told_not_to(env):
    env.store.add("m")
    call(env, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert not env.sent[-1].prompt.endswith("<think>\n\n</think>\n\n")
    call(env, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "think": False})
    assert env.sent[-1].prompt.endswith("<think>\n\n</think>\n\n")


def test_load_and_unload_without_a_prompt(env):
    env.store.add("m")
    status, body = call(env, "/api/chat", {"model": "m", "messages": [], "keep_alive": 0})
    assert body["done_reason"] == "unload" and body["message"] == {"role": "assistant",
                                                                    "content": ""}
    status, body = call(env, "/api/generate", {"model": "m"})
    assert body["done_reason"] == "load" and body["response"] == "" and env.sent == []

"""Gemma 4 end to end. With the fake runner forcing the output (a random model cannot be made
to think or call), the supervisor's side through the real `ollama`, `openai` and `anthropic`
clients: the thought channel goes to thinking, calls in Gemma 4's syntax to tool calls, and
with thinking off an empty thought block never reaches the content. With the real runner on
the random Gemma 4 model made a GGUF file: created with the ollama client, shown as gemma4 with
its capabilities, and a batch of mixed-length greedy requests token-identical to mlx-lm's own
generation of each alone (the sliding window crossed, KV-sharing layers and per-layer
embeddings in play)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from mlxr.supervisor.store.gguf.write import write_gguf
from mlxr.supervisor.store.random_model import write_random_model
from mlxr.supervisor.store.small_tokenizer import write_small_tokenizer
from tests.harness.server import serving, start_server, write_fake_model

pytestmark = pytest.mark.timeout(180)
Q = '<|"|>'
THOUGHT = "The user greets. Reply briefly."
ANSWER = f"<|channel>thought\n{THOUGHT}<channel|>Hello there!"
CALL = (f"<|channel>thought\nNeed the weather.<channel|>"
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>")
EMPTY = "<|channel>thought\n<channel|>Hi."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
HI = [{"role": "user", "content": "hi"}]
LONG = {"num_predict": 500}  # the fake runner's default length (16) would cut the output


@pytest.fixture(scope="module")
def fake(tmp_path_factory, subprocess_env):
    tmp = tmp_path_factory.mktemp("gemma4")
    outputs = {"answers": ANSWER, "calls": CALL, "empty": EMPTY}
    knobs = {"models": {f"{name}:latest": {"output": text} for name, text in outputs.items()}}
    server = start_server(tmp, subprocess_env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                          FAKE_RUNNER=json.dumps(knobs))
    model_dir = write_fake_model(tmp / "model")
    write_small_tokenizer(model_dir, "gemma4")  # its chat template: Gemma 4's
    for name in outputs:
        server.client().create(model=name, from_=str(model_dir))
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_splits_the_thought_channel_from_the_answer(fake, stream):
    client = fake.client()
    assert {"completion", "tools", "thinking"} <= set(client.show("answers").capabilities)
    reply = client.chat(model="answers", messages=HI, stream=stream, options=LONG)
    parts = list(reply) if stream else [reply]
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == "Hello there!"
    generated = client.generate(model="answers", prompt="hi", options=LONG)
    assert (generated.thinking, generated.response) == (THOUGHT, "Hello there!")


def test_ollama_tool_call_from_gemma4s_syntax(fake):
    reply = fake.client().chat(model="calls", messages=[{"role": "user", "content": "Paris?"}],
                               tools=TOOLS, options=LONG)
    assert reply.message.thinking == "Need the weather." and reply.message.content == ""
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris", "days": 2}


def test_thinking_off_asks_for_none_and_drops_an_empty_block(fake):
    client = fake.client()
    on = client.chat(model="empty", messages=HI, think=True, options=LONG)
    off = client.chat(model="empty", messages=HI, think=False, options=LONG)
    assert off.message.content == "Hi." and not off.message.thinking
    assert on.message.content == "Hi."
    # (the fake runner counts characters) on: "<|think|>\n" in a system turn of its own;
    # off: an empty thought block closes the prompt
    system = len("<|turn>system\n<|think|>\n<turn|>\n")
    assert on.prompt_eval_count - off.prompt_eval_count == \
        system - len("<|channel>thought\n<channel|>")


def test_openai_and_anthropic_clients_get_reasoning_and_calls(fake):
    oa = openai.OpenAI(base_url=fake.url + "/v1", api_key="x")
    reply = oa.chat.completions.create(model="answers", messages=HI, max_tokens=500)
    message = reply.choices[0].message
    assert message.content == "Hello there!" and message.model_extra["reasoning"] == THOUGHT
    called = oa.chat.completions.create(model="calls", messages=HI, tools=TOOLS, max_tokens=500)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert called.choices[0].finish_reason == "tool_calls"
    client = anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)
    answer = client.messages.create(model="answers", max_tokens=500, messages=HI)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in answer.content] == [("thinking", THOUGHT), ("text", "Hello there!")]
    tools = [{"name": "get_weather", "description": "The weather",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    used = client.messages.create(model="calls", max_tokens=500, messages=HI, tools=tools)
    assert used.stop_reason == "tool_use"
    use = next(b for b in used.content if b.type == "tool_use")
    assert (use.name, use.input) == ("get_weather", {"city": "Paris", "days": 2})


# -- the real model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("gemma4") / "g4", "gemma4")


@pytest.fixture(scope="module")
def real(tmp_path_factory, subprocess_env, gemma4):
    yield from serving(tmp_path_factory.mktemp("gemma4-server"), subprocess_env,
                       {"g4": gemma4})


def test_a_gguf_is_created_shown_and_batched_token_identical_to_mlx_lm(real, gemma4, tmp_path):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    client = real.client()
    path = write_gguf(gemma4, tmp_path / "g4.gguf", "F32")
    done = list(client.create(model="g4-gguf", files={path.name: client.create_blob(path)},
                              stream=True))
    assert done[-1].status == "success"
    shown = client.show("g4-gguf")
    assert shown.details.family == "gemma4"
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert shown.modelinfo["gemma4.attention.shared_kv_layers"] == 3

    model, tokenizer = load(str(gemma4))
    # 6 prompts, 4 to ~150 tokens: the longer ones cross the 64-token sliding window
    prompts = [" ".join(["river stone cloud"] * (1 + 9 * i)) for i in range(6)]
    lengths = [6 + 3 * i for i in range(6)]

    def alone(prompt: str, n: int) -> list[int]:
        steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=n,
                              sampler=make_sampler(0.0))
        return [int(t) for t, _ in steps]

    async def batch() -> list[list[int]]:
        async def one(http, prompt, n):
            r = await http.post(real.url + "/api/generate", json={
                "model": "g4-gguf", "prompt": prompt, "raw": True, "stream": False,
                "options": {"temperature": 0, "num_predict": n}})
            return r.json()

        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[one(http, p, n) for p, n in zip(prompts, lengths)])

    got = asyncio.run(batch())
    assert max(len(tokenizer.encode(p)) for p in prompts) > 64
    for prompt, n, reply in zip(prompts, lengths, got):
        assert reply["prompt_eval_count"] == len(tokenizer.encode(prompt))
        assert reply["response"] == tokenizer.decode(alone(prompt, n)), prompt[:30]

"""gpt-oss end to end: its harmony format through every API, and the model itself.

With the fake runner forcing the output (a random model cannot be made to write harmony
messages), the supervisor's side through the real `ollama`, `openai` and `anthropic` clients:
thinking, the answer and tool calls go to their fields, tool names are renamed and mapped back,
think levels reach the prompt. With the real runner on a random gpt_oss model: a batch of
mixed-length greedy requests is token-identical to mlx-lm's own generation of each alone (the
sliding window crossed), the harmony tokens reach the text, `think: false` with a JSON schema
gives JSON, and the model as a GGUF file with MXFP4 experts is created, shown and served."""

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
from tests.harness.runner_process import running
from tests.harness.server import serving, start_server, write_fake_model

pytestmark = pytest.mark.timeout(180)
ANSWER = ("<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello there!")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}')
TOOLS = [{"type": "function", "function": {
    "name": "get-weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}]
HI = [{"role": "user", "content": "hi"}]
THOUGHT = "The user greets. Reply briefly."
LONG = {"num_predict": 500}  # the fake runner's default length (16) would cut the output


@pytest.fixture(scope="module")
def fake(tmp_path_factory, subprocess_env):
    tmp = tmp_path_factory.mktemp("harmony")
    knobs = {"models": {"answers:latest": {"output": ANSWER}, "calls:latest": {"output": CALL}}}
    server = start_server(tmp, subprocess_env, MLXR_RUNNER_MODULE="tests.harness.fake_runner",
                          FAKE_RUNNER=json.dumps(knobs))
    model_dir = write_fake_model(tmp / "model")
    write_small_tokenizer(model_dir, "harmony")  # its chat template: harmony
    for name in ("answers", "calls"):
        server.client().create(model=name, from_=str(model_dir))
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_and_generate_split_thinking_from_the_answer(fake, stream):
    client = fake.client()
    assert {"completion", "tools", "thinking"} <= set(client.show("answers").capabilities)
    reply = client.chat(model="answers", messages=HI, stream=stream, options=LONG)
    parts = list(reply) if stream else [reply]
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == "Hello there!"
    generated = client.generate(model="answers", prompt="hi", options=LONG)
    assert (generated.thinking, generated.response) == (THOUGHT, "Hello there!")


def test_ollama_tool_call_under_the_users_name(fake):
    reply = fake.client().chat(model="calls", messages=[{"role": "user", "content": "Paris?"}],
                               tools=TOOLS, options=LONG)
    assert reply.message.thinking == "Need the weather." and reply.message.content == ""
    [call] = reply.message.tool_calls
    assert call.function.name == "get-weather" and call.function.arguments == {"city": "Paris"}


def test_think_levels_reach_the_prompt(fake):
    client = fake.client()

    def prompt_chars(think):  # the fake runner counts the prompt's characters
        return client.chat(model="answers", messages=HI, think=think).prompt_eval_count

    medium = prompt_chars(None)
    assert prompt_chars(True) == medium and prompt_chars("medium") == medium
    assert prompt_chars("high") == prompt_chars("max") == medium - 2  # "high" for "max"
    assert prompt_chars("low") == medium - 3
    # think false: the reply starts in the final channel
    assert prompt_chars(False) == medium + len("<|channel|>final<|message|>")


def test_openai_client_gets_reasoning_content_and_tool_calls(fake):
    oa = openai.OpenAI(base_url=fake.url + "/v1", api_key="x")
    reply = oa.chat.completions.create(model="answers", messages=HI, max_tokens=500)
    message = reply.choices[0].message
    assert message.content == "Hello there!" and message.model_extra["reasoning"] == THOUGHT
    called = oa.chat.completions.create(model="calls", messages=HI, tools=TOOLS, max_tokens=500)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get-weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert called.choices[0].finish_reason == "tool_calls"
    streamed = oa.chat.completions.create(model="answers", messages=HI, stream=True,
                                          max_tokens=500)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == THOUGHT


def test_anthropic_client_gets_a_thinking_block_then_text_or_a_tool_use(fake):
    client = anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)
    reply = client.messages.create(model="answers", max_tokens=500, messages=HI)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in reply.content] == [("thinking", THOUGHT), ("text", "Hello there!")]
    tools = [{"name": "get-weather", "description": "The weather",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    called = client.messages.create(model="calls", max_tokens=500, messages=HI, tools=tools)
    assert called.stop_reason == "tool_use"
    use = next(b for b in called.content if b.type == "tool_use")
    assert (use.name, use.input) == ("get-weather", {"city": "Paris"})


# -- the real model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("gpt_oss") / "oss", "gpt_oss")


def test_a_batch_of_mixed_prompts_is_token_identical_to_mlx_lm_alone(oss, subprocess_env):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    model, tokenizer = load(str(oss))
    # 8 prompts, 3 to 150 tokens: the longer ones cross the 64-token sliding window
    prompts = [" ".join(["river stone cloud"] * (1 + 7 * i)) for i in range(8)]
    lengths = [6 + 3 * i for i in range(8)]

    def alone(prompt: str, n: int) -> list[int]:
        steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=n,
                              sampler=make_sampler(0.0))
        return [int(t) for t, _ in steps]

    async def batch(url: str) -> list[list[int]]:
        async def one(client, prompt, n):
            tokens = []
            async with client.stream("POST", url + "/v1/completions", json={
                    "prompt": prompt, "options": {"temperature": 0, "num_predict": n}}) as r:
                async for line in r.aiter_lines():
                    tokens += json.loads(line).get("tokens", [])
            return tokens

        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client, p, n) for p, n in zip(prompts, lengths)])

    with running(oss, subprocess_env, num_parallel=8, prefill_chunk=48) as url:
        got = asyncio.run(batch(url))
    assert max(len(tokenizer.encode(p)) for p in prompts) > 64
    for prompt, n, tokens in zip(prompts, lengths, got):
        assert tokens == alone(prompt, n), prompt[:30]


@pytest.fixture(scope="module")
def real(tmp_path_factory, subprocess_env, oss):
    yield from serving(tmp_path_factory.mktemp("oss-server"), subprocess_env, {"oss": oss})


def test_the_harmony_tokens_reach_the_text_and_other_specials_do_not(real):
    oa = openai.OpenAI(base_url=real.url + "/v1", api_key="x")
    channel = str(2043)  # <|channel|> in the small harmony vocabulary
    text = oa.completions.create(model="oss", prompt="hi", max_tokens=3, temperature=0,
                                 logit_bias={channel: 100}).choices[0].text
    assert text == "<|channel|>" * 3
    bos = str(2039)  # <|startoftext|>: special, not structural
    text = oa.completions.create(model="oss", prompt="hi", max_tokens=3, temperature=0,
                                 logit_bias={bos: 100}).choices[0].text
    assert text == ""


def test_think_false_with_a_schema_answers_in_json(real):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"]}
    reply = real.client().chat(model="oss", messages=[{"role": "user", "content": "JSON"}],
                               format=schema, think=False,
                               options={"temperature": 0, "num_predict": 80})
    value = json.loads(reply.message.content)
    assert set(value) == {"city", "days"} and isinstance(value["days"], int)
    assert reply.message.thinking is None


def test_an_mxfp4_gguf_is_created_shown_and_served(real, oss, tmp_path):
    client = real.client()
    path = write_gguf(oss, tmp_path / "oss-mxfp4.gguf", "MXFP4")
    done = list(client.create(model="oss-gguf", files={path.name: client.create_blob(path)},
                              stream=True))
    assert done[-1].status == "success"
    shown = client.show("oss-gguf")
    assert shown.details.family == "gpt-oss" and shown.details.quantization_level == "MXFP4_MOE"
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    reply = client.generate(model="oss-gguf", prompt="river stone cloud", raw=True,
                            options={"temperature": 0, "num_predict": 8})
    assert reply.eval_count == 8 and reply.done_reason == "length"
    with httpx.Client(base_url=real.url) as http:
        held = {m["name"]: m.get("weights") for m in http.get("/api/ps").json()["models"]}
    # the mxfp4 experts as stored, on the CPU kernel (runner/mxfp4_kernel.py)
    assert held["oss-gguf:latest"] == "4-bit on the quantized kernel", held


def test_openais_own_checkpoint_layout_is_created_described_and_served(real, oss, tmp_path):
    # openai/gpt-oss-20b as Hugging Face has it: MXFP4 experts in blocks and scales
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    from tests.harness.gpt_oss import write_hf_gpt_oss

    hf = write_hf_gpt_oss(oss, tmp_path / "gpt-oss-hf")
    client = real.client()
    assert client.create(model="oss-hf", from_=str(hf)).status == "success"
    shown = client.show("oss-hf")
    assert shown.details.quantization_level == "MXFP4"
    assert shown.modelinfo["general.parameter_count"] == 8_689_984  # as the preset's
    prompt = "river stone cloud ember"
    reply = client.generate(model="oss-hf", prompt=prompt, raw=True,
                            options={"temperature": 0, "num_predict": 8})
    model, tokenizer = load(str(hf))
    steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=8,
                          sampler=make_sampler(0.0))
    assert reply.response == tokenizer.decode([int(t) for t, _ in steps])

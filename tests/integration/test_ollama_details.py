"""Ollama API details a client can see, and thinking, on a real `mlxr serve` with the real runner
and the tiny random qwen3 (real Qwen3 tokenizer and chat template), through the official
`ollama` and `openai` clients. Where the `ollama` client drops a field it does not model
(logprobs' `bytes`, `tensors`, `capabilities` in tags) or validates before sending, the test
reads the wire with plain HTTP."""

from __future__ import annotations

import datetime as dt
import json

import ollama
import openai
import pytest

from tests.harness.server import serving

pytestmark = pytest.mark.timeout(180)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0, "num_predict": 4}
THINK_CLOSE = "151668"  # Qwen3's </think>
# A legacy (.Prompt/.Response) template that opens the thinking section itself and shows the
# think values and dates the supervisor passes.
LEGACY = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
          "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n"
          "{{ if .Think }}<think>\n{{ end }}{{ .Response }}</think><|im_end|>\n")
PROBE = ("level={{ .ThinkLevel }} set={{ .IsThinkSet }} think={{ .Think }} "
         "today={{ currentDate }} yesterday={{ yesterdayDate }} <think></think>{{ .Prompt }}")
FIM = "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>"


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    gen = serving(tmp_path_factory.mktemp("details"), subprocess_env, {"tiny": tiny_model},
                  MLXR_KEEP_ALIVE="10m")
    server = next(gen)
    c = server.client()
    for name, template in (("legacy", LEGACY), ("probe", PROBE), ("fim", FIM)):
        c.create(model=name, from_="tiny", template=template)
    yield server
    gen.close()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return server.client()


@pytest.fixture(scope="module")
def oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _render(server, model: str, **body) -> str:
    with server.http() as http:
        r = http.post("/api/chat", json={"model": model, "_debug_render_only": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["_debug_info"]["rendered_template"]


# -- 1. think values and reasoning_effort -------------------------------------------------------

def test_think_levels_reach_go_templates(client, server):
    hi = [{"role": "user", "content": "hi"}]
    assert "level=high set=true think=true" in _render(server, "probe", messages=hi, think="high")
    assert "level=medium set=true think=true" in _render(server, "probe", messages=hi, think=True)
    assert "level= set=true think=false" in _render(server, "probe", messages=hi, think=False)
    reply = client.chat(model="tiny", messages=USER, think="low", options=GREEDY)
    assert reply.done_reason == "length"


@pytest.mark.parametrize("think,error", [
    ("extreme", 'invalid think value: "extreme" (must be "high", "medium", "low", "max", '
                'true, or false)'),
    (3, 'think must be a boolean or string ("high", "medium", "low", "max", true, or false)')])
def test_a_bad_think_is_a_400_in_ollamas_words(server, think, error):
    # the ollama client refuses these itself, so the wire is used
    with server.http() as http:
        r = http.post("/api/chat", json={"model": "tiny", "messages": USER, "think": think})
    assert (r.status_code, r.json()) == (400, {"error": error})


def test_reasoning_effort_maps_onto_think(oa):
    for effort in ("none", "minimal", "high"):
        reply = oa.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                           temperature=0, reasoning_effort=effort)
        assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model="tiny", messages=USER, reasoning_effort="huge")
    assert 'invalid reasoning value: "huge"' in info.value.message


# -- 2. format with thinking: think first, then the constrained answer --------------------------

def test_format_applies_after_the_thinking(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.chat(model="legacy", messages=USER, think=True, format=schema,
                        options={"num_predict": 200, "temperature": 0.8, "seed": 2,
                                 "logit_bias": {THINK_CLOSE: 2}})
    assert reply.message.thinking, "free thinking came first"
    assert reply.done_reason == "stop"
    assert isinstance(json.loads(reply.message.content)["ok"], bool)


# -- 3. roles are case-insensitive -------------------------------------------------------------

def test_roles_are_case_insensitive(client, oa):
    upper = [{"role": "USER", "content": "Why is the sky blue?"}]
    a = client.chat(model="tiny", messages=upper, think=False, options=GREEDY)
    b = client.chat(model="tiny", messages=USER, think=False, options=GREEDY)
    assert a.message.content == b.message.content and a.prompt_eval_count == b.prompt_eval_count
    c = oa.chat.completions.create(model="tiny", messages=upper, max_tokens=4, temperature=0)
    assert c.usage.prompt_tokens > 5


# -- 4. truncate -------------------------------------------------------------------------------

def test_an_over_long_chat_drops_its_oldest_turns(client, server):
    long = "the quick brown fox jumps over the lazy dog " * 12
    chat = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        chat += [{"role": "user", "content": f"{i} {long}"}, {"role": "assistant", "content": long}]
    chat.append({"role": "user", "content": "Last question?"})
    options = {**GREEDY, "num_ctx": 256}
    reply = client.chat(model="tiny", messages=chat, think=False, options=options)
    # Fewest messages dropped: one more (about 115 tokens each) would leave under 141.
    assert 256 - 115 < reply.prompt_eval_count < 256
    with server.http() as http:  # the ollama client has no `truncate` on chat
        r = http.post("/api/chat", json={"model": "tiny", "messages": chat, "think": False,
                                         "options": options, "truncate": False})
    assert r.status_code == 400 and "exceeds the context length" in r.json()["error"]


def test_a_reply_longer_than_num_ctx_shifts_unless_shift_is_false(client, server):
    options = {"temperature": 0, "num_predict": 90, "num_ctx": 64, "num_keep": 8}
    reply = client.generate(model="tiny", prompt="Tell me a story.", think=False, raw=True,
                            options=options)
    assert reply.eval_count == 90 and reply.done_reason == "length"
    with server.http() as http:  # the ollama client has no `shift`
        r = http.post("/api/generate", json={"model": "tiny", "prompt": "Tell me a story.",
                                             "raw": True, "think": False, "stream": False,
                                             "options": options, "shift": False})
    body = r.json()
    assert body["done_reason"] == "length"
    assert body["prompt_eval_count"] + body["eval_count"] == 64
    # The same greedy reply up to the shift.
    assert reply.response.startswith(body["response"])


# -- 5. tags, show, ps -------------------------------------------------------------------------

def test_tags_show_and_ps_details(client, server):
    with server.http() as http:
        tags = {m["name"]: m for m in http.get("/api/tags").json()["models"]}
        show = http.post("/api/show", json={"model": "tiny", "verbose": True}).json()
    tiny = tags["tiny:latest"]
    assert {"completion", "tools", "thinking"} <= set(tiny["capabilities"])
    assert tiny["details"]["context_length"] > 0
    assert "insert" in tags["fim:latest"]["capabilities"]
    assert "insert" in client.show("fim").capabilities
    assert "insert" not in client.show("tiny").capabilities
    names = {t["name"] for t in show["tensors"]}
    assert "model.embed_tokens.weight" in names and all(t["shape"] for t in show["tensors"])
    assert "tensors" not in http_show(server, "tiny")
    client.generate(model="probe", prompt="hi", options={"num_ctx": 512, "num_predict": 1})
    [running] = [m for m in client.ps().models if m.model == "probe:latest"]
    assert running.context_length == min(512, tiny["details"]["context_length"])


def http_show(server, model: str) -> dict:
    with server.http() as http:
        return http.post("/api/show", json={"model": model}).json()


def test_insert_uses_the_suffix(client):
    reply = client.generate(model="fim", prompt="def add(a, b):", suffix="    return c",
                            options=GREEDY)
    assert reply.eval_count == 4


# -- 6. version --------------------------------------------------------------------------------

def test_version_is_the_ollama_api_version(server):
    with server.http() as http:
        body = http.get("/api/version").json()
    assert body["version"] == "0.32.15" and body["mlxr_version"]


def test_status_says_the_cloud_is_off(server):
    """`ollama launch` reads it to leave cloud models out; mlxr serves none."""
    with server.http() as http:
        reply = http.get("/api/status")
        assert reply.status_code == 200
        assert reply.json() == {"cloud": {"disabled": True, "source": "none"}}
        assert http.head("/api/status").status_code == 200


# -- 7. logprobs bytes, load_duration ----------------------------------------------------------

def test_logprobs_carry_bytes_and_load_duration_is_measured(client, server):
    reply = client.chat(model="tiny", messages=USER, think=False, logprobs=True, top_logprobs=2,
                        options=GREEDY)
    assert reply.load_duration > 0 and reply.logprobs
    with server.http() as http:
        body = http.post("/api/generate", json={
            "model": "tiny", "prompt": "hi", "stream": False, "logprobs": True,
            "top_logprobs": 2, "think": False, "options": GREEDY}).json()
    assert body["load_duration"] > 0
    for entry in body["logprobs"]:
        assert entry["bytes"] == list(entry["token"].encode())
        assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])


# -- 8. /v1 tool results and models ------------------------------------------------------------

def test_v1_tool_result_by_call_id_and_model_by_name(oa):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
    reply = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       temperature=0)
    assert reply.usage.prompt_tokens > 20
    assert oa.models.retrieve("tiny").id == "tiny"
    assert oa.models.retrieve("tiny:latest").id == "tiny:latest"


# -- 9. body and option checks -----------------------------------------------------------------

def test_body_and_option_types(client, server):
    with server.http() as http:
        for path in ("/api/chat", "/api/generate", "/api/show"):
            r = http.post(path, content=b"")
            assert (r.status_code, r.json()) == (400, {"error": "missing request body"})
        r = http.post("/api/chat", json={"model": "tiny", "messages": USER, "stream": "yes"})
        assert r.status_code == 400 and "stream" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="tiny", prompt="hi", options={"num_predict": "four"})
    assert info.value.status_code == 400
    assert info.value.error == 'option "num_predict" must be of type integer'
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="tiny", prompt="hi", options={"use_mmap": 1})
    assert info.value.error == 'option "use_mmap" must be of type boolean'
    reply = client.generate(model="tiny", prompt="hi", think=False,
                            options={"num_predict": 2.9, "typical_p": 0.5, "num_keep": 4,
                                     "temperature": 0})
    assert reply.eval_count == 2  # truncated toward zero, as Go's int64(2.9)


# -- 10. Go template functions and continuing a reply ------------------------------------------

def test_yesterday_date_and_a_legacy_template_continues_the_reply(server):
    text = _render(server, "probe", messages=[{"role": "user", "content": "hi"}])
    today = dt.date.today()
    assert f"today={today.isoformat()}" in text
    assert f"yesterday={(today - dt.timedelta(days=1)).isoformat()}" in text
    prefill = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    legacy = _render(server, "legacy", messages=prefill, think=False)
    assert legacy.endswith("<|im_start|>assistant\n1, 2,")
    jinja = _render(server, "tiny", messages=prefill, think=False)
    assert jinja.endswith("1, 2,")

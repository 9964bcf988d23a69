"""Ollama's API on a real `mlxr serve` with the real runner and a real tiny model, driven by
the official `ollama` client."""

from __future__ import annotations

import asyncio
import time

import ollama
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.server import WEATHER_TOOLS, serving, wait_for

pytestmark = pytest.mark.timeout(180)
GREEDY = {"temperature": 0, "num_predict": 8}
TOOLS = WEATHER_TOOLS


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("api"), subprocess_env, {"tiny": tiny_model},
                       MLXR_MAX_REQUEST_BYTES="1MiB", MLXR_KEEP_ALIVE="10m")


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return server.client()


def test_root_version_and_head(server):
    with server.http() as http:
        root = http.get("/")
        assert root.status_code == 200 and root.text == "Ollama is running"
        assert http.head("/").status_code == 200
        assert http.get("/api/version").json()["version"]


def test_generate_streamed_and_not_agree(client):
    whole = client.generate(model="tiny", prompt="Why is the sky blue?", options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.prompt_eval_count > 5 and whole.eval_duration > 0
    assert whole.total_duration >= whole.load_duration >= 0
    parts = list(client.generate(model="tiny", prompt="Why is the sky blue?", options=GREEDY,
                                 stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].eval_count == 8 and parts[-1].context == whole.context
    # context = the prompt's tokens and the reply's: a continuation builds on it
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    follow = client.generate(model="tiny", prompt="And at night?", context=whole.context,
                             options=GREEDY)
    assert follow.prompt_eval_count > len(whole.context)


def test_raw_generate_has_no_context(client):
    reply = client.generate(model="tiny", prompt="1 2 3", raw=True, options=GREEDY)
    assert reply.eval_count == 8 and reply.context is None


def test_chat_streamed_and_not_agree(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    whole = client.chat(model="tiny", messages=messages, options=GREEDY, think=False)
    assert whole.message.role == "assistant" and whole.eval_count == 8
    assert whole.done_reason == "length"
    parts = list(client.chat(model="tiny", messages=messages, options=GREEDY, think=False,
                             stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_chat_prompt_uses_the_qwen3_template_with_tools(server, client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "think": False, "_debug_render_only": True}
    with server.http() as http:
        rendered = http.post("/api/chat", json=body).json()["_debug_info"]["rendered_template"]
    assert rendered.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in rendered
    assert rendered.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = client.chat(model="tiny", messages=body["messages"], tools=TOOLS, options=GREEDY)
    plain = client.chat(model="tiny", messages=body["messages"], options=GREEDY)
    assert reply.prompt_eval_count > plain.prompt_eval_count + 50  # the tool schema was sent


def test_show_list_copy_delete(client):
    names = [m.model for m in client.list().models]
    assert "tiny:latest" in names
    shown = client.show("tiny")
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    client.copy("tiny", "tiny-copy")
    assert "tiny-copy:latest" in [m.model for m in client.list().models]
    reply = client.generate(model="tiny-copy", prompt="hi", options=GREEDY, keep_alive=0)
    assert reply.eval_count == 8
    client.delete("tiny-copy")
    assert "tiny-copy:latest" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="tiny-copy", prompt="hi")
    assert info.value.status_code == 404
    assert info.value.error == 'model "tiny-copy" not found, try pulling it first'


def test_ps_load_and_unload(server, client):
    loaded = client.generate(model="tiny", keep_alive="10m")
    assert loaded.done_reason == "load" and loaded.response == ""
    [running] = [m for m in client.ps().models if m.model == "tiny:latest"]
    assert running.size > 0 and running.size_vram == 0 and running.context_length >= 2048
    assert running.details.family == "qwen3" and running.digest
    # The runner's KV block pool, as its /v1/status last reported it (re-read every 5 s: a
    # read that fell while the chat ran still counts its blocks as live, so wait for one after).
    client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options=GREEDY)
    deadline = time.monotonic() + 12
    while True:
        with server.http() as http:
            [entry] = [m for m in http.get("/api/ps").json()["models"]
                       if m["model"] == "tiny:latest"]
        settled = entry["kv"].get("blocks_used") and entry["kv"].get("live_bytes") == 0
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert entry["kv"]["block_size"] == 64 and entry["kv"]["blocks_total"] > 0
    assert entry["kv"]["blocks_used"] >= 1 and entry["kv"]["live_bytes"] == 0
    unloaded = client.chat(model="tiny", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload"
    assert "tiny:latest" not in server.ps_names()
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}],
                        options=GREEDY, keep_alive=0)
    assert reply.eval_count == 8
    assert "tiny:latest" not in server.ps_names()  # keep_alive 0: gone when the reply ends


def test_errors_have_ollama_shapes(server, client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "not found" in info.value.error
    with server.http() as http:
        assert http.post("/api/generate", json={"prompt": "x"}).json() == {
            "error": "model is required"}
        bad = http.post("/api/chat", content=b"{not json")
        assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]
        big = http.post("/api/generate", content=b'{"model": "' + b"x" * (2 << 20) + b'"}')
        assert big.status_code == 413
    for kwargs, message in (
            ({"images": [b"\x89PNG fake"]}, '"tiny" does not support images'),
            ({"keep_alive": "soon"}, 'invalid duration "soon"')):
        with pytest.raises(ollama.ResponseError) as info:
            client.generate(model="tiny", prompt="hi", **kwargs)
        assert info.value.status_code == 400 and info.value.error == message
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="tiny", prompt="word " * 400, options={"num_ctx": 64})
    assert info.value.status_code == 400 and "exceeds the context length" in info.value.error
    for endpoint in ("embed", "embeddings"):
        with pytest.raises(ollama.ResponseError) as info:
            getattr(client, endpoint)("nope", "hello")
        assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="tiny", input="hello", truncate=False, dimensions=10_000)
    assert info.value.status_code == 400 and "dimensions" in info.value.error


def test_64_concurrent_chat_streams(server):
    async def one(client: ollama.AsyncClient, i: int) -> tuple[int, int, str]:
        text, final = [], None
        async for part in await client.chat(
                model="tiny", messages=[{"role": "user", "content": f"Count to {i}"}],
                options={"temperature": 0, "num_predict": 12}, stream=True, think=False):
            text.append(part.message.content)
            final = part
        return final.eval_count, final.prompt_eval_count, "".join(text)

    async def main():
        client = ollama.AsyncClient(host=server.url)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert [r[0] for r in results] == [12] * 64
    assert all(r[1] > 0 for r in results)
    # the same prompt gives the same greedy text alone or inside a batch
    alone = server.client().chat(model="tiny", messages=[{"role": "user", "content": "Count to 7"}],
                                 options={"temperature": 0, "num_predict": 12}, think=False)
    assert results[7][2] == alone.message.content


def test_metrics_parse(server, client):
    client.generate(model="tiny", prompt="hi", options=GREEDY)
    with server.http() as http:
        resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in ("mlxr_requests", "mlxr_request_duration_seconds", "mlxr_prompt_tokens",
                 "mlxr_generated_tokens", "mlxr_time_to_first_token_seconds",
                 "mlxr_inter_token_seconds", "mlxr_queue_depth", "mlxr_loaded_models",
                 "mlxr_runner_memory_bytes"):
        assert name in families, name
    generated = [s for s in families["mlxr_generated_tokens"].samples
                 if s.name == "mlxr_generated_tokens_total"]
    assert sum(s.value for s in generated) >= 8
    routes = {s.labels.get("route") for s in families["mlxr_requests"].samples}
    assert "/api/generate" in routes
    memory = [s.value for s in families["mlxr_runner_memory_bytes"].samples]
    assert memory and all(v > 0 for v in memory)


def test_one_log_line_per_request(server, client):
    client.generate(model="tiny", prompt="log me", options=GREEDY)
    assert wait_for(lambda: any("POST /api/generate 200" in line and "eval_count=8" in line
                                for line in server.log().splitlines()))


def test_cors_for_local_pages_only(server):
    local = {"Origin": "http://localhost:3000"}
    with server.http() as http:
        pre = http.options("/api/chat", headers={**local, "Access-Control-Request-Method": "POST",
                                                 "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "content-type" in pre.headers["access-control-allow-headers"]
        with http.stream("POST", "/api/generate", headers=local, json={
                "model": "tiny", "prompt": "hi", "options": GREEDY}) as streamed:
            assert streamed.headers["access-control-allow-origin"] == "http://localhost:3000"
        evil = http.get("/api/tags", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in evil.headers


def test_push_then_pull_through_a_real_registry(server, client, tmp_path):
    from tests.harness.registry import start_registry

    registry = start_registry(tmp_path / "registry")
    try:
        name = f"{registry.host}/team/tiny:v1"
        client.copy("tiny", name)
        pushed = list(client.push(name, insecure=True, stream=True))
        assert pushed[-1].status == "success"
        client.delete(name)
        pulled = list(client.pull(name, insecure=True, stream=True))
        assert pulled[0].status == "pulling manifest" and pulled[-1].status == "success"
        reply = client.generate(model=name, prompt="Why is the sky blue?", options=GREEDY,
                                keep_alive=0)
        original = client.generate(model="tiny", prompt="Why is the sky blue?", options=GREEDY)
        assert reply.response == original.response
        client.delete(name)
    finally:
        registry.stop()

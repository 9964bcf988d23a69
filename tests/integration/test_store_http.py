"""The store's HTTP endpoints on a real aiohttp server, driven by the official `ollama` client
and by raw httpx requests for status codes and NDJSON framing."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import ollama
import pytest
from aiohttp import web

from mlxr.supervisor.api.keys import STORE
from mlxr.supervisor.api.middleware import error_middleware
from mlxr.supervisor.app import STORE_ROUTES
from mlxr.supervisor.store.store import Store
from tests.harness.registry import free_port


@pytest.fixture
def server(tmp_path):
    """(base URL, store) of an app with just the error middleware and the store routes."""
    store = Store(tmp_path / "models")
    port = free_port()
    started, stop = threading.Event(), None
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        app = web.Application(middlewares=[error_middleware])
        app[STORE] = store
        app.add_routes(STORE_ROUTES)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}", store
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


def ndjson(resp: httpx.Response) -> list[dict]:
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in resp.text.splitlines()]


def test_create_from_uploaded_blobs_list_show_copy_delete(server, tiny_model: Path):
    base, store = server
    client = ollama.Client(host=base)
    files = {p.name: client.create_blob(p) for p in sorted(tiny_model.iterdir())
             if p.name != "NOTICE"}
    for digest in files.values():
        assert httpx.head(f"{base}/api/blobs/{digest}").status_code == 200
    progress = list(client.create(model="demo", files=files, system="Be brief.",
                                  parameters={"stop": ["<|im_end|>"], "temperature": 0.3},
                                  stream=True))
    assert progress[-1].status == "success"

    listed = client.list().models
    assert [m.model for m in listed] == ["demo:latest"]
    assert listed[0].details.format == "safetensors" and listed[0].details.family == "qwen3"
    assert listed[0].size == sum(x["size"] for x in store.resolve("demo").manifest["layers"]) \
        + store.resolve("demo").manifest["config"]["size"]

    shown = client.show("demo")
    assert shown.details.quantization_level == "F32"
    assert shown.details.parameter_size.endswith("M")
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert httpx.post(f"{base}/api/show", json={"model": "demo"}).json()["system"] == "Be brief."
    assert shown.parameters.splitlines() == ['stop                           "<|im_end|>"',
                                             "temperature                    0.3"]
    assert "<|im_start|>" in shown.template  # the tokenizer's chat template
    assert "FROM demo:latest" in shown.modelfile and "SYSTEM Be brief." in shown.modelfile
    assert shown.modelinfo["general.architecture"] == "qwen3"
    assert shown.modelinfo["qwen3.embedding_length"] == 64

    client.copy("demo", "user/demo-copy:v2")
    assert sorted(m.model for m in client.list().models) == ["demo:latest", "user/demo-copy:v2"]
    client.delete("demo")
    assert [m.model for m in client.list().models] == ["user/demo-copy:v2"]
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("demo")
    assert info.value.status_code == 404


def test_blob_upload_verifies_the_digest(server):
    base, store = server
    data = b"some bytes"
    good = "sha256:" + __import__("hashlib").sha256(data).hexdigest()
    wrong = "sha256:" + "0" * 64
    resp = httpx.post(f"{base}/api/blobs/{wrong}", content=data)
    assert resp.status_code == 400 and "digest mismatch" in resp.json()["error"]
    assert httpx.head(f"{base}/api/blobs/{wrong}").status_code == 404
    assert httpx.post(f"{base}/api/blobs/{good}", content=data).status_code == 201
    assert httpx.post(f"{base}/api/blobs/{good}", content=data).status_code == 200
    assert httpx.head(f"{base}/api/blobs/{good}").status_code == 200
    assert httpx.post(f"{base}/api/blobs/sha256:xyz", content=data).status_code == 400
    assert not [p for p in store.blobs.root.iterdir() if "partial" in p.name]


@pytest.mark.parametrize("method, path, body, status, fragment", [
    ("POST", "/api/show", {"model": "bad name"}, 400, "invalid model name"),
    ("POST", "/api/show", {"model": "../../etc"}, 400, "invalid model name"),
    ("POST", "/api/show", {}, 400, "model is required"),
    ("POST", "/api/show", {"model": "nope"}, 404, 'model "nope" not found, try pulling it first'),
    ("DELETE", "/api/delete", {"name": "nope"}, 404, "not found"),
    ("POST", "/api/copy", {"source": "nope", "destination": "x"}, 404, "not found"),
    ("POST", "/api/copy", {"source": "nope"}, 400, "destination is required"),
    ("POST", "/api/create", {"model": "x", "random": {}, "quantize": "q3"}, 400, "quantization"),
    ("POST", "/api/create", {"model": "x:", "random": {}}, 400, "empty tag"),
    ("POST", "/api/create", {"model": "x", "from": "missing"}, 404, "not found"),
    ("POST", "/api/pull", {"model": "a/b/c/d"}, 400, "invalid model name"),
    ("POST", "/api/push", {"model": "nope"}, 404, "not found"),
    ("POST", "/api/pull", {"model": "x", "insecure": "yes"}, 400, "insecure must be"),
])
def test_errors_have_status_and_ollama_shape(server, method, path, body, status, fragment):
    base, _ = server
    resp = httpx.request(method, base + path, json=body)
    assert resp.status_code == status
    assert fragment in resp.json()["error"]


def test_create_streams_ndjson_or_answers_once(server):
    base, store = server
    resp = httpx.post(f"{base}/api/create", json={"model": "r", "random": {"seed": 2}},
                      timeout=60)
    lines = ndjson(resp)
    assert lines[0] == {"status": "reading model metadata"} and lines[-1] == {"status": "success"}
    resp = httpx.post(f"{base}/api/create", json={"model": "r2", "from": "r", "stream": False,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200 and resp.json() == {"status": "success"}
    shown = httpx.post(f"{base}/api/show", json={"name": "r2"}).json()
    assert shown["messages"] == [{"role": "user", "content": "hi"}]
    assert shown["model_info"]["general.description"].startswith("random test model")
    assert store.resolve("r2").digest != store.resolve("r").digest


def test_pull_error_after_streaming_began_is_the_last_line(server):
    base, _ = server
    unreachable = f"127.0.0.1:{free_port()}/library/x:latest"
    resp = httpx.post(f"{base}/api/pull", json={"model": unreachable, "insecure": True})
    lines = ndjson(resp)
    assert resp.status_code == 200
    assert lines[0] == {"status": "pulling manifest"}
    assert list(lines[-1]) == ["error"] and "ConnectError" in lines[-1]["error"]
    resp = httpx.post(f"{base}/api/pull", json={"model": unreachable, "insecure": True,
                                                "stream": False})
    assert resp.status_code == 502 and "ConnectError" in resp.json()["error"]

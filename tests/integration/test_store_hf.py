"""`pull hf.co/org/repo` through huggingface_hub.snapshot_download against a small local
aiohttp server that answers the Hub endpoints snapshot_download uses (repo info, tree,
resolve with HEAD metadata)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import pytest
from aiohttp import web

from mlxr.shared.errors import ModelNotFound
from mlxr.supervisor.store.store import Store
from mlxr.supervisor.store.transfer import pull_model
from tests.harness.registry import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_app(repo_id: str, files: dict[str, Path], requests: list[str]) -> web.Application:
    """The Hub endpoints for one model repository at one commit."""
    def known(request: web.Request) -> bool:
        return f"{request.match_info['org']}/{request.match_info['repo']}" == repo_id

    async def revision(request: web.Request) -> web.Response:
        requests.append(f"revision {request.match_info['rev']}")
        if not known(request):
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        return web.json_response({"id": repo_id, "modelId": repo_id, "sha": COMMIT,
                                  "siblings": [{"rfilename": n} for n in files]})

    async def tree(request: web.Request) -> web.Response:
        requests.append("tree")
        entries = []
        for name, path in files.items():
            data = path.read_bytes()
            entry = {"type": "file", "path": name, "size": len(data),
                     "oid": hashlib.sha1(data).hexdigest()}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def resolve(request: web.Request) -> web.StreamResponse:
        name = request.match_info["path"]
        requests.append(f"{request.method} {name}")
        if not known(request) or name not in files:
            return web.json_response({"error": "Entry not found"}, status=404,
                                     headers={"X-Error-Code": "EntryNotFound"})
        data = files[name].read_bytes()
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") \
            else hashlib.sha1(data).hexdigest()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"',
                   "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=data, headers={k: v for k, v in headers.items()
                                                 if k != "Content-Length"})

    app = web.Application()
    app.router.add_get("/api/models/{org}/{repo}/revision/{rev}", revision)
    app.router.add_get("/api/models/{org}/{repo}/tree/{rev:.*}", tree)
    app.router.add_route("*", "/{org}/{repo}/resolve/{rev}/{path:.*}", resolve)
    return app


@pytest.fixture
def hub(tiny_model):
    """(endpoint, request log) of a Hub serving the tiny random model as org/tiny-random."""
    requests: list[str] = []
    files = {p.name: p for p in sorted(tiny_model.iterdir())}
    files["README.md"] = tiny_model / "NOTICE"  # filtered out by allow_patterns
    loop, port = asyncio.new_event_loop(), free_port()
    runner = web.AppRunner(make_hub_app("org/tiny-random", files, requests))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", requests
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def pull(store: Store, name: str, endpoint: str) -> list[dict]:
    async def collect() -> list[dict]:
        return [x async for x in pull_model(store, name, hf_endpoint=endpoint)]
    return asyncio.run(collect())


def test_pull_from_hugging_face(hub, tiny_model, tmp_path):
    endpoint, requests = hub
    store = Store(tmp_path / "models")
    progress = pull(store, "hf.co/org/tiny-random", endpoint)
    assert progress[0] == {"status": "pulling org/tiny-random from Hugging Face"}
    assert progress[-1] == {"status": "success"}
    rec = store.resolve("hf.co/org/tiny-random:latest")
    assert rec.name == "hf.co/org/tiny-random:latest"
    assert rec.config["model_family"] == "qwen3" and rec.config["random"]["description"]
    run = store.runner_dir(rec)
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in tiny_model.iterdir())
    for p in tiny_model.iterdir():
        assert (run / p.name).read_bytes() == p.read_bytes()
    assert requests[:2] == ["revision main", "tree"] and "GET model.safetensors" in requests
    assert "GET README.md" not in requests and "HEAD README.md" not in requests
    assert list(store.tmp_dir.iterdir()) == []


def test_pull_of_an_unknown_hugging_face_repo(hub, tmp_path):
    endpoint, _ = hub
    with pytest.raises(ModelNotFound, match="not found on Hugging Face"):
        pull(Store(tmp_path / "models"), "hf.co/org/absent", endpoint)

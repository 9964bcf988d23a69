"""Hostile model files against a real `mlxr serve`: a safetensors directory or GGUF file with a
lying header or an absurd config.json is a 400 at create (POST /api/create, `mlxr create`,
a Hugging Face pull), and a model whose files were changed after create fails its load in the
runner with a message that reaches the client; the server keeps serving throughout."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from mlxr.shared.errors import InvalidModelFile
from mlxr.supervisor.store.store import Store
from mlxr.supervisor.store.transfer import pull_model
from tests.harness import runner_process
from tests.harness.server import free_port, start_server, write_fake_model
from tests.integration.test_store_hf import make_hub_app
from tests.unit.store.gguf.test_hostile_gguf import LLAMA, NORM, gguf, replace, u32

pytestmark = pytest.mark.timeout(120)


def safetensors(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


EMBED = "model.embed_tokens.weight"
# name -> (model.safetensors bytes or None, config.json changes, the message's telling part)
HOSTILE_DIRS = {
    "huge-header": (safetensors({}, length=1 << 50), {},
                    "model.safetensors: safetensors header length 1125899906842624 is larger "
                    "than the file (10 bytes)"),
    # MLX wraps this shape to 32-bit negatives and SIGSEGVs evaluating it.
    "wrapped-shape": (safetensors({EMBED: {"dtype": "F32", "shape": [1 << 31, 1 << 31],
                                           "data_offsets": [0, 0]}}, bytes(8)), {},
                      "model.safetensors: tensor 'model.embed_tokens.weight': shape "
                      "[2147483648, 2147483648] has a dimension outside 0 to 2147483647"),
    "short-data": (safetensors({EMBED: {"dtype": "F32", "shape": [16, 8],
                                        "data_offsets": [0, 512]}}, bytes(64)), {},
                   "data_offsets [0, 512] run past the end of the file"),
    "absurd-config": (None, {"hidden_size": 10 ** 9, "num_hidden_layers": 10 ** 6},
                      "config.json: hidden_size 1000000000 is out of range (1 to 262,144)"),
    "no-model-type": (None, {"model_type": None}, "config.json has no model_type"),
}


def hostile_dir(path: Path, weights: bytes | None, changes: dict) -> Path:
    write_fake_model(path)
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env):
    srv = start_server(tmp_path_factory.mktemp("hostile"), subprocess_env)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def blob_refs(http: httpx.Client, directory: Path) -> dict[str, str]:
    """Upload a directory's files as blobs; file name -> digest."""
    refs = {}
    for path in sorted(directory.iterdir()):
        data = path.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        assert http.post(f"/api/blobs/{digest}", content=data).status_code in (200, 201)
        refs[path.name] = digest
    return refs


def still_serving(server, http: httpx.Client, tmp_path: Path, name: str) -> None:
    assert server.proc.poll() is None
    good = write_fake_model(tmp_path / f"good-{name}")
    assert http.post("/api/create", json={"model": name, "from": str(good),
                                          "stream": False}).json() == {"status": "success"}
    assert name + ":latest" in [m["name"] for m in http.get("/api/tags").json()["models"]]


def test_create_from_hostile_safetensors_is_a_400(server, http, tmp_path):
    for name, (weights, changes, message) in HOSTILE_DIRS.items():
        directory = hostile_dir(tmp_path / name, weights, changes)
        resp = http.post("/api/create", json={"model": name, "from": str(directory)})
        assert resp.status_code == 400, resp.text
        assert message in resp.json()["error"], name
        # uploaded as blobs, as `mlxr create` and Ollama's client send a directory
        resp = http.post("/api/create", json={"model": name, "files": blob_refs(http, directory)})
        assert resp.status_code == 400, resp.text
        assert message in resp.json()["error"], name
    names = [m["name"] for m in http.get("/api/tags").json()["models"]]
    assert not any(n.split(":")[0] in HOSTILE_DIRS for n in names)
    still_serving(server, http, tmp_path, "after-safetensors")


def test_create_from_a_hostile_gguf_is_a_400(server, http, tmp_path):
    cases = {
        "counts.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60),
                        "counts.gguf: the GGUF header claims 1152921504606846976 metadata "
                        "entries, more than the 0 bytes left in the file can hold"),
        "layers.gguf": (gguf(replace(LLAMA, "llama.block_count",
                                     u32("llama.block_count", 10 ** 6)), [NORM], bytes(128)),
                        "layers.gguf: llama.block_count 1000000 is out of range"),
    }
    for file_name, (data, message) in cases.items():
        path = tmp_path / file_name
        path.write_bytes(data)
        resp = http.post("/api/create", json={"model": "g", "from": str(path)})
        assert resp.status_code == 400, resp.text
        assert message in resp.json()["error"]
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        assert http.post(f"/api/blobs/{digest}", content=data).status_code in (200, 201)
        resp = http.post("/api/create", json={"model": "g", "files": {file_name: digest}})
        assert resp.status_code == 400, resp.text
        assert message.split(": ", 1)[1] in resp.json()["error"]
    still_serving(server, http, tmp_path, "after-gguf")


def test_mlxr_create_reports_the_400(server, subprocess_env, tmp_path):
    weights, changes, message = HOSTILE_DIRS["wrapped-shape"]
    hostile_dir(tmp_path / "weights", weights, changes)
    env = {**subprocess_env, "MLXR_HOST": server.url.removeprefix("http://")}
    result = subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", "create", "cli-hostile",
                             "--from", "./weights"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert message in result.stderr


def tamper(server, directory: Path, file_name: str, data: bytes) -> None:
    """Overwrite the store's blob of a created model's file (its runner directory links to
    it), as a disk fault or another process might."""
    hex_digest = hashlib.sha256((directory / file_name).read_bytes()).hexdigest()
    blob = server.models_dir / "blobs" / f"sha256-{hex_digest}"
    blob.chmod(0o644)
    blob.write_bytes(data)


def test_a_model_changed_after_create_fails_its_load_with_a_clear_error(server, http, tmp_path):
    """config.json rewritten after create with a million layers (mlx_lm would spend minutes
    and gigabytes building them): the load fails at once, and the reason reaches the client in
    each API's error shape."""
    good = write_fake_model(tmp_path / "tampered")
    assert http.post("/api/create", json={"model": "tampered", "from": str(good),
                                          "stream": False}).status_code == 200
    tamper(server, good, "config.json", json.dumps({
        "model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 10 ** 6}).encode())
    message = "config.json: num_hidden_layers 1000000 is out of range (1 to 4,096)"
    resp = http.post("/api/generate", json={"model": "tampered", "prompt": "hi",
                                            "stream": False})
    assert resp.status_code == 400, resp.text  # the model's files are at fault
    error = resp.json()["error"]
    assert f"runner failed to load tampered:latest: failed to load model: {message}" in error
    assert "signal" not in error and "exited" not in error  # refused, not crashed
    resp = http.post("/v1/chat/completions", json={
        "model": "tampered", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400 and message in resp.json()["error"]["message"]
    assert http.get("/api/tags").status_code == 200 and server.proc.poll() is None


def test_a_runner_refuses_a_hostile_directory_and_says_why(subprocess_env, tmp_path,
                                                           monkeypatch):
    """The runner alone: its status says why the load failed, a completion gets that error,
    and the process is alive (no crash inside MLX)."""
    weights, _, message = HOSTILE_DIRS["wrapped-shape"]
    model = hostile_dir(tmp_path / "m", weights, {})
    seen: dict = {}

    def loaded(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
        """runner_process.wait_ready, but for any outcome of the load."""
        for _ in range(int(timeout * 10)):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                seen.update(httpx.get(url + "/v1/status", timeout=1).json())
            except httpx.HTTPError:
                pass
            if seen.get("status") in ("ready", "error"):
                seen["proc"] = proc
                return
            threading.Event().wait(0.1)
        raise TimeoutError("the runner neither loaded nor failed")

    monkeypatch.setattr(runner_process, "wait_ready", loaded)
    with runner_process.running(model, subprocess_env) as url:
        assert seen["status"] == "error"
        assert seen["error"] == f"failed to load model: {message}"
        assert seen["error_kind"] == "invalid_model_file"
        resp = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert resp.status_code == 400 and message in resp.text
        assert seen["proc"].poll() is None


def test_a_hostile_hugging_face_repo_is_refused_and_nothing_is_kept(tmp_path):
    weights, changes, message = HOSTILE_DIRS["huge-header"]
    repo = hostile_dir(tmp_path / "repo", weights, changes)
    files = {p.name: p for p in sorted(repo.iterdir())}
    loop, port = asyncio.new_event_loop(), free_port()
    runner = web.AppRunner(make_hub_app("org/hostile", files, []))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    store = Store(tmp_path / "models")

    async def pull() -> list[dict]:
        return [x async for x in pull_model(store, "hf.co/org/hostile",
                                            hf_endpoint=f"http://127.0.0.1:{port}")]
    try:
        with pytest.raises(InvalidModelFile, match=message.replace("(", "\\(").replace(")", "\\)")):
            asyncio.run(pull())
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert store.list() == [] and list(store.tmp_dir.iterdir()) == []

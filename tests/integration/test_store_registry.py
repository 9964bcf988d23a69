"""Push and pull against a real OCI registry (docker-registry 2.8) through a logging proxy:
round trip with Bearer-token auth, a pull killed with SIGKILL and resumed, shared concurrent
pulls, skipped uploads, a missing model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxr.shared.errors import ModelNotFound
from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.store import Store
from mlxr.supervisor.store.transfer import pull_model, push_model
from tests.harness.registry import Proxy, start_registry

ROOT = Path(__file__).resolve().parents[2]


def run(gen) -> list[dict]:
    async def collect() -> list[dict]:
        return [x async for x in gen]
    return asyncio.run(collect())


def greedy_tokens(model_dir: Path, n: int = 8) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))
    prompt = mx.array(tokenizer.encode("The store keeps every blob"))
    steps = generate_step(prompt, model, sampler=make_sampler(0.0))
    return [int(tok) for (tok, _), _ in zip(steps, range(n))]


def file_bytes(store: Store, name: str) -> dict[str, bytes]:
    run_dir = store.runner_dir(store.resolve(name))
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture
def proxy(registry):
    p = Proxy(f"http://{registry.host}").start()
    yield p
    p.release()
    p.stop()


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory):
    """A random tiny model pushed straight to the registry; returns (store, repository)."""
    store = Store(tmp_path_factory.mktemp("source") / "models")
    name = f"{registry.host}/library/tiny:latest"
    run(create_model(store, CreateRequest.from_json({"model": name, "random": {"seed": 3}})))
    run(push_model(store, name, insecure=True))
    return store, name


def test_push_delete_pull_round_trip_with_token_auth(registry, proxy, tmp_path):
    proxy.require_token = True
    store = Store(tmp_path / "models")
    name = f"{proxy.host}/alice/tiny:v1"
    run(create_model(store, CreateRequest.from_json({"model": name, "random": {"seed": 5},
                                                      "system": "You are tiny."})))
    before = store.resolve(name)
    files_before = file_bytes(store, name)
    tokens_before = greedy_tokens(store.runner_dir(before))

    progress = run(push_model(store, name, insecure=True))
    assert progress[0] == {"status": "retrieving manifest"}
    assert progress[-2:] == [{"status": "pushing manifest"}, {"status": "success"}]
    assert "repository:alice/tiny:push,pull" in proxy.tokens_issued
    assert all(r.authorized for r in proxy.log if r.method in ("PATCH", "PUT"))

    store.delete(name)
    assert list(store.blobs.root.iterdir()) == []
    with pytest.raises(ModelNotFound):
        store.resolve(name)

    progress = run(pull_model(store, name, insecure=True))
    assert progress[0] == {"status": "pulling manifest"}
    assert progress[-1] == {"status": "success"}
    layer = next(p for p in progress if p.get("digest"))
    assert layer["status"] == f"pulling {layer['digest'][7:19]}" and layer["total"] > 0
    after = store.resolve(name)
    assert after.digest == before.digest and after.system == "You are tiny."
    assert file_bytes(store, name) == files_before
    assert greedy_tokens(store.runner_dir(after)) == tokens_before


def test_killed_pull_resumes_with_range(pushed, proxy, tmp_path, subprocess_env):
    source, source_name = pushed
    store = Store(tmp_path / "models")
    name = f"{proxy.host}/library/tiny:latest"
    big = max(source.resolve(source_name).manifest["layers"], key=lambda x: x["size"])
    partial = store.blobs.download_partial(big["digest"][7:])
    proxy.stall_after = 3 << 20
    code = ("import asyncio, sys\nfrom pathlib import Path\n"
            "from mlxr.supervisor.store.store import Store\n"
            "from mlxr.supervisor.store.transfer import pull_model\n"
            "async def main():\n"
            "    async for _ in pull_model(Store(Path(sys.argv[1])), sys.argv[2], insecure=True):\n"
            "        pass\n"
            "asyncio.run(main())\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(store.root), name], cwd=ROOT,
                             env=subprocess_env)
    try:
        deadline = time.monotonic() + 30
        while not (partial.exists() and partial.stat().st_size >= 2 << 20):
            assert child.poll() is None and time.monotonic() < deadline, "pull did not stall"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    kept = partial.stat().st_size
    assert 0 < kept < big["size"]
    assert list(store.manifests_dir.iterdir()) == []  # no manifest before all blobs

    proxy.release()
    proxy.log.clear()
    progress = run(pull_model(store, name, insecure=True))
    assert progress[-1] == {"status": "success"}
    ranges = [r.range for r in proxy.blob_gets() if r.path.endswith(big["digest"])]
    assert ranges == [f"bytes={kept}-"]
    assert not [p for p in store.blobs.root.iterdir() if "partial" in p.name]
    rec = store.resolve(name)
    assert all(store.blobs.exists(x["digest"][7:]) for x in rec.manifest["layers"])
    assert rec.digest == source.resolve(source_name).digest
    assert file_bytes(store, name) == file_bytes(source, source_name)


def test_concurrent_pulls_of_one_model_share_the_work(pushed, proxy, tmp_path):
    store = Store(tmp_path / "models")
    name = f"{proxy.host}/library/tiny:latest"

    async def both() -> tuple[list[dict], list[dict]]:
        async def one() -> list[dict]:
            return [x async for x in pull_model(store, name, insecure=True)]
        return await asyncio.gather(one(), one())

    first, second = asyncio.run(both())
    assert first[-1] == second[-1] == {"status": "success"}
    gets = [r.path for r in proxy.blob_gets()]
    assert len(gets) == len(set(gets)) == len(store.resolve(name).manifest["layers"]) + 1


def test_second_push_skips_existing_blobs(pushed, proxy, tmp_path):
    source, name = pushed
    target = f"{proxy.host}/library/tiny:copy"
    source.copy(name, target)
    progress = run(push_model(source, target, insecure=True))
    assert progress[-1] == {"status": "success"}
    assert [r.method for r in proxy.log if r.method in ("POST", "PATCH")] == []
    assert [r.method for r in proxy.log if r.method == "PUT"] == ["PUT"]  # the manifest only


def test_pull_of_a_missing_model_fails_after_the_first_line(registry, proxy, tmp_path):
    store = Store(tmp_path / "models")
    items: list[dict] = []

    async def pull() -> None:
        async for x in pull_model(store, f"{proxy.host}/library/absent:latest", insecure=True):
            items.append(x)

    with pytest.raises(ModelNotFound, match="not found"):
        asyncio.run(pull())
    assert items == [{"status": "pulling manifest"}]
    assert list(store.manifests_dir.iterdir()) == []


def test_a_gguf_model_pulls_and_is_converted_once(registry, proxy, tmp_path):
    """Ollama's own format through a registry: the GGUF layer is pulled and converted to MLX
    before the manifest is written, so the model runs as soon as the pull succeeds."""
    from mlxr.supervisor.store import conversions
    from mlxr.supervisor.store.gguf.write import write_gguf
    from mlxr.supervisor.store.random_model import write_random_model

    source = Store(tmp_path / "source")
    gguf = write_gguf(write_random_model(tmp_path / "llama", arch="llama"),
                      tmp_path / "llama.gguf", "Q4_K_M")
    name = f"{proxy.host}/library/llama-gguf:q4"
    progress = run(create_model(source, CreateRequest.from_json({
        "model": name, "from": str(gguf), "template": "{{ .Prompt }}"})))
    assert any(p["status"] == "converting model to MLX" for p in progress)
    tokens = greedy_tokens(source.runner_dir(source.resolve(name)))
    run(push_model(source, name, insecure=True))

    store = Store(tmp_path / "models")
    progress = run(pull_model(store, name, insecure=True))
    converting = [p for p in progress if p["status"] == "converting model to MLX"]
    assert converting and converting[-1]["completed"] == converting[-1]["total"]
    statuses = [p["status"] for p in progress]
    assert statuses.index("converting model to MLX") < statuses.index("writing manifest")
    record = store.resolve(name)
    assert record.config["model_format"] == "gguf" and record.config["file_type"] == "Q4_K_M"
    assert record.template == "{{ .Prompt }}"
    source_hex = store.gguf_source(record)
    assert conversions.is_converted(store.root, source_hex)
    assert greedy_tokens(store.runner_dir(record)) == tokens
    # A second pull finds everything in place: nothing is converted again.
    again = run(pull_model(store, name, insecure=True))
    assert not [p for p in again if p["status"] == "converting model to MLX"]

"""The store on tmp_path: create from a directory / blobs / another model, manifests, atomic
writes, garbage collection, pins and the inter-process lock. No mlx here."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxr.shared.errors import InvalidRequest, ModelNotFound
from mlxr.supervisor.store import manifest as mf
from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.store import CorruptModel, Store

ROOT = Path(__file__).resolve().parents[3]
CHAT_TEMPLATE = "{% if tools %}tools{% endif %}{{ '<think>' }}{{ messages }}"


def make_hf_dir(path: Path, hidden: int = 8, seed: int = 0) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "num_hidden_layers": 1, "max_position_embeddings": 2048, "vocab_size": 32,
        "torch_dtype": "float32"}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (path / "README.md").write_text("not a model file")
    rng = np.random.default_rng(seed)
    save_file({"embed.weight": rng.standard_normal((32, hidden), dtype=np.float32),
               "norm.weight": np.ones(hidden, np.float32)}, str(path / "model.safetensors"))
    return path


def create(store: Store, body: dict) -> list[dict]:
    async def run() -> list[dict]:
        return [x async for x in create_model(store, CreateRequest.from_json(body))]
    return asyncio.run(run())


def blob_names(store: Store) -> set[str]:
    return {p.name for p in store.blobs.root.iterdir()}


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "models")


def test_create_from_directory(store, tmp_path):
    src = make_hf_dir(tmp_path / "src")
    progress = create(store, {"model": "demo", "from": str(src), "system": "Be brief.",
                              "parameters": {"stop": "</s>", "num_ctx": 512}})
    assert progress[0] == {"status": "reading model metadata"}
    assert progress[-2:] == [{"status": "writing manifest"}, {"status": "success"}]
    rec = store.resolve("demo")
    path = store.manifests_dir / "registry.ollama.ai/library/demo/latest"
    assert rec.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    m = mf.Manifest.from_bytes(path.read_bytes())
    assert m.config.media_type == mf.MEDIA_CONFIG
    by_name = {x.name: x for x in m.files()}
    assert set(by_name) == {"config.json", "tokenizer_config.json", "model.safetensors"}
    assert by_name["model.safetensors"].media_type == mf.MEDIA_TENSOR
    assert by_name["config.json"].media_type == mf.MEDIA_JSON
    assert rec.config["model_format"] == "safetensors" and rec.config["model_family"] == "llama"
    assert rec.config["file_type"] == "F32" and rec.config["model_type"] == "264"
    assert rec.capabilities == ["completion", "tools", "thinking"]
    assert rec.model_info["general.parameter_count"] == 32 * 8 + 8
    assert rec.model_info["llama.context_length"] == 2048
    assert rec.system == "Be brief." and rec.params == {"stop": ["</s>"], "num_ctx": 512}
    run = store.runner_dir(rec)
    for name in by_name:
        assert (run / name).is_symlink() and (run / name).read_bytes() == (src / name).read_bytes()
    assert not any("partial" in n for n in blob_names(store))
    assert not list(store.tmp_dir.glob("*")) if store.tmp_dir.exists() else True


def test_create_random_architecture_in_bfloat16(store):
    assert create(store, {"model": "g", "random": {"preset": "gemma3", "seed": 1,
                                                   "dtype": "bfloat16"}})[-1]["status"] == "success"
    record = store.resolve("g")
    assert record.config["model_family"] == "gemma3_text" and record.config["file_type"] == "BF16"
    assert "gemma3" in record.model_info["general.description"]


def test_create_from_uploaded_blobs_matches_directory(store, tmp_path):
    src = make_hf_dir(tmp_path / "src")
    create(store, {"model": "from-dir", "from": str(src)})
    files = {}
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        digest, _, _ = store.blobs.add_file(src / name)
        files[name] = f"sha256:{digest}"
    create(store, {"model": "from-files", "files": files})
    a, b = store.resolve("from-dir"), store.resolve("from-files")
    assert a.manifest == b.manifest and a.digest == b.digest  # same files, same model


def test_create_from_model_inherits_and_shares_blobs(store, tmp_path):
    create(store, {"model": "base", "from": str(make_hf_dir(tmp_path / "src")),
                   "system": "old", "parameters": {"temperature": 0.5, "top_k": 10},
                   "license": "MIT", "messages": [{"role": "user", "content": "hi"}]})
    create(store, {"model": "user/derived:v1", "from": "base", "system": "new",
                   "parameters": {"temperature": 0.9}})
    base, derived = store.resolve("base"), store.resolve("user/derived:v1")
    assert derived.name == "user/derived:v1"
    assert derived.system == "new" and derived.license == "MIT"
    assert derived.params == {"temperature": 0.9, "top_k": 10}
    assert derived.messages == [{"role": "user", "content": "hi"}]
    base_files = {x["digest"] for x in base.manifest["layers"] if x.get("name")}
    assert base_files <= {x["digest"] for x in derived.manifest["layers"]}

    before = blob_names(store)
    store.delete("base")  # shared blobs stay; the old system prompt and params go
    after = blob_names(store)
    assert {f"sha256-{d[7:]}" for d in base_files} <= after
    assert len(before - after) == 3  # base's config blob, system and params layers
    assert store.resolve("user/derived:v1").digest == derived.digest
    store.delete("user/derived:v1")
    assert blob_names(store) == set()


def test_replacing_a_model_collects_its_old_layers(store, tmp_path):
    src = make_hf_dir(tmp_path / "src")
    create(store, {"model": "demo", "from": str(src), "system": "one"})
    first = blob_names(store)
    create(store, {"model": "demo", "from": str(src), "system": "two"})
    second = blob_names(store)
    assert len(first) == len(second) and len(first - second) == 2  # system + config blob


def test_a_read_model_is_kept_until_its_manifest_changes(store, tmp_path):
    """The store keeps what it read of a model between requests; another writer's new
    manifest (another process: another Store on the same root), a deleted model and a
    removed runner directory are all seen at the next read."""
    src = make_hf_dir(tmp_path / "src")
    create(store, {"model": "demo", "from": str(src), "system": "one"})
    first = store.resolve("demo")
    assert store.resolve("demo") is first
    assert store.manifest_of(first) is store.manifest_of(first)
    other = Store(store.root)
    create(other, {"model": "demo", "from": str(src), "system": "two"})
    second = store.resolve("demo")
    assert second.system == "two" and second.digest != first.digest
    assert [x.name for x in store.list()] == ["demo:latest"]
    run = store.runner_dir(second)
    assert store.runner_dir(second) == run
    shutil.rmtree(store.runners_dir)
    assert store.runner_dir(second) == run and (run / "model.safetensors").is_file()
    other.delete("demo")
    with pytest.raises(ModelNotFound):
        store.resolve("demo")

@pytest.mark.parametrize("body, error, fragment", [
    ({"model": "x", "from": "nope"}, ModelNotFound, 'model "nope" not found'),
    ({"model": "x"}, InvalidRequest, "neither"),
    ({"model": "x", "from": "/no/such/dir"}, InvalidRequest, "not a directory"),
    ({"model": "x", "random": {"preset": "huge"}}, InvalidRequest,
     "an architecture (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, granite, qwen3_moe, "
     "gpt_oss, gemma4, mixtral, granitemoe, gemma4-moe, embeddinggemma) or a vision model "
     "(qwen2.5-vl, qwen2-vl, gemma3-vision)"),
    ({"model": "x", "random": {"preset": "llama", "dtype": "int8"}}, InvalidRequest,
     'unknown random dtype "int8"'),
    ({"model": "x", "random": {}, "quantize": "q3_K_M"}, InvalidRequest,
     'unsupported quantization type "q3_K_M"'),
    ({"model": "x", "files": {"config.json": "sha256:" + "0" * 64}}, InvalidRequest,
     "not found: upload it"),
    ({"model": "x", "files": {"../config.json": "sha256:" + "0" * 64}}, InvalidRequest,
     "invalid file name"),
    ({"model": "x", "files": {"m.gguf": "sha256:" + "0" * 64}}, InvalidRequest, "not found"),
    ({"model": "bad name", "random": {}}, InvalidRequest, "invalid model name"),
    ({"model": "x", "random": {}, "parameters": {"bogus": 1}}, InvalidRequest,
     "unknown parameter"),
])
def test_create_rejects_bad_requests_before_any_progress(store, body, error, fragment):
    with pytest.raises(error) as info:
        create(store, body)
    assert fragment in info.value.message
    assert list(store.manifests_dir.iterdir()) == []


def test_manifest_write_is_atomic(store, tmp_path, monkeypatch):
    create(store, {"model": "demo", "from": str(make_hf_dir(tmp_path / "src")), "system": "a"})
    path = store.manifests_dir / "registry.ollama.ai/library/demo/latest"
    old = path.read_bytes()

    def fail(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        create(store, {"model": "demo", "from": "demo", "system": "b"})
    assert path.read_bytes() == old
    assert os.listdir(path.parent) == ["latest"]  # no temporary file left behind


def test_manifest_naming_a_missing_blob_is_refused(store):
    cfg, _ = store.blobs.add_bytes(b"{}")
    m = mf.Manifest(mf.Layer(mf.MEDIA_CONFIG, f"sha256:{cfg}", 2),
                    [mf.Layer(mf.MEDIA_TENSOR, "sha256:" + "1" * 64, 5, name="w.safetensors")])
    from mlxr.supervisor.store.names import parse_name
    with pytest.raises(CorruptModel, match="missing blobs"):
        store.write_manifest(parse_name("demo"), m.to_bytes())
    with pytest.raises(ModelNotFound, match='model "demo" not found, try pulling it first'):
        store.resolve("demo")


def test_prune_spares_pinned_blobs_and_download_partials(store):
    kept, _ = store.blobs.add_bytes(b"pinned")
    gone, _ = store.blobs.add_bytes(b"orphan")
    store.blobs.download_partial("2" * 64).write_bytes(b"half")
    with store.pinned([kept]):
        assert store.prune() == 1
    assert store.blobs.exists(kept) and not store.blobs.exists(gone)
    assert store.blobs.download_partial("2" * 64).exists()
    assert store.prune() == 1 and not store.blobs.exists(kept)


def test_blob_writer_verifies_digest(store):
    w = store.blobs.writer("3" * 64)
    w.write(b"not that")
    with pytest.raises(InvalidRequest, match="digest mismatch"):
        w.commit()
    w.abort()
    assert blob_names(store) == set()


def test_store_lock_excludes_another_process(store):
    code = ("import sys, time; from pathlib import Path; from mlxr.supervisor.store.files "
            "import StoreLock\nwith StoreLock(Path(sys.argv[1])).held():\n"
            "    print('locked', flush=True); time.sleep(0.6)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(store.root / ".lock")],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        start = time.monotonic()
        with store.lock.held():
            waited = time.monotonic() - start
    finally:
        child.wait(10)
    assert waited > 0.3


def _ollama_made(store: Store, name: str, gguf_kv: dict, template: str | None) -> None:
    """A GGUF model as Ollama writes it into its store: a config blob naming no capabilities,
    the GGUF as the model layer, the Go template as a layer of its own."""
    import gguf

    path = store.root / "made.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_kv.pop("general.architecture"))
    for key, value in gguf_kv.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str)
                             else gguf.GGUFValueType.UINT32)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layers = []
    for media, data in ((mf.MEDIA_MODEL, path.read_bytes()),
                        *([(mf.MEDIA_TEMPLATE, template.encode())] if template else [])):
        digest = hashlib.sha256(data).hexdigest()
        (store.blobs.root / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)})
    config = json.dumps({"model_format": "gguf", "model_family": "x"}).encode()
    digest = hashlib.sha256(config).hexdigest()
    (store.blobs.root / f"sha256-{digest}").write_bytes(config)
    manifest = {"schemaVersion": 2, "mediaType": mf.MEDIA_MANIFEST,
                "config": {"mediaType": mf.MEDIA_CONFIG, "digest": f"sha256:{digest}",
                           "size": len(config)}, "layers": layers}
    from mlxr.supervisor.store.names import parse_name

    store.write_manifest(parse_name(name), json.dumps(manifest).encode())


@pytest.mark.parametrize("kv, template, caps", [
    ({"general.architecture": "nomic-bert"}, None, ["embedding"]),
    ({"general.architecture": "qwen3", "qwen3.pooling_type": 3}, None, ["embedding"]),
    ({"general.architecture": "qwen3"}, "{{ .Prompt }}{{ if .Tools }}{{ .Tools }}{{ end }}"
     "{{ if .Think }}<think>{{ end }}", ["completion", "tools", "thinking"]),
    ({"general.architecture": "qwen3", "tokenizer.chat_template": CHAT_TEMPLATE}, None,
     ["completion", "tools", "thinking"]),
    ({"general.architecture": "llama"}, "{{ .Prompt }}", ["completion"]),
])
def test_ollama_made_gguf_models_get_the_capabilities_ollama_derives(store, kv, template, caps):
    store.blobs.root.mkdir(parents=True, exist_ok=True)
    _ollama_made(store, "made", dict(kv), template)
    assert store.resolve("made").capabilities == caps

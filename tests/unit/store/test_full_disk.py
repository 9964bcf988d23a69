"""A full disk while the store writes, in-process: the store's `open` is replaced by a quota
(tests/harness/full_disk.py) that fails with ENOSPC once the files under the store's root
would pass it. Each failure is an InsufficientStorage (507) that names what was being
written, and the store is left as it was: no manifest, no blob under a final name, no
partial or temporary file, and the disk space the failed operation took given back."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from mlxr.shared.errors import InsufficientStorage
from mlxr.supervisor.store import create as create_module
from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.gguf.write import write_gguf
from mlxr.supervisor.store.names import parse_name
from mlxr.supervisor.store.random_model import write_random_model
from mlxr.supervisor.store.store import Store
from tests.harness.full_disk import DiskQuota


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "models")


@pytest.fixture
def quota(store, monkeypatch) -> DiskQuota:
    return DiskQuota(store.root, 1 << 40).install(monkeypatch)


def create(store: Store, **body) -> tuple[list[dict], BaseException | None]:
    """Run a create to its end: (progress items, the error it ended with or None)."""
    items: list[dict] = []

    async def go() -> None:
        async for item in create_model(store, CreateRequest.from_json(body)):
            items.append(item)

    try:
        asyncio.run(go())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return items, exc
    return items, None


def snapshot(root: Path) -> dict[str, int]:
    """Every file under the store's root but its lock (relative path -> size)."""
    return {str(p.relative_to(root)): p.lstat().st_size for p in root.rglob("*")
            if (p.is_file() or p.is_symlink()) and p.name != ".lock"}


def leftovers(store: Store) -> list[str]:
    """Partial, temporary and work files that a finished operation must not leave."""
    out = [p.name for p in store.blobs.root.iterdir() if "partial" in p.name]
    out += [p.name for p in store.root.rglob(".tmp-*")]
    if store.tmp_dir.is_dir():
        out += [p.name for p in store.tmp_dir.iterdir()]
    return out


def test_a_blob_that_does_not_fit_is_a_507_and_its_partial_file_is_removed(store, quota):
    data = os.urandom(300_000)
    quota.set_limit(100_000)
    with pytest.raises(InsufficientStorage) as info:
        store.blobs.add_bytes(data)
    hex_digest = hashlib.sha256(data).hexdigest()
    assert info.value.status == 507
    assert info.value.message.startswith(
        f"no space left on device while writing blob sha256:{hex_digest}")
    assert "partial file was removed" in info.value.message
    assert quota.failures == 1
    assert list(store.blobs.root.iterdir()) == [] and quota.used() == 0
    # The space is free again: a blob that fits is stored.
    small = os.urandom(50_000)
    assert store.blobs.add_bytes(small) == (hashlib.sha256(small).hexdigest(), True)


def test_a_create_that_fills_the_disk_leaves_the_store_as_it_was(store, quota, llama_dir,
                                                                  tmp_path):
    _, err = create(store, model="kept", random={"preset": "llama", "seed": 1})
    assert err is None
    before, used = snapshot(store.root), quota.used()
    source = tmp_path / "source"
    shutil.copytree(llama_dir, source)
    (source / "generation_config.json").write_text('{"do_sample": false}')  # a new small blob
    # Room for the small files of the new model, not for its weights.
    quota.set_limit(used + 1_000_000)
    items, err = create(store, model="big", **{"from": str(source)})
    assert isinstance(err, InsufficientStorage), err
    assert items[0] == {"status": "reading model metadata"}
    assert sum(x["status"].startswith("creating new layer") for x in items) == 1
    assert err.message.startswith("no space left on device while writing a blob of "
                                  f"{source / 'model.safetensors'}: its partial file was removed")
    assert "(creating big:latest: the store is unchanged)" in err.message
    assert snapshot(store.root) == before and quota.used() == used
    assert leftovers(store) == []
    assert [r.name for r in store.list()] == ["kept:latest"]


def test_a_failed_create_keeps_the_blobs_it_did_not_write(store, quota, llama_dir):
    """Uploaded blobs (POST /api/blobs) that a failed create named are not its to discard."""
    files = {}
    for path in sorted(llama_dir.iterdir()):
        hex_digest, _, _ = store.blobs.add_file(path)
        files[path.name] = f"sha256:{hex_digest}"
    before = snapshot(store.root)
    quota.set_limit(quota.used() + 600)  # the template fits, the config blob does not
    items, err = create(store, model="m", files=files, template="{{ .Prompt }}")
    assert isinstance(err, InsufficientStorage), err
    assert snapshot(store.root) == before
    assert leftovers(store) == []


def test_a_manifest_that_does_not_fit_leaves_the_old_one(store, quota):
    _, err = create(store, model="m", random={"preset": "llama", "seed": 2})
    assert err is None
    path = store.manifest_file(parse_name("m"))
    old = path.read_bytes()
    quota.set_limit(quota.used())  # not one byte more
    with pytest.raises(InsufficientStorage) as info:
        store.write_manifest(parse_name("m"), old.replace(b"}", b"} ", 1))
    assert info.value.message.startswith(f"no space left on device while writing {path}")
    assert path.read_bytes() == old
    assert leftovers(store) == []


def fails_like_a_full_disk(tmp_path: Path) -> Path:
    """A stand-in for the Python that runs the quantizer and the GGUF converter: it writes
    part of its output, then dies of ENOSPC with a real traceback."""
    script = tmp_path / "full-disk-python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import errno, os, sys\nfrom pathlib import Path\n"
        "out = Path(sys.argv[4] if sys.argv[1] == '-m' else sys.argv[3])\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'model.safetensors').write_bytes(bytes(4096))\n"
        f"raise OSError({errno.ENOSPC}, os.strerror({errno.ENOSPC}), "
        "str(out / 'model.safetensors'))\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_quantization_that_fills_the_disk_is_a_507_and_leaves_nothing(
        store, llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(create_module.sys, "executable", str(fails_like_a_full_disk(tmp_path)))
    items, err = create(store, model="q", quantize="q4", **{"from": str(llama_dir)})
    assert isinstance(err, InsufficientStorage), err
    assert any(x["status"].startswith("quantizing") for x in items)
    assert err.message.startswith("no space left on device while quantizing (its partial "
                                  "output was removed)")
    assert "[Errno 28] No space left on device" in err.message
    assert snapshot(store.root) == {} and leftovers(store) == []


def test_a_gguf_conversion_that_fills_the_disk_is_a_507_and_leaves_nothing(
        store, llama_dir, tmp_path, monkeypatch):
    gguf = write_gguf(llama_dir, tmp_path / "llama.gguf", "F16")
    monkeypatch.setattr(create_module.sys, "executable", str(fails_like_a_full_disk(tmp_path)))
    items, err = create(store, model="g", **{"from": str(gguf)})
    assert isinstance(err, InsufficientStorage), err
    assert any(x["status"] == "converting model to MLX" for x in items)
    assert err.message.startswith("no space left on device while converting the GGUF model "
                                  "to MLX (its partial output was removed)")
    assert snapshot(store.root) == {} and leftovers(store) == []


def test_a_hugging_face_download_that_fills_the_disk_is_a_507_and_keeps_nothing(
        store, monkeypatch):
    import huggingface_hub

    from mlxr.supervisor.store.hf import pull_huggingface

    def download(*, local_dir, **_):
        Path(local_dir).mkdir(parents=True)
        (Path(local_dir) / "model.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    before = snapshot(store.root)
    with pytest.raises(InsufficientStorage) as info:
        asyncio.run(pull_huggingface(store, parse_name("hf.co/org/repo"), lambda item: None))
    assert info.value.status == 507 and "pulling org/repo from Hugging Face" in info.value.message
    assert snapshot(store.root) == before and leftovers(store) == []

"""Pulls from a registry that misbehaves, and a full disk, through a real `mlxr serve`.

The registry (tests/harness/hostile_registry.py) runs in the test process; each test adds its
own repository with one fault. Every fault ends the pull with a clear error line, in bounded
time (MLXR_REGISTRY_TIMEOUT=1s here) and bounded bytes, with nothing in the store under a
final name (no manifest, no blob), and the server goes on serving. The full-disk test runs
`mlxr serve` over a disk quota (tests/harness/full_disk.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxr.supervisor.store.registry_client import MAX_MANIFEST_BYTES
from tests.harness.full_disk import start_full_disk_server
from tests.harness.hostile_registry import (MEDIA_CONFIG, MEDIA_MANIFEST, MEDIA_TENSOR,
                                            HostileRegistry, digest_of, model_manifest)
from tests.harness.server import Server, start_server, write_fake_model

SLACK_BYTES = 16 << 20  # what socket buffers may take in after a client stops reading
TIME_BOUND_S = 10.0


@pytest.fixture(scope="module")
def registry():
    reg = HostileRegistry().start()
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env):
    s = start_server(tmp_path_factory.mktemp("faults"), subprocess_env,
                     MLXR_REGISTRY_TIMEOUT="1s")
    yield s
    s.stop()


def post_lines(server: Server, path: str, body: dict) -> tuple[list[dict], float]:
    """An NDJSON endpoint's lines, and how long it took."""
    start = time.monotonic()
    with server.http() as http:
        resp = http.post(path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return [json.loads(line) for line in resp.text.splitlines()], time.monotonic() - start


def pull(server: Server, name: str) -> tuple[list[dict], float]:
    return post_lines(server, "/api/pull", {"model": name, "insecure": True})


def weights(size: int) -> bytes:
    return os.urandom(size)  # a blob no other test shares


def blob_files(server: Server) -> dict[str, int]:
    root = server.models_dir / "blobs"
    return {p.name: p.stat().st_size for p in root.iterdir()} if root.is_dir() else {}


def manifests(server: Server) -> list[str]:
    root = server.models_dir / "manifests"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def assert_nothing_stored(server: Server, blobs: dict[str, bytes], repository: str) -> None:
    """No manifest for the repository, and no blob of it under its final name."""
    assert not [m for m in manifests(server) if repository in m]
    stored = blob_files(server)
    for digest in blobs:
        assert f"sha256-{digest[7:]}" not in stored


def assert_still_serving(server: Server) -> None:
    assert server.proc.poll() is None
    with server.http() as http:
        assert http.get("/api/version").status_code == 200
        assert http.get("/api/tags").status_code == 200


# Faults of the registry's behaviour: (fault, the error line says, partial file kept).
BEHAVIOUR = [
    ("wrong_blob", "the registry sent data that does not match its digest, twice", False),
    ("long_blob", "past the 300000 bytes the manifest declares", False),
    ("endless_blob", "the registry sent more than the 300000 bytes the manifest declares", False),
    ("short_blob", "the registry ended the blob after 150000 of 300000 bytes", True),
    ("redirect_loop", "redirected more than 10 times", False),
    ("stall_blob", "sent nothing for 1s (MLXR_REGISTRY_TIMEOUT)", True),
    ("drip_blob", "bytes in 1s (less than 1024 bytes a second)", True),
    ("stall_manifest", "sent nothing for 1s (MLXR_REGISTRY_TIMEOUT)", False),
    ("drip_manifest", "bytes in 1s (less than 1024 bytes a second)", False),
    ("huge_manifest", f"manifest is too large ({1 << 40} bytes, at most {MAX_MANIFEST_BYTES})",
     False),
    ("endless_manifest", f"manifest is too large (more than {MAX_MANIFEST_BYTES} bytes)", False),
    ("manifest_digest", "the manifest's bytes hash to sha256:", False),
]


@pytest.mark.parametrize("fault,says,kept", BEHAVIOUR, ids=[b[0] for b in BEHAVIOUR])
def test_a_misbehaving_registry_fails_the_pull_clearly_and_stores_nothing(
        registry, server, fault, says, kept):
    data = weights(300_000)  # first, so that it is the blob the fault hits
    manifest, blobs = model_manifest({"model.safetensors": data,
                                      "config.json": f'{{"fault": "{fault}"}}'.encode()},
                                     config=f'{{"model_format": "{fault}"}}'.encode())
    repository = f"faults/{fault.replace('_', '-')}"
    name = registry.add(repository, manifest, blobs, fault)
    lines, took = pull(server, name)
    assert lines[0] == {"status": "pulling manifest"}
    assert "error" in lines[-1] and says in lines[-1]["error"], lines[-1]
    assert not [x for x in lines if x.get("status") == "success"]
    assert took < TIME_BOUND_S
    repo = registry.repos[repository]
    assert repo.sent <= len(data) + MAX_MANIFEST_BYTES + SLACK_BYTES
    assert_nothing_stored(server, blobs, repository)
    partial = blob_files(server).get(f"sha256-{digest_of(data)[7:]}-partial")
    if kept:
        assert partial is not None and 0 < partial < len(data)
    else:
        assert partial is None
    assert_still_serving(server)


def raw_manifest(config: bytes, layers: list[dict]) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": MEDIA_MANIFEST,
                       "config": {"mediaType": MEDIA_CONFIG, "digest": digest_of(config),
                                  "size": len(config)},
                       "layers": layers}).encode()


CONFIG = b'{"model_format":"safetensors"}\n'
DATA = b"x" * 1000
# Manifests that must be refused before any download: (id, manifest, the error line says).
BAD_MANIFESTS = [
    ("digest-with-path", raw_manifest(CONFIG, [{"mediaType": MEDIA_TENSOR, "size": 10,
                                                "digest": "sha256:../../x"}]),
     "bad layer digest 'sha256:../../x'"),
    ("digest-too-short", raw_manifest(CONFIG, [{"mediaType": MEDIA_TENSOR, "size": 10,
                                                "digest": "sha256:" + "a" * 63}]),
     "bad layer digest"),
    ("name-with-path", raw_manifest(CONFIG, [{"mediaType": MEDIA_TENSOR, "size": len(DATA),
                                              "digest": digest_of(DATA),
                                              "name": "../../evil.safetensors"}]),
     'invalid file name "../../evil.safetensors"'),
    ("absurd-size", raw_manifest(CONFIG, [{"mediaType": MEDIA_TENSOR, "size": 1 << 60,
                                           "digest": digest_of(DATA),
                                           "name": "model.safetensors"}]),
     "not enough space on device for pulling"),
    ("absurd-config", json.dumps({"schemaVersion": 2, "config": {
        "mediaType": MEDIA_CONFIG, "digest": digest_of(CONFIG), "size": 1 << 30},
        "layers": []}).encode(), "declares 1073741824 bytes, more than 16777216"),
    ("nested-json", b"[" * 100_000, "manifest is not JSON: nested too deeply"),
    ("not-json", b"\xff\xfe{", "manifest is not JSON"),
]


@pytest.mark.parametrize("manifest,says", [b[1:] for b in BAD_MANIFESTS],
                         ids=[b[0] for b in BAD_MANIFESTS])
def test_a_manifest_with_bad_digests_names_or_sizes_is_refused_before_downloading(
        registry, server, manifest, says):
    repository = f"manifests/{hashlib.sha256(manifest).hexdigest()[:12]}"
    name = registry.add(repository, manifest, {digest_of(CONFIG): CONFIG, digest_of(DATA): DATA})
    lines, took = pull(server, name)
    assert "error" in lines[-1] and says in lines[-1]["error"], lines[-1]
    assert took < TIME_BOUND_S
    assert registry.repos[repository].blob_gets() == []
    assert_nothing_stored(server, {digest_of(CONFIG): CONFIG, digest_of(DATA): DATA}, repository)
    assert not [n for n in blob_files(server) if ".." in n or not n.startswith("sha256-")]
    assert_still_serving(server)


def test_a_push_the_registry_refuses_leaves_the_store_unchanged(registry, server, tmp_path):
    """The registry answers the upload with a 500 whose body never ends: the push fails with
    its start, having read a bounded part of it, and the store is as it was."""
    name = registry.add("faults/push-refused", b"", {}, "endless_error")
    source = write_fake_model(tmp_path / "fake")
    lines, _ = post_lines(server, "/api/create", {"model": name, "from": str(source)})
    assert lines[-1] == {"status": "success"}
    before = {p: p.stat() for p in server.models_dir.rglob("*") if p.is_file()}
    lines, took = post_lines(server, "/api/push", {"model": name, "insecure": True})
    assert "error" in lines[-1] and ': 500 {"errors":[{"message":"xxx' in lines[-1]["error"]
    assert took < TIME_BOUND_S
    assert registry.repos["faults/push-refused"].sent < SLACK_BYTES
    after = {p: p.stat() for p in server.models_dir.rglob("*") if p.is_file()}
    assert {p: (s.st_size, s.st_mtime_ns) for p, s in after.items()} == \
        {p: (s.st_size, s.st_mtime_ns) for p, s in before.items()}
    assert_still_serving(server)


def big_fake_model(dest: Path, vocab: int) -> Path:
    """write_fake_model with weights of `vocab` x 8 float32 (32 bytes a token)."""
    write_fake_model(dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    save_file({"model.embed_tokens.weight": np.ones((vocab, 8), np.float32)},
              str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_a_full_disk_fails_each_write_clearly_and_the_server_keeps_serving(
        registry, tmp_path, subprocess_env):
    quota = tmp_path / "quota"
    quota.write_text(str(256 << 10))
    server = start_full_disk_server(tmp_path, subprocess_env, quota, MLXR_REGISTRY_TIMEOUT="5s")
    try:
        with server.http() as http:
            # A blob upload that does not fit: a 507, and its partial file is gone ...
            data = os.urandom(400_000)
            digest = digest_of(data)
            resp = http.post(f"/api/blobs/{digest}", content=data)
            assert resp.status_code == 507
            assert resp.json()["error"] == (
                f"no space left on device while writing blob {digest}: its partial file was "
                "removed, so the space it took is free again")
            assert blob_files(server) == {}
            # ... so its space is free again: a smaller blob fits.
            small = os.urandom(100_000)
            assert http.post(f"/api/blobs/{digest_of(small)}", content=small).status_code == 201

            # A create whose weights do not fit: an error line, and nothing of it is kept.
            source = big_fake_model(tmp_path / "big", vocab=8192)  # 256 KiB of weights
            lines, _ = post_lines(server, "/api/create", {"model": "big", "from": str(source)})
            assert lines[-1]["error"].startswith("no space left on device while writing a blob")
            assert lines[-1]["error"].endswith("(creating big:latest: the store is unchanged)")
            assert blob_files(server) == {f"sha256-{digest_of(small)[7:]}": len(small)}
            assert manifests(server) == []
            assert list((server.models_dir / "tmp").glob("*")) == []

            # A pull that does not fit: an error line that says what is kept for a resume.
            weights_bytes = weights(300_000)
            manifest, blobs = model_manifest({"model.safetensors": weights_bytes,
                                              "config.json": b'{"model_type": "qwen3"}'})
            name = registry.add("disk/full", manifest, blobs)
            lines, _ = pull(server, name)
            partial_name = f"sha256-{digest_of(weights_bytes)[7:]}-partial"
            kept = blob_files(server)[partial_name]
            assert 0 < kept < len(weights_bytes)
            assert lines[-1] == {"error": (
                f"no space left on device while writing blob {digest_of(weights_bytes)}: the "
                f"{kept} bytes of it downloaded so far are kept in "
                f"{server.models_dir / 'blobs' / partial_name} and pulling again resumes from "
                "there")}
            assert manifests(server) == []
            assert_still_serving(server)

            # Space freed: the pull resumes where it stopped, and a create succeeds.
            quota.write_text(str(64 << 20))
            registry.repos["disk/full"].requests.clear()
            lines, _ = pull(server, name)
            assert lines[-1] == {"status": "success"}
            ranges = [r[2] for r in registry.repos["disk/full"].blob_gets()
                      if r[1].endswith(digest_of(weights_bytes))]
            assert ranges == [f"bytes={kept}-"]
            lines, _ = post_lines(server, "/api/create", {"model": "big", "from": str(source)})
            assert lines[-1] == {"status": "success"}
            assert len(manifests(server)) == 2
            assert not [n for n in blob_files(server) if "partial" in n]
    finally:
        server.stop()


def test_mlxr_pull_reports_a_misbehaving_registry_and_exits_non_zero(
        registry, server, subprocess_env):
    data = weights(200_000)
    manifest, blobs = model_manifest({"model.safetensors": data, "config.json": b'{"cli": 1}'})
    name = registry.add("faults/cli-long-blob", manifest, blobs, "long_blob")
    env = {**subprocess_env, "MLXR_HOST": server.url.removeprefix("http://"),
           "OLLAMA_HOST": server.url.removeprefix("http://")}
    done = subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", "pull", "--insecure",
                           name], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert (f"download {digest_of(data)}: the registry would send 400000 bytes from byte 0, "
            "past the 200000 bytes the manifest declares") in done.stderr
    assert_nothing_stored(server, blobs, "faults/cli-long-blob")

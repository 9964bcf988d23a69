"""`/health` and `/ready` on a real `mlxr serve`: liveness always, readiness only with a model
to serve and a runner to start; both open without the API key."""

from __future__ import annotations

import pytest

from tests.harness.server import start_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path, subprocess_env):
    srv = start_server(tmp_path, subprocess_env, MLXR_API_KEY="sesame")
    yield srv
    srv.stop()


def test_ready_only_once_the_store_has_a_model(server, tiny_model):
    http = server.http()
    assert http.get("/health").json() == {"status": "ok"}
    r = http.get("/ready")
    assert r.status_code == 503
    assert r.json()["checks"] == {"store": "ok", "models": 0, "runner": "ok"}
    assert "no model to serve" in r.json()["error"]
    assert http.get("/api/tags").status_code == 401  # the key still guards the API
    assert http.get("/api/status").json()["cloud"]["disabled"] is True  # no data: open
    admin = server.client(headers={"Authorization": "Bearer sesame"})
    assert admin.create(model="tiny", from_=str(tiny_model)).status == "success"
    r = http.get("/ready")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "checks": {"store": "ok", "models": 1,
                                                      "runner": "ok"}}


def test_not_ready_when_the_runner_cannot_start(tmp_path, subprocess_env, tiny_model):
    srv = start_server(tmp_path, subprocess_env, MLXR_RUNNER_MODULE="mlxr.no_such_runner")
    try:
        assert srv.client().create(model="tiny", from_=str(tiny_model)).status == "success"
        r = srv.http().get("/ready")
        assert r.status_code == 503
        assert r.json()["checks"]["runner"] == "module mlxr.no_such_runner not found"
        assert srv.http().get("/health").status_code == 200
    finally:
        srv.stop()


def test_not_ready_when_the_store_cannot_be_read(tmp_path, subprocess_env, tiny_model):
    import shutil

    srv = start_server(tmp_path, subprocess_env)
    try:
        assert srv.client().create(model="tiny", from_=str(tiny_model)).status == "success"
        assert srv.http().get("/ready").status_code == 200
        manifests = srv.models_dir / "manifests"
        shutil.rmtree(manifests)
        manifests.write_text("not a directory")
        r = srv.http().get("/ready")
        assert r.status_code == 503
        assert r.json()["checks"]["store"].startswith("unreadable")
        assert "cannot be read" in r.json()["error"]
    finally:
        srv.stop()

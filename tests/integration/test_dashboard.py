"""The web dashboard at /ui, driven in real headless Chromium against a real `mlxr serve`:
the store's models, a streamed chat with options and a JSON schema, a pull from a real OCI
registry with its progress, copy and delete, a loaded runner's live figures and its unload.
The API key and origin rules, the page's own headers and the feed's end at shutdown are
checked over HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.store import Store
from mlxr.supervisor.store.transfer import push_model
from tests.harness.browser import chromium, watch_errors
from tests.harness.registry import start_registry
from tests.harness.server import serving, start_server

# Where the screenshots for docs/dashboard.md are written, when set.
SHOTS = os.environ.get("MLXR_UI_SCREENSHOTS")
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
                 "additionalProperties": False,
                 "required": ["answer"]}


def shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("ui"), subprocess_env, {"tiny": tiny_model})


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    page = context.new_page()
    errors = watch_errors(page)
    page.goto(f"{server.url}/ui/")
    page.wait_for_selector("[data-testid=live].on")
    yield page
    context.close()
    assert errors == []


@pytest.fixture(scope="module")
def registry_model(tmp_path_factory):
    """A random model pushed to a real docker-registry; returns its name there."""
    registry = start_registry(tmp_path_factory.mktemp("registry"))
    store = Store(tmp_path_factory.mktemp("source") / "models")
    name = f"{registry.host}/library/remote:latest"

    async def push() -> None:
        async for _ in create_model(store, CreateRequest.from_json(
                {"model": name, "random": {"seed": 5}})):
            pass
        async for _ in push_model(store, name, insecure=True):
            pass

    # (in a thread: Playwright's sync API keeps an event loop running on this one)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, push()).result()
    yield name
    registry.stop()


def tag_names(server) -> set[str]:
    with server.http() as http:
        return {m["name"] for m in http.get("/api/tags").json()["models"]}


def model_row(page, name: str):
    return page.locator(f"tr[data-model='{name}']")


def send_chat(page, text: str, *, num_predict: int, schema: dict | None = None,
              think: str = "") -> str:
    """Send `text` from the playground and wait for the reply; returns its text."""
    page.click("[data-testid=tab-playground]")
    page.select_option("[data-testid=pg-model]", "tiny:latest")
    page.fill("[data-testid=pg-temperature]", "0")
    page.fill("[data-testid=pg-num_predict]", str(num_predict))
    page.fill("[data-testid=pg-format]", json.dumps(schema) if schema else "")
    page.select_option("[data-testid=pg-think]", think)
    before = page.locator(".msg.assistant[data-done=true]").count()
    page.fill("[data-testid=pg-input]", text)
    page.click("[data-testid=pg-send]")
    page.wait_for_function("n => document.querySelectorAll('.msg.assistant[data-done=true]')"
                           ".length > n", arg=before, timeout=60_000)
    return page.locator(".msg.assistant .text").last.text_content()


def test_the_page_lists_the_store_models(page, server):
    row = model_row(page, "tiny:latest")
    row.wait_for()
    cells = row.locator("td").all_text_contents()
    assert cells[2] == "qwen3"  # family
    assert "F32" in cells
    assert {"completion", "tools", "thinking"} <= set(row.locator(".badge").all_text_contents())
    assert page.locator("#version").text_content().startswith("v")
    shot(page, "models")


def test_a_chat_streams_and_matches_the_api(page, server):
    page.click("[data-testid=tab-playground]")
    # every state of the reply's text, recorded as the page changes it
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const t = document.querySelector('.msg.assistant:last-child .text');
            if (t && t.textContent !== window.seen[window.seen.length - 1])
                window.seen.push(t.textContent);
        }).observe(document.getElementById('pg-log'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    text = send_chat(page, "Tell me about the sea", num_predict=16)
    expected = server.client().chat(model="tiny", messages=[
        {"role": "user", "content": "Tell me about the sea"}],
        options={"temperature": 0, "num_predict": 16}).message.content
    assert text == expected and text
    seen = page.evaluate("window.seen")
    assert len(seen) >= 3, seen  # the text grew piece by piece as it streamed
    assert all(text.startswith(s) for s in seen)
    stats = page.locator("[data-testid=reply-stats]").last.text_content()
    assert "TTFT" in stats and "tok/s" in stats and "16 tokens" in stats
    shot(page, "playground")


def test_a_json_schema_in_the_format_box_shapes_the_reply(page, server):
    # (a thinking model's format shapes what follows its thinking: thinking off here)
    text = send_chat(page, "Is the sea wet?", num_predict=300, schema=ANSWER_SCHEMA,
                     think="false")
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


def test_a_bad_format_box_is_refused_before_sending(page, server):
    page.click("[data-testid=tab-playground]")
    page.fill("[data-testid=pg-format]", "{not json")
    page.fill("[data-testid=pg-input]", "hello")
    page.click("[data-testid=pg-send]")
    error = page.locator("[data-testid=pg-format-error]")
    error.wait_for()
    assert "JSON schema" in error.text_content()
    assert page.locator(".msg").count() == 0  # nothing was sent
    assert page.input_value("[data-testid=pg-input]") == "hello"


def test_pull_shows_progress_to_100_and_the_model_appears(page, server, registry_model):
    # every value each layer's bar shows, recorded as the page changes it
    page.evaluate("""() => {
        window.bars = {};
        new MutationObserver(() => {
            for (const row of document.querySelectorAll('.layer')) {
                const values = window.bars[row.dataset.digest] ||= [];
                const v = row.querySelector('progress').value;
                if (values[values.length - 1] !== v) values.push(v);
            }
        }).observe(document.getElementById('pulls'),
                   {subtree: true, childList: true, characterData: true, attributes: true});
    }""")
    page.fill("[data-testid=pull-name]", registry_model)
    page.check("[data-testid=pull-insecure]")
    page.click("[data-testid=pull-button]")
    page.wait_for_function("() => document.querySelector('[data-testid=pull-status]')"
                           "?.textContent === 'success'", timeout=60_000)
    assert page.locator("[data-testid=pull-percent]").text_content() == "100%"
    bars = page.evaluate("window.bars")
    with server.http() as http:
        layers = http.post("/api/show", json={"model": registry_model}).json()
    assert len(bars) >= 2  # the weights, the config, the tokenizer's files...
    for digest, values in bars.items():
        assert values == sorted(values) and values[-1] == 100, (digest, values)
    assert layers["details"]["family"] == "qwen3"
    model_row(page, registry_model).wait_for(timeout=10_000)  # from the feed's models event
    assert registry_model in tag_names(server)
    shot(page, "pull")


def test_a_pull_of_a_missing_model_shows_the_error(page, server, registry_model):
    missing = registry_model.replace("remote", "absent")
    page.fill("[data-testid=pull-name]", missing)
    page.check("[data-testid=pull-insecure]")
    page.click("[data-testid=pull-button]")
    page.wait_for_selector(".pull.failed", timeout=30_000)
    assert "error" in page.locator(".pull.failed [data-testid=pull-status]").text_content()


def test_copy_then_delete_from_the_table(page, server):
    model_row(page, "tiny:latest").locator("[data-testid=copy-model]").click()
    page.fill("[data-testid=copy-name]", "tiny-copy")
    page.click("[data-testid=copy-confirm]")
    model_row(page, "tiny-copy:latest").wait_for(timeout=10_000)
    assert "tiny-copy:latest" in tag_names(server)
    page.once("dialog", lambda d: d.accept())
    model_row(page, "tiny-copy:latest").locator("[data-testid=delete-model]").click()
    model_row(page, "tiny-copy:latest").wait_for(state="detached", timeout=10_000)
    assert "tiny-copy:latest" not in tag_names(server)
    assert "tiny:latest" in tag_names(server)


def test_a_running_model_shows_live_figures_and_unloads(page, server):
    send_chat(page, "Count to ten", num_predict=32)
    page.click("[data-testid=tab-running]")
    card = page.locator("[data-runner='tiny:latest']")
    card.wait_for()
    assert page.locator("#running-count").text_content() == "1"
    # the chat has ended: within a feed tick the runner says nothing is running
    page.wait_for_function("() => document.querySelector(\"[data-runner='tiny:latest'] "
                           "[data-field=sequences]\").textContent === '0 / 0'", timeout=5_000)
    fields = {f: card.locator(f"[data-field={f}]").text_content()
              for f in ("memory", "context", "sequences", "prefix", "expires", "kv", "weights")}
    assert fields["weights"] == "float32"  # the test model is stored as float32
    assert fields["memory"].endswith("MB") and fields["context"].endswith("tokens")
    assert fields["sequences"] == "0 / 0" and fields["expires"].startswith("in ")
    assert fields["prefix"].endswith("%") and "blocks" in fields["kv"]
    # the chart's data: tokens per second over the last minute, the chat's tokens in it
    page.wait_for_function("() => state.running.length && "
                           "Math.max(0, ...state.running[0].tokens_per_s) > 0", timeout=5_000)
    shot(page, "running")
    card.locator("[data-testid=unload]").click()
    card.wait_for(state="detached", timeout=20_000)
    assert page.locator("[data-testid=runners-empty]").is_visible()
    assert server.ps_names() == []


def test_one_sampler_feeds_every_page(browser, server):
    """Three pages open: the feed still samples (reads every runner) once a second."""
    contexts = [browser.new_context() for _ in range(3)]
    try:
        for c in contexts:
            c.new_page().goto(f"{server.url}/ui/")
        for c in contexts:
            c.pages[0].wait_for_selector("[data-testid=live].on")
        start = server_ticks(server)
        time.sleep(2)
        assert 1 <= server_ticks(server) - start <= 3
    finally:
        for c in contexts:
            c.close()


def server_ticks(server) -> int:
    """The feed's sampler passes so far (each reads every runner's status once)."""
    with server.http() as http:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("mlxr_dashboard_samples "):
                return int(float(line.split()[-1]))
    raise AssertionError("no mlxr_dashboard_samples in /metrics")


# -- security and lifecycle, over HTTP ---------------------------------------------------------

def test_the_page_is_not_frameable_and_loads_only_its_own_files(server):
    with server.http() as http:
        page = http.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-frame-options"] == "DENY"
        assert http.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
        assert http.get("/ui/static/app.js").headers["content-type"].startswith(
            "text/javascript")
        assert http.get("/ui/static/nothing.js").status_code == 404
        assert http.get("/ui/static/%2e%2e%2fapp.py").status_code == 404


def test_the_feed_refuses_other_origins(server):
    with server.http() as http:
        refused = http.get("/ui/events", headers={"Origin": "https://evil.example"})
        assert refused.status_code == 403 and "origin" in refused.json()["error"]
        with http.stream("GET", "/ui/events", headers={"Origin": "http://localhost:3000"}) as r:
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert r.headers["content-type"] == "text/event-stream"


def test_with_an_api_key_the_page_asks_for_it(tmp_path, subprocess_env, tiny_model, browser):
    gen = serving(tmp_path, subprocess_env, {}, MLXR_API_KEY="sesame")
    server = next(gen)
    try:
        with httpx.Client(base_url=server.url, trust_env=False,
                          headers={"Authorization": "Bearer sesame"}) as http:
            assert http.post("/api/create", json={"model": "tiny", "from": str(tiny_model),
                                                  "stream": False}).status_code == 200
        with httpx.Client(base_url=server.url, trust_env=False) as http:
            assert http.get("/ui/").status_code == 200  # the page itself holds no data
            assert http.get("/ui/static/app.js").status_code == 200
            assert http.get("/ui/events").status_code == 401
            assert http.get("/api/tags").status_code == 401
            assert http.get("/ui/events", headers={"Authorization": "Bearer nope"}
                            ).status_code == 401
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{server.url}/ui/")
        page.wait_for_selector("[data-testid=key-dialog][open]")
        assert page.locator("[data-testid=live]").text_content() == "API key needed"
        assert model_row(page, "tiny:latest").count() == 0
        page.fill("[data-testid=key-input]", "wrong")
        page.click("[data-testid=key-save]")
        page.wait_for_selector("[data-testid=key-dialog][open]")  # asked again
        page.fill("[data-testid=key-input]", "sesame")
        page.click("[data-testid=key-save]")
        model_row(page, "tiny:latest").wait_for(timeout=10_000)
        page.wait_for_selector("[data-testid=live].on")
        context.close()
    finally:
        gen.close()


def test_open_dashboards_do_not_hold_up_shutdown(tmp_path, subprocess_env):
    server = start_server(tmp_path, subprocess_env, MLXR_SHUTDOWN_GRACE="30")
    with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as http:
        with http.stream("GET", "/ui/events") as stream:
            lines = stream.iter_lines()
            assert next(lines) == "retry: 2000"
            assert next(lines) == ""
            assert next(lines) == "event: hello"
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            list(lines)  # returns when the server ends the stream
            assert server.proc.wait(10) == 0
    # the 30 s grace is for requests, not for pages left open
    assert time.monotonic() - started < 5

"""Image URLs with MLXR_ALLOW_IMAGE_URLS=1: the server fetches them (here from a local HTTP
server) and the reply equals the one for the same image sent as data; a URL that does not
answer with an image is a clear 400."""

from __future__ import annotations

import http.server
import threading

import openai
import pytest

from tests.harness.images import data_url, encoded, noise
from tests.harness.server import serving

pytestmark = pytest.mark.timeout(180)

PNG = encoded(noise(21))


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images_url():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, model_factory):
    yield from serving(tmp_path_factory.mktemp("vision-urls"), subprocess_env,
                       {"vl": model_factory("qwen2.5-vl")}, MLXR_ALLOW_IMAGE_URLS="1",
                       MLXR_KEEP_ALIVE="10m")


def chat(client, url: str) -> str:
    reply = client.chat.completions.create(model="vl", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What is this?"}]}])
    return reply.choices[0].message.content


def test_an_allowed_url_is_fetched_and_read_like_the_same_data(server, images_url):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert chat(client, images_url + "/cat.png") == chat(client, data_url(PNG))


def test_a_url_that_gives_no_image_is_a_400(server, images_url):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, images_url + "/missing.png")
    assert "HTTP 404" in str(err.value)
    r = server.http().post("/api/chat", json={"model": "vl", "stream": False,
                                              "options": {"num_predict": 4}, "messages": [
        {"role": "user", "content": "hi", "images": [images_url + "/cat.png"]}]})
    assert r.status_code == 200, r.text

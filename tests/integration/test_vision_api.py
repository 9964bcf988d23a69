"""Vision models on a real `mlxr serve`: a random-weight Qwen2.5-VL (made by the store's own
writer) through /api/chat, /api/generate, /v1/chat/completions and /v1/messages, driven by the
official ollama, openai and anthropic clients. Greedy output with an image is token-identical to
mlx-vlm's own generation of the same prompt and image, alone and inside a batch of text
streams; bad images are clear 400s.

Every family runs the model tests (identity with mlx-vlm, alone and in a batch, two images,
raw prompts, the image prefix cache). The API-surface tests (image formats, the three clients,
bad input, stop strings and schemas, cancellation, `mlxr run`) do not depend on the family, so
they run on Qwen2.5-VL only (`SURFACE`), which keeps the suite's time for what differs."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.harness.images import animated_gif, b64, data_url, encoded, noise
from tests.harness.server import serving, wait_for

pytestmark = pytest.mark.timeout(300)

QUESTION = "What is in this picture?"
N = 12
GREEDY = {"temperature": 0, "num_predict": N}
# preset -> (the image placeholder, the chat prompt of one user turn as its template renders it)
QWEN = ("<|vision_start|><|image_pad|><|vision_end|>",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n{images}{question}<|im_end|>\n<|im_start|>assistant\n")
FAMILIES = {  # Qwen2-VL (the same text path as Qwen2.5-VL) is in test_vision_formats.py
    "qwen2.5-vl": QWEN,
    "gemma3-vision": ("<start_of_image>",
                      "<s><start_of_turn>user\n{images}{question}<end_of_turn>\n"
                      "<start_of_turn>model\n"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def preset(request) -> str:
    return request.param


# For the family-independent tests: Qwen2.5-VL only (the first family, so its server is the
# one the model tests use).
SURFACE = pytest.mark.parametrize("preset", ["qwen2.5-vl"], indirect=True)


@pytest.fixture(scope="module")
def mark(preset) -> str:
    return FAMILIES[preset][0]


@pytest.fixture(scope="module")
def chat_prompt(preset):
    mark, template = FAMILIES[preset]
    return lambda question, images: template.format(images=mark * images, question=question)


@pytest.fixture(scope="module")
def vision_model(model_factory, preset) -> Path:
    return model_factory(preset)


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, vision_model, tiny_model):
    yield from serving(tmp_path_factory.mktemp("vision"), subprocess_env,
                       {"vl": vision_model, "tiny": tiny_model}, MLXR_KEEP_ALIVE="10m")


@pytest.fixture(scope="module")
def mlx_vlm_greedy(vision_model):
    """mlx-vlm's own greedy generation: (its output tokens as reply text, prompt token
    count). The text is the runner's decode of those tokens (a reply keeps the space its
    first SentencePiece piece begins with, where a document's decode drops it)."""
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate

    from mlxr.runner.text_stream import output_decode
    from mlxr.runner.tokenizer import load_tokenizer

    model, processor = load(vision_model)
    reply_text = output_decode(load_tokenizer(vision_model, {}))

    def generate(prompt: str, images: list, n: int = N) -> tuple[str, int]:
        steps = list(stream_generate(model, processor, prompt, image=images, max_tokens=n,
                                     temperature=0.0))
        ids = [s.token for s in steps][:n]
        return reply_text(ids), steps[0].prompt_tokens

    return generate


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return server.client()


def ask(client, images: list[bytes], question: str = QUESTION, **options):
    return client.chat(model="vl", messages=[{"role": "user", "content": question,
                                              "images": images}],
                       options={**GREEDY, **options})


def test_show_lists_vision_only_for_the_vision_model(client):
    assert "vision" in client.show("vl").capabilities
    assert "vision" not in client.show("tiny").capabilities
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="tiny", messages=[{"role": "user", "content": "hi",
                                             "images": [encoded(noise(1))]}])
    assert err.value.status_code == 400 and 'does not support images' in err.value.error


def test_chat_with_an_image_matches_mlx_vlm(client, mlx_vlm_greedy, chat_prompt):
    img = noise(1)
    want, prompt_tokens = mlx_vlm_greedy(chat_prompt(QUESTION, 1), [img])
    got = ask(client, [encoded(img)])
    assert got.message.content == want
    assert got.eval_count == N
    # the image's tokens are counted: the processor's expanded prompt, as mlx-vlm counts it
    assert got.prompt_eval_count == prompt_tokens
    text_only = client.chat(model="vl", messages=[{"role": "user", "content": QUESTION}],
                            options=GREEDY)
    assert got.prompt_eval_count > text_only.prompt_eval_count + 2


def test_different_images_give_different_outputs(client, mlx_vlm_greedy, chat_prompt):
    outs = {ask(client, [encoded(noise(seed))]).message.content for seed in (1, 2, 3)}
    assert len(outs) == 3
    want, _ = mlx_vlm_greedy(chat_prompt(QUESTION, 1), [noise(2)])
    assert ask(client, [encoded(noise(2))]).message.content == want


def test_two_images_in_one_message_match_mlx_vlm(client, mlx_vlm_greedy, chat_prompt):
    a, b = noise(4), noise(5, 56, 56)
    want, _ = mlx_vlm_greedy(chat_prompt("Compare them.", 2), [a, b])
    assert ask(client, [encoded(a), encoded(b)], "Compare them.").message.content == want


def test_image_request_inside_seven_text_streams_keeps_its_output(client, mlx_vlm_greedy,
                                                                  chat_prompt):
    img = noise(6)
    want, _ = mlx_vlm_greedy(chat_prompt(QUESTION, 1), [img])
    questions = [f"Tell me about the number {i}. " * (1 + 3 * i) for i in range(7)]
    alone = [client.chat(model="vl", messages=[{"role": "user", "content": q}],
                         options={**GREEDY, "num_predict": 24}).message.content
             for q in questions]

    def text(q):
        return client.chat(model="vl", messages=[{"role": "user", "content": q}],
                           options={**GREEDY, "num_predict": 24}).message.content

    with ThreadPoolExecutor(8) as pool:
        texts = [pool.submit(text, q) for q in questions]
        image = pool.submit(ask, client, [encoded(img)])
        assert image.result().message.content == want
        assert [t.result() for t in texts] == alone


def test_generate_with_images_and_raw_prompt(client, mlx_vlm_greedy, chat_prompt, mark):
    img = noise(7)
    want, _ = mlx_vlm_greedy(chat_prompt(QUESTION, 1), [img])
    got = client.generate(model="vl", prompt=QUESTION, images=[encoded(img)], options=GREEDY)
    assert got.response == want
    raw = "Picture: "
    want_raw, _ = mlx_vlm_greedy(mark + raw, [img])
    got_raw = client.generate(model="vl", prompt=raw, images=[encoded(img)], raw=True,
                              options=GREEDY)
    assert got_raw.response == want_raw


@SURFACE
@pytest.mark.parametrize("fmt,kwargs", [("JPEG", {"quality": 90}), ("WEBP", {}), ("GIF", {})])
def test_jpeg_webp_and_gif_images_are_read(client, mlx_vlm_greedy, chat_prompt, fmt, kwargs):
    from io import BytesIO

    from PIL import Image

    data = encoded(noise(8), fmt, **kwargs)
    decoded = Image.open(BytesIO(data)).convert("RGB")
    want, _ = mlx_vlm_greedy(chat_prompt(QUESTION, 1), [decoded])
    assert ask(client, [data]).message.content == want


@SURFACE
def test_animated_gif_gives_its_first_frame(client):
    first, second = noise(9), noise(10)
    animated = ask(client, [animated_gif(first, second)]).message.content
    still = ask(client, [encoded(first.convert("P"), "GIF")]).message.content
    assert animated == still


def test_repeated_image_reuses_the_kv_prefix(server, client):
    img = encoded(noise(11))
    first = [{"role": "user", "content": QUESTION, "images": [img]}]
    turn = client.chat(model="vl", messages=first, options=GREEDY)
    reply = turn.message.content
    text_only = client.chat(model="vl", messages=[{"role": "user", "content": QUESTION}],
                            options=GREEDY)
    image_tokens = turn.prompt_eval_count - text_only.prompt_eval_count - 4
    follow = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "And the colours?"}]
    got = server.http().post("/v1/chat/completions", json={
        "model": "vl", "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": data_url(img)}}]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the colours?"}]}).json()
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= turn.prompt_eval_count - 1  # the whole first turn, image included
    # Another image with the same token count shares nothing past the text before it.
    other = server.http().post("/v1/chat/completions", json={
        "model": "vl", "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": data_url(encoded(noise(12)))}}]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the colours?"}]}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= cached - image_tokens
    assert image_tokens >= 2 and follow  # (the Ollama-shaped history the OpenAI one mirrors)


@SURFACE
def test_openai_client_sends_an_image_url_part(server, client):
    img = encoded(noise(13))
    want = ask(client, [img]).message.content
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    got = oa.chat.completions.create(model="vl", temperature=0, max_tokens=N, messages=[
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(img)}},
            {"type": "text", "text": QUESTION}]}])
    assert got.choices[0].message.content == want


@SURFACE
def test_anthropic_client_sends_an_image_block(server, client):
    img = encoded(noise(14))
    want = ask(client, [img]).message.content
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    msg = an.messages.create(model="vl", max_tokens=N, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": [
                                 {"type": "image", "source": {"type": "base64",
                                                              "media_type": "image/png",
                                                              "data": b64(img)}},
                                 {"type": "text", "text": QUESTION}]}])
    assert msg.content[0].text == want


@pytest.mark.parametrize("image,message", [
    (b64(b"not an image at all"), "is not a JPEG, PNG, WebP or GIF image"),
    ("%%%not base64%%%", "is not valid base64"),
    (b64(encoded(noise(1))[:60]), "corrupt or truncated"),
    (b64(encoded(noise(1), "BMP")), "BMP images are not supported"),
    ("https://example.com/cat.png", "MLXR_ALLOW_IMAGE_URLS"),
])
@SURFACE
def test_bad_images_are_clear_400s(server, image, message):
    r = server.http().post("/api/chat", json={
        "model": "vl", "stream": False,
        "messages": [{"role": "user", "content": "hi", "images": [image]}]})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


@SURFACE
def test_oversized_image_is_refused_before_decoding(server):
    from PIL import Image

    huge = encoded(Image.new("RGB", (8000, 6000)), "PNG")  # 48 Mpx, a small file
    r = server.http().post("/api/chat", json={
        "model": "vl", "stream": False,
        "messages": [{"role": "user", "content": "hi", "images": [b64(huge)]}]})
    assert r.status_code == 400 and "8000x6000" in r.json()["error"]
    r = server.http().post("/v1/chat/completions", json={
        "model": "vl", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(huge)}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@SURFACE
def test_image_request_keeps_stop_strings_and_structured_output(client, chat_prompt,
                                                                 mlx_vlm_greedy):
    img = noise(15)
    full, _ = mlx_vlm_greedy(chat_prompt(QUESTION, 1), [img], 24)
    cut = full.strip()[2:6]  # a stop string inside the greedy reply
    got = ask(client, [encoded(img)], num_predict=24, stop=[cut]).message.content
    assert cut not in got and full.startswith(got) and len(got) < len(full)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}
    reply = client.chat(model="vl", format=schema, options={"temperature": 0, "num_predict": 64},
                        messages=[{"role": "user", "content": QUESTION,
                                   "images": [encoded(img)]}])
    assert set(json.loads(reply.message.content)) == {"colour"}


@SURFACE
def test_client_leaving_during_an_image_request_frees_the_runner(server, client):
    body = {"model": "vl", "stream": True, "options": {"temperature": 0, "num_predict": 400},
            "messages": [{"role": "user", "content": QUESTION,
                          "images": [b64(encoded(noise(16)))]}]}
    with server.http().stream("POST", "/api/chat", json=body) as r:
        for line in r.iter_lines():
            if line and json.loads(line).get("message", {}).get("content"):
                break  # the first token: then hang up

    def in_flight() -> list[float]:
        lines = server.http().get("/metrics").text.splitlines()
        return [float(x.rsplit(" ", 1)[1]) for x in lines
                if x.startswith("mlxr_runner_requests{")]

    assert wait_for(lambda: in_flight() and not any(in_flight()))
    assert ask(client, [encoded(noise(16))]).done  # and it serves the next one


@SURFACE
def test_mlxr_run_sends_the_image_paths_in_its_prompt(server, client, subprocess_env,
                                                       tmp_path):
    import subprocess
    import sys

    (tmp_path / "photo one.png").write_bytes(encoded(noise(17)))
    want = client.generate(model="vl", prompt=QUESTION, images=[encoded(noise(17))],
                           options=GREEDY).response
    env = {**subprocess_env, "MLXR_HOST": server.url.removeprefix("http://")}
    (tmp_path / "Modelfile").write_text(f"FROM vl\nPARAMETER temperature 0\n"
                                        f"PARAMETER num_predict {N}\n")
    made = subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", "create", "vl-cli",
                           "-f", "Modelfile"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([sys.executable, "-m", "mlxr.supervisor.cli", "run", "vl-cli",
                          f"./photo\\ one.png {QUESTION}"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "Added image 'photo one.png'" in ran.stderr
    assert ran.stdout.strip() == want.strip()

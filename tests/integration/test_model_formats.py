"""Every architecture and every format through the whole server, as users reach it: a random
model of each architecture as safetensors float32 and as GGUF (Q4_K) written from it, and in
one of bfloat16 or MLX 4-bit (alternating over the architectures, so each of the two is
served for half of them; tests/mlx/test_architectures.py runs every architecture in each
precision in-process), each created through the API (GGUF blobs pushed with the real ollama client's
create_blob and named in `files`, as Ollama's CLI does), then:
- /api/chat streamed, greedy, to the length asked;
- /v1/chat/completions (the openai client) with the same messages gives the same text, and a
  repeat reuses the prompt from the prefix cache;
- for float32 and GGUF Q4_K (the source weights, and the conversion most Ollama users' models
  take), a batch of 8 concurrent requests (one longer than the sliding windows) whose first
  and last are equal to their prompts run alone. The batch's code does not change with the
  weights' format, so the other formats skip it: the suite's time goes to what differs.

The architectures are spread over two servers, two at a time on each (one's models load\nwhile another's are served)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil

import httpx
import openai
import pytest

from mlxr.supervisor.store.gguf.write import write_gguf
from mlxr.supervisor.store.quantize import quantize_dir
from mlxr.supervisor.store.random_model import ARCH_NAMES, write_random_model
from tests.harness.server import start_server

# GGUF F16 and Q8_0 convert by the same path: tests/mlx/test_gguf_convert.py checks every
# architecture in all four GGUF types in-process (tokens, and quantized values bit for bit);
# here one type per architecture goes through the server.
GGUF_TYPES = ("Q4_K",)
FORMATS = ("f32", "bf16", "q4") + tuple(f"gguf-{t.lower()}" for t in GGUF_TYPES)
MESSAGES = [{"role": "user", "content": "Write a line of Python: print('你好') 🙂"}]
# The last prompt is longer than Gemma's sliding window (64 tokens in these models).
PROMPTS = [f"{w} " * (i + 1) for i, w in enumerate(
    ("river", "stone", "cloud", "ember", "maple", "harbor", "violet"))] + [
    "a long road past quiet towns and " * 16]
N = 5
# runner/host_body.py's shape (a mixture's experts: runner/host_moe.py); the others' quantized
# layers take the kernel one by one (runner/kernel_layers.py)
HOST_BODY_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}
BATCHED = ("f32", "gguf-q4_k")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, subprocess_env):
    """Two servers: a supervisor loads one runner at a time, so two halve the wall time."""
    started = []
    try:
        for i in range(2):
            started.append(start_server(tmp_path_factory.mktemp(f"formats{i}"), subprocess_env,
                                        MLXR_MAX_LOADED_MODELS="4", MLXR_NUM_PARALLEL="8"))
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def formats(arch: str) -> tuple[str, ...]:
    """The formats one architecture is served in: float32, GGUF, and bf16 or q4 in turn."""
    return ("f32", ("bf16", "q4")[ARCH_NAMES.index(arch) % 2]) + FORMATS[3:]


def _create(server, arch: str, tmp) -> dict[str, str]:
    """The models of one architecture (format -> model name)."""
    client = server.client()
    f32 = write_random_model(tmp / f"{arch}-f32", arch=arch)
    names = {fmt: f"{arch}-{fmt}" for fmt in formats(arch)}
    assert client.create(model=names["f32"], from_=str(f32)).status == "success"
    if "bf16" in names:
        bf16 = write_random_model(tmp / f"{arch}-bf16", arch=arch, dtype="bfloat16")
        assert client.create(model=names["bf16"], from_=str(bf16)).status == "success"
    if "q4" in names:
        q4 = tmp / f"{arch}-q4"  # made here: the server's own --quantize has its tests
        quantize_dir(f32, q4, 4)
        for extra in f32.iterdir():
            if not (q4 / extra.name).exists():
                shutil.copy(extra, q4 / extra.name)
        assert client.create(model=names["q4"], from_=str(q4)).status == "success"
    for file_type in GGUF_TYPES:
        path = write_gguf(f32, tmp / f"{arch}-{file_type}.gguf", file_type)
        digest = client.create_blob(path)
        progress = list(client.create(model=names[f"gguf-{file_type.lower()}"],
                                      files={path.name: digest}, stream=True))
        assert progress[-1].status == "success"
        assert any(p.status == "converting model to MLX" for p in progress)
    return names


def _exercise(server, model: str, batched: bool) -> None:
    client = server.client()
    options = {"temperature": 0, "num_predict": N}
    chunks = list(client.chat(model=model, messages=MESSAGES, stream=True, options=options))
    text = "".join(c.message.content for c in chunks)
    assert chunks[-1].done and chunks[-1].eval_count == N, model
    # On the CPU every float format is served as float32 (runner/weights.py) and 4-bit
    # models stay packed for the quantized kernel (the numpy body's, or each layer's where
    # the body does not serve the architecture: runner/kernel_layers.py); /api/ps says so.
    weights = {m["name"]: m.get("weights") for m in
               httpx.get(server.url + "/api/ps").json()["models"]}
    held = weights[f"{model}:latest"]
    if model.endswith("-f32"):
        assert held == "float32", (model, held)
    elif model.endswith("-bf16"):
        assert held.startswith("float32 from "), (model, held)
    elif model.split("-")[0] in HOST_BODY_ARCHS:
        assert held == "4-bit on the quantized kernel", (model, held)
    else:  # (mlx_lm keeps a few of some models' layers at 8 bits: Granite's)
        assert held.startswith("4-bit") and held.endswith(" on the quantized kernel"), \
            (model, held)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    for attempt in range(2):
        reply = oa.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                           max_tokens=N)
        assert reply.choices[0].message.content == text, (model, attempt)
    usage = reply.usage
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1, model
    if not batched:
        client.generate(model=model, keep_alive=0)
        return

    def generate(prompt: str) -> str:  # raw: a random gpt-oss writes no harmony messages
        return client.generate(model=model, prompt=prompt, raw=True, options=options).response

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        batch = list(pool.map(generate, PROMPTS))
    alone = [generate(p) for p in (PROMPTS[0], PROMPTS[-1])]
    assert [batch[0], batch[-1]] == alone, model
    assert len(set(batch)) > 1, model  # the prompts lead to different text
    client.generate(model=model, keep_alive=0)


def _architecture(server, arch: str, tmp) -> list[str]:
    names = _create(server, arch, tmp)
    details = {m.model: m.details for m in server.client().list().models}
    assert details[f"{names['gguf-q4_k']}:latest"].format == "gguf"
    assert details[f"{names['gguf-q4_k']}:latest"].quantization_level.startswith("Q4_K")
    for fmt in names:
        _exercise(server, names[fmt], batched=fmt in BATCHED)
    return list(names)


def test_every_architecture_and_every_format(servers, tmp_path):
    jobs = [(servers[i % len(servers)], arch) for i, arch in enumerate(ARCH_NAMES)]
    with cf.ThreadPoolExecutor(2 * len(servers)) as pool:
        done = list(pool.map(lambda job: _architecture(job[0], job[1], tmp_path), jobs))
    assert all(len(x) == 3 for x in done)
    assert {fmt for x in done for fmt in x} == set(FORMATS)  # each served somewhere
    for s in servers:
        assert "Traceback" not in s.log(), s.log()[-3000:]


def test_gguf_errors_are_400s_naming_what_is_unsupported(server, tmp_path):
    import gguf

    client = server.http()
    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 32), "float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    q8k = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(str(q8k), "llama")
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 292), "uint8"),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"just some text")
    for source, fragment in ((path, 'unsupported model architecture "rwkv6"'),
                             (q8k, 'unsupported GGUF tensor type Q8_K in "token_embd.weight"'),
                             (not_gguf, "is not a GGUF file")):
        digest = server.client().create_blob(source)
        reply = client.post("/api/create", json={"model": "bad", "files": {
            source.name: digest}})
        assert reply.status_code == 400, reply.text
        assert fragment in json.loads(reply.text)["error"]
    assert "bad:latest" not in [m.model for m in server.client().list().models]

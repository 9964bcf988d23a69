"""A vision model as Hugging Face publishes it (`mlxr create --from DIR` of a transformers
checkpoint: `model.*` and `visual.*` names, PyTorch's channels-first patch embedding) serves
the same tokens as the same weights in mlx-vlm's converted layout; Qwen2-VL (its tower run
in one stage) gives mlx-vlm's own greedy tokens, alone and beside text streams; and a bfloat16
Qwen2-VL, widened to float32 on the CPU (runner/weights.py, text model and image tower), gives
mlx-vlm's tokens for the same widened weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.harness.images import encoded, noise
from tests.harness.server import serving

pytestmark = pytest.mark.timeout(180)


def hf_layout(src: Path, dest: Path) -> Path:
    """The random Qwen2.5-VL renamed and reshaped into transformers' own layout."""
    shutil.copytree(src, dest)
    out = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        if name.startswith("vision_tower."):
            name = "visual." + name[len("vision_tower."):]
            if name == "visual.patch_embed.proj.weight":  # (out, t, h, w, in) -> (out, in, t, h, w)
                value = np.ascontiguousarray(value.transpose(0, 4, 1, 2, 3))
        else:
            name = name[len("language_model."):]
        out[name] = value
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"
    return dest


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    from mlxr.supervisor.store.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("bf16") / "qwen2-vl", preset="qwen2-vl",
                              dtype="bfloat16")


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, model_factory, bf16_dir):
    mlx_dir = model_factory("qwen2.5-vl")
    hf_dir = hf_layout(mlx_dir, tmp_path_factory.mktemp("hf") / "qwen2.5-vl")
    yield from serving(tmp_path_factory.mktemp("vision-formats"), subprocess_env,
                       {"mlx": mlx_dir, "hf": hf_dir, "q2": model_factory("qwen2-vl"),
                        "q2bf": bf16_dir},
                       MLXR_KEEP_ALIVE="10m", MLXR_MAX_LOADED_MODELS="4")


def test_hugging_face_layout_serves_the_same_tokens(server):
    client = server.client()
    assert "vision" in client.show("hf").capabilities
    # (that another image changes the output is test_vision_api's; one image is enough here)
    replies = {model: client.chat(model=model, options={"temperature": 0, "num_predict": 10},
                                  messages=[{"role": "user", "content": "What is this?",
                                             "images": [encoded(noise(31))]}]).message.content
               for model in ("mlx", "hf")}
    assert replies["hf"] == replies["mlx"] and replies["mlx"]


def mlx_vlm_reply(model_dir, widened: bool = False) -> str:
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate

    from mlxr.runner.weights import widen

    model, processor = load(model_dir)
    if widened:
        widen(model)
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
              "<|im_start|>assistant\n")
    steps = list(stream_generate(model, processor, prompt, image=[noise(33)], max_tokens=10,
                                 temperature=0.0))
    return processor.tokenizer.decode([s.token for s in steps][:10])


def test_a_bfloat16_vision_model_is_widened_whole_on_the_cpu(server, bf16_dir):
    client = server.client()
    reply = client.chat(model="q2bf", options={"temperature": 0, "num_predict": 10},
                        messages=[{"role": "user", "content": "What is this?",
                                   "images": [encoded(noise(33))]}]).message.content
    held = {m["name"]: m.get("weights") for m in
            httpx.get(server.url + "/api/ps").json()["models"]}
    assert held["q2bf:latest"] == "float32 from bfloat16"
    assert reply == mlx_vlm_reply(bf16_dir, widened=True)


def test_qwen2_vl_matches_mlx_vlm_alone_and_beside_text_streams(server, model_factory):
    from concurrent.futures import ThreadPoolExecutor

    want = mlx_vlm_reply(model_factory("qwen2-vl"))
    client = server.client()
    options = {"temperature": 0, "num_predict": 10}

    def ask(images):
        return client.chat(model="q2", options=options, messages=[
            {"role": "user", "content": "What is this?", "images": images}]).message.content

    assert ask([encoded(noise(33))]) == want
    with ThreadPoolExecutor(4) as pool:
        texts = [pool.submit(ask, []) for _ in range(3)]
        assert pool.submit(ask, [encoded(noise(33))]).result() == want
        assert len({t.result() for t in texts}) == 1

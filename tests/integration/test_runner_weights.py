"""A real runner serving a bfloat16 model on the CPU: by default it widens the weights to
float32 (runner/weights.py) and says so in /v1/status, and its greedy tokens are mlx-lm's for
the widened model, and its KV pool holds as many tokens as the bfloat16 budget it was given
(so twice the bytes: its keys and values are float32 too); with `float32_weights` off it
serves the bfloat16 weights as stored. An 8-bit model keeps its packed layers for the
quantized kernel (runner/quant_kernel.py), and its runner stopped by SIGTERM exits with 0.
(bfloat16 arithmetic rounds differently over different shapes, so the stored model's tokens
are not compared with mlx-lm's: the runner's last-position head and mlx-lm's whole-prompt
logits already part at the first token on this random model.)"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.runner.weights import widen, widen_around_kernel
from mlxr.supervisor.store.quantize import quantize_dir
from mlxr.supervisor.store.random_model import write_random_model
from mlxr.shared.runner_auth import make_token
from tests.harness.runner_process import running, wait_ready
from tests.harness.server import free_port
from tests.integration.test_runner import complete, greedy

BUDGET = 4 << 20  # the KV bytes the supervisor would budget from config.json's bfloat16
PROMPTS = [[11, 12, 13, 14, 15], [300, 301, 302, 303, 304, 305, 306, 307, 308]]
N = 12


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("bf16") / "m", preset="tiny",
                              dtype="bfloat16")


def mlx_lm_tokens(model_dir, widened: bool) -> list[list[int]]:
    model, _ = load(str(model_dir))
    if widened:
        widen(model)
    out = []
    for prompt in PROMPTS:
        steps = generate_step(mx.array(prompt), model, max_tokens=N, sampler=make_sampler(0.0))
        out.append([int(t) for t, _ in steps])
    return out


def served_tokens(url: str) -> list[list[int]]:
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return [await complete(client, url, {"tokens": p, "options": greedy(N)})
                    for p in PROMPTS]

    return [tokens for tokens, *_ in asyncio.run(main())]


def test_by_default_a_bfloat16_model_is_widened_and_generates_mlx_lms_tokens_for_it(
        bf16_model, subprocess_env):
    with running(bf16_model, subprocess_env, num_parallel=4, kv_cache_bytes=BUDGET) as url:
        status = httpx.get(url + "/v1/status").json()
        assert status["weights"] == "float32 from bfloat16"
        pool = status["kv_blocks_total"] * status["kv_block_bytes"]
        assert 2 * BUDGET - status["kv_block_bytes"] < pool <= 2 * BUDGET
        assert served_tokens(url) == mlx_lm_tokens(bf16_model, widened=True)


def test_with_the_setting_off_the_stored_bfloat16_weights_are_served(bf16_model,
                                                                      subprocess_env):
    with running(bf16_model, subprocess_env, num_parallel=4, float32_weights="off",
                 kv_cache_bytes=BUDGET) as url:
        status = httpx.get(url + "/v1/status").json()
        assert status["weights"] == "bfloat16"
        pool = status["kv_blocks_total"] * status["kv_block_bytes"]
        assert BUDGET - status["kv_block_bytes"] < pool <= BUDGET
        served = served_tokens(url)
        assert [len(t) for t in served] == [N] * len(PROMPTS)
        assert served != mlx_lm_tokens(bf16_model, widened=True)


@pytest.fixture(scope="module")
def q8_model(bf16_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("q8") / "m"
    quantize_dir(bf16_model, out, 8)
    for extra in bf16_model.iterdir():
        if not (out / extra.name).exists():
            shutil.copy(extra, out / extra.name)
    return out


def test_an_8_bit_model_is_served_as_stored_on_the_quantized_kernel(q8_model, subprocess_env):
    # its packed layers stay as they are (a quarter of float32's bytes), its scales and the
    # rest become float32, and so do its keys and values; the tokens are mlx-lm's for that
    # model (MLX's own quantized products, over the same values)
    def reference() -> list[list[int]]:
        model, _ = load(str(q8_model))
        widen_around_kernel(model)
        return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                                   sampler=make_sampler(0.0))]
                for p in PROMPTS]

    with running(q8_model, subprocess_env, num_parallel=4, kv_cache_bytes=BUDGET) as url:
        status = httpx.get(url + "/v1/status").json()
        assert status["weights"] == "8-bit+bfloat16 on the quantized kernel"  # its norms
        pool = status["kv_blocks_total"] * status["kv_block_bytes"]
        assert 2 * BUDGET - status["kv_block_bytes"] < pool <= 2 * BUDGET
        assert served_tokens(url) == reference()
        # embeddings go through the numpy body too: the mean of MLX's hidden states
        got = httpx.post(url + "/v1/embeddings", json={"input": [PROMPTS[1]]},
                         timeout=60).json()["embeddings"][0]
        model, _ = load(str(q8_model))
        widen_around_kernel(model)
        mean = np.array(model.model(mx.array([PROMPTS[1]]))[0].mean(axis=0))
        assert np.allclose(got, mean / np.linalg.norm(mean), atol=1e-5)


def test_a_quantized_runner_stopped_by_sigterm_exits_cleanly(q8_model, subprocess_env):
    # Started by hand (no supervisor's stdin to close), after MLX's quantized products and the
    # kernel's have run: SIGTERM ends it with status 0. Before runner/__main__.py's
    # `_exit_now`, a joinable C++ thread destroyed in the interpreter's teardown aborted most
    # such stops (status -6, "terminate called without an active exception").
    for _ in range(2):  # it aborted in most stops, not all
        port = free_port()
        config = {"model_dir": str(q8_model), "port": port, "token_stdin": True}
        proc = subprocess.Popen([sys.executable, "-m", "mlxr.runner", "--config",
                                 json.dumps(config)], env=subprocess_env,
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        token = make_token()
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.flush()
        url = f"http://runner:{token}@127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            assert served_tokens(url)  # the quantized kernel's products ran
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()[-1000:]
        assert b"terminate called" not in err

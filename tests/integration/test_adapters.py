"""LoRA adapters through `mlxr serve`: `/api/create` with `adapters` (the official ollama
client) and `ADAPTER` in a Modelfile (the `mlxr` CLI), in mlx-lm's format and in PEFT's. A
random rank-4 LoRA on the tiny random qwen3 changes its greedy output, and the server's output
is mlx-lm's own `load(model, adapter_path=...)` generation, token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import ollama
import pytest
from safetensors.numpy import save_file

from tests.harness.server import serving

pytestmark = pytest.mark.timeout(300)
RANK, SCALE = 4, 8.0
KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]
NUM_LAYERS = 1  # mlx-lm's num_layers: the last of the tiny model's two decoder layers
GREEDY = {"temperature": 0, "num_predict": 12}
PROMPT = "The adapter changes what comes next"
MLXR = [sys.executable, "-m", "mlxr.supervisor.cli"]


def random_lora(model_dir: Path, seed: int = 3) -> dict[str, np.ndarray]:
    """mlx-lm names -> arrays for the last NUM_LAYERS layers' KEYS, as linear_to_lora_layers
    lays them out (lora_a: (in, r), lora_b: (r, out)); lora_b is non-zero so it matters."""
    config = json.loads((model_dir / "config.json").read_text())
    from safetensors.numpy import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    n = config["num_hidden_layers"]
    out = {}
    for layer in range(n - NUM_LAYERS, n):
        for key in KEYS:
            base = f"model.layers.{layer}.{key}"
            out_dims, in_dims = weights[base + ".weight"].shape
            out[base + ".lora_a"] = rng.normal(0, in_dims ** -0.5, (in_dims, RANK)) \
                .astype(np.float32)
            out[base + ".lora_b"] = rng.normal(0, 0.05, (RANK, out_dims)).astype(np.float32)
    return out


def write_mlx_adapter(dest: Path, tensors: dict[str, np.ndarray]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapters.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": NUM_LAYERS, "model": "ignored/by/mlxr",
        "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": KEYS}}))
    (dest / "0000100_adapters.safetensors").write_bytes(b"a training checkpoint: not sent")
    return dest


def write_peft_adapter(dest: Path, tensors: dict[str, np.ndarray], **config) -> Path:
    """The same adapter as PEFT saves it: lora_A (r, in), lora_B (out, r), alpha = scale * r."""
    dest.mkdir(parents=True, exist_ok=True)
    peft = {}
    for name, value in tensors.items():
        module, leaf = name.rsplit(".", 1)
        peft[f"base_model.model.{module}.lora_{'A' if leaf == 'lora_a' else 'B'}.weight"] = \
            np.ascontiguousarray(value.T)
    save_file(peft, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": SCALE * RANK, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj", "down_proj"], "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "task_type": "CAUSAL_LM", **config}))
    (dest / "README.md").write_text("a model card")
    return dest


def mlx_lm_greedy(model_dir: Path, adapter: Path | None, prompt_tokens: list[int],
                  n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    model, _ = load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    steps = generate_step(mx.array(prompt_tokens), model, max_tokens=n,
                          sampler=make_sampler(0.0))
    return [int(t) for t, _ in steps][:n]


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env, tiny_model):
    yield from serving(tmp_path_factory.mktemp("adapters"), subprocess_env,
                       {"tiny": tiny_model}, MLXR_KEEP_ALIVE="10m", MLXR_MAX_LOADED_MODELS="1")


@pytest.fixture(scope="module")
def lora(tiny_model) -> dict[str, np.ndarray]:
    return random_lora(tiny_model)


@pytest.fixture(scope="module")
def mlx_adapter(tmp_path_factory, lora) -> Path:
    return write_mlx_adapter(tmp_path_factory.mktemp("mlx-adapter"), lora)


def upload(client: ollama.Client, directory: Path, names: list[str]) -> dict[str, str]:
    return {name: client.create_blob(directory / name) for name in names}


def reply_tokens(client: ollama.Client, model: str) -> tuple[list[int], list[int]]:
    """(prompt tokens, greedy reply tokens) of one generate."""
    reply = client.generate(model=model, prompt=PROMPT, options=GREEDY)
    assert reply.eval_count == GREEDY["num_predict"]
    return reply.context[:reply.prompt_eval_count], reply.context[reply.prompt_eval_count:]


@pytest.fixture(scope="module")
def expected(server, tiny_model, mlx_adapter) -> dict[str, list[int]]:
    """The base model's reply through the server, and mlx-lm's own with the adapter."""
    prompt, base = reply_tokens(server.client(), "tiny")
    assert base == mlx_lm_greedy(tiny_model, None, prompt, GREEDY["num_predict"])
    return {"prompt": prompt, "base": base,
            "lora": mlx_lm_greedy(tiny_model, mlx_adapter, prompt, GREEDY["num_predict"])}


def adapter_layers(server, name: str) -> list[dict]:
    path = server.models_dir / "manifests/registry.ollama.ai/library" / name / "latest"
    return [x for x in json.loads(path.read_bytes())["layers"]
            if x["mediaType"] == "application/vnd.ollama.image.adapter"]


def test_an_mlx_lm_adapter_applies_as_mlx_lm_applies_it(server, mlx_adapter, expected):
    client = server.client()
    adapters = upload(client, mlx_adapter, ["adapters.safetensors", "adapter_config.json"])
    progress = [x.status for x in client.create(model="tiny-lora", from_="tiny",
                                                adapters=adapters, stream=True)]
    assert "converting adapter" in progress and progress[-1] == "success"
    assert [x["name"] for x in adapter_layers(server, "tiny-lora")] == \
        ["adapters.safetensors", "adapter_config.json"]
    prompt, tokens = reply_tokens(client, "tiny-lora")
    assert prompt == expected["prompt"]
    assert tokens != expected["base"] and tokens == expected["lora"]

    # A model made from it keeps the adapter (and answers the same); a second one is refused.
    client.create(model="tiny-lora-2", from_="tiny-lora", system="Still adapted.")
    assert adapter_layers(server, "tiny-lora-2") == adapter_layers(server, "tiny-lora")
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="tiny-lora-3", from_="tiny-lora", adapters=adapters)
    assert err.value.status_code == 400 and "already has an adapter" in err.value.error


def test_show_names_the_adapter_and_its_modelfile_builds_the_same_model(
        server, mlx_adapter, expected, tmp_path, subprocess_env):
    client = server.client()
    adapters = upload(client, mlx_adapter, ["adapters.safetensors", "adapter_config.json"])
    client.create(model="tiny-lora-show", from_="tiny", adapters=adapters)
    modelfile = client.show("tiny-lora-show").modelfile
    [line] = [x for x in modelfile.splitlines() if x.startswith("ADAPTER ")]
    assert {"adapters.safetensors", "adapter_config.json"} <= \
        {p.name for p in Path(line.removeprefix("ADAPTER ")).iterdir()}
    # As `ollama show --modelfile` says: replace the FROM line to build on it.
    (tmp_path / "Modelfile").write_text(modelfile.replace("FROM tiny-lora-show", "FROM tiny"))
    env = {**subprocess_env, "MLXR_HOST": server.url.removeprefix("http://")}
    made = subprocess.run([*MLXR, "create", "tiny-lora-again"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert adapter_layers(server, "tiny-lora-again") == adapter_layers(server, "tiny-lora-show")


def test_a_peft_adapter_in_a_modelfile_is_converted(server, tmp_path, lora, expected,
                                                     subprocess_env):
    peft = write_peft_adapter(tmp_path / "peft", lora)
    (tmp_path / "Modelfile").write_text("FROM tiny\nADAPTER ./peft\nPARAMETER num_predict 12\n")
    env = {**subprocess_env, "MLXR_HOST": server.url.removeprefix("http://")}
    made = subprocess.run([*MLXR, "create", "tiny-peft"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert len([x for x in made.stderr.splitlines() if x.startswith("copying file")]) == 2
    assert "converting adapter" in made.stderr.splitlines()
    config = json.loads((server.models_dir / "blobs" / ("sha256-" + next(
        x["digest"][7:] for x in adapter_layers(server, "tiny-peft")
        if x["name"] == "adapter_config.json"))).read_text())
    assert config == {"fine_tune_type": "lora", "num_layers": NUM_LAYERS, "lora_parameters": {
        "rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": sorted(KEYS)}}
    prompt, tokens = reply_tokens(server.client(), "tiny-peft")
    assert prompt == expected["prompt"] and tokens == expected["lora"]


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "unsupported PEFT adapter: use_dora"),
    ({"rank_pattern": {"q_proj": 8}}, "unsupported PEFT adapter: rank_pattern"),
    ({"bias": "all"}, "unsupported PEFT adapter: bias"),
    ({"r": 8}, "not rank 8 as adapter_config.json says"),
])
def test_unsupported_peft_adapters_are_400s(server, tmp_path, lora, change, message):
    client = server.client()
    peft = write_peft_adapter(tmp_path / "peft", lora, **change)
    adapters = upload(client, peft, ["adapter_model.safetensors", "adapter_config.json"])
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="bad", from_="tiny", adapters=adapters)
    assert err.value.status_code == 400 and message in err.value.error, err.value.error


def test_adapters_that_do_not_fit_the_base_are_400s(server, tmp_path, lora):
    client = server.client()
    cases = {
        "lm_head": ({"lm_head.lora_a": np.zeros((64, RANK), np.float32)},
                    "outside the decoder layers"),
        "shape": ({"model.layers.1.self_attn.q_proj.lora_a":
                   np.zeros((3, RANK), np.float32)}, "needs ["),
        "layer": ({"model.layers.0.self_attn.q_proj.lora_a": next(iter(lora.values()))},
                  f"is not among the last {NUM_LAYERS} layers"),
    }
    for case, (tensors, message) in cases.items():
        adapter = write_mlx_adapter(tmp_path / case, tensors)
        adapters = upload(client, adapter, ["adapters.safetensors", "adapter_config.json"])
        with pytest.raises(ollama.ResponseError) as err:
            client.create(model="bad", from_="tiny", adapters=adapters)
        assert err.value.status_code == 400 and message in err.value.error, (case, err.value)
    gguf = tmp_path / "adapter.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    for adapters, message in (({"adapter.gguf": client.create_blob(gguf)}, "GGUF adapters"),
                              ({"adapters.safetensors": "sha256:" + "0" * 64}, "not found")):
        with pytest.raises(ollama.ResponseError) as err:
            client.create(model="bad", from_="tiny", adapters=adapters)
        assert err.value.status_code == 400 and message in err.value.error
    assert "bad" not in [m.model for m in client.list().models]

"""Every architecture's random model through mlx_lm (float32, bfloat16, MLX 4-bit), and what
the runner adds per architecture: the body/head split with logit transforms, the Gemma 2
attention fix, and prefix-cache state for sliding-window layers (runner/architectures.py,
runner/kv/cache_state.py); and each model through a GGUF file written and read with
supervisor/store/gguf/arch.py alone (float32 tensors: no quantization involved)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxr.runner.kv import cache_state
from mlxr.runner.architectures import fix_model
from mlxr.runner.model_step import split_model
from mlxr.runner.weights import widen_experts
from mlxr.supervisor.store.gguf import arch as A
from mlxr.supervisor.store.quantize import quantize_dir
from mlxr.supervisor.store.random_model import ARCH_NAMES, PRESETS, write_random_model

PROMPTS = ("the quick brown fox jumps over the lazy dog", "once upon a time, in a land far away")


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    made = {}

    def make(arch: str, dtype: str = "float32"):
        if (arch, dtype) not in made:
            made[arch, dtype] = write_random_model(
                tmp_path_factory.mktemp(f"{arch}-{dtype}"), arch=arch, dtype=dtype)
        return made[arch, dtype]

    return make


def greedy(model, tokenizer, prompt: str, n: int = 6) -> list[int]:
    steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=n,
                          sampler=make_sampler(0.0))
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_every_architecture_loads_and_generates_in_each_precision(arch, arch_model, tmp_path):
    outputs, logits = {}, {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load(str(arch_model(arch, dtype)))
        assert model.model.embed_tokens.weight.dtype == getattr(mx, dtype)
        # MLX's CPU expert product is float32 only; the runner widens the experts alike
        experts = 3 * PRESETS[arch].layers if PRESETS[arch].experts and dtype != "float32" \
            else 0  # 3 a layer
        assert widen_experts(model) == experts
        outputs[dtype] = [greedy(model, tokenizer, p) for p in PROMPTS]
        eos = set(tokenizer.eos_token_ids)
        for tokens in outputs[dtype]:
            assert len(tokens) == 6 and not eos & set(tokens)
        logits[dtype] = model(mx.array([tokenizer.encode(PROMPTS[0])]))[0, -1].astype(mx.float32)
    assert outputs["float32"][0] != outputs["float32"][1], "the output depends on the prompt"
    a, b = logits["float32"], logits["bfloat16"]
    assert (a @ b / mx.sqrt((a @ a) * (b @ b))).item() > 0.99, "bfloat16 is the same model"

    quantized = tmp_path / "q4"
    quantize_dir(arch_model(arch), quantized, bits=4, group_size=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(arch_model(arch) / name, quantized / name)
    model, tokenizer = load(str(quantized))
    layer = model.layers[0]
    mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe  # (mixtral)
    experts = getattr(mlp, "switch_mlp", None) or getattr(mlp, "experts", mlp)  # qwen3_moe, gpt_oss
    assert isinstance(experts.down_proj,
                      (nn.QuantizedLinear, QuantizedSwitchLinear))
    assert len(greedy(model, tokenizer, PROMPTS[0])) == 6


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_every_architecture_splits_into_body_and_head(arch, arch_model):
    model, _, config = load(str(arch_model(arch)), return_config=True)
    fix_model(model, config)
    split = split_model(model)
    assert split.body is not None, "prefill computes logits for the last position only"
    # final soft-capping (Gemma 2 and 4) or logits scaling (Granite)
    assert (split.post is not None) == (arch in ("gemma2", "gemma4", "granite", "granitemoe"))
    probe = mx.array([[5, 6, 7, 8]])
    whole = model(probe, cache=make_prompt_cache(model))[:, -1]
    parts = split.logits(split.head(split.body(probe, cache=make_prompt_cache(model))[:, -1]))
    assert mx.allclose(whole, parts, atol=1e-5).item()


def gemma2_reference(model, tokens: list[int], window: int) -> mx.array:
    """Gemma 2's last-position logits computed with mlx_lm's own layers, unchanged, given
    explicit masks: causal, and limited to `window` keys on the even (sliding) layers."""
    h = model.model.embed_tokens(mx.array([tokens])) * (model.args.hidden_size ** 0.5)
    causal = create_causal_mask(len(tokens))
    sliding = create_causal_mask(len(tokens), window_size=window)
    for index, layer in enumerate(model.model.layers):
        h = layer(h, sliding if index % 2 == 0 else causal, None)
    logits = model.model.embed_tokens.as_linear(model.model.norm(h))[:, -1]
    return mx.tanh(logits / model.final_logit_softcapping) * model.final_logit_softcapping


def test_gemma2_fix_keeps_mlx_lms_output_below_the_window_and_slides_above(arch_model):
    path = arch_model("gemma2")
    stock, _, config = load(str(path), return_config=True)
    fixed, _ = load(str(path))
    fix_model(fixed, config)
    window = config["sliding_window"]
    short = list(range(3, 3 + window // 2))
    long = [(7 * i) % 1900 + 3 for i in range(2 * window + 8)]
    for tokens in (short, long):
        got = fixed(mx.array([tokens]), cache=make_prompt_cache(fixed))[:, -1]
        assert mx.allclose(got, gemma2_reference(stock, tokens, window), atol=1e-4).item()
    assert mx.array_equal(fixed(mx.array([short]))[:, -1], stock(mx.array([short]))[:, -1]).item()
    # Decoding one token at a time over a cache longer than the window slides too.
    cache = make_prompt_cache(fixed)
    fixed(mx.array([long[:-1]]), cache=cache)
    step = fixed(mx.array([long[-1:]]), cache=cache)[:, -1]
    assert mx.allclose(step, gemma2_reference(stock, long, window), atol=1e-4).item()
    assert not mx.allclose(step, stock(mx.array([long]))[:, -1], atol=1e-2).item()


def test_gemma2_fix_decodes_a_left_padded_batch_like_each_row_alone(arch_model):
    model, _, config = load(str(arch_model("gemma2")), return_config=True)
    fix_model(model, config)
    prompts = [list(range(10, 10 + n)) for n in (5, 90, 30)]  # one row past the window
    alone = []
    for tokens in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([tokens[:-1]]), cache=cache)
        alone.append(model(mx.array([tokens[-1:]]), cache=cache)[0, -1])
    rows = []
    for tokens in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([tokens[:-1]]), cache=cache)
        rows.append(cache)
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*rows)]
    last = model(mx.array([[t[-1]] for t in prompts]), cache=batch)[:, -1]
    for i, expected in enumerate(alone):
        assert mx.allclose(last[i], expected, atol=1e-4).item(), i


def test_gemma3_sliding_layers_restore_from_a_prefix_state(arch_model):
    model, _ = load(str(arch_model("gemma3")))
    window = model.args.sliding_window
    tokens = [(11 * i) % 1900 + 3 for i in range(window + 20)]
    n = len(tokens)
    source = make_prompt_cache(model)
    for start in range(0, n, 40):  # prefill chunks, as the runner runs them
        model(mx.array([tokens[start:start + 40]]), cache=source)
    assert all(cache_state.cacheable(c) for c in source)
    states = [cache_state.take(c, n) for c in source]
    assert max(s.start for s in states) > 0, "the sliding layers evicted early positions"
    for length in (n, n - 1):  # a conversation going on; the same prompt sent again
        caches = make_prompt_cache(model)
        assert all(cache_state.restorable(c, s, length) for c, s in zip(caches, states))
        for c, s in zip(caches, states):
            cache_state.restore(c, s, length)
        follow = tokens[length:] + [42, 43]
        ours = model(mx.array([follow]), cache=caches)[:, -1]
        full = make_prompt_cache(model)
        expected = model(mx.array([tokens + [42, 43]]), cache=full)[:, -1]
        assert mx.allclose(ours, expected, atol=1e-4).item(), length
        ours = model(mx.array([[44]]), cache=caches)[:, -1]  # then one token at a time
        assert mx.allclose(ours, model(mx.array([[44]]), cache=full)[:, -1], atol=1e-4).item()
    caches = make_prompt_cache(model)
    assert not all(cache_state.restorable(c, s, window) for c, s in zip(caches, states))


def write_gguf(src, out) -> None:
    """The model as llama.cpp's converter would write it (float32), using only arch.py."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((src / "config.json").read_text())
    arch, kv = A.gguf_metadata(config)
    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in kv.items():
        if key != "general.architecture":
            add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
            add.get(type(value), writer.add_array)(key, value)
    for name, tensor in A.gguf_extra_tensors(config).items():
        writer.add_tensor(name, tensor)
    for name, tensor in A.stack_experts(load_file(str(src / "model.safetensors"))).items():
        order = A.gguf_row_order(arch, name, config)
        tensor = tensor if order is None else tensor[order]
        writer.add_tensor(A.gguf_tensor_name(arch, name),
                          (tensor - np.float32(A.value_offset(arch, name))).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_gguf(path, dest, like) -> None:
    """The GGUF file back as a model directory, using only arch.py (tokenizer from `like`)."""
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)])
               for t in reader.tensors}
    arch = kv["general.architecture"]
    config = A.hf_config(kv, vocab_size=tensors["token_embd.weight"].shape[0],
                         tied="output.weight" not in tensors, tensor_names=list(tensors),
                         rope_tensors={n: tensors[n] for n in A.ROPE_TENSORS if n in tensors})
    weights = {}
    for name, tensor in tensors.items():
        if (hf := A.hf_tensor_name(arch, name)) is not None:
            order = A.row_order(arch, hf, config)
            tensor = tensor if order is None else tensor[order]
            weights[hf] = (tensor + np.float32(A.value_offset(arch, hf))).astype(np.float32)
    dest.mkdir()
    save_file(weights, str(dest / "model.safetensors"))
    eos = json.loads((like / "config.json").read_text())["eos_token_id"]
    (dest / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / name, dest / name)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_model_through_a_gguf_file_and_back_gives_the_same_logits(arch, arch_model, tmp_path):
    """arch.py's names, row orders, offsets and configs compose into an exact round trip, and
    the config it makes loads in mlx_lm and transformers (which checks field types)."""
    write_gguf(arch_model(arch), tmp_path / "model.gguf")
    read_gguf(tmp_path / "model.gguf", tmp_path / "back", arch_model(arch))
    ours, tokenizer = load(str(arch_model(arch)))
    back, _ = load(str(tmp_path / "back"))
    tokens = mx.array([tokenizer.encode(" ".join(PROMPTS))])
    assert mx.array_equal(ours(tokens), back(tokens)).item()


def test_random_models_are_the_same_bytes_every_time(tmp_path):
    for dtype in ("float32", "bfloat16"):
        a = write_random_model(tmp_path / f"a-{dtype}", "gemma2", dtype=dtype)
        b = write_random_model(tmp_path / f"b-{dtype}", arch="gemma2", dtype=dtype)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (dtype, name)
    assert json.loads((a / "config.json").read_text())["torch_dtype"] == "bfloat16"

"""Image towers run in stages (runner/vision/model.py): split by query rows (the CPU's stages)
and a whole block a stage (a GPU's), each against mlx-vlm's own forward pass of the tower.
Qwen2.5-VL and Qwen2-VL (`_qwen_tower_stages`; Qwen2.5-VL's windows under one block-diagonal
mask on a GPU) on the store's random models with an image large enough for several attention
windows; Gemma 3's SigLIP tower (`_siglip_tower_stages`) with its projector."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxr.runner.kv import host_attention
from mlxr.runner.vision import model as vision
from mlxr.shared.images import decode_base64_image
from mlxr.supervisor.store.random_model import write_random_model
from tests.harness.images import b64, encoded, noise

SIDE = 224  # 256 patches: 16 windows of 16 in the windowed block


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen2-vl"])
def prompt(request, tmp_path_factory):
    from mlx_lm import load

    path = write_random_model(tmp_path_factory.mktemp("vl") / "vl", request.param)
    cfg_path = path / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_pixels"] = SIDE * SIDE
    cfg_path.write_text(json.dumps(cfg))
    text_model, _ = load(str(path))
    config = json.loads((path / "config.json").read_text())
    vm = vision.VisionModel(str(path), getattr(text_model, "language_model", text_model),
                            config)
    image = decode_base64_image(b64(encoded(noise(3, SIDE, SIDE))))
    return vm, vm.prepare(f"look: {vm.placeholder}", [image])


def run_stages(vm, vp, host: bool = False, **kwargs) -> tuple[mx.array, int]:
    stages = list(vision._qwen_tower_stages(vm.vlm.vision_tower, vp, host, **kwargs))
    return stages[-1], len(stages) - 1


def reference(vm, vp) -> mx.array:
    tower = vm.vlm.vision_tower
    pixels = mx.array(vp.arrays["pixel_values"]).astype(tower.patch_embed.proj.weight.dtype)
    return tower(pixels, mx.array(vp.arrays["image_grid_thw"]))


def test_the_image_spans_several_windows_or_is_attended_whole(prompt):
    vm, vp = prompt
    tower = vm.vlm.vision_tower
    if vm.family == "qwen2_vl":  # every block attends over the whole image
        assert not hasattr(tower, "get_window_index") and len(tower.blocks) > 1
        return
    _, bounds = tower.get_window_index(mx.array(vp.arrays["image_grid_thw"]))
    assert len(set(bounds.tolist())) > 3  # at least three windows to keep apart
    assert tower.fullatt_block_indexes and len(tower.blocks) > len(tower.fullatt_block_indexes)


@pytest.mark.parametrize("whole_blocks,masked", [(False, 0), (True, 4096), (True, 16)])
def test_staged_tower_gives_mlx_vlm_features(prompt, whole_blocks, masked, monkeypatch):
    vm, vp = prompt
    monkeypatch.setattr(vision, "MASKED_PATCHES", masked)  # 16: a call a window
    got, _ = run_stages(vm, vp, whole_blocks=whole_blocks)
    want = reference(vm, vp)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scores", [16 * 16, 2 * 16 * 16, vision.STAGE_SCORES],
                         ids=["a-window-a-call", "two-windows-a-call", "all-windows-a-call"])
@pytest.mark.parametrize("host", [False, True], ids=["mlx-attention", "numpy-softmax"])
def test_windows_attended_together_give_mlx_vlm_features(prompt, scores, host, monkeypatch):
    # CPU stages: runs of equal windows in one call (each head and window a head of it),
    # with MLX's attention or numpy's softmax.
    vm, vp = prompt
    monkeypatch.setattr(vision, "STAGE_SCORES", scores)
    monkeypatch.setattr(host_attention, "MIN_SCORES", 0)  # every call, where host
    got, _ = run_stages(vm, vp, host=host)
    np.testing.assert_allclose(np.array(got), np.array(reference(vm, vp)), rtol=1e-4,
                               atol=1e-4)


def test_attention_calls_join_equal_windows_within_the_stage_budget(monkeypatch):
    monkeypatch.setattr(vision, "STAGE_SCORES", 3 * 16)  # three 4-patch windows a call
    windows = [0, 4, 8, 12, 16, 20, 26, 30]  # five of 4 patches, one of 6, one of 4
    assert list(vision._attention_calls(windows)) == [
        (0, 12, 0, 12, 3), (12, 20, 12, 20, 2), (20, 26, 20, 26, 1), (26, 30, 26, 30, 1)]
    # a segment past the budget alone: its query rows in pieces, one call each
    assert list(vision._attention_calls([0, 10])) == [(0, 4, 0, 10, 1), (4, 8, 0, 10, 1),
                                                      (8, 10, 0, 10, 1)]


def test_whole_blocks_take_one_stage_each(prompt, monkeypatch):
    vm, vp = prompt
    monkeypatch.setattr(vision, "STAGE_SCORES", 1024)  # many pieces, had it been split
    _, whole = run_stages(vm, vp, whole_blocks=True)
    _, split = run_stages(vm, vp, whole_blocks=False)
    assert whole == 1 + len(vm.vlm.vision_tower.blocks)  # the set-up, then each block
    assert split > 2 * whole


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from mlx_lm import load

    path = write_random_model(tmp_path_factory.mktemp("g3") / "g3", "gemma3-vision")
    text_model, _ = load(str(path))
    config = json.loads((path / "config.json").read_text())
    vm = vision.VisionModel(str(path), getattr(text_model, "language_model", text_model),
                            config)
    images = [decode_base64_image(b64(encoded(noise(seed, 64, 48)))) for seed in (1, 2)]
    return vm, vm.prepare(f"one {vm.placeholder} two {vm.placeholder}", images)


def siglip_stages(vm, vp, **kwargs) -> tuple[mx.array, int]:
    stages = list(vision._siglip_tower_stages(vm.vlm, vp, False, **kwargs))
    return stages[-1], len(stages) - 1


@pytest.mark.parametrize("whole_layers", [False, True])
def test_staged_siglip_tower_gives_mlx_vlm_features(gemma, whole_layers):
    vm, vp = gemma
    pixels = mx.array(vp.arrays["pixel_values"])
    assert pixels.shape[0] == 2  # two images, attended each on its own
    got, _ = siglip_stages(vm, vp, whole_layers=whole_layers)
    hidden, _, _ = vm.vlm.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
    want = vm.vlm.multi_modal_projector(hidden)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_siglip_layers_split_by_query_rows_on_the_cpu(gemma, monkeypatch):
    vm, vp = gemma
    layers = len(vm.vlm.vision_tower.vision_model.encoder.layers)
    _, whole = siglip_stages(vm, vp, whole_layers=True)
    assert whole == 1 + layers
    n = vm.vlm.vision_tower.vision_model.embeddings(
        mx.array(vp.arrays["pixel_values"][:1]).transpose(0, 2, 3, 1)).shape[1]
    monkeypatch.setattr(vision, "STAGE_SCORES", 4 * n)  # four query rows a stage
    _, split = siglip_stages(vm, vp, whole_layers=False)
    pieces = 2 * -(-n // 4)  # both images' attention, four rows a piece
    assert split == 1 + layers * (2 + pieces)  # each layer: projections, pieces, the rest


def test_segment_mask_keeps_each_segment_to_itself():
    mask = np.array(vision._segment_mask([0, 2, 5, 6]))
    segment = np.array([0, 0, 1, 1, 1, 2])
    assert (mask == (segment[:, None] == segment[None, :])).all()
    assert vision._segment_mask([0, 6]) is None
    past = vision.MASKED_PATCHES + 1  # too many patches for a mask: a call a window instead
    assert vision._segment_mask([0, 2, past]) is None

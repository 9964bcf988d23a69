"""Images in prompts: Hugging Face image parts for a Jinja chat template, the family's placeholder
written in for a Go TEMPLATE, and which checkpoints count as vision models."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.shared.vision import placeholder, vision_family
from mlxr.supervisor.inference.prepare import image_mark, with_image_marks
from mlxr.supervisor.inference.prompt import GoRenderer, JinjaRenderer, to_hf_message
from mlxr.supervisor.store.random_vision import CHAT_TEMPLATE

QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VL = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}
CHATML_GO = ("{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
             "<|im_start|>assistant\n")
CONVERSATION = [
    {"role": "user", "content": "What is in these?", "images": ["AAAA", "BBBB"]},
    {"role": "assistant", "content": "A cat and a dog."},
    {"role": "user", "content": "Which is bigger?"},
]


def model_dir(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


# -- to_hf_message ---------------------------------------------------------------------------
def test_a_message_with_images_becomes_image_parts_then_its_text():
    out = to_hf_message({"role": "user", "content": "Describe", "images": ["a", "b", "c"]})
    assert out["role"] == "user"
    assert out["content"] == [{"type": "image"}, {"type": "image"}, {"type": "image"},
                              {"type": "text", "text": "Describe"}]


def test_a_message_with_images_and_no_text_has_an_empty_text_part():
    out = to_hf_message({"role": "user", "images": ["a"]})
    assert out["content"] == [{"type": "image"}, {"type": "text", "text": ""}]


@pytest.mark.parametrize("images", [None, []])
def test_a_message_without_images_keeps_string_content(images):
    message = {"role": "user", "content": "Hello"}
    if images is not None:
        message["images"] = images
    assert to_hf_message(message)["content"] == "Hello"


# -- with_image_marks / image_mark ------------------------------------------------------------
def test_a_go_template_gets_one_placeholder_per_image_before_the_text(tmp_path):
    root = model_dir(tmp_path / "m", QWEN_VL)
    messages = copy.deepcopy(CONVERSATION)
    out = with_image_marks(messages, GoRenderer(CHATML_GO), root)
    assert out[0]["content"] == QWEN_MARK * 2 + "What is in these?"
    assert out[0]["images"] == ["AAAA", "BBBB"]
    assert out[1:] == CONVERSATION[1:]
    assert messages == CONVERSATION  # the caller's messages are left as they were


def test_every_message_with_images_gets_its_own_placeholders(tmp_path):
    root = model_dir(tmp_path / "m", QWEN_VL)
    messages = [{"role": "user", "content": "one", "images": ["A"]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": None, "images": ["B", "C", "D"]}]
    out = with_image_marks(messages, GoRenderer(CHATML_GO), root)
    assert [m["content"] for m in out] == [QWEN_MARK + "one", "ok", QWEN_MARK * 3]


def test_the_go_template_prompt_carries_the_placeholders(tmp_path):
    root = model_dir(tmp_path / "m", QWEN_VL)
    renderer = GoRenderer(CHATML_GO)
    prompt = renderer.chat(with_image_marks(CONVERSATION, renderer, root))
    assert prompt == ("<|im_start|>user\n" + QWEN_MARK * 2 + "What is in these?<|im_end|>\n"
                      "<|im_start|>assistant\nA cat and a dog.<|im_end|>\n"
                      "<|im_start|>user\nWhich is bigger?<|im_end|>\n"
                      "<|im_start|>assistant\n")


def test_the_placeholder_is_the_family_one(tmp_path):
    gemma = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"}}
    root = model_dir(tmp_path / "g", gemma)
    out = with_image_marks([{"role": "user", "content": "hi", "images": ["A"]}],
                           GoRenderer(CHATML_GO), root)
    assert out[0]["content"] == "<start_of_image>hi"
    assert image_mark(root) == placeholder("gemma3")


def test_a_jinja_template_gets_the_messages_unchanged(tmp_path):
    root = model_dir(tmp_path / "m", QWEN_VL)
    messages = copy.deepcopy(CONVERSATION)
    out = with_image_marks(messages, JinjaRenderer(CHAT_TEMPLATE, {}), root)
    assert out == CONVERSATION


def test_messages_without_images_need_no_vision_model(tmp_path):
    # a text model's directory: nothing to mark, so nothing is asked of its config
    root = model_dir(tmp_path / "t", {"model_type": "qwen2"})
    messages = [{"role": "user", "content": "hi"}]
    assert with_image_marks(messages, GoRenderer(CHATML_GO), root) == messages


def test_image_mark_reads_the_family_from_config_json(tmp_path):
    assert image_mark(model_dir(tmp_path / "m", QWEN_VL)) == QWEN_MARK


@pytest.mark.parametrize("config", [
    {"model_type": "qwen2"},
    {"model_type": "qwen2_5_vl"},  # no vision_config
    {"model_type": "llava", "vision_config": {}},  # a family mlxr does not serve with images
])
def test_image_mark_of_a_model_that_is_no_vision_model_is_refused(tmp_path, config):
    root = model_dir(tmp_path / "t", config)
    with pytest.raises(InvalidRequest):
        image_mark(root)
    with pytest.raises(InvalidRequest):
        with_image_marks([{"role": "user", "content": "x", "images": ["A"]}],
                         GoRenderer(CHATML_GO), root)


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]"])
def test_image_mark_with_a_missing_or_bad_config_is_refused(tmp_path, text):
    root = tmp_path / "bad"
    root.mkdir()
    if text:
        (root / "config.json").write_text(text)
    with pytest.raises(InvalidRequest):
        image_mark(root)


# -- the random vision model's chat template ---------------------------------------------------
def test_the_random_vision_template_renders_image_parts_as_placeholders():
    prompt = JinjaRenderer(CHAT_TEMPLATE, {}).chat(CONVERSATION)
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\n" + QWEN_MARK + QWEN_MARK + "What is in these?"
                      "<|im_end|>\n"
                      "<|im_start|>assistant\nA cat and a dog.<|im_end|>\n"
                      "<|im_start|>user\nWhich is bigger?<|im_end|>\n"
                      "<|im_start|>assistant\n")


def test_the_random_vision_template_keeps_a_given_system_message():
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Look", "images": ["A"]}]
    prompt = JinjaRenderer(CHAT_TEMPLATE, {}).chat(messages)
    assert prompt == ("<|im_start|>system\nBe terse.<|im_end|>\n"
                      "<|im_start|>user\n" + QWEN_MARK + "Look<|im_end|>\n"
                      "<|im_start|>assistant\n")


# -- vision_family ---------------------------------------------------------------------------
@pytest.mark.parametrize("config, family", [
    (QWEN_VL, "qwen2_5_vl"),
    ({"model_type": "qwen2_vl", "vision_config": {}}, "qwen2_vl"),
    ({"model_type": "gemma3", "vision_config": {}}, "gemma3"),
    ({"model_type": "qwen2_5_vl"}, None),  # the language part alone
    ({"model_type": "qwen2_5_vl", "vision_config": None}, None),
    ({"model_type": "qwen2", "hidden_size": 64}, None),
    ({"model_type": "gemma3_text"}, None),
    ({}, None),
])
def test_vision_family(config, family):
    assert vision_family(config) == family

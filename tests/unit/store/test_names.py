"""Model name parsing and validation (Ollama's types/model/name.go rules)."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.names import ModelName, name_from_manifest_path, parse_name


@pytest.mark.parametrize("text, parts, display", [
    ("demo", ("registry.ollama.ai", "library", "demo", "latest"), "demo:latest"),
    ("demo:v1", ("registry.ollama.ai", "library", "demo", "v1"), "demo:v1"),
    ("user/demo:7b-q4", ("registry.ollama.ai", "user", "demo", "7b-q4"), "user/demo:7b-q4"),
    ("registry.ollama.ai/library/demo:latest",
     ("registry.ollama.ai", "library", "demo", "latest"), "demo:latest"),
    ("127.0.0.1:5000/library/tiny:latest", ("127.0.0.1:5000", "library", "tiny", "latest"),
     "127.0.0.1:5000/library/tiny:latest"),
    ("example.com/eva/mistral.v2", ("example.com", "eva", "mistral.v2", "latest"),
     "example.com/eva/mistral.v2:latest"),
    ("hf.co/Qwen/Qwen3-0.6B", ("hf.co", "Qwen", "Qwen3-0.6B", "latest"),
     "hf.co/Qwen/Qwen3-0.6B:latest"),
    ("http://localhost:5000/ns/m:t", ("localhost:5000", "ns", "m", "t"), "localhost:5000/ns/m:t"),
])
def test_parse_fills_defaults_and_displays_short_form(text, parts, display):
    name = parse_name(text)
    assert (name.host, name.namespace, name.model, name.tag) == parts
    assert name.display == display
    assert parse_name(name.full) == name


def test_names_match_case_insensitively_and_paths_are_lower_case():
    a, b = parse_name("User/Demo:Latest"), parse_name("user/demo")
    assert a != b and a.key == b.key
    assert a.manifest_path == PurePosixPath("registry.ollama.ai/user/demo/latest")
    assert a.repository == "User/Demo"


def test_huggingface_names():
    assert parse_name("hf.co/org/repo:main").is_huggingface
    assert parse_name("huggingface.co/org/repo").is_huggingface
    assert not parse_name("org/repo").is_huggingface


@pytest.mark.parametrize("text, fragment", [
    ("", "required"),
    ("   ", "required"),
    ("demo:", "empty tag"),
    (":latest", "empty model"),
    ("a//b", "empty namespace"),
    ("../etc/passwd", "host \"..\""),
    ("library/..", "model"),
    ("a/b..c", '".."'),
    (".hidden", 'start with "."'),
    ("a\\b", "path separators"),
    ("h/n/m/extra", "expected [host/][namespace/]model[:tag]"),
    ("bad name", "may only contain"),
    ("demo:t@g", "not supported"),
    ("demo:tag+Q4_0", "not supported"),
    ("na.me/model", "namespace"),
    ("demo$", "may only contain"),
    ("m" * 129, "longer than 128"),
    ("demo:" + "t" * 129, "longer than 128"),
])
def test_invalid_names_are_400s_with_a_reason(text, fragment):
    with pytest.raises(InvalidRequest) as info:
        parse_name(text)
    assert fragment in info.value.message
    assert info.value.status == 400


def test_manifest_paths_map_back_to_names():
    assert name_from_manifest_path(PurePosixPath("registry.ollama.ai/library/demo/latest")) == \
        ModelName("registry.ollama.ai", "library", "demo", "latest")
    assert name_from_manifest_path(PurePosixPath("a/b/c")) is None
    assert name_from_manifest_path(PurePosixPath("h/n/m/.tmp-latest-123")) is None

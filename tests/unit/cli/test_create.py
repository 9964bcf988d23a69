"""`mlxr create`: a Modelfile and flags become Ollama's JSON create body, and the local files
to upload as blobs."""

from __future__ import annotations

import json

import pytest

from mlxr.supervisor.cli.create import create_request
from mlxr.supervisor.cli.client import CliError


def model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    (path / "tokenizer.json").write_text("{}")
    (path / "README.md").write_text("not a model file")
    return path


def test_from_a_local_directory_lists_its_files(tmp_path):
    model_dir(tmp_path / "weights")
    (tmp_path / "Modelfile").write_text(
        'FROM ./weights\nTEMPLATE """{{ .Prompt }}"""\nSYSTEM Be brief.\n'
        "PARAMETER num_predict 8\nPARAMETER temperature 0\nPARAMETER stop a\nPARAMETER stop b\n"
        "LICENSE MIT\nMESSAGE user hi\nMESSAGE assistant hello\n")
    body, files, adapters = create_request("m", cwd=tmp_path, quantize="q4")
    assert body == {"model": "m", "template": "{{ .Prompt }}", "system": "Be brief.",
                    "license": ["MIT"], "quantize": "q4",
                    "parameters": {"num_predict": 8, "temperature": 0.0, "stop": ["a", "b"]},
                    "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}]}
    assert sorted(files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert files["config.json"] == tmp_path / "weights" / "config.json" and adapters == {}


def test_relative_from_is_relative_to_the_modelfile(tmp_path):
    model_dir(tmp_path / "a" / "weights")
    (tmp_path / "a" / "Modelfile").write_text("FROM weights\n")
    _, files, _ = create_request("m", "a/Modelfile", cwd=tmp_path)
    assert files["config.json"] == tmp_path / "a" / "weights" / "config.json"


def test_from_a_model_name_sends_from(tmp_path):
    (tmp_path / "Modelfile").write_text("FROM llama3.2:1b\nSYSTEM Hi.\n")
    assert create_request("m", cwd=tmp_path) == (
        {"model": "m", "from": "llama3.2:1b", "system": "Hi."}, {}, {})


def test_flags_replace_from(tmp_path):
    model_dir(tmp_path / "weights")
    (tmp_path / "Modelfile").write_text("FROM other\nPARAMETER num_predict 8\n")
    body, files, _ = create_request("m", "Modelfile", from_="weights", cwd=tmp_path)
    assert "from" not in body and "config.json" in files
    body, files, _ = create_request("m", "Modelfile", preset="tiny", seed=3, cwd=tmp_path)
    assert body == {"model": "m", "random": {"preset": "tiny", "seed": 3},
                    "parameters": {"num_predict": 8}} and files == {}
    # a Modelfile with no FROM is fine when a flag gives the source
    (tmp_path / "Params").write_text("PARAMETER num_predict 8\n")
    assert create_request("m", "Params", preset="tiny", cwd=tmp_path)[0]["random"]
    assert create_request("m", from_="base", cwd=tmp_path)[0]["from"] == "base"


def test_without_a_modelfile_the_current_directory_is_the_model(tmp_path):
    model_dir(tmp_path / "here")
    _, files, _ = create_request("m", cwd=tmp_path / "here")
    assert "model.safetensors" in files


def test_an_adapter_line_lists_the_adapter_files_relative_to_the_modelfile(tmp_path):
    lora = tmp_path / "a" / "lora"
    lora.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md",
                 "0000100_adapters.safetensors"):
        (lora / name).write_text("{}")
    (tmp_path / "a" / "Modelfile").write_text("FROM base\nADAPTER lora\n")
    body, files, adapters = create_request("m", "a/Modelfile", cwd=tmp_path)
    assert body == {"model": "m", "from": "base"} and files == {}
    assert adapters == {"adapter_config.json": lora / "adapter_config.json",
                        "adapter_model.safetensors": lora / "adapter_model.safetensors"}
    # a weights file names its directory's config too
    (tmp_path / "a" / "Modelfile").write_text("FROM base\nADAPTER ./lora/adapter_model.safetensors")
    assert create_request("m", "a/Modelfile", cwd=tmp_path)[2] == adapters


@pytest.mark.parametrize("modelfile, message", [
    (None, "specified Modelfile wasn't found"),
    ("FROM ./nowhere\n", 'no such directory "./nowhere"'),
    ("FROM ./file.bin\n", '"./file.bin" is neither a GGUF file nor a directory'),
    ("FROM ./empty\n", "has no config.json"),
    ("FROM x\nPARAMETER num_predict lots\n", "invalid int value for parameter num_predict"),
    ("FROM x\nBOGUS y\n", 'Modelfile line 2: unknown command "bogus"'),
    ("PARAMETER num_predict 8\n", "Modelfile has no FROM line"),
    ("FROM x\nADAPTER ./missing\n", 'no such adapter directory'),
    ("FROM x\nADAPTER ./empty\n", "has no adapters.safetensors"),
    ("FROM x\nADAPTER ./file.gguf\n", "is a GGUF adapter")])
def test_errors(tmp_path, modelfile, message):
    (tmp_path / "file.bin").write_bytes(b"x")
    (tmp_path / "file.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    if modelfile is not None:
        (tmp_path / "Modelfile").write_text(modelfile)
    with pytest.raises(CliError, match=message):
        create_request("m", "Modelfile", cwd=tmp_path)

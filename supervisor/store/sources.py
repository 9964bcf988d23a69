"""Which files of a Hugging Face/MLX directory become layers, and as what media type."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from mlxr.shared.errors import InvalidRequest

from .manifest import MEDIA_JSON, MEDIA_TENSOR

MAX_TEXT_FILE_BYTES = 64 << 20
_TEXT_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_TEXT_NAMES = ("NOTICE", "LICENSE", "LICENSE.txt")
_UNSUPPORTED = (".bin", ".pt", ".pth")


def media_type_for(file_name: str) -> str:
    return MEDIA_TENSOR if file_name.endswith(".safetensors") else MEDIA_JSON


def check_file_name(file_name: str) -> str:
    """A relative, normalized file name for a layer; else a 400."""
    rel = PurePosixPath(file_name)
    if (not file_name or rel.is_absolute() or ".." in rel.parts or "\\" in file_name
            or any(p.startswith(".") for p in rel.parts) or len(rel.parts) > 2):
        raise InvalidRequest(f'invalid file name "{file_name}": must be a relative path '
                             "inside the model directory")
    if file_name.endswith(_UNSUPPORTED):
        raise InvalidRequest(f'unsupported file "{file_name}": mlxr stores Hugging Face/MLX '
                             "safetensors and GGUF models (PyTorch files are not supported)")
    return rel.as_posix()


def _wanted(path: Path) -> bool:
    name = path.name
    if name.startswith("."):
        return False
    if name.endswith(".safetensors"):
        return True
    if name.endswith(_TEXT_SUFFIXES) or name in _TEXT_NAMES:
        return path.stat().st_size <= MAX_TEXT_FILE_BYTES
    return False


def select_files(directory: Path) -> dict[str, Path]:
    """The model files of a directory (name -> path): weights, JSON and small text files, and
    from one level of sub-directories their JSON and weights (sentence-transformers' modules:
    1_Pooling/config.json, 2_Dense/model.safetensors)."""
    if not directory.is_dir():
        raise InvalidRequest(f'"{directory}" is not a directory')
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and _wanted(path):
            found[path.name] = path
        elif path.is_dir() and not path.name.startswith("."):
            for sub in sorted(path.iterdir()):
                if sub.is_file() and sub.suffix in (".json", ".safetensors") \
                        and not sub.name.startswith("."):
                    found[f"{path.name}/{sub.name}"] = sub
    if "config.json" not in found:
        raise InvalidRequest(f'"{directory}" has no config.json (not a Hugging Face model '
                             "directory)")
    if not any(n.endswith(".safetensors") for n in found):
        raise InvalidRequest(f'"{directory}" has no .safetensors weights')
    return found

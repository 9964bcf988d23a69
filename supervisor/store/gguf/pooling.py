"""A GGUF embedding model's pooling (`{arch}.pooling_type`, llama.cpp's enum) as the
sentence-transformers files runner/embed reads: modules.json (transformer, pooling, normalize)
and 1_Pooling/config.json. Both encoders (bert, nomic-bert) and language models made into
embedding models (a qwen3 file with pooling type "last": Qwen3-Embedding) carry one.

- Types 1, 2, 3 are mean, CLS (first token) and last token, then L2 normalization (Ollama
  normalizes every embedding). Type 4 (rank: a reranker) and, for an encoder, 0 (one vector a
  token) are refused by name. A language model with type 0, or none, is a chat model.
- Plain Python: no mlx, no file access.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from mlxr.shared.sentence_transformers import MODE_KEYS

from .arch import UnsupportedArchitecture

POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
EMBEDDING_ARCHS = ("gemma-embedding",)  # language-model bodies made only for embeddings
IDENTITY = "torch.nn.modules.linear.Identity"
_REFUSED = {0: "none (one vector a token)", 4: "rank (a reranker)"}


def pooling_type(kv: Mapping[str, Any]) -> Any:
    return kv.get(f"{kv.get('general.architecture')}.pooling_type")


def embeds(kv: Mapping[str, Any]) -> bool:
    """Whether a language model's file makes it an embedding model (a pooling type 1-4; 4 is
    then refused by `pooling_mode`). An EmbeddingGemma file is one whatever it says."""
    return kv.get("general.architecture") in EMBEDDING_ARCHS or pooling_type(kv) not in (None, 0)


def pooling_mode(kv: Mapping[str, Any]) -> str:
    """The sentence-transformers mode of the file's pooling type (an encoder's default: mean)."""
    kind = pooling_type(kv)
    kind = 1 if kind is None else kind
    if kind not in POOLING:
        what = _REFUSED.get(kind, str(kind))
        raise UnsupportedArchitecture(f"{kv.get('general.architecture')} GGUF with pooling "
                                      f"type {what}: mlxr pools embeddings by mean, CLS or "
                                      "last token")
    return POOLING[kind]


def sentence_transformers_files(kv: Mapping[str, Any], max_length: int | None = None,
                                dense: tuple[tuple[str, int, int], ...] = ()
                                ) -> dict[str, bytes]:
    """modules.json, the pooling config and, given `max_length`, the input limit. `dense`:
    (folder, inputs, outputs) of each Dense module after the pooling (EmbeddingGemma's
    `dense_2`, `dense_3`: no bias, no activation), whose weights the caller writes."""
    mode = pooling_mode(kv)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"),
             *((folder, "Dense") for folder, _, _ in dense)]
    kinds.append((f"{len(kinds)}_Normalize", "Normalize"))
    modules = [{"idx": i, "name": str(i), "path": path,
                "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate(kinds)]
    files = {"modules.json": _dump(modules),
             "1_Pooling/config.json": _dump({key: value == mode
                                             for key, value in MODE_KEYS.items()})}
    for folder, n_in, n_out in dense:
        files[f"{folder}/config.json"] = _dump({"in_features": n_in, "out_features": n_out,
                                                "bias": False, "activation_function": IDENTITY})
    if max_length is not None:
        files["sentence_bert_config.json"] = _dump({"max_seq_length": max_length,
                                                    "do_lower_case": False})
    return files


def _dump(value: Any) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()

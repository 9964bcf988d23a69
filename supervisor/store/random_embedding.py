"""The `embeddinggemma` random preset: the gemma3 preset's body laid out as Google's
EmbeddingGemma directory is (sentence-transformers' layout), so tests meet what users pull:

- config.json: `Gemma3TextModel`, `use_bidirectional_attention`, `layer_types`, a 2,048-token
  context, no rope scaling; weights named as the base model saves them (`layers.0...`, no
  `model.` prefix, no head);
- modules.json: Transformer, mean Pooling, two Dense modules without bias or activation
  (hidden -> 2 x hidden -> hidden, as 768 -> 3072 -> 768), Normalize; their folders, and
  sentence_bert_config.json.

Called by random_model.write_random_model, with the gemma3 preset's config and weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

PRESET = "embeddinggemma"
CONTEXT = 2048
IDENTITY = "torch.nn.modules.linear.Identity"


def embedding_config(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k not in ("rope_scaling", "tie_word_embeddings")}
    layers, pattern = out["num_hidden_layers"], out.pop("sliding_window_pattern", 6)
    out.update({
        "architectures": ["Gemma3TextModel"],
        "use_bidirectional_attention": True,
        "max_position_embeddings": CONTEXT,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                        for i in range(layers)],
        "_sliding_window_pattern": pattern,
    })
    return out


def base_model_names(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name.removeprefix("model."): value for name, value in weights.items()}


def write_sentence_transformers(dest: Path, hidden: int, seed: int,
                                save: Callable[[dict[str, np.ndarray], Path, str], None],
                                dtype: str) -> None:
    rng = np.random.default_rng((seed, 0xE6))
    kinds = (("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Dense", "Dense"),
             ("3_Dense", "Dense"), ("4_Normalize", "Normalize"))
    modules = [{"idx": i, "name": str(i), "path": path,
                "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate(kinds)]
    _json(dest / "modules.json", modules)
    _json(dest / "sentence_bert_config.json", {"max_seq_length": CONTEXT, "do_lower_case": False})
    _json(dest / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False, "include_prompt": True})
    (dest / "4_Normalize").mkdir(exist_ok=True)
    for path, (n_in, n_out) in (("2_Dense", (hidden, 2 * hidden)),
                                ("3_Dense", (2 * hidden, hidden))):
        _json(dest / path / "config.json", {"in_features": n_in, "out_features": n_out,
                                            "bias": False, "activation_function": IDENTITY})
        weight = rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)
        save({"linear.weight": weight.astype(np.float32)}, dest / path / "model.safetensors",
             dtype)


def _json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")

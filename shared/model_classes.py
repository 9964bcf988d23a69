"""mlx_lm's model classes for checkpoints saved as a base model (no `model.` prefix on the
weights: Google's EmbeddingGemma, `Gemma3TextModel`), for mlx_lm.utils.load_model's
`get_model_classes`: the runner loads them (runner/embed/bidirectional.py) and the store
quantizes them (supervisor/store/quantize.py). mlx_lm is imported when called."""

from __future__ import annotations

from typing import Any


def base_named_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx_lm's (model class, args class) for `config`, the model taking weights named as the
    base model saves them (`layers.0...`, `embed_tokens...`) as well as mlx_lm's own
    (`model.layers.0...`)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)

    class BaseNamed(model_class):
        def sanitize(self, weights):
            weights = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v
                       for k, v in weights.items()}
            return super().sanitize(weights)

    return BaseNamed, args_class

"""Which architectures the block pool's rows serve (runner/kv/rows.py `probe`): every one
without a sliding window; the others keep the padded batch, and both give mlx-lm's logits."""

import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxr.runner.kv import rows
from mlxr.supervisor.store.random_model import ARCH_NAMES, write_random_model

# window layers (gpt_oss's also attention sinks): mlx-lm's rotating cache, in the padded batch
SLIDING = {"gemma2", "gemma3", "gpt_oss", "gemma4"}


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_the_rows_serve_every_architecture_without_a_sliding_window(arch, tmp_path):
    model, _ = load(str(write_random_model(tmp_path / arch, arch=arch)))
    num_layers = len(make_prompt_cache(model))
    assert rows.probe(model, num_layers) == (arch not in SLIDING)

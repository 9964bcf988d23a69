"""A runner loads a model without importing transformers (runner/mlx_lm_import.py,
runner/tokenizer.py): 2.7 s of a tiny model's load on the 2-core EPYC. Run in a fresh
interpreter, as a runner is."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
from mlxr.runner import mlx_lm_import
assert mlx_lm_import.install()
from mlxr.runner.__main__ import _import_for_load
_import_for_load()
from mlxr.runner.loader import load_model
from mlxr.shared.config import RunnerConfig
loaded = load_model(RunnerConfig(model_dir=sys.argv[1]), "test", lambda fraction: None)
ids = loaded.tokenizer.encode("Hello there")
assert ids and loaded.tokenizer.decode(ids) == "Hello there", ids
assert "transformers" not in sys.modules, "transformers was imported"
import mlx_lm
assert mlx_lm.__version__
# What mlx_lm's own __init__ exports still resolves, and its tokenizer loader is the real one
# (transformers imported only now).
assert callable(mlx_lm.load) and callable(mlx_lm.stream_generate)
from mlx_lm.utils import load_tokenizer
wrapper = load_tokenizer(__import__("pathlib").Path(sys.argv[1]))
assert wrapper.encode("Hello there") == ids
assert "transformers" in sys.modules
real = sys.modules["mlx_lm.tokenizer_utils"]
assert load_tokenizer(__import__("pathlib").Path(sys.argv[1])).encode("Hello there") == ids
assert sys.modules["mlx_lm.tokenizer_utils"] is real  # imported once
print("ok")
"""


def test_a_runner_loads_a_model_without_transformers(tiny_model):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_install_leaves_an_imported_mlx_lm_alone():
    script = ("import sys, mlx_lm\nfrom mlxr.runner import mlx_lm_import\n"
              "assert not mlx_lm_import.install()\nassert sys.modules['mlx_lm'] is mlx_lm\n"
              "assert 'transformers' in sys.modules\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

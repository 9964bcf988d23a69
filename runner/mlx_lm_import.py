"""Import mlx-lm's model code without transformers.

`import mlx_lm.models.qwen3` first runs mlx_lm/__init__.py, which imports the command-line
tools (`convert`, `generate`) and through `mlx_lm.utils` its tokenizer wrapper, and that
imports transformers: 2.7 s of a tiny model's 5.6 s load through the supervisor on the 2-core
EPYC (Zen 3), where mlx.core alone takes 0.08 s. A runner reads its tokenizer with
`tokenizers` (runner/tokenizer.py) and needs none of that.

`install()` registers the `mlx_lm` package without running its __init__ (its submodules still
import from its directory, as usual; the names its __init__ exports, `mlx_lm.load` and the
rest, are imported when first read) and, in place of `mlx_lm.tokenizer_utils`, a module whose
names load the real one when first used: `mlx_lm.utils` imports `TokenizerWrapper` (for its
annotations only) and `load`, which the runner never calls. A process that already imported
mlx_lm keeps it as it is."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

PACKAGE = "mlx_lm"
TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"
# What mlx_lm/__init__.py exports: name -> its module.
EXPORTS = {"convert": "mlx_lm.convert", "batch_generate": "mlx_lm.generate",
           "generate": "mlx_lm.generate", "stream_generate": "mlx_lm.generate",
           "load": "mlx_lm.utils"}


def install() -> bool:
    """Register the package and the tokenizer module's stand-in; False where mlx_lm was
    imported already (or is not installed) and nothing changed."""
    if PACKAGE in sys.modules:
        return False
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return False
    package = importlib.util.module_from_spec(spec)  # its __init__ is never executed
    package.__getattr__ = _export
    sys.modules[PACKAGE] = package
    try:
        package.__version__ = importlib.import_module("mlx_lm._version").__version__
    except (ImportError, AttributeError):
        pass
    sys.modules[TOKENIZER_UTILS] = _TokenizerUtils(TOKENIZER_UTILS)
    return True


def _export(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)


def _real_tokenizer_utils() -> types.ModuleType:
    current = sys.modules.get(TOKENIZER_UTILS)
    if current is not None and not isinstance(current, _TokenizerUtils):
        return current  # imported by an earlier use
    stand_in = sys.modules.pop(TOKENIZER_UTILS, None)
    try:
        return importlib.import_module(TOKENIZER_UTILS)
    except BaseException:
        if stand_in is not None:
            sys.modules[TOKENIZER_UTILS] = stand_in
        raise


class _TokenizerUtils(types.ModuleType):
    """`mlx_lm.tokenizer_utils` until something uses it: `TokenizerWrapper` is a placeholder
    class (mlx_lm.utils names it in annotations); any other name imports the real module
    (and transformers) and is looked up there."""

    class TokenizerWrapper:  # noqa: D106 (a placeholder: see the class docstring)
        pass

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real_tokenizer_utils(), name)

    @staticmethod
    def load(*args, **kwargs):
        return _real_tokenizer_utils().load(*args, **kwargs)

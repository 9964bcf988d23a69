"""pyproject.toml ships every package: a folder of shared/, runner/ or supervisor/ with an
__init__.py that is missing from [tool.setuptools] packages works in the editable install and
the tests, and breaks a plain `pip install .` (runner/distributed/ once did)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    folders = {"mlxr." + ".".join(init.parent.relative_to(ROOT).parts)
               for side in ("shared", "runner", "supervisor")
               for init in (ROOT / side).rglob("__init__.py")}
    assert folders - listed == set()
    # and every listed one exists (a data-only folder such as the dashboard's has no
    # __init__.py)
    for name in listed:
        assert ROOT.joinpath(*name.split(".")[1:]).is_dir(), name


def test_every_c_source_the_runners_build_is_shipped():
    # the kernels are compiled on the user's machine from these files: a source left out of
    # the package data builds nothing in a plain install (quant_kernel.c once was)
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["mlxr.shared.assets"]
    for source in (ROOT / "shared" / "assets").glob("*.c"):
        assert any(source.match(p) for p in patterns), source.name

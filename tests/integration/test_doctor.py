"""`mlxr doctor`: the BLAS choice (its probing stubbed here: tests/unit/shared/test_blas_choice.py
covers it) and whether the row kernel, the attention kernel and the quantized kernel build on
this machine."""

from __future__ import annotations

import shutil

from click.testing import CliRunner

from mlxr.shared import blas, native
from mlxr.shared.config import Settings
from mlxr.supervisor.cli import local


def run_doctor(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("MLXR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas, "choose", lambda *args, **kwargs: blas.BlasChoice(
        None, "MLX's own BLAS", "no OpenBLAS found"))
    result = CliRunner().invoke(local.doctor, [])
    assert result.exit_code == 0, result.output
    return result.output


def test_doctor_builds_and_names_the_row_kernel(tmp_path, monkeypatch):
    # Built in the default cache (where the runners of other tests find them), then copied:
    # building all three in an empty directory took 24 s of the suite. Their names are the
    # digest of source, flags, compiler and CPU, so the doctor finds these copies.
    default = Settings.from_env().cache_dir
    for build in (native.row_kernel_library, native.attend_kernel_library,
                  native.quant_kernel_library):
        path, why = build(default)
        assert path is not None, why  # `make test` machines have a C compiler
        shutil.copy2(path, tmp_path / path.name)
    out = run_doctor(tmp_path, monkeypatch)
    built = list(tmp_path.glob("row_kernel-*.so"))
    assert len(built) == 1
    assert f"row kernel (the decode step's products on a CPU): {built[0]}" in out
    attend = list(tmp_path.glob("attend_kernel-*.so"))
    assert len(attend) == 1
    assert f"attention kernel (one decode position, and one row's whole step, on a CPU): " \
        f"{attend[0]}" in out
    quant = list(tmp_path.glob("quant_kernel-*.so"))
    assert len(quant) == 1
    assert f"quantized kernel (4- and 8-bit weights as stored, on a CPU): {quant[0]}" in out
    assert "chose: MLX's own BLAS (no OpenBLAS found)" in out


def test_doctor_says_why_there_is_no_row_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    out = run_doctor(tmp_path, monkeypatch)
    assert "row kernel: not built (no C compiler); runners keep OpenBLAS and MLX" in out
    assert "attention kernel: not built (no C compiler); runners attend in numpy" in out
    assert "quantized kernel: not built (no C compiler); runners widen quantized weights " \
        "to float32 where they fit" in out
    assert not list(tmp_path.glob("*.so"))

"""When a runner widens its weights to float32 (runner/weights.py `decide`): only on the CPU,
only for weights not already float32, and under "auto" only when the extra bytes and the KV
budget fit in the memory available."""

from __future__ import annotations

import pytest

from mlxr.runner.weights import FREE_SHARE, Footprint, decide

GIB = 1 << 30
BF16 = Footprint(stored_bytes=1 * GIB, float32_bytes=2 * GIB, stored_as="bfloat16")
Q4 = Footprint(stored_bytes=GIB // 2, float32_bytes=4 * GIB, stored_as="4-bit")


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_float32_weights_are_never_widened(mode):
    f32 = Footprint(2 * GIB, 2 * GIB, "float32")
    assert decide(mode, True, f32, 64 * GIB, 0) == (False, "stored as float32")


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_gpu_keeps_the_stored_weights(mode):
    assert decide(mode, False, BF16, 64 * GIB, 0)[0] is False


def test_auto_widens_on_the_cpu_when_it_fits():
    assert decide("auto", True, BF16, 64 * GIB, 4 * GIB)[0] is True
    assert decide("auto", True, Q4, 64 * GIB, 4 * GIB)[0] is True


def test_auto_counts_the_extra_bytes_and_the_kv_budget_against_the_free_memory():
    # BF16 needs 1 GiB more; with a 2 GiB KV budget that is 3 GiB.
    enough = int(3 * GIB / FREE_SHARE) + 1
    assert decide("auto", True, BF16, enough, 2 * GIB)[0] is True
    wide, why = decide("auto", True, BF16, enough - 2, 2 * GIB)
    assert wide is False and "1.00 GiB more" in why
    # A 4-bit model's float32 copy is 3.5 GiB more: it does not fit where bf16 did.
    assert decide("auto", True, Q4, enough, 2 * GIB)[0] is False


def test_on_widens_whatever_the_free_memory_and_off_never_does():
    assert decide("on", True, Q4, 1 * GIB, 8 * GIB)[0] is True
    assert decide("off", True, Q4, 64 * GIB, 0) == (False, "float32_weights is off")


def test_an_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="auto, on, off"):
        decide("sometimes", True, BF16, 64 * GIB, 0)

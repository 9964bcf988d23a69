"""Pooling, normalization and Matryoshka truncation on hand-made numpy arrays."""

from __future__ import annotations

import numpy as np
import pytest

from mlxr.runner.embed.pooling import l2_normalize, pool, truncate_dimensions

# Two rows, three positions, two features; the second row has one padded position whose
# values are huge, so any leak of padding into a result shows.
HIDDEN = np.array([[[1.0, 2.0], [3.0, -4.0], [5.0, 0.0]],
                   [[2.0, 2.0], [0.0, -6.0], [100.0, 100.0]]], dtype=np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], dtype=np.int32)


def test_mean_pooling_ignores_padding():
    out = pool(HIDDEN, MASK, ["mean"])
    assert np.allclose(out, [[3.0, -2 / 3], [1.0, -2.0]])


def test_cls_max_and_lasttoken_pooling():
    assert np.allclose(pool(HIDDEN, MASK, ["cls"]), [[1.0, 2.0], [2.0, 2.0]])
    assert np.allclose(pool(HIDDEN, MASK, ["max"]), [[5.0, 2.0], [2.0, 2.0]])
    assert np.allclose(pool(HIDDEN, MASK, ["lasttoken"]), [[5.0, 0.0], [0.0, -6.0]])


def test_mean_sqrt_len_divides_by_the_root_of_the_real_length():
    out = pool(HIDDEN, MASK, ["mean_sqrt_len"])
    assert np.allclose(out, [[9 / np.sqrt(3), -2 / np.sqrt(3)], [2 / np.sqrt(2), -4 / np.sqrt(2)]])


def test_several_modes_concatenate_in_the_order_given():
    out = pool(HIDDEN, MASK, ["cls", "mean"])
    assert out.shape == (2, 4)
    assert np.allclose(out[1], [2.0, 2.0, 1.0, -2.0])


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError):
        pool(HIDDEN, MASK, ["median"])


def test_l2_normalize_gives_unit_rows_and_keeps_zero_rows_zero():
    out = l2_normalize(np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32))
    assert np.allclose(out, [[0.6, 0.8], [0.0, 0.0]])


def test_truncate_dimensions_keeps_the_prefix_and_renormalizes():
    vectors = l2_normalize(np.array([[1.0, 1.0, 2.0, 4.0]], dtype=np.float32))
    out = truncate_dimensions(vectors, 2)
    assert np.allclose(out, [[2 ** -0.5, 2 ** -0.5]])
    assert truncate_dimensions(vectors, None) is vectors
    assert truncate_dimensions(vectors, 4) is vectors

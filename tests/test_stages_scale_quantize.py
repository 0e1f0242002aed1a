"""Group scales and nearest-level codes against plain NumPy."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.stages import (
    codebook_values,
    group_rms,
    lloyd_max_levels,
    nearest_codes,
    refit_scales,
    ternary_levels,
)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_group_rms(group_size):
    w = np.random.default_rng(0).standard_normal((5, 4 * group_size)).astype(np.float32)
    s = group_rms(mx.array(w), group_size)
    assert s.dtype == mx.float16 and s.shape == (5, 4)
    want = np.sqrt((w.reshape(5, 4, group_size) ** 2).mean(-1))
    np.testing.assert_allclose(np.array(s, dtype=np.float32), want, rtol=1e-3)


def test_group_rms_partial_last_group():
    w = np.zeros((2, 128), np.float32)
    w[:, :64] = 1.0
    w[:, 64:100] = 2.0  # 36 real entries in the second group, then padding
    s = np.array(group_rms(mx.array(w), 64, valid=100), dtype=np.float32)
    np.testing.assert_allclose(s, [[1.0, 2.0], [1.0, 2.0]])


def test_refit_is_least_squares():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 128)).astype(np.float32)
    q = rng.standard_normal((3, 128)).astype(np.float32)
    q[2, 64:] = 0.0  # a group with <q, q> = 0 gets scale 0
    s = np.array(refit_scales(mx.array(w), mx.array(q), 64), dtype=np.float32)
    gw, gq = w.reshape(3, 2, 64), q.reshape(3, 2, 64)
    want = (gw * gq).sum(-1) / np.maximum((gq * gq).sum(-1), 1e-30)
    want[2, 1] = 0.0
    np.testing.assert_allclose(s, np.clip(want, 0, None), rtol=1e-3, atol=1e-6)


def test_group_size_and_shape_errors():
    with pytest.raises(ValueError, match="group size"):
        group_rms(mx.ones((2, 96)), 48)
    with pytest.raises(ValueError, match="multiple of 64"):
        group_rms(mx.ones((2, 96)), 64)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_nearest_codes_match_brute_force(bits):
    x = np.random.default_rng(bits).standard_normal((4, 1000)).astype(np.float32) * 1.5
    levels = lloyd_max_levels(bits)
    codes = nearest_codes(mx.array(x), bits)
    assert codes.dtype == mx.uint8 and codes.shape == x.shape
    want = np.abs(x[..., None] - levels).argmin(-1)
    np.testing.assert_array_equal(np.array(codes), want)


def test_ternary_codes():
    t, c = ternary_levels()
    x = mx.array([-5.0, -t - 1e-4, -t + 1e-4, 0.0, t - 1e-4, t + 1e-4, 5.0])
    np.testing.assert_array_equal(np.array(nearest_codes(x, "ternary")), [0, 0, 1, 1, 1, 2, 2])
    values = np.array(codebook_values("ternary"))[np.array(nearest_codes(x, "ternary"))]
    np.testing.assert_allclose(values, [-c, -c, 0, 0, 0, c, c], rtol=1e-6)

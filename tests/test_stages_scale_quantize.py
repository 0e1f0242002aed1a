"""Group scales and nearest-level codes against plain NumPy."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.stages import (
    code_values,
    codebook_values,
    group_rms,
    lloyd_max_levels,
    nearest_codes,
    refit_scales,
    ternary_levels,
)
from turboquant.stages.codebook import midpoints


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


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
@pytest.mark.parametrize("cols", [999, 1000])  # odd rows: one lookup a code; even: a pair
def test_numpy_twins_match_mlx_exactly(bits, cols):
    from turboquant.stages.quantize import code_values_np, nearest_codes_np

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, cols)) * 1.3).astype(np.float32)
    # entries exactly on the thresholds, and signed zeros
    x[0, : len(midpoints(bits))] = np.array(midpoints(bits), dtype=np.float32)
    x[1, :2] = [0.0, -0.0]
    codes = nearest_codes_np(x, bits)
    assert codes.dtype == np.uint8
    np.testing.assert_array_equal(codes, np.array(nearest_codes(mx.array(x), bits)))
    values = code_values_np(codes, bits)
    assert values.dtype == np.float32
    want = np.array(code_values(mx.array(codes), bits))
    np.testing.assert_array_equal(values.view(np.uint32), want.view(np.uint32))


def test_numpy_sums_and_scales_match_mlx_exactly():
    from turboquant.stages.scale import (
        group_energy,
        group_energy_np,
        refit_sums,
        refit_sums_np,
        rms_from_energy,
        rms_from_energy_np,
        scales_from_sums,
        scales_from_sums_np,
    )

    rng = np.random.default_rng(5)
    rows, groups, gs = 6, 40, 64
    w = (rng.standard_normal((rows, groups * gs)) * np.exp(2 * rng.standard_normal((rows, 1))))
    w = w.astype(np.float32)
    w[0] = 0.0
    w[1, :gs] = -0.0
    w[2] *= 1e-7  # float16 subnormal scales
    q = np.array(codebook_values(3))[rng.integers(0, 8, size=w.shape)]
    q[3, :gs] = -0.0
    wt = np.ascontiguousarray(w.reshape(-1, gs).T)  # group axis first
    qt = np.ascontiguousarray(q.reshape(-1, gs).T)

    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))

    energy = group_energy_np(wt).reshape(rows, groups)
    same(energy, group_energy(mx.array(w), gs))
    same(rms_from_energy_np(energy, gs, valid=2500), rms_from_energy(mx.array(energy), gs, 2500))
    wq, qq = (a.reshape(rows, groups) for a in refit_sums_np(wt, qt))
    want_wq, want_qq = refit_sums(mx.array(w), mx.array(q), gs)
    same(wq, want_wq)
    same(qq, want_qq)
    same(scales_from_sums_np(wq, qq), scales_from_sums(want_wq, want_qq))

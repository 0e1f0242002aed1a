"""Lloyd-Max and ternary codebooks against published constants and their own optimality."""

import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant.stages import (
    codebook_values,
    lloyd_max_levels,
    lloyd_max_mse,
    ternary_levels,
    ternary_mse,
)

# positive halves (negative half mirrors) and MSE, from the design brief
KNOWN = {
    1: ([0.797885], 0.363380),
    2: ([0.452780, 1.510418], 0.117482),
    3: ([0.245094, 0.756005, 1.343909, 2.151946], 0.034548),
    4: (
        [0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590],
        0.009501,
    ),
}


@pytest.mark.parametrize("bits", sorted(KNOWN))
def test_levels_match_known_constants(bits):
    half, mse = KNOWN[bits]
    levels = lloyd_max_levels(bits)
    assert levels.dtype == np.float64 and levels.shape == (2**bits,)
    np.testing.assert_allclose(levels[2 ** (bits - 1) :], half, atol=1e-6)
    np.testing.assert_allclose(levels[: 2 ** (bits - 1)], -np.array(half[::-1]), atol=1e-6)
    assert lloyd_max_mse(bits) == pytest.approx(mse, abs=1e-6)


@pytest.mark.parametrize("bits", range(1, 9))
def test_levels_are_a_lloyd_fixed_point_above_shannon(bits):
    levels = lloyd_max_levels(bits)
    assert np.all(np.diff(levels) > 0)
    np.testing.assert_array_equal(levels, -levels[::-1])
    # optimality by independent numerical integration (Simpson's rule over each cell)
    edges = np.concatenate([[-12.0], (levels[:-1] + levels[1:]) / 2, [12.0]])
    centroids, mse = [], 0.0
    for a, b, level in zip(edges[:-1], edges[1:], levels):
        x = np.linspace(a, b, 4001)
        w = np.ones_like(x)
        w[1:-1:2], w[2:-1:2] = 4, 2
        w *= (x[1] - x[0]) / 3 * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        centroids.append(np.sum(w * x) / np.sum(w))
        mse += np.sum(w * (x - level) ** 2)
    np.testing.assert_allclose(centroids, levels, atol=1e-9)
    assert lloyd_max_mse(bits) == pytest.approx(mse, rel=1e-9)
    assert 4.0**-bits < lloyd_max_mse(bits) < 4.0**-bits * 3  # Shannon bound, and close


def test_ternary():
    threshold, level = ternary_levels()
    assert threshold == pytest.approx(0.612003, abs=1e-6)
    assert level == pytest.approx(1.224006, abs=1e-6)
    assert threshold == pytest.approx(level / 2, abs=1e-12)  # nearest-neighbour threshold
    assert ternary_mse() == pytest.approx(0.190174, abs=1e-6)
    assert ternary_mse() > 4.0 ** -math.log2(3)


def test_codebook_values_in_code_order():
    for bits in (1, 2, 3, 4):
        values = codebook_values(bits)
        assert values.dtype == mx.float32
        np.testing.assert_allclose(np.array(values), lloyd_max_levels(bits), rtol=1e-7)
    _, c = ternary_levels()
    np.testing.assert_allclose(np.array(codebook_values("ternary")), [-c, 0.0, c], rtol=1e-7)


def test_levels_are_fresh_copies():
    lloyd_max_levels(2)[0] = 99.0
    assert lloyd_max_levels(2)[0] == pytest.approx(-1.510418, abs=1e-6)


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, "3", True, None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_levels(bits)

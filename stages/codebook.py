"""Lloyd-Max codebooks for N(0, 1), computed from first principles.

A b-bit Lloyd-Max quantizer has 2**b levels; it is optimal when every threshold is the
midpoint of its two neighbouring levels and every level is the centroid (conditional mean)
of its cell. Both conditions use exact Gaussian integrals (math.erf, the pdf), so the
levels converge to machine precision: Lloyd's iteration gets close, Newton steps on the
same fixed point finish the job (plain Lloyd needs ~10^5 steps at 8 bits).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import mlx.core as mx
import numpy as np

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TOL = 1e-13
MAX_BITS = 8


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def _mass(a: float, b: float) -> float:
    """P(a < X < b) for X ~ N(0, 1), accurate in the tails (erfc there, not 1 - erf)."""
    if a >= 0:
        return 0.5 * (math.erfc(a / _SQRT2) - math.erfc(b / _SQRT2))
    if b <= 0:
        return 0.5 * (math.erfc(-b / _SQRT2) - math.erfc(-a / _SQRT2))
    return 0.5 * (math.erf(b / _SQRT2) - math.erf(a / _SQRT2))


def _centroid(a: float, b: float) -> float:
    """E[X | a < X < b]: the centroid of a truncated Gaussian."""
    return (_pdf(a) - _pdf(b)) / _mass(a, b)


def _thresholds(levels: np.ndarray) -> np.ndarray:
    mids = (levels[:-1] + levels[1:]) / 2
    return np.concatenate([[-math.inf], mids, [math.inf]])


def _lloyd_step(levels: np.ndarray) -> np.ndarray:
    t = _thresholds(levels)
    return np.array([_centroid(t[i], t[i + 1]) for i in range(len(levels))])


def _newton_step(levels: np.ndarray) -> np.ndarray:
    """One Newton step on F(c) = lloyd(c) - c, with the exact (tridiagonal) Jacobian."""
    n = len(levels)
    t = _thresholds(levels)
    new = _lloyd_step(levels)
    jac = -np.eye(n)
    for i in range(n):
        a, b, p = t[i], t[i + 1], _mass(t[i], t[i + 1])
        # d centroid / d lower edge and / d upper edge; each edge moves half as fast as a level
        d_a = 0.0 if math.isinf(a) else _pdf(a) * (new[i] - a) / p
        d_b = 0.0 if math.isinf(b) else _pdf(b) * (b - new[i]) / p
        if i > 0:
            jac[i, i - 1] += d_a / 2
        if i < n - 1:
            jac[i, i + 1] += d_b / 2
        jac[i, i] += (d_a + d_b) / 2
    return levels - np.linalg.solve(jac, new - levels)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"bits must be an integer 1..{MAX_BITS}, got {bits!r}")
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
    return int(bits)


@functools.cache
def _levels(bits: int) -> tuple[float, ...]:
    n = 2**bits
    # Start at the high-resolution optimum: level density ~ pdf^(1/3), i.e. N(0, 3) quantiles.
    start = NormalDist(0.0, math.sqrt(3.0))
    levels = np.array([start.inv_cdf((i + 0.5) / n) for i in range(n)])
    for _ in range(200):  # Lloyd: monotone, safe from any sorted start
        new = _lloyd_step(levels)
        step, levels = np.abs(new - levels).max(), new
        if step < 1e-6:
            break
    for _ in range(50):  # Newton: quadratic from here
        new = _newton_step(levels)
        step, levels = np.abs(new - levels).max(), new
        if step < _TOL:
            break
    levels = (levels - levels[::-1]) / 2  # exact symmetry
    if np.abs(_lloyd_step(levels) - levels).max() > 1e-11 or np.any(np.diff(levels) <= 0):
        raise RuntimeError(f"Lloyd-Max iteration did not converge at {bits} bits")
    return tuple(float(x) for x in levels)


def lloyd_max_levels(bits: int) -> np.ndarray:
    """The 2**bits Lloyd-Max levels for N(0, 1), ascending, float64 (a fresh copy)."""
    return np.array(_levels(_check_bits(bits)), dtype=np.float64)


def _mse(levels: tuple[float, ...], thresholds: np.ndarray) -> float:
    """E[(X - Q(X))^2] for cells between `thresholds` mapped to `levels`, exactly."""
    total = 0.0
    for c, a, b in zip(levels, thresholds[:-1], thresholds[1:]):
        p = _mass(a, b)
        first = _pdf(a) - _pdf(b)  # integral of x pdf over the cell
        a_pdf = 0.0 if math.isinf(a) else a * _pdf(a)
        b_pdf = 0.0 if math.isinf(b) else b * _pdf(b)
        second = p + a_pdf - b_pdf  # integral of x^2 pdf over the cell
        total += second - 2 * c * first + c * c * p
    return total


@functools.cache
def lloyd_max_mse(bits: int) -> float:
    """Mean squared error of the b-bit Lloyd-Max quantizer on N(0, 1)."""
    levels = _levels(_check_bits(bits))
    return _mse(levels, _thresholds(np.array(levels)))


@functools.cache
def ternary_levels() -> tuple[float, float]:
    """(threshold, level) of the optimal symmetric quantizer {-c, 0, +c} for N(0, 1).

    Nearest-neighbour threshold c/2, and c the centroid of the tail beyond it.
    """
    c = 1.0
    for _ in range(1000):
        new = _centroid(c / 2, math.inf)
        if abs(new - c) < _TOL:
            c = new
            break
        c = new
    else:
        raise RuntimeError("ternary Lloyd iteration did not converge")
    return c / 2, c


def ternary_mse() -> float:
    """Mean squared error of the optimal ternary quantizer on N(0, 1)."""
    t, c = ternary_levels()
    return _mse((-c, 0.0, c), np.array([-math.inf, -t, t, math.inf]))


@functools.cache
def codebook_values(bits: int | str) -> mx.array:
    """Levels in code order as float32: code i decodes to values[i]. Ternary: [-c, 0, +c]."""
    if bits == "ternary":
        _, c = ternary_levels()
        return mx.array([-c, 0.0, c], dtype=mx.float32)
    return mx.array(lloyd_max_levels(bits), dtype=mx.float32)


@functools.cache
def midpoints(bits: int | str) -> tuple[float, ...]:
    """Decision thresholds between consecutive levels (float64), ascending."""
    if bits == "ternary":
        t, _ = ternary_levels()
        return (-t, t)
    levels = _levels(_check_bits(bits))
    return tuple((a + b) / 2 for a, b in zip(levels[:-1], levels[1:]))

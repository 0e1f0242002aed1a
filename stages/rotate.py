"""Seeded orthogonal rotation along the last axis: y = T(s * x), x = s * T^T(y).

s is a ±1 sign vector and T an orthogonal transform of size n, both fixed by (seed, n):

- n = m * 2^k with m in {1, 12, 20, 28} and 2^k <= 8192: T is `mx.hadamard_transform`
  scaled by 1/sqrt(n). For m = 20, 28 it is not symmetric; MLX computes x @ kron(B_m, H)
  on rows, so the inverse applies H and then B_m^T as an explicit m x m matrix.
- 2^k > 8192: x is viewed as (..., 2^k / 8192, m * 8192), a Hadamard on each axis.
- anything else: n = d * q, with q the part above and d the rest (odd, or 3, 5, 7 with too
  few factors of two); T is a Hadamard over q times a seeded dense orthogonal d x d matrix
  (QR of a Gaussian, sign-fixed), so every n >= 1 works, primes included.

Exactly (this is part of the format): rng = numpy.random.default_rng(seed) (PCG64);
s = 1 - 2 * rng.integers(0, 2, size=n); then, if d > 1, q, r = qr(rng.standard_normal((d, d)))
and Q = q * sign(diag(r)). With x viewed as (..., d, m * p): T(x) = Q @ H(x), H acting on the
last axis. Sign vectors and dense factors are cached per (seed, n).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re

import mlx.core as mx
import numpy as np

_MLX_MAX_POW2 = 8192  # largest power-of-two factor passed to mx.hadamard_transform
_MLX_M = (1, 12, 20, 28)  # non-power-of-two factors mx.hadamard_transform supports
_EXPERT = re.compile(r"\.experts\.\d+(?=\.|$)")
_SEED_DOMAIN = b"turboquant/rotation/v1"


def tensor_seed(model_seed: int, name: str) -> int:
    """A 64-bit rotation seed from (model seed, tensor name), stable across processes.

    The first 8 bytes (little-endian) of sha256(b"turboquant/rotation/v1" 0x00
    decimal(model_seed) 0x00 utf8(name)).
    """
    if isinstance(model_seed, bool) or not isinstance(model_seed, (int, np.integer)):
        raise ValueError(f"model_seed must be an integer, got {model_seed!r}")
    if not 0 <= model_seed < 2**64:
        raise ValueError(f"model_seed must be in [0, 2**64), got {model_seed}")
    if not isinstance(name, str):
        raise ValueError(f"name must be a str, got {type(name).__name__}")
    data = b"\0".join([_SEED_DOMAIN, str(int(model_seed)).encode(), name.encode("utf-8")])
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def rotation_key(name: str) -> str:
    """The name a rotation is keyed on: all experts of a layer and projection share one."""
    return _EXPERT.sub(".experts.*", name)


# ---------------------------------------------------------------------------- the plan


def _split(n: int) -> tuple[int, int, int]:
    """n = d * m * p: d the dense factor, m in _MLX_M, p a power of two."""
    p = n & -n  # largest power of two dividing n
    odd = n // p
    if odd == 1:
        return 1, 1, p
    if odd in (3, 5, 7) and p >= 4:
        return 1, 4 * odd, p // 4
    return odd, 1, p


@functools.cache
def _hadamard_factor(m: int) -> mx.array:
    """The m x m matrix B_m (scaled to be orthogonal) that mx.hadamard_transform uses."""
    return mx.hadamard_transform(mx.eye(m, dtype=mx.float32), scale=1.0 / math.sqrt(m))


def _hadamard(x: mx.array, m: int, p: int, inverse: bool) -> mx.array:
    """Orthogonal Hadamard of size m * p along the last axis (p a power of two)."""
    if p > _MLX_MAX_POW2:
        # kron over (p // 8192, m * 8192): both factors act on their own axis
        outer = p // _MLX_MAX_POW2
        lead = x.shape[:-1]
        x = x.reshape(*lead, outer, m * _MLX_MAX_POW2)
        x = _hadamard(x, m, _MLX_MAX_POW2, inverse)
        x = _hadamard(x.swapaxes(-1, -2), 1, outer, inverse).swapaxes(-1, -2)
        return x.reshape(*lead, m * p)
    if m not in _MLX_M or p & (p - 1) or not 1 <= p <= _MLX_MAX_POW2:
        raise RuntimeError(f"unsupported Hadamard size {m} * {p}")  # never hand MLX a bad size
    n = m * p
    if n == 1:
        return x
    if not inverse or m in (1, 12):  # symmetric: its own inverse
        return mx.hadamard_transform(x, scale=1.0 / math.sqrt(n))
    # MLX computes rows @ kron(B_m, H_p); the inverse is rows @ kron(B_m^T, H_p)
    lead = x.shape[:-1]
    x = x.reshape(*lead, m, p)
    if p > 1:
        x = mx.hadamard_transform(x, scale=1.0 / math.sqrt(p))
    x = _hadamard_factor(m).astype(x.dtype) @ x
    return x.reshape(*lead, n)


@functools.lru_cache(maxsize=4096)
def _plan(seed: int, n: int) -> tuple[mx.array, mx.array | None, int, int]:
    """(signs, dense factor or None, m, p) for a rotation of size n, drawn from seed."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if n < 1:
        raise ValueError(f"cannot rotate a last axis of size {n}")
    d, m, p = _split(n)
    rng = np.random.default_rng(int(seed))
    signs = mx.array(1.0 - 2.0 * rng.integers(0, 2, size=n), dtype=mx.float32)
    dense = None
    if d > 1:
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q *= np.where(np.diag(r) < 0, -1.0, 1.0)  # Haar-distributed, and unique
        dense = mx.array(q, dtype=mx.float32)
    return signs, dense, m, p


def _as_float(x) -> mx.array:
    x = x if isinstance(x, mx.array) else mx.array(x)
    return x if mx.issubdtype(x.dtype, mx.floating) else x.astype(mx.float32)


def rotate(x: mx.array, seed: int) -> mx.array:
    """y = T(s * x) along the last axis; keeps x's float dtype (ints become float32)."""
    x = _as_float(x)
    n = x.shape[-1]
    signs, dense, m, p = _plan(seed, n)
    y = x * signs.astype(x.dtype)
    if dense is None:
        return _hadamard(y, m, p, inverse=False)
    lead = x.shape[:-1]
    y = _hadamard(y.reshape(*lead, dense.shape[0], m * p), m, p, inverse=False)
    return (dense.astype(x.dtype) @ y).reshape(*lead, n)


def unrotate(y: mx.array, seed: int) -> mx.array:
    """x = s * T^T(y) along the last axis: the inverse of rotate."""
    y = _as_float(y)
    n = y.shape[-1]
    signs, dense, m, p = _plan(seed, n)
    if dense is None:
        x = _hadamard(y, m, p, inverse=True)
    else:
        lead = y.shape[:-1]
        x = dense.T.astype(y.dtype) @ y.reshape(*lead, dense.shape[0], m * p)
        x = _hadamard(x, m, p, inverse=True).reshape(*lead, n)
    return x * signs.astype(y.dtype)

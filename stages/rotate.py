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

`rotate_np` is rotate() for encode, on the host: with numba, stages/fast_hadamard.py's kernel
(below); without, MLX's hadamard_transform for the power-of-two factor and numpy for the
m x m Hadamard factor and the dense factor. Those two are sums of m
(or d) terms; MLX's CPU kernels (hadamard_m, and the reference BLAS behind its float32
matmul) add them in order from 0.0 in float32, and numpy does the same on whole slabs, so
the values are bit for bit those of rotate() on MLX's CPU backend, at a fraction of the time.

`rotate_groups_np` gives the same values padded to whole groups and laid out group-axis
first, the layout encode works in. With n = a * p (a the 12/20/28 or dense factor, or 1, and
p the power of two) and b = p / group_size, it is (group_size, a, b, rows): column j of
block i of a row is at [j % group_size, i, j // group_size, row]. Where numba is installed,
stages/fast_hadamard.py computes it in one compiled pass with the same float32 operations in
the same order (its module notes say how). Without numba: the Hadamard over p is split at
group_size: the butterflies of stride < group_size run in numpy over the first axis (each
one contiguous op over all groups), then mx.hadamard_transform does the rest on a last axis
of b; the a-factor then mixes whole slabs of the second axis. The stages, their order and
the scales are those of rotate(), so the values are the same.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re

import mlx.core as mx
import numpy as np

from . import fast_hadamard
from .scale import group_energy_np

_MLX_MAX_POW2 = 8192  # largest power-of-two factor passed to mx.hadamard_transform
_MLX_M = (1, 12, 20, 28)  # non-power-of-two factors mx.hadamard_transform supports
_EXPERT = re.compile(r"\.experts\.\d+(?=\.|$)")
_SEED_DOMAIN = b"turboquant/rotation/v1"
_COMPILED = fast_hadamard.AVAILABLE  # encode's rotation through numba (same bits); tests flip it


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
    """The m x m matrix B_m (scaled to be orthogonal) that mx.hadamard_transform uses.

    Built on the CPU: MLX's CUDA hadamard_transform does not compile for a size of m alone."""
    with mx.stream(mx.cpu):
        b = mx.hadamard_transform(mx.eye(m, dtype=mx.float32), scale=1.0 / math.sqrt(m))
        mx.eval(b)
    return b


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


def _plan(seed: int, n: int) -> tuple[mx.array, mx.array | None, int, int]:
    """(signs, dense factor or None, m, p) for a rotation of size n, drawn from seed."""
    # checked before the cache: True == 1 there, and must not find seed 1's plan
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if n < 1:
        raise ValueError(f"cannot rotate a last axis of size {n}")
    return _cached_plan(int(seed), int(n))


@functools.lru_cache(maxsize=4096)
def _cached_plan(seed: int, n: int) -> tuple[mx.array, mx.array | None, int, int]:
    d, m, p = _split(n)
    rng = np.random.default_rng(int(seed))
    signs = mx.array(1.0 - 2.0 * rng.integers(0, 2, size=n), dtype=mx.float32)
    dense = None
    if d > 1:
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q *= np.where(np.diag(r) < 0, -1.0, 1.0)  # Haar-distributed, and unique
        dense = mx.array(q, dtype=mx.float32)
    return signs, dense, m, p


@functools.cache
def _hadamard_signs(m: int) -> np.ndarray:
    """The +-1 matrix behind mx.hadamard_transform's m-factor (the rows it adds and subtracts),
    built on the CPU like `_hadamard_factor`."""
    with mx.stream(mx.cpu):
        return np.array(mx.hadamard_transform(mx.eye(m, dtype=mx.float32), scale=1.0)).T.copy()


def _mix_np(y: np.ndarray, mat: np.ndarray, scale: float | None = None) -> np.ndarray:
    """out[:, j] = scale * sum_k mat[j, k] * y[:, k] for y (rows, k, L), float32.

    Summed in order k = 0, 1, ... from 0.0, a product rounded before it is added: the order
    of MLX's hadamard_m and of the reference BLAS sgemm. Slabs are laid out k-major so every
    step is one contiguous numpy op.
    """
    rows, k, length = y.shape
    yt = np.ascontiguousarray(y.transpose(1, 0, 2)).reshape(k, rows * length)
    out = np.empty_like(yt)
    term = np.empty(rows * length, dtype=np.float32)
    zero = np.float32(0.0)
    for j in range(k):
        acc = out[j]
        for i in range(k):
            c = mat[j, i]
            prev = zero if i == 0 else acc
            if c == 1.0:
                np.add(prev, yt[i], out=acc)
            elif c == -1.0:
                np.subtract(prev, yt[i], out=acc)
            else:
                np.add(prev, np.multiply(yt[i], c, out=term), out=acc)
        if scale is not None:
            np.multiply(acc, np.float32(scale), out=acc)
    return np.ascontiguousarray(out.reshape(k, rows, length).transpose(1, 0, 2))


def rotate_np(x: mx.array, seed: int) -> np.ndarray:
    """rotate(x, seed) of rows (rows, n) in float32, as a numpy array: the same values, faster
    on the CPU where n has a 12/20/28 factor or a dense factor (see the module notes).

    Always computed on the CPU (MLX's CPU stream), whatever the default device, so encode
    gives the same bytes on every machine.
    """
    with mx.stream(mx.cpu):
        x = _as_float(x).astype(mx.float32)
        if _COMPILED:
            rows, n = x.shape
            args = _compiled_plan(seed, n)
            if args is not None:  # laid out (n, rows) by the kernel
                y = fast_hadamard.rotate_groups(np.asarray(x), *args, 1, 1)
                return np.ascontiguousarray(y.reshape(n, rows).T)
        return _rotate_np(x, seed)


def _rotate_np(x: mx.array, seed: int) -> np.ndarray:
    rows, n = x.shape
    signs, dense, m, p = _plan(seed, n)
    if m > 1 and p > _MLX_MAX_POW2:
        return np.array(rotate(x, seed))  # no host path for this split; the same values
    d = 1 if dense is None else dense.shape[0]
    y = x * signs
    if m == 1:
        y = np.asarray(_hadamard(y.reshape(rows * d, p), 1, p, inverse=False))
    else:
        y = y.reshape(rows * d * m, p)
        if p > 1:  # mx.hadamard_transform does the power-of-two part first, unscaled
            y = mx.hadamard_transform(y, scale=1.0)
        y = np.asarray(y).reshape(rows * d, m, p)
        y = _mix_np(y, _hadamard_signs(m), 1.0 / math.sqrt(m * p))
    if d > 1:
        y = _mix_np(y.reshape(rows, d, m * p), np.asarray(dense))
    return y.reshape(rows, n)


def rotate_groups_np(x: np.ndarray, seed: int, group_size: int, energy: bool = False,
                     times: np.ndarray | None = None):
    """rotate(x, seed) of float32 rows (rows, n), zero-padded to whole groups, laid out
    (group_size, a, b, rows) as the module notes say (a = 1 where n has no such split).

    With `energy`, (rotated, energies): also each group's sum of squares, (a, b, rows)
    float32, the values of scale.group_energy_np. With `times` (float32, (n,)), the rows
    x * times are rotated: compiled, the vector rides in the signs (x * (+-t) is
    +-(x * t) bit for bit), with no pass of its own over the rows.
    """
    rows, n = x.shape
    signs, dense, m, p = _plan(seed, n)
    args = _compiled_plan(seed, n) if _COMPILED and p >= group_size else None
    if args is not None:
        blocks = 1 if p > _MLX_MAX_POW2 else (m if dense is None else dense.shape[0])
        if times is not None:
            args = (args[0] * np.asarray(times, dtype=np.float32),) + args[1:]
        return fast_hadamard.rotate_groups(x, *args, group_size, blocks, energy)
    if times is not None:
        x = x * np.asarray(times, dtype=np.float32)
    y = _rotate_groups_host(x, seed, group_size)
    if not energy:
        return y
    return y, group_energy_np(y.reshape(group_size, -1)).reshape(y.shape[1:])


def _rotate_groups_host(x: np.ndarray, seed: int, group_size: int) -> np.ndarray:
    """rotate_groups_np without numba: numpy, and MLX's hadamard_transform."""
    rows, n = x.shape
    signs, dense, m, p = _plan(seed, n)
    if p > _MLX_MAX_POW2 or p < group_size:
        y = rotate_np(mx.array(x), seed)
        groups = -(-n // group_size)
        if groups * group_size > n:
            y = np.pad(y, [(0, 0), (0, groups * group_size - n)])
        y = y.reshape(rows, 1, groups, group_size).transpose(3, 1, 2, 0)
        return np.ascontiguousarray(y)
    a = m if dense is None else dense.shape[0]
    b = p // group_size
    # signs, and the move to a layout with b last (for the transform over b), in one pass
    s = np.asarray(signs).reshape(a, b, group_size).transpose(2, 0, 1)[:, :, None, :]
    y = np.empty((group_size, a, rows, b), dtype=np.float32)
    np.multiply(x.reshape(rows, a, b, group_size).transpose(3, 1, 0, 2), s, out=y)
    y = _butterflies_np(y, group_size.bit_length() - 1)
    # the Hadamard over p carries the scale unless a 12/20/28 factor follows (MLX's order)
    scale = 1.0 / math.sqrt(p) if m == 1 else 1.0
    if b > 1:
        with mx.stream(mx.cpu):
            z = mx.hadamard_transform(mx.array(y).reshape(-1, b), scale=scale)
            y = np.asarray(z).reshape(group_size, a, rows, b)
    elif scale != 1.0:
        np.multiply(y, np.float32(scale), out=y)
    if dense is not None:
        y = _mix_blocks_np(y, np.asarray(dense))
    elif m > 1:
        y = _mix_blocks_np(y, _hadamard_signs(m), 1.0 / math.sqrt(m * p))
    return np.ascontiguousarray(y.transpose(0, 1, 3, 2))


def _compiled_plan(seed: int, n: int) -> tuple | None:
    """fast_hadamard.rotate_groups' arguments for rotate(., seed) of size n, the scales and the
    split at 8192 being those of _hadamard (None: no compiled path for this split)."""
    signs, dense, m, p = _plan(seed, n)
    if m > 1 and p > _MLX_MAX_POW2:
        return None
    split = min(p, _MLX_MAX_POW2)
    if m > 1:
        mat, scales = _hadamard_signs(m), (1.0, 1.0, 1.0 / math.sqrt(m * p))
    elif p > split:  # MLX's transform in two: over 8192, then over p // 8192
        mat = None if dense is None else np.asarray(dense)
        scales = (1.0 / math.sqrt(split), 1.0 / math.sqrt(p // split), 1.0)
    else:
        mat = None if dense is None else np.asarray(dense)
        scales = (1.0, 1.0 / math.sqrt(p), 1.0)
    return np.asarray(signs), mat, p, split, scales


def _butterflies_np(y: np.ndarray, stages: int) -> np.ndarray:
    """The first `stages` radix-2 stages (stride 1, 2, 4, ...) of a Hadamard over axis 0."""
    k = y.shape[0]
    src = y.reshape(k, -1)
    dst = np.empty_like(src)
    for stage in range(stages):
        h = 1 << stage
        u = src.reshape(k // (2 * h), 2, h, -1)
        v = dst.reshape(k // (2 * h), 2, h, -1)
        np.add(u[:, 0], u[:, 1], out=v[:, 0])
        np.subtract(u[:, 0], u[:, 1], out=v[:, 1])
        src, dst = dst, src
    return src.reshape(y.shape)


def _mix_blocks_np(y: np.ndarray, mat: np.ndarray, scale: float | None = None) -> np.ndarray:
    """_mix_np over axis 1 of (k, a, rows, b): block i becomes sum_j mat[i, j] * block j,
    summed in order j = 0, 1, ... from 0.0, for all i at once (2 a numpy ops in all)."""
    k, a = y.shape[:2]
    y3 = y.reshape(k, a, -1)
    out = np.zeros_like(y3)
    term = np.empty_like(y3)
    column = np.asarray(mat, dtype=np.float32).T[:, None, :, None]  # [j] -> mat[:, j]
    for j in range(a):
        np.add(out, np.multiply(y3[:, j : j + 1], column[j], out=term), out=out)
    if scale is not None:
        np.multiply(out, np.float32(scale), out=out)
    return out.reshape(y.shape)


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


def single_transform(seed: int, n: int) -> tuple[mx.array, float] | None:
    """(signs, scale) where rotate(x, seed) of a float32 x of last axis n is
    mx.hadamard_transform(x * signs, scale=scale), its ops exactly; None where it takes
    more (a dense factor, a split Hadamard). For callers that rotate the same shapes
    every decode step and would rather not look the plan up each time."""
    signs, dense, m, p = _plan(seed, n)
    if dense is not None or n == 1 or p > _MLX_MAX_POW2 or m not in _MLX_M or p & (p - 1):
        return None
    return signs, 1.0 / math.sqrt(n)  # _hadamard's forward transform: one MLX call


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

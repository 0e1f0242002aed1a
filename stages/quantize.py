"""Map normalized weights to codebook indices: nearest Lloyd-Max level, or a ternary trit.

`nearest_codes_np` and `code_values_np` are the same maps on numpy arrays (encode's path on
the host): comparisons against the same float32 thresholds and a lookup of the same float32
levels, so they agree with the MLX versions exactly.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from .codebook import codebook_values, midpoints


@functools.cache
def _coder(bits: int | str):
    # code = number of decision thresholds below x; compiled into one elementwise pass
    # (midpoints as float32 arrays, not Python floats: the compiled kernel is much faster)
    mids = mx.array(midpoints(bits), dtype=mx.float32)

    def code(x: mx.array) -> mx.array:
        c = (x > mids[0]).astype(mx.uint8)
        for k in range(1, mids.size):
            c = c + (x > mids[k]).astype(mx.uint8)
        return c

    return mx.compile(code, shapeless=True)


def nearest_codes(x_normalized: mx.array, bits: int | str) -> mx.array:
    """uint8 index of the nearest level of `codebook_values(bits)` for every entry.

    Ternary ("ternary") gives trits: 0 below -threshold, 2 above +threshold, else 1.
    NaN maps to code 0; callers reject non-finite weights before coding.
    """
    x = x_normalized if isinstance(x_normalized, mx.array) else mx.array(x_normalized)
    return _coder(bits)(x.astype(mx.float32))


@functools.cache
def _small_lookup(bits: int | str):
    # a compiled select chain beats a gather for <= 4 levels; beyond that MLX's CPU kernel
    # for the chain gets slower than `take`
    levels = codebook_values(bits)
    table = [levels[k] for k in range(levels.size)]
    mx.eval(table)

    def lookup(codes: mx.array) -> mx.array:
        q = mx.where(codes == 1, table[1], table[0])
        for k in range(2, len(table)):
            q = mx.where(codes == k, table[k], q)
        return q

    return mx.compile(lookup, shapeless=True)


def code_values(codes: mx.array, bits: int | str) -> mx.array:
    """float32 codebook level of every code: codebook_values(bits)[codes], exactly."""
    levels = codebook_values(bits)
    if levels.size <= 4:
        return _small_lookup(bits)(codes)
    return levels[codes]


@functools.cache
def _host_tables(bits: int | str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float32 thresholds, float32 levels, pair table) as numpy arrays.

    The pair table maps two codes read as one little-endian uint16 (c0 + 256 * c1) to the
    levels (values[c0], values[c1]) stored as one 8-byte item: one lookup per two codes.
    """
    levels = np.array(codebook_values(bits))
    index = np.arange(1 << 16)
    pairs = np.empty((1 << 16, 2), dtype=np.float32)
    pairs[:, 0] = levels[np.minimum(index & 0xFF, levels.size - 1)]
    pairs[:, 1] = levels[np.minimum(index >> 8, levels.size - 1)]
    return np.array(midpoints(bits), dtype=np.float32), levels, pairs.view(np.uint64).ravel()


def code_tables_np(bits: int | str) -> tuple[np.ndarray, np.ndarray]:
    """(float32 decision thresholds, float32 levels) of a width, as the host path uses them."""
    mids, levels, _ = _host_tables(bits)
    return mids, levels


def nearest_codes_np(x: np.ndarray, bits: int | str) -> np.ndarray:
    """nearest_codes on a float32 numpy array: the number of thresholds below each entry."""
    mids = _host_tables(bits)[0]
    codes = np.greater(x, mids[0]).view(np.uint8)
    above = np.empty(x.shape, dtype=bool)
    for m in mids[1:]:
        np.add(codes, np.greater(x, m, out=above).view(np.uint8), out=codes)
    return codes


def code_values_np(codes: np.ndarray, bits: int | str) -> np.ndarray:
    """code_values on numpy: float32 codebook level of every (valid) uint8 code."""
    _, levels, pairs = _host_tables(bits)
    if codes.dtype != np.uint8 or not codes.flags.c_contiguous or codes.shape[-1] % 2:
        return levels.take(codes)
    return pairs.take(codes.view("<u2")).view(np.float32)

"""Map normalized weights to codebook indices: nearest Lloyd-Max level, or a ternary trit."""

from __future__ import annotations

import functools

import mlx.core as mx

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

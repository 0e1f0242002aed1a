"""Prefill's tiled product and gathered experts (`kernels/tiles.py`), shared by the GPU
backends: the dtype it multiplies in, how a matrix is cut into tiles, and the products
against the reference's with the reference's decode standing in for a backend's kernel."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.kernels import reference, tiles
from turboquant.stages import encode


def test_compute_dtype():
    assert tiles.compute_dtype(mx.bfloat16) == mx.bfloat16
    assert tiles.compute_dtype(mx.float16) == mx.float16
    assert tiles.compute_dtype(mx.float32) == mx.float32


def test_rows_per_tile():
    assert tiles.rows_per_tile(14336, 4096) == 14336  # one tile
    assert tiles.rows_per_tile(4096, 14336, 1 << 24) == 1024  # four, not 1170 rows
    assert tiles.rows_per_tile(28672, 8192) == 7168
    assert tiles.rows_per_tile(128256, 4096) == 16128  # 8 tiles, the last shorter
    assert tiles.rows_per_tile(100, 4096) == 100
    assert tiles.rows_per_tile(10, 1 << 27) == 1  # rows wider than a tile
    assert tiles.rows_per_tile(70, 128, 20 * 128) == 18  # 4 tiles: 18, 18, 18, 16


def _decode_recorded(bits, group_size, padded_in, tiles_seen):
    """A backend's `dequantize` stood in for by the reference's, its launches recorded."""
    def dequantize(codes, scales, bits_, group_size_, padded_in_, dtype):
        assert (bits_, group_size_, padded_in_) == (bits, group_size, padded_in)
        tiles_seen.append((codes.shape[0], dtype))
        return reference.dequantize(codes, scales, bits, group_size, padded_in).astype(dtype)

    return dequantize


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_tiles_make_the_reference_product(bits, dtype):
    out_f, in_f = 70, 100
    qt = encode(mx.random.normal((out_f, in_f), key=mx.random.key(1)), bits, 32, seed=5)
    p = qt.spec.padded_in
    x = mx.random.normal((2, 9, p), key=mx.random.key(2)).astype(dtype)
    seen = []
    y = tiles.tiled_matmul(x, qt.codes, qt.scales, bits, 32, out_f, p,
                           _decode_recorded(bits, 32, p, seen), chunk=20 * p)
    assert y.shape == (2, 9, out_f) and y.dtype == dtype
    assert seen == [(18, dtype)] * 3 + [(16, dtype)]
    want = reference.tq_matmul(x, qt.codes, qt.scales, bits, 32, out_f, p).astype(mx.float32)
    err = mx.max(mx.abs(y.astype(mx.float32) - want)).item() / mx.max(mx.abs(want)).item()
    assert err < (1e-6 if dtype == mx.float32 else 1e-2), err


def test_what_the_tiles_do_not_cover_is_declined():
    qt = encode(mx.random.normal((8, 64)), 4, 32, seed=1)
    x = mx.random.normal((9, 64))
    decode = _decode_recorded(4, 32, 64, [])
    with pytest.raises(NotImplementedError):  # experts stacked: the gathered op's business
        tiles.tiled_matmul(x, qt.codes[None], qt.scales[None], 4, 32, 8, 64, decode)
    with pytest.raises(NotImplementedError):  # the wrong width: the reference names it
        tiles.tiled_matmul(x[:, :32], qt.codes, qt.scales, 4, 32, 8, 64, decode)


@settings(max_examples=40, deadline=None)
@given(experts=st.integers(2, 6), tokens=st.integers(1, 12), top=st.integers(1, 3),
       per_launch=st.integers(1, 6), sort=st.booleans(), seed=st.integers(0, 2**16))
def test_gathered_matmul_makes_the_references_result(experts, tokens, top, per_launch, sort,
                                                     seed):
    """`gathered_matmul` (prefill's experts through gather_mm) for any routing, a run of
    `per_launch` experts a decode: the reference's result, each expert in use decoded
    once and launches of at most `CHUNK` weights; SwitchGLU's sorted layout (one pair a
    row, in expert order) too."""
    top = min(top, experts)
    rng = np.random.default_rng(seed)
    out_f, in_f = 24, 40
    qts = [encode(mx.array(rng.standard_normal((out_f, in_f)).astype(np.float32)), 3, 32,
                  seed=5) for _ in range(experts)]
    k = qts[0].spec.padded_in
    codes = mx.stack([q.codes for q in qts])
    scales = mx.stack([q.scales for q in qts])
    routing = np.stack([rng.choice(experts, top, replace=False) for _ in range(tokens)])
    x = mx.array(rng.standard_normal((1, tokens, 1, 1, k)).astype(np.float32))
    indices = mx.array(routing[None].astype(np.uint32))  # (1, tokens, top)
    if sort:
        order = np.argsort(routing.reshape(-1), kind="stable")
        x = x.reshape(tokens, 1, k)[mx.array(order // top)]
        indices = mx.array(routing.reshape(-1)[order].astype(np.uint32))
    seen = []
    old_chunk = tiles.CHUNK
    tiles.CHUNK = per_launch * out_f * k
    try:
        y = tiles.gathered_matmul(x, codes, scales, indices, 3, 32, out_f, k,
                                  _decode_recorded(3, 32, k, seen), sorted_indices=sort)
    finally:
        tiles.CHUNK = old_chunk
    want = reference.tq_gather_matmul(x, codes, scales, indices, 3, 32, out_f, k)
    assert y.shape == want.shape
    assert mx.allclose(y, want, rtol=1e-5, atol=1e-5).item()
    used = len(np.unique(routing))
    assert sum(rows for rows, _ in seen) == used * out_f  # each expert in use once
    assert all(rows <= per_launch * out_f for rows, _ in seen)
    assert len(seen) == -(-used // per_launch)

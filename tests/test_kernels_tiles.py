"""Prefill's tiled product (`kernels/tiles.py`), shared by the GPU backends: the dtype it
multiplies in, how a matrix is cut into tiles, and the product against the reference's
with the reference's decode standing in for a backend's kernel."""

from __future__ import annotations

import mlx.core as mx
import pytest

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
    def decode(codes, scales, dtype):
        tiles_seen.append((codes.shape[0], dtype))
        return reference.dequantize(codes, scales, bits, group_size, padded_in).astype(dtype)

    return decode


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

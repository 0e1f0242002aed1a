"""CUDA kernels for trellis-coded weights (`kernels/cuda_trellis.py`): the GEMV, prefill's
tile decode and the rotated linear, against `stages.trellis.decode_rows` and a float64
product.

Any words are a valid trellis code (every bit stream decodes), so the cases draw random
words and scales rather than run the slow CPU Viterbi. The `check_*` functions are run on
the GPU here (skipped off MLX's CUDA backend) and on the CPU by the emulation
(`tests/test_kernels_cuda_trellis_emulated.py`), with blocks shuffled; nvcc compiles the
sources there too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.kernels import cuda_trellis
from turboquant.stages import trellis
from turboquant.stages.rotate import rotate as rotate_rows
from turboquant.stages.trellis import TrellisCode

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
on_gpu = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")


def random_rows(code: TrellisCode, rows: int, padded: int, group_size: int, seed: int = 0):
    """(words uint32, scales float16) of `rows` random trellis-coded rows."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(rows, padded * code.bits // 32), dtype=np.uint64)
    scales = rng.uniform(0.01, 0.1, size=(rows, padded // group_size)).astype(np.float16)
    return words.astype(np.uint32), scales


def reference_rows(code, words, scales, group_size, block) -> np.ndarray:
    return trellis.decode_rows(code, words, scales, group_size, block).astype(np.float64)


def check_matvec(bits: int, state_bits: int, values: int, out_f: int, padded: int, block: int,
                 group_size: int = 64, tokens: int = 1, dtype=mx.float32, rows_per_warp=None,
                 version: int = 1):
    """`matvec` against decode_rows + a float64 product (relative to the output's scale)."""
    code = TrellisCode(state_bits, bits, values, version)
    words, scales = random_rows(code, out_f, padded, group_size, seed=bits * 100 + padded)
    x = np.random.default_rng(7).standard_normal((tokens, padded)).astype(np.float32)
    y = cuda_trellis.matvec(mx.array(x).astype(dtype), mx.array(words), mx.array(scales), code,
                            block, group_size, out_f, padded, rows_per_warp=rows_per_warp)
    assert y.shape == (tokens, out_f) and y.dtype == dtype
    want = x.astype(np.float64) @ reference_rows(code, words, scales, group_size, block).T
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    if dtype != mx.float32:  # x was rounded too: compare with the rounded x
        xr = np.array(mx.array(x).astype(dtype).astype(mx.float32)).astype(np.float64)
        want = xr @ reference_rows(code, words, scales, group_size, block).T
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < tol, (err, bits, state_bits, values, out_f, padded, block)


def check_dequantize(bits: int, state_bits: int, values: int, rows: int, padded: int,
                     block: int, group_size: int = 32, version: int = 1):
    """The tile decode: float32 exactly decode_rows, fp16/bf16 its values rounded once."""
    code = TrellisCode(state_bits, bits, values, version)
    words, scales = random_rows(code, rows, padded, group_size, seed=bits + padded)
    want = trellis.decode_rows(code, words, scales, group_size, block)
    for dtype in cuda_trellis.OUT_DTYPES:
        got = cuda_trellis.dequantize(mx.array(words), mx.array(scales), code, block, group_size,
                                      padded, dtype)
        assert got.dtype == dtype
        rounded = np.array(mx.array(want).astype(dtype).astype(mx.float32))
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), rounded)


def check_matmul(bits: int, out_f: int, padded: int, block: int, tokens: int = 12,
                 dtype=mx.bfloat16, chunk=None):
    """Prefill through the tile decode and MLX's GEMM."""
    code = TrellisCode(12, bits)
    words, scales = random_rows(code, out_f, padded, 32, seed=3)
    x = np.random.default_rng(2).standard_normal((tokens, padded)).astype(np.float32)
    xd = mx.array(x).astype(dtype)
    y = cuda_trellis.matmul(xd, mx.array(words), mx.array(scales), code, block, 32, out_f,
                            padded, chunk=chunk)
    assert y.shape == (tokens, out_f) and y.dtype == dtype
    want = (np.array(xd.astype(mx.float32)).astype(np.float64)
            @ reference_rows(code, words, scales, 32, block).T)
    err = np.abs(np.array(y.astype(mx.float32)) - want).max() / np.abs(want).max()
    assert err < 2e-2, err


def check_linear(bits: int, out_f: int, in_f: int, padded: int, block: int, tokens: int = 1,
                 seed: int = 11):
    """x rotated by the scalar path's rotation kernel, then the GEMV (or the tiles)."""
    code = TrellisCode(12, bits)
    words, scales = random_rows(code, out_f, padded, 32, seed=5)
    x = np.random.default_rng(4).standard_normal((tokens, in_f)).astype(np.float32)
    y = cuda_trellis.linear(mx.array(x), mx.array(words), mx.array(scales), code, block, 32,
                            out_f, padded, seed)
    with mx.stream(mx.cpu):
        xr = np.array(rotate_rows(mx.array(x), seed)).astype(np.float64)
    xr = np.pad(xr, ((0, 0), (0, padded - in_f)))
    want = xr @ reference_rows(code, words, scales, 32, block).T
    err = np.abs(np.array(y) - want).max() / np.abs(want).max()
    assert err < (1e-4 if tokens <= cuda_trellis.MATVEC_MAX_TOKENS else 2e-2), err


# ---------------------------------------------------------------------------- everywhere


@st.composite
def layouts(draw):
    """A code, a block and a row length the kernels take (blocks of whole chunks, a
    shorter last block, single-chunk blocks included)."""
    bits = draw(st.sampled_from([2, 3, 4]))
    values = draw(st.sampled_from([1, 2]))
    state_bits = draw(st.integers(bits * values + 1, 20))
    block = 32 * draw(st.integers(1, 9))
    n = 32 * draw(st.integers(1, 24))
    return TrellisCode(state_bits, bits, values), block, n


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), data=st.data())
def test_the_kernels_windows_give_the_reference_values(layout, data):
    """The kernels' chunk arithmetic (a chunk's words and the word before it in the block's
    circle, a state's window at a fixed offset), in Python, against `decode_words`."""
    code, block, n = layout
    words = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * code.bits // 32,
                                        max_size=n * code.bits // 32)), dtype=np.uint32)
    want = trellis.decode_words(code, words[None], block)[0]
    sums = [s for chunk in range(n // 32)
            for s in cuda_trellis.emulate_chunk_sums(code, block, words, chunk)]
    got = (np.array(sums, np.float32) - np.float32(510)) / np.float32(trellis.BYTESUM_STD)
    np.testing.assert_array_equal(got, want)


def test_reference_matvec_is_decode_rows_times_x():
    """The reference's arithmetic, on the CPU: MLX's CUDA backend multiplies float32 in TF32
    (relative error ~2e-3 on the H100, 2026-12-05), which is the device's matmul, not this."""
    code = TrellisCode(10, 3)
    words, scales = random_rows(code, 24, 320, 64)
    x = np.random.default_rng(1).standard_normal((2, 320)).astype(np.float32)
    with mx.stream(mx.cpu):
        got = cuda_trellis.reference_matvec(mx.array(x), mx.array(words), mx.array(scales),
                                            code, 128, 64, 24, 320)
    want = x.astype(np.float64) @ reference_rows(code, words, scales, 64, 128).T
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_float_constants_parse_to_the_reference_float32():
    for v in (trellis.BYTESUM_STD, 1 / trellis.BYTESUM_STD):
        assert np.float32(cuda_trellis._float(v)[:-1]) == np.float32(v)


def test_operands_are_checked_before_a_launch():
    code = TrellisCode(16, 3)
    words, scales = random_rows(code, 8, 256, 64)
    with pytest.raises(ValueError, match="expected uint32"):
        cuda_trellis.matvec(mx.zeros((1, 256)), mx.array(words[:, :-3]), mx.array(scales), code,
                            256, 64, 8, 256)
    with pytest.raises(ValueError, match="padded_in 256"):
        cuda_trellis.matvec(mx.zeros((1, 128)), mx.array(words), mx.array(scales), code,
                            256, 64, 8, 256)
    with pytest.raises(ValueError, match="out_dtype"):
        cuda_trellis.dequantize(mx.array(words), mx.array(scales), code, 256, 64, 256, mx.int32)
    with pytest.raises(ValueError, match="multiple of 32"):
        cuda_trellis.code_constants(code, 100, 64, 256)


# ---------------------------------------------------------------------------- on the GPU


@on_gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("values", [1, 2])
def test_gpu_matvec_matches_the_reference(bits, values):
    check_matvec(bits, 16, values, 4096, 4096, 256)
    check_matvec(bits, 16, values, 200, 4160, 256, tokens=3)  # a 64-weight last block


@on_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_gpu_matvec_in_half_dtypes(dtype):
    check_matvec(3, 16, 1, 1024, 2048, 256, dtype=dtype)


@on_gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gpu_tile_decode_is_exact(bits):
    check_dequantize(bits, 16, 1, 300, 4096, 256)
    check_dequantize(bits, 15, 2, 20, 800, 256)


@on_gpu
def test_gpu_prefill_and_linear():
    check_matmul(3, 1000, 2048, 256, tokens=64, chunk=300 * 2048)
    check_linear(3, 512, 3840, 4096, 256, tokens=1)  # 15 x 256: a mixed rotation
    check_linear(4, 512, 3840, 4096, 256, tokens=40)
    check_linear(3, 64, 4000, 4096, 256, tokens=2)  # 125 x 32: MLX's ops rotate

"""stages/dequant.py against independent decodings: ml_dtypes for FP8 and FP4, plain numpy
for E8M0 exponents and int4 words, on small random tensors with ragged block edges."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.stages import dequant

ML = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
SETTINGS = settings(max_examples=40, deadline=None)


def _codes(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_every_fp8_code_decodes_as_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    for tag, ml in ML.items():
        want = codes.view(ml).astype(np.float32)
        got = dequant.fp8_to_float32(codes, tag)
        np.testing.assert_array_equal(got, want)  # NaN == NaN here, signed zeros too
        assert np.array_equal(np.signbit(got), np.signbit(want))


def test_every_fp4_code_decodes_as_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(dequant.FP4_E2M1, want)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 300), cols=st.integers(1, 300),
       br=st.sampled_from([1, 16, 128]), bc=st.sampled_from([1, 32, 128]),
       tag=st.sampled_from(sorted(ML)), row0=st.integers(0, 300))
def test_fp8_block_scales_with_ragged_edges(seed, rows, cols, br, bc, tag, row0):
    """A chunk of rows [row0, row0 + rows) of a matrix with (br x bc) block scales, given
    the scale rows its blocks need, equals ml_dtypes' values times each element's block."""
    rng = np.random.default_rng(seed)
    codes = _codes(seed, (rows, cols))
    first, last = row0 // br, (row0 + rows - 1) // br
    grid = rng.uniform(1e-4, 4, size=(last - first + 1, math.ceil(cols / bc))).astype(np.float32)
    want = np.empty((rows, cols), np.float32)
    vals = codes.view(ML[tag]).astype(np.float32)
    for i in range(rows):
        for j in range(0, cols, bc):
            want[i, j:j + bc] = vals[i, j:j + bc] * grid[(row0 + i) // br - first, j // bc]
    got = dequant.dequant_fp8(codes, grid, tag, (br, bc), row0)
    np.testing.assert_array_equal(got, want)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 40), cols=st.integers(1, 40),
       per_channel=st.booleans(), tag=st.sampled_from(sorted(ML)))
def test_fp8_per_tensor_and_per_channel(seed, rows, cols, per_channel, tag):
    rng = np.random.default_rng(seed)
    codes = _codes(seed, (rows, cols))
    scale = rng.uniform(1e-3, 2, size=(rows, 1) if per_channel else (1,)).astype(np.float32)
    want = codes.view(ML[tag]).astype(np.float32) * (scale if per_channel else scale[0])
    np.testing.assert_array_equal(dequant.dequant_fp8(codes, scale, tag), want)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lead=st.lists(st.integers(1, 3), max_size=2),
       groups=st.integers(1, 4))
def test_mxfp4_against_ml_dtypes_and_numpy_powers(seed, lead, groups):
    """Two FP4 E2M1 codes a byte, low nibble first, times 2^(e - 127) per 32 values."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(*lead, groups, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, size=(*lead, groups), dtype=np.uint8)  # 255 is NaN
    nibbles = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*lead, groups, 32)
    vals = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    with np.errstate(over="ignore"):
        want = vals * np.power(2.0, scales.astype(np.float64) - 127)[..., None]
        want = want.astype(np.float32)
    got = dequant.dequant_mxfp4(blocks, scales)
    assert got.shape == (*lead, groups * 32)
    np.testing.assert_array_equal(got, want.reshape(*lead, groups * 32))


def test_mxfp4_nan_scale_stays_nan():
    blocks = np.zeros((1, 2, 16), np.uint8)
    got = dequant.dequant_mxfp4(blocks, np.array([[127, 255]], np.uint8))
    assert np.all(got[0, :32] == 0) and np.all(np.isnan(got[0, 32:]))


def _int4_words(q: np.ndarray) -> np.ndarray:
    """Independent packing: value j of each 8 at bits 4j, stored q + 8."""
    u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
    words = sum(u[..., j] << (4 * j) for j in range(8))
    return words.astype(np.uint32).view(np.int32)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 20), words=st.integers(1, 8),
       group=st.sampled_from([8, 16, 32, 64]), zero=st.booleans())
def test_int4_pack_quantized(seed, rows, words, group, zero):
    rng = np.random.default_rng(seed)
    cols = words * 8
    group = min(group, cols) if cols % min(group, cols) == 0 else cols
    q = rng.integers(-8, 8, size=(rows, cols))
    scale = rng.uniform(1e-3, 1, size=(rows, cols // group)).astype(np.float32)
    zp = rng.integers(-8, 8, size=scale.shape) if zero else None
    packed = _int4_words(q)
    np.testing.assert_array_equal(dequant.unpack_int4(packed), q)
    per_col = np.repeat(scale, group, axis=1)
    shift = np.repeat(zp, group, axis=1) if zero else 0
    want = (q - shift).astype(np.float32) * per_col
    np.testing.assert_array_equal(dequant.dequant_int4(packed, scale, cols, zp), want)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 30), groups=st.integers(1, 4))
def test_int4_zero_points_unpack_along_rows(seed, rows, groups):
    """compressed-tensors packs zero points along the output axis: (ceil(rows / 8), groups)."""
    zp = np.random.default_rng(seed).integers(-8, 8, size=(rows, groups))
    padded = np.pad(zp, ((0, -rows % 8), (0, 0)))
    words = _int4_words(padded.T).T
    assert words.shape == (math.ceil(rows / 8), groups)
    np.testing.assert_array_equal(dequant.unpack_int4(words, axis=0)[:rows], zp)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), experts=st.integers(1, 4), rows=st.integers(1, 20),
       words=st.integers(1, 6), group=st.sampled_from([8, 16, 32]), zero=st.booleans())
def test_int4_stacked_experts_one_at_a_time(seed, experts, rows, words, group, zero):
    """Stacked (E, out, in / 8) int4 experts, scales (E, out, groups), zero points packed
    along rows (E, ceil(out / 8), groups): each expert's slices decode to (q - zp) * s,
    computed here with numpy from the unpacked values."""
    rng = np.random.default_rng(seed)
    cols = words * 8
    group = group if cols % group == 0 else cols
    q = rng.integers(-8, 8, size=(experts, rows, cols))
    scale = rng.uniform(1e-3, 1, size=(experts, rows, cols // group)).astype(np.float32)
    zp = rng.integers(-8, 8, size=scale.shape) if zero else np.zeros(scale.shape, np.int64)
    packed = np.stack([_int4_words(q[e]) for e in range(experts)])
    zwords = np.stack([_int4_words(np.pad(zp[e], ((0, -rows % 8), (0, 0))).T).T
                       for e in range(experts)])
    assert packed.shape == (experts, rows, words)
    assert zwords.shape == (experts, math.ceil(rows / 8), cols // group)
    for e in range(experts):
        want = (q[e] - np.repeat(zp[e], group, axis=1)).astype(np.float32) * np.repeat(
            scale[e], group, axis=1)
        got = dequant.dequant_int4_expert(packed[e], scale[e], cols, zwords[e] if zero else None)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()

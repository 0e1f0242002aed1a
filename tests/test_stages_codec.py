"""encode/decode: quality against Lloyd-Max, real bits per weight, determinism, errors."""

import hashlib
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.stages import (
    QuantizedTensor,
    QuantSpec,
    codec,
    decode,
    encode,
    lloyd_max_mse,
    ternary_mse,
)


def rel_mse(w, w_hat):
    w = w.astype(mx.float32)
    return float(mx.sum((w - w_hat.astype(mx.float32)) ** 2) / mx.sum(w * w))


def gaussian(rows, cols, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32))


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
@pytest.mark.parametrize("shape", [(256, 1024), (96, 1000)])
def test_quality_near_lloyd_max(bits, shape):
    w = gaussian(*shape)
    w_hat = decode(encode(w, bits, group_size=64, seed=3))
    assert w_hat.shape == w.shape and w_hat.dtype == mx.float32
    bound = ternary_mse() if bits == "ternary" else lloyd_max_mse(bits)
    assert rel_mse(w, w_hat) <= 1.03 * bound


def test_refit_lowers_error():
    w = gaussian(128, 512)
    plain = rel_mse(w, decode(encode(w, 3, refit=False)))
    refit = rel_mse(w, decode(encode(w, 3, refit=True)))
    assert refit < plain * 0.99


@pytest.mark.parametrize("bits, bpw", [(2, 2.25), (3, 3.25), (4, 4.25), ("ternary", 1.85)])
def test_bits_per_weight(bits, bpw):
    qt = encode(gaussian(16, 1280), bits, group_size=64)  # 1280 = 64 * 20: no padding at all
    assert qt.bits_per_weight == pytest.approx(bpw, abs=1e-12)
    assert qt.nbytes == qt.codes.nbytes + qt.scales.nbytes
    assert qt.codes.dtype == mx.uint32 and qt.scales.dtype == mx.float16
    assert qt.scales.shape == (16, 20)


def test_ternary_bits_per_weight_at_llm_width():
    assert encode(gaussian(4, 4096), "ternary").bits_per_weight == pytest.approx(
        1.6 + 0.25, abs=2e-3
    )


def test_padding_counts_in_bits_per_weight():
    qt = encode(gaussian(8, 100), 4, group_size=128)
    assert qt.spec.padded_in == 128 and qt.shape == (8, 100)
    assert qt.bits_per_weight == pytest.approx((128 * 4 + 16) / 100)


def test_spec_records_everything():
    qt = encode(gaussian(4, 72), 2, group_size=32, seed=99, refit=False)
    assert qt.spec == QuantSpec(
        bits=2, group_size=32, seed=99, in_features=72, padded_in=96, refit=False
    )


def test_input_dtypes_and_numpy():
    w = gaussian(32, 384)
    ref = encode(w, 3, seed=1)
    same = encode(np.array(w), 3, seed=1)
    assert mx.array_equal(ref.codes, same.codes) and mx.array_equal(ref.scales, same.scales)
    for dtype in (mx.float16, mx.bfloat16):
        qt = encode(w.astype(dtype), 3, seed=1)
        assert rel_mse(w, decode(qt)) < 1.03 * lloyd_max_mse(3)
    assert decode(ref, dtype=mx.bfloat16).dtype == mx.bfloat16


def test_numpy_bfloat16_input():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = np.random.default_rng(0).standard_normal((8, 128)).astype(ml_dtypes.bfloat16)
    qt = encode(w, 4)
    want = encode(mx.array(w.astype(np.float32)).astype(mx.bfloat16), 4)
    assert mx.array_equal(qt.codes, want.codes)


def test_chunking_does_not_change_bytes(monkeypatch):
    w = gaussian(64, 1000)
    whole = encode(w, 3, seed=5)
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 3000)  # 3 rows per chunk
    chunked = encode(w, 3, seed=5)
    assert mx.array_equal(whole.codes, chunked.codes)
    assert mx.array_equal(whole.scales, chunked.scales)
    assert mx.array_equal(decode(whole), decode(chunked))


def test_zero_rows_and_groups():
    w = mx.zeros((4, 128)).at[1, :64].add(1.0)
    qt = encode(w, 2)
    w_hat = decode(qt)
    assert float(mx.abs(w_hat[0]).max()) == 0.0 and float(mx.abs(w_hat[2:]).max()) == 0.0
    assert bool(mx.isfinite(w_hat).all())


@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 300),
    bits=st.sampled_from([2, 3, 4, "ternary"]),
    group_size=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**64 - 1),
    scale=st.floats(1e-3, 1e3),
)
@settings(max_examples=40, deadline=None)
def test_any_shape_codes_better_than_zero(rows, cols, bits, group_size, seed, scale):
    # with the least-squares refit no group can decode worse than all zeros
    w = gaussian(rows, cols, seed=seed % 1000) * scale
    qt = encode(w, bits, group_size=group_size, seed=seed)
    w_hat = decode(qt)
    assert w_hat.shape == (rows, cols)
    assert rel_mse(w, w_hat) <= 1.0 + 1e-3


@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    bits=st.sampled_from([2, 3, 4, "ternary"]),
    group_size=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**64 - 1),
    column_scaled=st.booleans(),
    refit=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_encode_np_is_encode_as_numpy(rows, cols, bits, group_size, seed, column_scaled, refit):
    # the converter writes encode_np's arrays: they are encode's, field for field
    w = np.random.default_rng(seed % 1000).standard_normal((rows, cols), dtype=np.float32)
    t = (np.exp(np.random.default_rng(1).normal(0.0, 0.3, cols)).astype(np.float16)
         if column_scaled else None)
    qt = encode(w, bits, group_size=group_size, seed=seed, refit=refit, in_scales=t)
    got = codec.encode_np(w, bits, group_size=group_size, seed=seed, refit=refit, in_scales=t)
    assert isinstance(got.codes, np.ndarray) and isinstance(got.scales, np.ndarray)
    assert got.codes.dtype == np.uint32 and got.scales.dtype == np.float16
    assert got.codes.tobytes() == np.asarray(qt.codes).tobytes()
    assert got.scales.tobytes() == np.asarray(qt.scales).tobytes()
    assert (got.shape, got.spec) == (qt.shape, qt.spec)
    assert np.array_equal(got.row_sq_error, qt.row_sq_error)
    assert np.array_equal(got.row_sq_norm, qt.row_sq_norm)
    if t is None:
        assert got.in_scales is None and qt.in_scales is None
    else:
        assert got.in_scales.tobytes() == np.asarray(qt.in_scales).tobytes()


_SUBPROCESS = """
import hashlib, numpy as np
from turboquant.stages import encode
w = np.random.default_rng(7).standard_normal((48, 1000)).astype(np.float32)
h = hashlib.sha256()
for bits in (2, 3, 4, "ternary"):
    qt = encode(w, bits, group_size=64, seed=2**63 + 5)
    h.update(np.array(qt.codes).tobytes()); h.update(np.array(qt.scales).tobytes())
print(h.hexdigest())
"""


def test_same_bytes_in_any_process():
    digests = [
        subprocess.run(
            [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert len(digests[0]) == 64 and digests[0] == digests[1]
    w = np.random.default_rng(7).standard_normal((48, 1000)).astype(np.float32)
    h = hashlib.sha256()
    for bits in (2, 3, 4, "ternary"):
        qt = encode(w, bits, group_size=64, seed=2**63 + 5)
        h.update(np.array(qt.codes).tobytes())
        h.update(np.array(qt.scales).tobytes())
    assert h.hexdigest() == digests[0]


def test_error_cases():
    w = gaussian(4, 64)
    with pytest.raises(ValueError, match="2-D"):
        encode(mx.ones((64,)), 3)
    with pytest.raises(ValueError, match="2-D"):
        encode(mx.ones((2, 2, 64)), 3)
    with pytest.raises(ValueError, match="empty"):
        encode(mx.ones((0, 64)), 3)
    with pytest.raises(ValueError, match="empty"):
        encode(mx.ones((4, 0)), 3)
    for bits in (1, 5, 8, "3", 3.0, True, None, "binary"):
        with pytest.raises(ValueError, match="unsupported bits"):
            encode(w, bits)
    for group_size in (16, 48, 256, True):
        with pytest.raises(ValueError, match="group size"):
            encode(w, 3, group_size=group_size)
    with pytest.raises(ValueError, match="floating-point"):
        encode(mx.ones((4, 64), dtype=mx.int32), 3)
    with pytest.raises(ValueError, match="seed"):
        encode(w, 3, seed=-1)


def test_non_finite_reported_with_count_and_position():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w[2, 5] = np.nan
    w[3, 0] = np.inf
    w[3, 1] = -np.inf
    with pytest.raises(ValueError, match=r"3 non-finite.*first at \[2, 5\] = nan"):
        encode(w, 3)
    with pytest.raises(ValueError, match=r"1 non-finite.*\[0, 0\] = inf"):
        encode(mx.array([[np.inf] + [0.0] * 63], dtype=mx.bfloat16), 2)


def test_scales_beyond_float16_rejected():
    with pytest.raises(ValueError, match="float16"):
        encode(mx.full((2, 64), 1e6), 3)


def test_quantized_tensor_checks_shapes():
    qt = encode(gaussian(4, 128), 3)
    with pytest.raises(ValueError, match="codes must be"):
        QuantizedTensor(qt.codes[:, :-1], qt.scales, qt.shape, qt.spec)
    with pytest.raises(ValueError, match="scales must be"):
        QuantizedTensor(qt.codes, qt.scales.astype(mx.float32), qt.shape, qt.spec)
    with pytest.raises(ValueError, match="padded_in"):
        QuantSpec(3, 64, 0, 100, 100, True)


def _reference_encode(w, bits, group_size, seed, refit=True):
    """encode as the plain MLX stages spell it (the codec before its host fast path), on
    MLX's CPU backend (whose sums and float32 matmul add in order, as encode does)."""
    with mx.stream(mx.cpu):
        return _plain_mlx_encode(w, bits, group_size, seed, refit)


def _plain_mlx_encode(w, bits, group_size, seed, refit):
    from turboquant.stages import (
        code_values,
        group_rms,
        nearest_codes,
        pack_codes,
        refit_scales,
        rotate,
    )

    rows, n = w.shape
    padded = -(-n // group_size) * group_size
    x = rotate(w.astype(mx.float32), seed)
    if padded > n:
        x = mx.pad(x, [(0, 0), (0, padded - n)])
    scales = group_rms(x, group_size, valid=n)
    s = scales.astype(mx.float32)[..., None]
    g = x.reshape(rows, -1, group_size)
    codes = nearest_codes(mx.where(s > 0, g / mx.where(s > 0, s, 1.0), 0.0), bits)
    codes = codes.reshape(rows, padded)
    if refit:
        q = code_values(codes, bits) * (mx.arange(padded) < n)
        scales = refit_scales(x, q, group_size)
    packed = pack_codes(codes, bits)
    mx.eval(packed, scales)
    return packed, scales


@given(
    rows=st.integers(1, 5),
    cols=st.sampled_from([1, 5, 64, 100, 384, 640, 896, 1000, 1536, 2048, 2304, 2816, 3584]),
    bits=st.sampled_from([2, 3, 4, "ternary"]),
    group_size=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**64 - 1),
    refit=st.booleans(),
    magnitude=st.sampled_from([1e-8, 1e-5, 0.05, 3.0, 1e3]),  # float16 subnormal to large scales
)
@settings(max_examples=60, deadline=None)
def test_same_bytes_as_the_plain_mlx_stages(rows, cols, bits, group_size, seed, refit, magnitude):
    w = gaussian(rows, cols, seed=seed % 997) * magnitude
    qt = encode(w, bits, group_size=group_size, seed=seed, refit=refit)
    codes, scales = _reference_encode(w, bits, group_size, seed, refit)
    assert mx.array_equal(qt.codes, codes) and mx.array_equal(qt.scales, scales)


def _decoded_error(w, qt):
    w64 = np.array(w.astype(mx.float32), dtype=np.float64)
    d = np.array(decode(qt), dtype=np.float64)
    return ((w64 - d) ** 2).sum(axis=1), (w64**2).sum(axis=1)


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
@pytest.mark.parametrize(
    "shape, group_size, refit",
    [((64, 2048), 64, True), ((16, 1000), 32, False), ((8, 5632), 128, True), ((6, 3), 32, True)],
)
def test_error_by_product_equals_decoded_error(bits, shape, group_size, refit):
    w = np.random.default_rng(3).standard_t(4, size=shape).astype(np.float32)
    w[:, :2] *= 40.0  # outlier channels
    w[1] = 0.0  # a zero row: no error, no norm
    w = mx.array(w)
    qt = encode(w, bits, group_size=group_size, seed=11, refit=refit)
    err, norm = _decoded_error(w, qt)
    assert qt.row_sq_error.dtype == np.float64 and qt.row_sq_error.shape == (shape[0],)
    np.testing.assert_allclose(qt.row_sq_norm, norm, rtol=1e-5)
    np.testing.assert_allclose(qt.row_sq_error, err, rtol=1e-3, atol=1e-6 * norm.max())
    assert qt.row_sq_error[1] == 0.0 and qt.row_sq_norm[1] == 0.0
    assert qt.rel_mse == pytest.approx(err.sum() / norm.sum(), rel=1e-3)


def test_error_by_product_does_not_depend_on_chunking(monkeypatch):
    w = gaussian(40, 1000)
    whole = encode(w, 4, seed=2)
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 3000)
    chunked = encode(w, 4, seed=2)
    np.testing.assert_array_equal(whole.row_sq_error, chunked.row_sq_error)
    np.testing.assert_array_equal(whole.row_sq_norm, chunked.row_sq_norm)
    assert whole.rel_mse == chunked.rel_mse


def test_rel_mse_of_an_all_zero_weight_and_of_a_loaded_tensor():
    qt = encode(mx.zeros((3, 64)), 3)
    assert qt.rel_mse == 0.0
    loaded = QuantizedTensor(qt.codes, qt.scales, qt.shape, qt.spec)
    assert loaded.rel_mse is None and loaded.row_sq_error is None

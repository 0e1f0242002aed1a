"""The trellis branch of stages.codec: encode/decode with codec="trellis" (docs/FORMAT.md)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.stages import codec, decode, encode, trellis
from turboquant.stages.codec import QuantSpec


def weight(seed, out, n, scale=0.02):
    return np.random.default_rng(seed).standard_normal((out, n)).astype(np.float32) * scale


@given(st.integers(0, 2**32 - 1), st.sampled_from([2, 3, 4]), st.sampled_from([32, 64]),
       st.sampled_from([64, 96, 130, 256]), st.sampled_from([(8, 1, 64), (9, 1, 128),
                                                             (10, 2, 64)]),
       st.sampled_from(trellis.VERSIONS))
@settings(max_examples=16, deadline=None)
def test_trellis_round_trip_is_the_reference_decode(seed, bits, group_size, n, lvt, version):
    """decode gives s * T^T(unpad(scale * v(S_t))) of the reference's rows (at the
    trellis version encode was given), and the error encode reports is the decoded
    weight's."""
    state_bits, values, block = lvt
    w = weight(seed, 5, n)
    qt = encode(w, bits, group_size, seed=seed % 1000, codec="trellis",
                trellis_state_bits=state_bits, trellis_values=values, trellis_block=block,
                trellis_version=version)
    spec = qt.spec
    assert spec.trellis_version == spec.trellis_code.version == version
    assert spec.codec == "trellis" and qt.codes.shape == (5, spec.padded_in * bits // 32)
    assert qt.codes.dtype == mx.uint32 and qt.scales.dtype == mx.float16
    rows = trellis.decode_rows(spec.trellis_code, np.array(qt.codes), np.array(qt.scales),
                               group_size, block, valid=n)[:, :n]
    want = np.array(codec.unrotate(mx.array(rows), spec.seed))
    got = np.array(decode(qt))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    err = ((w.astype(np.float64) - got) ** 2).sum()
    assert qt.rel_mse == pytest.approx(err / (w.astype(np.float64) ** 2).sum(), rel=2e-3)


def test_trellis_halves_the_scalar_error_at_the_same_bytes():
    w = weight(1, 16, 256)
    scalar = encode(w, 3, 64, seed=3)
    tc = encode(w, 3, 64, seed=3, codec="trellis", trellis_state_bits=12)
    assert tc.nbytes == scalar.nbytes and tc.bits_per_weight == scalar.bits_per_weight
    assert tc.rel_mse < 0.65 * scalar.rel_mse


def test_trellis_bytes_do_not_depend_on_the_chunking(monkeypatch):
    w = weight(2, 12, 128)
    whole = encode(w, 2, 64, seed=1, codec="trellis", trellis_state_bits=8)
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 300)  # 2 rows a chunk
    parts = encode(w, 2, 64, seed=1, codec="trellis", trellis_state_bits=8)
    assert np.array(whole.codes).tobytes() == np.array(parts.codes).tobytes()
    assert np.array(whole.scales).tobytes() == np.array(parts.scales).tobytes()
    assert whole.rel_mse == parts.rel_mse


def test_trellis_takes_in_scales():
    w = weight(4, 8, 128)
    t = np.linspace(0.5, 2.0, 128).astype(np.float16)
    qt = encode(w, 3, 64, seed=2, in_scales=t, codec="trellis", trellis_state_bits=8)
    plain = encode(w / t.astype(np.float32), 3, 64, seed=2, codec="trellis",
                   trellis_state_bits=8)
    assert np.array(qt.codes).tobytes() == np.array(plain.codes).tobytes()
    np.testing.assert_allclose(np.array(decode(qt)),
                               np.array(decode(plain)) * t.astype(np.float32), rtol=1e-5,
                               atol=1e-7)


def test_a_custom_encoder_is_called_with_the_reference_arguments():
    """The pipeline hands a GPU encoder in through `trellis_rows`: same call, same result."""
    calls = []

    def encoder(code, x, group_size, block, valid=None):
        calls.append((code, x.shape, group_size, block, valid))
        return trellis.encode_rows(code, x, group_size, block, valid=valid)

    w = weight(5, 4, 100)
    a = encode(w, 4, 32, seed=9, codec="trellis", trellis_state_bits=9, trellis_rows=encoder)
    b = encode(w, 4, 32, seed=9, codec="trellis", trellis_state_bits=9)
    assert calls == [(trellis.TrellisCode(9, 4, 1), (4, 128), 32, trellis.BLOCK, 100)]
    assert np.array(a.codes).tobytes() == np.array(b.codes).tobytes()


@pytest.mark.parametrize("kwargs, match", [
    (dict(codec="lattice"), "unknown codec 'lattice'"),
    (dict(codec="trellis", refit=False), "refits its scales"),
    (dict(codec="trellis", trellis_block=48), "multiple of 32"),
])
def test_bad_trellis_specs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantSpec(kwargs.pop("bits", 3), 64, 0, 128, 128, kwargs.pop("refit", True), **kwargs)


def test_ternary_has_no_trellis():
    with pytest.raises(ValueError, match="2, 3 or 4 bits"):
        encode(weight(0, 2, 64), "ternary", 64, codec="trellis")


def test_non_finite_weights_name_the_position():
    w = weight(0, 3, 64)
    w[1, 7] = np.inf
    with pytest.raises(ValueError, match=r"first at \[1, 7\]"):
        encode(w, 3, 64, codec="trellis", trellis_state_bits=8)


def test_default_spec_is_scalar_and_unchanged():
    w = weight(6, 4, 128)
    qt = encode(w, 3, 64)
    assert qt.spec.codec == "scalar" and qt.spec == QuantSpec(3, 64, 0, 128, 128, True)

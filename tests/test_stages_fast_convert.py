"""bfloat16 bits to float32 with the finiteness check in one pass (stages/fast_convert.py):
the same bits as the numpy widening, and the same answer as np.isfinite, for every bit
pattern (NaN and infinity included), with numba and without."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from turboquant.pipeline.safetensors_io import to_float32
from turboquant.stages import fast_convert


def _reference(bits: np.ndarray) -> tuple[np.ndarray, bool]:
    x = to_float32(np.ascontiguousarray(bits).view(np.uint8), "BF16").reshape(bits.shape)
    return x, bool(np.isfinite(x).all())


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(fast_convert, "AVAILABLE", False)
    elif not fast_convert.AVAILABLE:
        pytest.skip("numba is not installed")
    return request.param


@settings(max_examples=200, deadline=None)
@given(bits=arrays(np.uint16, st.tuples(st.integers(1, 9), st.integers(1, 70))))
def test_same_bits_and_finiteness_as_numpy(bits):
    for available in (fast_convert.AVAILABLE, False):
        saved, fast_convert.AVAILABLE = fast_convert.AVAILABLE, available
        try:
            x, finite = fast_convert.bf16_to_float32(bits)
        finally:
            fast_convert.AVAILABLE = saved
        want, want_finite = _reference(bits)
        assert x.shape == bits.shape and x.dtype == np.float32
        assert np.array_equal(x.view(np.uint32), want.view(np.uint32))
        assert finite == want_finite


@pytest.mark.parametrize("special", [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81])
def test_one_nan_or_inf_anywhere_is_seen(path, special):
    rng = np.random.default_rng(0)
    normal = (rng.standard_normal(4096).astype(np.float32).view(np.uint32) >> 16)
    for where in (0, 1, 17, 4095):
        bits = normal.astype(np.uint16)
        bits[where] = special
        x, finite = fast_convert.bf16_to_float32(bits.reshape(64, 64))
        assert not finite and not np.isfinite(x.reshape(-1)[where])
    assert fast_convert.bf16_to_float32(normal.astype(np.uint16))[1]


def test_largest_finite_values_are_finite(path):
    bits = np.array([0x7F7F, 0xFF7F, 0x0001, 0x8000, 0x0000, 0x3F80], np.uint16)
    x, finite = fast_convert.bf16_to_float32(bits)
    assert finite and np.isfinite(x).all()

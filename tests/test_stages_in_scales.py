"""Per-input-column scales (in_scales): W / t is coded, decode multiplies t back.

The column equalisation that makes each column's error proportional to its own size
(docs/quality.md: on SmolLM2-135M it is what brings TurboQuant below affine)."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.stages import (
    QuantizedTensor,
    codec,
    column_scales,
    column_scales_from_sums,
    decode,
    encode,
    lloyd_max_mse,
)


def trained_like(rows, cols, seed=0):
    """Columns of very different sizes, as in a trained model's v_proj / down_proj."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return w * np.exp(rng.normal(0.0, 1.0, cols)).astype(np.float32)


def test_ones_give_the_plain_bytes():
    w = trained_like(32, 640)
    plain = encode(w, 3, seed=4)
    scaled = encode(w, 3, seed=4, in_scales=np.ones(640, np.float16))
    assert mx.array_equal(plain.codes, scaled.codes)
    assert mx.array_equal(plain.scales, scaled.scales)
    assert plain.in_scales is None and scaled.in_scales.dtype == mx.float16
    assert scaled.nbytes == plain.nbytes + 2 * 640


@settings(max_examples=20, deadline=None)
@given(cols=st.sampled_from([64, 100, 768, 1000, 3072, 5632, 11008]), rows=st.integers(1, 40),
       bits=st.sampled_from([2, 3, 4, "ternary"]), seed=st.integers(0, 2**16),
       numba=st.booleans(), trellis=st.booleans())
def test_in_scales_code_the_rows_divided_by_t(cols, rows, bits, seed, numba, trellis):
    """encode(W, in_scales=t) codes W * (1 / t) bit for bit (the compiled rotation carries
    1 / t in its signs, the host path multiplies), with or without numba."""
    rotate = importlib.import_module("turboquant.stages.rotate")  # the module, not rotate()
    if trellis and bits == "ternary":
        bits = 3
    w = trained_like(rows, cols, seed)
    t = np.exp(np.random.default_rng(seed).normal(0, 0.5, cols)).astype(np.float16)
    divided = w * (np.float32(1.0) / t.astype(np.float32))
    kw = dict(codec="trellis", trellis_state_bits=8) if trellis else {}
    before = rotate._COMPILED
    rotate._COMPILED = before and numba
    try:
        got = encode(w, bits, seed=seed, in_scales=t, **kw)
        want = encode(divided, bits, seed=seed, **kw)
    finally:
        rotate._COMPILED = before
    assert mx.array_equal(got.codes, want.codes) and mx.array_equal(got.scales, want.scales)
    assert np.array_equal(got.row_sq_error, want.row_sq_error)


def test_column_error_follows_the_column_size():
    w = trained_like(256, 512, seed=1)
    t = column_scales(w)
    plain = np.asarray(decode(encode(w, 3, seed=9))) - w
    eq = np.asarray(decode(encode(w, 3, seed=9, in_scales=t))) - w
    col = np.sqrt((w**2).mean(0))
    small = col < np.quantile(col, 0.1)  # the smallest tenth of the columns
    # plain rotation: every column gets about the same error, so the small columns get
    # a large one relative to their size; equalised: about the same relative error
    rel_plain = np.sqrt((plain[:, small] ** 2).mean(0)) / col[small]
    rel_eq = np.sqrt((eq[:, small] ** 2).mean(0)) / col[small]
    assert np.median(rel_eq) < 0.25 * np.median(rel_plain)
    assert np.median(rel_eq) < 2.0 * np.sqrt(lloyd_max_mse(3))


def test_error_by_product_is_the_equalised_basis_error():
    w = trained_like(48, 1000, seed=2)
    t = column_scales(w)
    qt = encode(w, 4, group_size=32, seed=3, in_scales=t)
    t32 = t.astype(np.float32)
    err = ((np.asarray(decode(qt)) - w) / t32) ** 2
    np.testing.assert_allclose(qt.row_sq_error, err.sum(1), rtol=2e-3, atol=1e-7)
    np.testing.assert_allclose(qt.row_sq_norm, ((w / t32) ** 2).sum(1), rtol=1e-5)
    assert qt.rel_mse <= 1.05 * lloyd_max_mse(4)


def test_chunking_does_not_change_bytes(monkeypatch):
    w = trained_like(64, 1000, seed=5)
    t = column_scales(w)
    whole = encode(w, 3, seed=5, in_scales=t)
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 3000)  # 3 rows per chunk
    chunked = encode(w, 3, seed=5, in_scales=t)
    assert mx.array_equal(whole.codes, chunked.codes)
    assert mx.array_equal(whole.scales, chunked.scales)
    assert mx.array_equal(decode(whole), decode(chunked))


def test_sums_accumulate_over_chunks_of_rows():
    w = trained_like(30, 200, seed=6)
    sums = (w[:10] ** 2).sum(0).astype(np.float64) + (w[10:] ** 2).sum(0)
    np.testing.assert_allclose(column_scales_from_sums(sums, 30).astype(np.float32),
                               column_scales(w).astype(np.float32), rtol=1e-3)


def test_column_scales_shape_range_and_edge_cases():
    t = column_scales(trained_like(16, 300, seed=7))
    assert t.dtype == np.float16 and t.shape == (300,)
    assert np.sqrt(np.mean(t.astype(np.float64) ** 2)) == pytest.approx(1.0, rel=2e-3)
    w = np.zeros((4, 64), np.float32)
    np.testing.assert_array_equal(column_scales(w), np.ones(64, np.float16))
    w[:, 0] = 1.0  # one live column, the rest zero: the floor keeps every scale positive
    assert (column_scales(w) > 0).all()
    w = trained_like(8, 64)
    w[:, 5] = 0.0
    assert column_scales(w)[5] > 0  # a dead column is floored, not zero
    with pytest.raises(ValueError, match="column power"):
        column_scales(w, power=0.0)
    with pytest.raises(ValueError, match="2-D"):
        column_scales(np.ones(5))


def test_min_ratio_leaves_even_columns_alone():
    rng = np.random.default_rng(8)
    even = rng.standard_normal((64, 256)).astype(np.float32)  # smallest column ~0.8 x median
    assert column_scales(even, min_ratio=0.5) is None
    assert column_scales(even) is not None  # without the test: always scales
    uneven = even.copy()
    uneven[:, 3] *= 0.1
    t = column_scales(uneven, min_ratio=0.5)
    assert t is not None and t[3] < 0.2 * np.median(t)
    assert column_scales(np.zeros((2, 8), np.float32), min_ratio=0.5) is None


def test_bad_in_scales_are_refused():
    w = trained_like(4, 64)
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        encode(w, 3, in_scales=np.ones(63, np.float16))
    with pytest.raises(ValueError, match="positive"):
        encode(w, 3, in_scales=np.zeros(64, np.float16))
    with pytest.raises(ValueError, match="positive"):
        encode(w, 3, in_scales=np.full(64, 1e6))  # beyond float16
    qt = encode(w, 3)
    with pytest.raises(ValueError, match="in_scales must be float16"):
        QuantizedTensor(qt.codes, qt.scales, qt.shape, qt.spec,
                        in_scales=mx.ones((64,), dtype=mx.float32))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 300),
    bits=st.sampled_from([2, 3, 4, "ternary"]),
    group_size=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**64 - 1),
    spread=st.floats(0.0, 3.0),
)
def test_any_shape_round_trips_near_the_codebook(rows, cols, bits, group_size, seed, spread):
    rng = np.random.default_rng(seed % 2**32)
    w = (rng.standard_normal((rows, cols)) * np.exp(rng.normal(0, spread, cols))).astype(
        np.float32)
    t = column_scales(w)
    qt = encode(w, bits, group_size=group_size, seed=seed, in_scales=t)
    back = np.asarray(decode(qt))
    assert back.shape == w.shape and np.isfinite(back).all()
    # the decoded weight is the equalised decode times t, column by column
    assert mx.array_equal(qt.in_scales, mx.array(t))
    eq = QuantizedTensor(qt.codes, qt.scales, qt.shape, qt.spec)
    np.testing.assert_allclose(back, np.asarray(decode(eq)) * t.astype(np.float32),
                               rtol=1e-6, atol=1e-30)
    # and it codes better than nothing, in the basis the codebook saw
    wt = w / t.astype(np.float32)
    assert ((back / t.astype(np.float32) - wt) ** 2).sum() <= (wt**2).sum() * (1 + 1e-5)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 700), cols=st.integers(1, 96), cuts=st.lists(
    st.integers(1, 699), max_size=4), seed=st.integers(0, 2**16), bf16=st.booleans())
def test_column_sums_do_not_depend_on_chunks_or_numba(rows, cols, cuts, seed, bf16):
    """The converter's pre-pass (stages.scale.ColumnSums): the same float64 sums however
    the rows arrive, with or without numba, so reruns and resumes write the same t."""
    from turboquant.stages import fast_hadamard
    from turboquant.stages.scale import ColumnSums

    x = (np.random.default_rng(seed).standard_normal((rows, cols)) * 3).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32)

    def sums(pieces):
        c = ColumnSums(cols)
        for a in np.split(bits if bf16 else x, sorted({k for k in cuts if k < rows})):
            c.add_bf16(a) if bf16 else c.add(a)
        return c.total()

    whole = sums(None)
    np.testing.assert_allclose(whole, np.square((values if bf16 else x).astype(np.float64))
                               .sum(axis=0), rtol=1e-5)
    assert np.array_equal(sums(cuts), whole)
    fast_hadamard.AVAILABLE, before = False, fast_hadamard.AVAILABLE
    try:
        assert np.array_equal(sums(cuts), whole)
    finally:
        fast_hadamard.AVAILABLE = before


def test_neuron_column_scales_protect_a_massive_neuron():
    from turboquant.stages.scale import neuron_column_scales, neuron_sizes_from_sums

    rng = np.random.default_rng(5)
    cols, rows = 96, 48
    gate = rng.standard_normal((cols, 64))
    up = rng.standard_normal((cols, 64))
    assert neuron_column_scales(np.ones(cols) * rows, rows,
                                neuron_sizes_from_sums((gate ** 2).sum(1), (up ** 2).sum(1),
                                                       64)) is None  # no massive neuron
    gate[17] *= 5.0
    up[17] *= 4.0  # neuron 17: ~20x the median
    sizes = neuron_sizes_from_sums((gate ** 2).sum(1), (up ** 2).sum(1), 64)
    assert sizes.argmax() == 17 and sizes[17] > 8
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    t = neuron_column_scales((w.astype(np.float64) ** 2).sum(0), rows, sizes)
    assert t.dtype == np.float16 and t.shape == (cols,) and (t > 0).all()
    assert t.argmin() == 17 and t[17] < 0.5 * np.median(t)
    assert abs(float(np.mean(t.astype(np.float64) ** 2)) - 1) < 1e-2


@given(st.integers(2, 40), st.floats(9.0, 1e3), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_neuron_column_scales_property(cols, big, seed):
    from turboquant.stages.scale import neuron_column_scales

    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.normal(0, 0.3, cols))
    sizes /= np.median(sizes)
    k = int(rng.integers(cols))
    sizes[k] = big
    sums = np.exp(rng.normal(0, 1, cols)) * 10
    t = neuron_column_scales(sums, 10, sizes).astype(np.float64)
    assert np.isfinite(t).all() and (t > 0).all()
    # the same column size: the bigger neuron gets the smaller scale
    t2 = neuron_column_scales(np.full(cols, 10.0), 10, sizes).astype(np.float64)
    order = np.argsort(sizes)
    assert (np.diff(t2[order]) <= 1e-3 * t2.max()).all()
    assert neuron_column_scales(sums, 10, np.minimum(sizes, 8.0)) is None


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), seed=st.integers(0, 2**16),
       bf16=st.booleans())
def test_row_square_sums_from_bits_with_or_without_numba(rows, cols, seed, bf16):
    """The neuron rule's row sums (stages.scale.row_square_sums) read bfloat16 from its
    bits: the float32 squares summed in float64 lanes in a fixed order, the same with numba
    or without."""
    from turboquant.stages import fast_hadamard
    from turboquant.stages.scale import ROW_LANES, row_square_sums

    x = (np.random.default_rng(seed).standard_normal((rows, cols)) * 5).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32) if bf16 else x
    got = row_square_sums(bits if bf16 else x, bf16=bf16)
    assert got.dtype == np.float64 and got.shape == (rows,)
    lanes = np.zeros((rows, ROW_LANES))  # element j into running sum j % ROW_LANES
    for j in range(cols):
        lanes[:, j % ROW_LANES] += (values[:, j] * values[:, j]).astype(np.float64)
    want = np.zeros(rows)
    for k in range(ROW_LANES):
        want += lanes[:, k]
    assert np.array_equal(got, want)
    np.testing.assert_allclose(got, np.square(values.astype(np.float64)).sum(axis=1),
                               rtol=1e-5)
    fast_hadamard.AVAILABLE, before = False, fast_hadamard.AVAILABLE
    try:
        assert np.array_equal(row_square_sums(bits if bf16 else x, bf16=bf16), want)
    finally:
        fast_hadamard.AVAILABLE = before


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 600), cols=st.integers(1, 200), cuts=st.lists(
    st.integers(1, 599), max_size=3), seed=st.integers(0, 2**16), bf16=st.booleans(),
    numba=st.booleans())
def test_one_pass_row_and_column_sums_equal_the_two_passes(rows, cols, cuts, seed, bf16,
                                                           numba):
    """ColumnSums.add_with_row_sums (a gate/up tensor read once for its own column scales
    and down_proj's neuron sizes) gives bit for bit the column sums of add / add_bf16 and
    the row sums of row_square_sums, however the rows are chunked, numba or not."""
    from turboquant.stages import fast_hadamard
    from turboquant.stages.scale import ColumnSums, row_square_sums

    x = (np.random.default_rng(seed).standard_normal((rows, cols)) * 4).astype(np.float32)
    data = (x.view(np.uint32) >> 16).astype(np.uint16) if bf16 else x
    parts = np.split(data, sorted({k for k in cuts if k < rows}))
    apart = ColumnSums(cols)
    for a in parts:
        apart.add_bf16(a) if bf16 else apart.add(a)
    want_rows = row_square_sums(data, bf16=bf16)
    before = fast_hadamard.AVAILABLE
    fast_hadamard.AVAILABLE = before and numba
    try:
        together = ColumnSums(cols)
        got_rows = np.concatenate([together.add_with_row_sums(a, bf16=bf16) for a in parts])
    finally:
        fast_hadamard.AVAILABLE = before
    assert np.array_equal(together.total(), apart.total())
    assert together.rows == apart.rows == rows
    assert np.array_equal(got_rows, want_rows)



def test_in_scales_checked_once_give_the_same_bytes():
    """codec.InScales (checked once for a tensor's chunks, as the converter does) codes as
    the raw vector does, and a vector of another width is refused."""
    w = trained_like(20, 640)
    t = np.exp(np.random.default_rng(2).normal(0, 0.5, 640)).astype(np.float16)
    raw = encode(w, 3, seed=4, in_scales=t)
    checked = encode(w, 3, seed=4, in_scales=codec.InScales.of(t, 640))
    assert mx.array_equal(raw.codes, checked.codes) and mx.array_equal(raw.scales, checked.scales)
    assert mx.array_equal(raw.in_scales, checked.in_scales)
    with pytest.raises(ValueError, match="shape"):
        encode(w[:, :320], 3, seed=4, in_scales=codec.InScales.of(t, 640))

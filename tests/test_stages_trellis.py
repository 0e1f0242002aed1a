"""The trellis code (stages/trellis.py): round trips, optimality by brute force, packing."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.stages import fast_trellis, trellis
from turboquant.stages.trellis import TrellisCode

TINY = [TrellisCode(4, 1, 1), TrellisCode(5, 2, 1), TrellisCode(5, 1, 2), TrellisCode(6, 2, 2)]
SMALL = [TrellisCode(8, 2, 1), TrellisCode(8, 3, 1), TrellisCode(9, 4, 1), TrellisCode(8, 2, 2)]

codes_tiny = st.sampled_from(TINY)
codes_small = st.sampled_from(SMALL)
seeds = st.integers(0, 2**32 - 1)


def gaussian(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def stream_states(code, fields):
    return trellis.states_from_bits(code, fields)


def cost_of(code, y, states, table):
    yv = y.reshape(y.shape[0], -1, code.values)
    return ((yv - table[states]) ** 2).sum(axis=(1, 2), dtype=np.float64)


def all_streams(code, steps):
    """Every tail-biting stream of `steps` steps, as fields (2^(steps kV), steps)."""
    fan = 1 << code.step_bits
    return np.array(list(itertools.product(range(fan), repeat=steps)), dtype=np.int64)


def test_state_values_are_near_unit_gaussian():
    code = TrellisCode(16, 2, 2)
    v = trellis.codebook(code)
    assert v.shape == (1 << 16, 2) and v.dtype == np.float32
    for j in range(2):
        col = v[:, j].astype(np.float64)
        assert abs(col.mean()) < 0.02 and abs(col.std() - 1.0) < 0.02
        assert np.abs(col).max() <= 510 / trellis.BYTESUM_STD + 1e-6
        # Irwin-Hall(4) is close to a Gaussian: the mass within 1 and 2 sigma
        assert abs(np.mean(np.abs(col) < 1.0) - math.erf(1 / math.sqrt(2))) < 0.02
        assert abs(np.mean(np.abs(col) < 2.0) - math.erf(2 / math.sqrt(2))) < 0.01
    # the two values of a state are uncorrelated, and so are a state and its successors'
    assert abs(np.corrcoef(v[:, 0], v[:, 1])[0, 1]) < 0.02
    succ = (np.arange(1 << 16) >> 2) | (1 << 14)
    assert abs(np.corrcoef(v[:, 0], v[succ, 0])[0, 1]) < 0.05


@given(codes_tiny, seeds, st.integers(2, 5))
@settings(max_examples=25, deadline=None)
def test_exact_tail_biting_encoder_is_optimal(code, seed, steps):
    """The exact encoder's cost is the minimum over every tail-biting stream (brute force)."""
    if steps * code.step_bits < code.state_bits or steps * code.step_bits > 12:
        steps = max(-(-code.state_bits // code.step_bits), 2)
    y = gaussian(seed, 3, steps * code.values)
    table = trellis.codebook(code)
    path = trellis.encode_block(code, y, table, exact=True)
    streams = all_streams(code, steps)
    for r in range(y.shape[0]):
        brute = cost_of(code, np.broadcast_to(y[r], (len(streams), y.shape[1])),
                        stream_states(code, streams), table).min()
        got = cost_of(code, y[r : r + 1], path[r : r + 1], table)[0]
        assert got == pytest.approx(brute, rel=1e-5, abs=1e-6)


@given(codes_tiny, seeds, st.integers(2, 6))
@settings(max_examples=25, deadline=None)
def test_free_viterbi_is_optimal(code, seed, steps):
    """Without a closing, Viterbi finds the best of all state sequences a trellis allows."""
    if code.state_bits + (steps - 1) * code.step_bits > 14:
        steps = 2
    y = gaussian(seed, 2, steps, code.values)
    table = trellis.codebook(code)
    path, cost = trellis.viterbi(code, y, table)
    kv, keep = code.step_bits, code.keep_bits
    # every path: a start state, then kV new bits a step
    starts = np.arange(1 << code.state_bits)
    paths = starts[:, None]
    for _ in range(steps - 1):
        s = paths[:, -1]
        nxt = (s[:, None] >> kv) | (np.arange(1 << kv)[None, :] << keep)
        paths = np.concatenate([np.repeat(paths, 1 << kv, axis=0), nxt.reshape(-1, 1)], 1)
    for r in range(2):
        brute = ((y[r][None] - table[paths]) ** 2).sum(axis=(1, 2)).min()
        assert cost[r] == pytest.approx(brute, rel=1e-5, abs=1e-6)
        assert cost_of(code, y[r : r + 1], path[r : r + 1], table)[0] == pytest.approx(
            cost[r], rel=1e-5, abs=1e-6)
        # the path is a path of the trellis
        assert np.all((path[r, 1:] & ((1 << keep) - 1)) == path[r, :-1] >> kv)


@given(codes_small, seeds, st.booleans())
@settings(max_examples=20, deadline=None)
def test_decode_of_encode_is_the_path_reconstruction(code, seed, exact):
    """The packed bits decode to exactly the values of the states the encoder chose, and the
    approximate tail-biting path costs no less than the exact one."""
    if exact and code.keep_bits > 6:
        exact = False
    block = 64
    y = gaussian(seed, 3, block)
    table = trellis.codebook(code)
    path = trellis.encode_block(code, y, table, exact=exact)
    fields = trellis.path_bits(code, path)
    assert np.array_equal(trellis.states_from_bits(code, fields), path)  # tail-biting
    words = trellis.pack_bits(code, fields)
    assert words.shape == (3, block * code.bits // 32) and words.dtype == np.uint32
    got = trellis.decode_words(code, words, block)
    assert np.array_equal(got, table[path].reshape(3, block))
    if not exact:
        best = trellis.encode_block(code, y, table, exact=True) if code.keep_bits <= 6 else path
        assert np.all(cost_of(code, y, path, table) >= cost_of(code, y, best, table) - 1e-5)


@given(st.sampled_from(TINY + SMALL), seeds, st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_packing_round_trips(code, seed, words):
    steps = words * 32 // math.gcd(32, code.step_bits)  # whole words of k*V-bit fields
    rng = np.random.default_rng(seed)
    fields = rng.integers(0, 1 << code.step_bits, size=(2, steps))
    packed = trellis.pack_bits(code, fields)
    assert packed.shape == (2, steps * code.step_bits // 32)
    assert np.array_equal(trellis.unpack_bits(code, packed), fields)


def test_packing_bit_order_is_little_endian_stream():
    code = TrellisCode(8, 3, 1)
    fields = np.zeros((1, 32), dtype=np.int64)
    fields[0, 10] = 0b101  # bits 30 and 32 of the stream: word 0 bit 30, word 1 bit 0
    assert trellis.pack_bits(code, fields).tolist() == [[1 << 30, 1, 0]]


@given(codes_small, seeds, st.sampled_from([32, 64]))
@settings(max_examples=12, deadline=None)
def test_encode_rows_round_trip_and_determinism(code, seed, group_size):
    x = gaussian(seed, 3, 192) * np.float32(0.02)
    first = trellis.encode_rows(code, x, group_size, block=128)
    again = trellis.encode_rows(code, x.copy(), group_size, block=128)
    assert first.words.tobytes() == again.words.tobytes()
    assert first.scales.tobytes() == again.scales.tobytes()
    assert first.words.shape == (3, 192 * code.bits // 32)  # same words as the scalar code
    assert first.scales.shape == (3, 192 // group_size) and first.scales.dtype == np.float16
    x_hat = trellis.decode_rows(code, first.words, first.scales, group_size, block=128)
    err = ((x.astype(np.float64) - x_hat) ** 2).sum(axis=1)
    np.testing.assert_allclose(err, first.sq_error, rtol=1e-4)
    assert first.sq_error.sum() / first.sq_norm.sum() < 0.5 ** code.bits  # it codes at all


def test_trellis_beats_lloyd_max_at_two_bits():
    """On Gaussian rows even L = 10 is below the scalar Lloyd-Max MSE (0.1175)."""
    x = gaussian(7, 4, 512)
    rows = trellis.encode_rows(TrellisCode(10, 2, 1), x, 64)
    assert rows.sq_error.sum() / rows.sq_norm.sum() < 0.085


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(state_bits=4, bits=2, values=2), "state_bits must exceed"),
        (dict(state_bits=12, bits=5, values=1), "bits per weight"),
        (dict(state_bits=12, bits=2, values=3), "values per step"),
        (dict(state_bits=24, bits=2, values=1), "<= 20"),
    ],
)
def test_bad_codes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrellisCode(**kwargs)


def test_bad_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        TrellisCode(8, 2, 1).check_block(48)


@pytest.mark.skipif(not fast_trellis.AVAILABLE, reason="numba not installed")
@given(st.sampled_from(TINY + SMALL + [TrellisCode(12, 3, 1), TrellisCode(11, 2, 2)]), seeds,
       st.booleans(), st.integers(2, 40), st.booleans())
@settings(max_examples=40, deadline=None)
def test_compiled_viterbi_gives_the_numpy_paths(code, seed, closed, steps, ties):
    """Both orders of the compiled step (runs where 2^kV <= 2^(L-kV), gathered otherwise),
    rows in parallel: the numpy path's states and costs, ties (quantized inputs) included."""
    y = gaussian(seed, 3, steps, code.values)
    if ties:  # few distinct values: many equal costs, broken as np.argmin breaks them
        y = np.round(y)
    table = trellis.codebook(code)
    closing = (np.arange(3) * 7) % (1 << code.keep_bits) if closed else None
    fast = fast_trellis.viterbi(code, y, table, closing)
    slow = trellis._viterbi_np(code, y, table, closing)
    assert np.array_equal(fast[0], slow[0])
    assert fast[1].tobytes() == slow[1].tobytes()


def test_state_values_follow_the_documented_formula():
    """docs/FORMAT.md's integer steps, by hand for state 1, and the whole L = 16 codebook
    pinned: changing the constants or the steps changes every decoded weight."""
    h = (1 * 0xA4B9361B + 0x5ADBDCC7) % 2**32
    h ^= h >> 16
    assert h == 0xFF95ED77 and sum(h.to_bytes(4, "little")) == 760
    value = trellis.state_values(TrellisCode(16, 2, 1), [1])[0, 0]
    assert trellis.BYTESUM_STD == pytest.approx(147.8005, abs=1e-4)
    assert value == (np.float32(760) - np.float32(510)) / np.float32(trellis.BYTESUM_STD)
    table = trellis.codebook(TrellisCode(16, 2, 2))
    digest = hashlib.sha256(table.tobytes()).hexdigest()
    assert digest == "c4e6e0a7d156533eab1e142e5ccfb62df18de9de87506574d408280141389847"


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "numba"])
def test_the_scalar_state_value_compiled_code_uses_is_the_codebook(compiled):
    """fast_trellis.state_value, the one hash compiled code calls (kernels/cpu_gemv.py),
    gives trellis.codebook's float32 bits for every state of L = 12 and both values."""
    fn = fast_trellis.state_value
    if compiled:
        if not fast_trellis.AVAILABLE:
            pytest.skip("numba is not installed")
        import numba

        fn = numba.njit(fn)
    code = TrellisCode(12, 2, 2)
    table = trellis.codebook(code)
    got = np.array([[fn(s, trellis.MUL[j], trellis.ADD[j], trellis.BYTESUM_MEAN,
                        trellis.BYTESUM_STD) for j in range(2)] for s in range(1 << 12)],
                   dtype=np.float32)
    assert got.tobytes() == table.tobytes()


def test_zero_groups_decode_to_zero_and_non_finite_rows_are_refused():
    code = TrellisCode(8, 2, 1)
    x = gaussian(5, 2, 128)
    x[1, 64:] = 0.0
    rows = trellis.encode_rows(code, x, 64, block=128)
    assert rows.scales[1, 1] == 0
    assert not trellis.decode_rows(code, rows.words, rows.scales, 64, block=128)[1, 64:].any()
    x[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        trellis.encode_rows(code, x, 64, block=128)


@given(codes_small, seeds, st.integers(1, 63))
@settings(max_examples=10, deadline=None)
def test_padding_decodes_to_zero_and_costs_no_error(code, seed, pad):
    """Columns from `valid` on are padding: left out of the error, decoded as 0."""
    n, valid = 128, 128 - pad
    x = gaussian(seed, 2, n)
    x[:, valid:] = 0.0
    rows = trellis.encode_rows(code, x, 64, block=128, valid=valid)
    x_hat = trellis.decode_rows(code, rows.words, rows.scales, 64, block=128, valid=valid)
    assert not x_hat[:, valid:].any()
    err = ((x.astype(np.float64) - x_hat) ** 2).sum(axis=1)
    np.testing.assert_allclose(err, rows.sq_error, rtol=1e-4)


@given(codes_small, seeds)
@settings(max_examples=15, deadline=None)
def test_states_are_the_documented_bit_windows_of_the_packed_words(code, seed):
    """docs/FORMAT.md: S_t is the L-bit window of the block's stream (read as a circle, bit
    p = bit p % 32 of word p // 32) that ends with step t's bits, least significant first."""
    block = 64
    y = gaussian(seed, 1, block)
    path = trellis.encode_block(code, y)
    words = trellis.pack_bits(code, trellis.path_bits(code, path))[0]
    nbits = block * code.bits
    stream = sum(int(w) << (32 * i) for i, w in enumerate(words))
    circle = stream | (stream << nbits)  # the window may wrap: read it from a doubled stream
    for t in range(block // code.values):
        end = (t + 1) * code.step_bits + nbits
        window = (circle >> (end - code.state_bits)) & ((1 << code.state_bits) - 1)
        assert window == path[0, t]


@given(st.sampled_from(TINY[1:] + SMALL + [TrellisCode(16, 3, 1), TrellisCode(16, 2, 2)]),
       seeds, st.sampled_from([(96, 32), (256, 128), (320, 256)]))
@settings(max_examples=20, deadline=None)
def test_mlx_window_decode_equals_the_reference(code, seed, sizes):
    """decode_words_mx (what a fused kernel does per weight) gives decode_words' values for
    random words: every bit pattern is a valid stream, blocks of any legal length."""
    n, block = sizes
    if block * code.bits < code.state_bits or block % code.values:
        block = 128
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(3, n * code.bits // 32), dtype=np.uint32)
    want = trellis.decode_words(code, words, block)
    got = np.array(trellis.decode_words_mx(code, words, block))
    assert got.dtype == np.float32 and np.array_equal(got, want)


DIGEST_V2 = "2e1fd915c32efd2df0ffa55f3a954bb72f4db7479730dae203592417abdc85b2"  # L=16, V=2


def test_version_2_values_follow_the_documented_formula():
    """Trellis version 2 (docs/FORMAT.md): version 1's steps without the shift-xor."""
    h = (1 * 0xA4B9361B + 0x5ADBDCC7) % 2**32
    value = trellis.state_values(TrellisCode(16, 2, 1, version=2), [1])[0, 0]
    want = np.float32(sum(h.to_bytes(4, "little")))
    assert value == (want - np.float32(510)) / np.float32(trellis.BYTESUM_STD)
    table = trellis.codebook(TrellisCode(16, 2, 2, version=2))
    assert not np.array_equal(table, trellis.codebook(TrellisCode(16, 2, 2)))
    assert abs(table.mean()) < 0.01 and abs(table.std() - 1) < 0.01
    digest = hashlib.sha256(table.tobytes()).hexdigest()
    assert digest == DIGEST_V2
    with pytest.raises(ValueError, match="trellis version must be one of"):
        TrellisCode(16, 2, 1, version=3)


@given(st.sampled_from([TrellisCode(8, 2, 1, 2), TrellisCode(9, 3, 1, 2),
                        TrellisCode(8, 2, 2, 2), TrellisCode(12, 4, 1, 2)]),
       seeds, st.sampled_from([32, 64]))
@settings(max_examples=12, deadline=None)
def test_version_2_round_trips_and_decodes_in_mlx(code, seed, group_size):
    """Encode with version 2's codebook, decode through the reference and decode_words_mx:
    the encoder's own reconstruction, bit for bit."""
    x = gaussian(seed, 3, 256)
    rows = trellis.encode_rows(code, x, group_size, block=128)
    x_hat = trellis.decode_rows(code, rows.words, rows.scales, group_size, block=128)
    err = ((x.astype(np.float64) - x_hat) ** 2).sum(axis=1)
    np.testing.assert_allclose(err, rows.sq_error, rtol=1e-4)
    assert np.array_equal(np.array(trellis.decode_words_mx(code, rows.words, 128)),
                          trellis.decode_words(code, rows.words, 128))
    assert (err / (x.astype(np.float64) ** 2).sum(axis=1)).max() < 0.4 / 2 ** (code.bits - 1)

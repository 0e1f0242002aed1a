"""Packing against a plain reference packer written from docs/FORMAT.md, step 5."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.stages import pack_codes, unpack_codes, words_per_row

LEVELS = {2: 4, 3: 8, 4: 16, "ternary": 3}


def reference_pack(codes: np.ndarray, width) -> np.ndarray:
    """One Python integer per block, then split into little-endian uint32 words."""
    rows = []
    for row in codes.tolist():
        if width == "ternary":
            row = row + [1] * (-len(row) % 20)  # padded with trit 1 (zero)
            words = [
                sum(t * 3**d for d, t in enumerate(row[i : i + 20])) for i in range(0, len(row), 20)
            ]
        else:
            per_block, n_words = {2: (16, 1), 4: (8, 1), 3: (32, 3)}[width]
            row = row + [0] * (-len(row) % per_block)
            words = []
            for i in range(0, len(row), per_block):
                big = sum(c << (width * j) for j, c in enumerate(row[i : i + per_block]))
                words += [(big >> (32 * k)) & 0xFFFFFFFF for k in range(n_words)]
        rows.append(words)
    return np.array(rows, dtype=np.uint32)


@pytest.mark.parametrize("width", list(LEVELS))
@pytest.mark.parametrize("n", [1, 7, 8, 16, 19, 20, 21, 31, 32, 33, 64, 95, 96, 100, 257])
def test_matches_reference(width, n):
    rng = np.random.default_rng(n)
    codes = rng.integers(0, LEVELS[width], size=(3, n)).astype(np.uint8)
    packed = pack_codes(mx.array(codes), width)
    assert packed.dtype == mx.uint32 and packed.shape == (3, words_per_row(n, width))
    np.testing.assert_array_equal(np.array(packed), reference_pack(codes, width))
    back = unpack_codes(packed, width, n)
    assert back.dtype == mx.uint8
    np.testing.assert_array_equal(np.array(back), codes)


def test_bit_positions_by_hand():
    # 3 bits: code 10 straddles words 0/1 (bits 30..32), code 21 words 1/2 (bits 63..65)
    codes = np.zeros((1, 32), np.uint8)
    codes[0, 10] = 0b111
    np.testing.assert_array_equal(np.array(pack_codes(mx.array(codes), 3)), [[0xC0000000, 1, 0]])
    codes[0, 10], codes[0, 21], codes[0, 31] = 0, 0b111, 0b101
    np.testing.assert_array_equal(
        np.array(pack_codes(mx.array(codes), 3)), [[0, 0x80000000, 0b11 | 0b101 << 29]]
    )
    # 2 and 4 bits: code i at bits width * i of its word
    np.testing.assert_array_equal(
        np.array(pack_codes(mx.array([[1, 2, 3] + [0] * 12 + [3]], dtype=mx.uint8), 2)),
        [[1 | 2 << 2 | 3 << 4 | 3 << 30]],
    )
    np.testing.assert_array_equal(
        np.array(pack_codes(mx.array([[15, 0, 0, 0, 0, 0, 0, 9, 5]], dtype=mx.uint8), 4)),
        [[15 | 9 << 28, 5]],
    )
    # ternary: base 3, least significant first, padded with trit 1
    np.testing.assert_array_equal(
        np.array(pack_codes(mx.array([[2, 0, 1]], dtype=mx.uint8), "ternary")),
        [[2 + sum(3**d for d in range(2, 20))]],
    )
    assert int(np.array(pack_codes(mx.full((1, 20), 2, dtype=mx.uint8), "ternary"))[0, 0]) == (
        3**20 - 1
    )


@given(
    width=st.sampled_from(list(LEVELS)),
    lead=st.lists(st.integers(1, 3), max_size=2),
    n=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_round_trip_property(width, lead, n, seed):
    codes = np.random.default_rng(seed).integers(0, LEVELS[width], size=(*lead, n))
    packed = pack_codes(mx.array(codes.astype(np.uint8)), width)
    assert packed.shape == (*lead, words_per_row(n, width))
    np.testing.assert_array_equal(np.array(unpack_codes(packed, width, n)), codes)


def test_words_per_row():
    assert [words_per_row(64, w) for w in (2, 3, 4, "ternary")] == [4, 6, 8, 4]
    assert [words_per_row(4096, w) for w in (2, 3, 4, "ternary")] == [256, 384, 512, 205]
    assert words_per_row(33, 3) == 6


def test_errors():
    with pytest.raises(ValueError, match="width"):
        pack_codes(mx.zeros((1, 4), dtype=mx.uint8), 5)
    with pytest.raises(ValueError, match="width"):
        unpack_codes(mx.zeros((1, 4), dtype=mx.uint32), 1, 4)
    with pytest.raises(ValueError, match="words per row"):
        unpack_codes(mx.zeros((1, 4), dtype=mx.uint32), 2, 65)


@pytest.mark.parametrize("width", list(LEVELS))
@pytest.mark.parametrize("n", [1, 7, 19, 20, 31, 32, 33, 96, 100, 257, 4096])
def test_numpy_packer_matches(width, n):
    from turboquant.stages.pack import pack_codes_np

    codes = np.random.default_rng(n).integers(0, LEVELS[width], size=(3, n)).astype(np.uint8)
    packed = pack_codes_np(codes, width)
    assert packed.dtype == np.uint32 and packed.shape == (3, words_per_row(n, width))
    np.testing.assert_array_equal(packed, reference_pack(codes, width))


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_group_major_packer_matches_rows(width, group_size):
    from turboquant.stages.pack import pack_codes_np, pack_groups_np

    rows, groups = 3, 5
    rng = np.random.default_rng(group_size)
    codes = rng.integers(0, LEVELS[width], size=(rows, groups * group_size)).astype(np.uint8)
    codes_t = np.ascontiguousarray(codes.reshape(rows * groups, group_size).T)
    words = pack_groups_np(codes_t, width).reshape(rows, -1)
    np.testing.assert_array_equal(words, pack_codes_np(codes, width))

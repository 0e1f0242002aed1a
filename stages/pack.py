"""Pack codes into uint32 words, row by row, exactly as docs/FORMAT.md (step 5) says.

- width 2 / 4: 16 / 8 codes a word, code i at bit width * (i % per_word) of word i // per_word;
- width 3: blocks of 32 codes in 3 words; code j at bit 3j of w0 | w1 << 32 | w2 << 64;
- "ternary": 20 trits a word, base 3, least significant first; rows padded with trit 1.

Rows of any length: pack pads (with code 0, or trit 1), unpack crops to n.
`pack_codes_np` is the same packer on numpy arrays (encode's path on the host): byte
arithmetic, so its words are those of `pack_codes` exactly.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

PACK_WIDTHS = (2, 3, 4, "ternary")
_TRITS_PER_WORD = 20
_POW3 = mx.array([3**i for i in range(_TRITS_PER_WORD)], dtype=mx.uint32)


def _check_width(width) -> None:
    if isinstance(width, bool) or width not in PACK_WIDTHS:
        raise ValueError(f"unsupported code width {width!r}: use one of {PACK_WIDTHS}")


def codes_per_block(width) -> tuple[int, int]:
    """(codes, words) of one packing block: 16/1, 32/3, 8/1, 20/1."""
    _check_width(width)
    return {2: (16, 1), 3: (32, 3), 4: (8, 1), "ternary": (20, 1)}[width]


def words_per_row(n: int, width) -> int:
    """uint32 words that one packed row of n codes takes."""
    codes, words = codes_per_block(width)
    return math.ceil(n / codes) * words


def _blocks(codes: mx.array, width) -> tuple[mx.array, tuple[int, ...]]:
    """codes (..., n) -> uint32 (rows, blocks, codes_per_block), padded."""
    per, _ = codes_per_block(width)
    if codes.ndim < 1:
        raise ValueError("codes must have at least one axis")
    lead, n = codes.shape[:-1], codes.shape[-1]
    rows = math.prod(lead)
    c = codes.astype(mx.uint32).reshape(rows, n)
    pad = -n % per
    if pad:
        fill = 1 if width == "ternary" else 0
        c = mx.concatenate([c, mx.full((rows, pad), fill, dtype=mx.uint32)], axis=1)
    return c.reshape(rows, (n + pad) // per, per), lead


# 3-bit layout of one block: code j starts at bit 3j of the 96 bits, i.e. in word 3j // 32
# at bit 3j % 32. Codes 10 and 21 straddle into the next word; their high bits come first
# there (as code >> (32 - shift)).
_SHIFT3 = [(3 * j) % 32 for j in range(32)]
_WORD3 = [(0, 11), (11, 22), (22, 32)]  # [first, last) code starting in word k
_STRADDLE3 = {1: 10, 2: 21}  # word k -> code straddling in from word k - 1


def _shifts(a: int, b: int) -> mx.array:
    return mx.array(_SHIFT3[a:b], dtype=mx.uint32)


def _pack3_shifts() -> tuple[mx.array, mx.array]:
    """(left, right) shifts (3, 32) that put code j into word k of a block: left by
    3j - 32k where that is 0..31 (uint32 drops what passes bit 31), right by 32k - 3j where
    that is 1 or 2 (the high bits of codes 10 and 21), else right by 3 (nothing: codes
    are below 8)."""
    left, right = np.zeros((3, 32), np.uint32), np.full((3, 32), 3, np.uint32)
    for k in range(3):
        for j in range(32):
            s = 3 * j - 32 * k
            if 0 <= s <= 31:
                left[k, j], right[k, j] = s, 0
            elif -3 < s < 0:
                right[k, j] = -s
    return mx.array(left), mx.array(right)


_LEFT3, _RIGHT3 = _pack3_shifts()


def _pack3(c: mx.array) -> mx.array:
    # the 3 words at once: fields never overlap, so their sum is their bitwise or. A 3-bit
    # pack_codes graph has 13 nodes this way against 34 word by word, which the KV cache's
    # compression (every 64 decode tokens a layer) pays for on the host
    return mx.sum((c[..., None, :] << _LEFT3) >> _RIGHT3, axis=-1)


def _unpack3(w: mx.array) -> mx.array:
    parts = []
    for k, (a, b) in enumerate(_WORD3):
        part = w[..., k : k + 1] >> _shifts(a, b)
        if k + 1 in _STRADDLE3:  # last code of this word takes its high bits from word k + 1
            high = w[..., k + 1] << (32 - _SHIFT3[b - 1])
            part = mx.concatenate([part[..., :-1], (part[..., -1] | high)[..., None]], axis=-1)
        parts.append(part)
    return mx.concatenate(parts, axis=-1) & 7


def pack_codes(codes: mx.array, width) -> mx.array:
    """uint8 codes (..., n) -> uint32 words (..., words_per_row(n, width)).

    Codes must be below 2**width (below 3 for ternary); they are not masked.
    """
    c, lead = _blocks(codes if isinstance(codes, mx.array) else mx.array(codes), width)
    if width in (2, 4):
        shifts = mx.arange(0, 32, width, dtype=mx.uint32)
        words = mx.sum(c << shifts, axis=-1)
    elif width == "ternary":
        words = mx.sum(c * _POW3, axis=-1)
    else:
        words = _pack3(c).reshape(c.shape[0], 3 * c.shape[1])
    return words.astype(mx.uint32).reshape(*lead, words.shape[-1])


def unpack_codes(packed: mx.array, width, n: int) -> mx.array:
    """uint32 words (..., words) -> uint8 codes (..., n); the inverse of pack_codes."""
    packed = packed if isinstance(packed, mx.array) else mx.array(packed)
    per, per_words = codes_per_block(width)
    lead, words = packed.shape[:-1], packed.shape[-1]
    if words != words_per_row(n, width):
        raise ValueError(
            f"{words} words per row cannot hold {n} codes of width {width!r} "
            f"(expected {words_per_row(n, width)})"
        )
    rows = math.prod(lead)
    w = packed.astype(mx.uint32).reshape(rows, words // per_words, per_words)
    if width in (2, 4):
        shifts = mx.arange(0, 32, width, dtype=mx.uint32)
        c = (w >> shifts) & ((1 << width) - 1)
    elif width == "ternary":
        c = (w // _POW3) % 3
    else:
        c = _unpack3(w)
    c = c.reshape(rows, w.shape[1] * per)[:, :n].astype(mx.uint8)
    return c.reshape(*lead, n)


def _gather_bits(x: np.ndarray, width: int) -> np.ndarray:
    """Eight codes, one a byte of a little-endian uint64, -> their 8 * width bits, code j at
    bit width * j (three shift-or-mask steps: pairs, quads, then all eight)."""
    step = 8 - width
    x = (x | (x >> np.uint64(step))) & np.uint64(_lanes(16, 2 * width))
    x = (x | (x >> np.uint64(2 * step))) & np.uint64(_lanes(32, 4 * width))
    return (x | (x >> np.uint64(4 * step))) & np.uint64((1 << 8 * width) - 1)


def _lanes(lane: int, bits: int) -> int:
    """A uint64 mask with the low `bits` bits of every `lane`-bit lane set."""
    return sum(((1 << bits) - 1) << k for k in range(0, 64, lane))


def pack_codes_np(codes: np.ndarray, width) -> np.ndarray:
    """pack_codes on numpy: uint8 codes (rows, n) -> uint32 words (rows, words_per_row(n, width)).

    Exact integer arithmetic, so the words are those of pack_codes. 2, 3, 4 bits: eight codes
    (one uint64) are squeezed into 16, 24 or 32 bits; 3 bits then joins four such 24-bit runs
    into three words. Ternary: 5 trits a byte value (< 243), 4 of them a word in base 243.
    """
    per, _ = codes_per_block(width)
    if codes.ndim != 2:
        raise ValueError(f"codes must be (rows, n), got shape {codes.shape}")
    rows, n = codes.shape
    c = codes.astype(np.uint8, copy=False)
    pad = -n % per
    if pad:
        fill = 1 if width == "ternary" else 0
        c = np.concatenate([c, np.full((rows, pad), fill, np.uint8)], axis=1)
    if width == "ternary":
        c = c.reshape(rows, -1, 4, 5)
        b = c[..., 4].copy()
        for j in range(3, -1, -1):
            b = b * np.uint8(3) + c[..., j]
        b = b.astype(np.uint32)
        b243 = np.uint32(243)
        return ((b[..., 3] * b243 + b[..., 2]) * b243 + b[..., 1]) * b243 + b[..., 0]
    x = _gather_bits(np.ascontiguousarray(c).view("<u8"), width)
    if width == 4:
        return x.astype(np.uint32)
    if width == 2:
        return x.astype("<u2").reshape(rows, -1).view("<u4").astype(np.uint32, copy=False)
    v = x.reshape(rows, -1, 4)  # 3 bits: four 24-bit runs -> three words
    words = np.empty((rows, v.shape[1], 3), dtype=np.uint32)
    words[..., 0] = v[..., 0] | (v[..., 1] << np.uint64(24))
    words[..., 1] = (v[..., 1] >> np.uint64(8)) | (v[..., 2] << np.uint64(16))
    words[..., 2] = (v[..., 2] >> np.uint64(16)) | (v[..., 3] << np.uint64(8))
    return words.reshape(rows, -1)


def pack_groups_np(codes_t: np.ndarray, width) -> np.ndarray:
    """Pack codes laid out group-axis first, (group_size, groups), to words (groups, words).

    The same words as pack_codes_np on the rows (2, 3, 4 bits): a group of 32, 64 or 128
    codes fills whole words (blocks never straddle groups), so a row's words are its groups'
    words in order. Bytes are built from whole rows of `codes_t` (contiguous over groups),
    then transposed once, a quarter to a half of the codes' size.
    """
    if width not in (2, 3, 4):
        raise ValueError(f"pack_groups_np packs 2, 3 or 4 bits, not {width!r}")
    gs, groups = codes_t.shape
    if gs % 32:
        raise ValueError(f"a group of {gs} codes does not fill whole 3-bit blocks")
    c = codes_t.astype(np.uint8, copy=False)
    if width == 3:  # 8 codes -> 24 bits -> 3 bytes
        v = c[0::8].astype(np.uint32)
        for j in range(1, 8):
            v |= c[j::8].astype(np.uint32) << np.uint32(3 * j)
        b = np.empty((gs // 8, 3, groups), dtype=np.uint8)
        for k in range(3):
            b[:, k] = v >> np.uint32(8 * k)
    else:  # 8 // width codes a byte
        k = 8 // width
        b = c[0::k].copy()
        for j in range(1, k):
            b |= c[j::k] << np.uint8(width * j)
    b = np.ascontiguousarray(b.reshape(-1, groups).T)
    return b.view("<u4").astype(np.uint32, copy=False)

"""Pack codes into uint32 words, row by row, exactly as docs/FORMAT.md (step 5) says.

- width 2 / 4: 16 / 8 codes a word, code i at bit width * (i % per_word) of word i // per_word;
- width 3: blocks of 32 codes in 3 words; code j at bit 3j of w0 | w1 << 32 | w2 << 64;
- "ternary": 20 trits a word, base 3, least significant first; rows padded with trit 1.

Rows of any length: pack pads (with code 0, or trit 1), unpack crops to n.
"""

from __future__ import annotations

import math

import mlx.core as mx

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


def _pack3(c: mx.array) -> mx.array:
    words = []
    for k, (a, b) in enumerate(_WORD3):
        word = mx.sum(c[..., a:b] << _shifts(a, b), axis=-1)
        if k in _STRADDLE3:
            j = _STRADDLE3[k]
            word = word + (c[..., j] >> (32 - _SHIFT3[j]))
        words.append(word)
    return mx.stack(words, axis=-1)


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

"""Published low-precision weights -> float32: FP8 (E4M3, E5M2), MXFP4, int4 pack-quantized.

Pure functions on NumPy arrays of raw codes (no files). Each decodes exactly: a code's
value times its scale is one float32 multiplication (or an exact power-of-two ldexp), so a
checkpoint converted from these codes and one converted from their float32 copy are the
same bytes. Bit layouts:

- FP8 E4M3 (float8_e4m3fn): s eeee mmm, bias 7, no infinities, 0x7f / 0xff are NaN.
- FP8 E5M2: s eeeee mm, bias 15, IEEE-like (exponent 31: Inf / NaN).
- FP4 E2M1 (MXFP4 elements): s ee m, bias 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; two a byte, low
  nibble first. E8M0 (MXFP4 scales): 2^(e - 127), 255 is NaN.
- int4 pack-quantized (compressed-tensors): eight 4-bit values per int32, value j at bits
  4j, stored as q + 8 for q in [-8, 7]. Experts stacked (E, out, in / 8), with scales
  (E, out, groups) and zero points (E, ceil(out / 8), groups), decode one expert at a time.
"""

from __future__ import annotations

import numpy as np


def _fp8_table(exp_bits: int, man_bits: int, fn: bool) -> np.ndarray:
    """float32 value of every 8-bit code of a 1-exp_bits-man_bits float."""
    codes = np.arange(256, dtype=np.int64)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    frac = m / (1 << man_bits)
    value = np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e - bias))
    top = (1 << exp_bits) - 1
    if fn:  # no infinities: only all-ones exponent and mantissa is NaN
        value = np.where((e == top) & (m == (1 << man_bits) - 1), np.nan, value)
    else:
        value = np.where(e == top, np.where(m == 0, np.inf, np.nan), value)
    return np.where(codes >> 7, -value, value).astype(np.float32)  # -NaN keeps its sign


FP8_E4M3 = _fp8_table(4, 3, fn=True)
FP8_E5M2 = _fp8_table(5, 2, fn=False)
FP8_TABLES = {"F8_E4M3": FP8_E4M3, "F8_E5M2": FP8_E5M2}
FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                    dtype=np.float32)
MXFP4_BLOCK = 32  # values per E8M0 scale


def fp8_to_float32(codes: np.ndarray, dtype: str = "F8_E4M3") -> np.ndarray:
    """uint8 FP8 codes (any shape) -> float32 values."""
    return FP8_TABLES[dtype][codes]


def dequant_fp8(codes: np.ndarray, scale: np.ndarray, dtype: str = "F8_E4M3",
                block: tuple[int, int] | None = None, row0: int = 0) -> np.ndarray:
    """FP8 codes (rows, cols) times their scale, in float32.

    `block` None: `scale` is per tensor (one value) or per output channel (rows values).
    Else the block grid's scales (`weight_scale_inv`, e.g. 128 x 128) for rows [row0,
    row0 + rows): its block rows from row0 // block[0] on (a slice of the grid is enough);
    the last block of each axis may be ragged.
    """
    x = fp8_to_float32(codes, dtype)
    s = np.asarray(scale, dtype=np.float32)
    if block is not None:
        br, bc = block
        per_col = np.repeat(s, bc, axis=1)[:, : x.shape[1]]  # (block rows, cols): small
        first = row0 // br
        for k in range(first, (row0 + x.shape[0] - 1) // br + 1):  # one block row at a time
            a, b = max(0, k * br - row0), min(x.shape[0], (k + 1) * br - row0)
            x[a:b] *= per_col[k - first]
        return x
    if s.size == 1:
        return x * s.reshape(())
    return x * s.reshape(-1, 1)


def e8m0_exponents(scales: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes -> the power of two they stand for (int32; 255 -> NaN marker -1000)."""
    e = scales.astype(np.int32) - 127
    return np.where(scales == 255, -1000, e)


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (..., G, 16) uint8 blocks and (..., G) E8M0 scales -> float32 (..., G * 32)."""
    lo = FP4_E2M1[blocks & 0x0F]
    hi = FP4_E2M1[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    e = e8m0_exponents(scales)
    with np.errstate(over="ignore"):  # overflow gives Inf: the job's finite check names it
        out = np.ldexp(vals, e[..., None]).astype(np.float32, copy=False)
    out[scales == 255] = np.nan  # a NaN scale stays NaN, so the finite check names it
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * vals.shape[-1])


def unpack_int4(packed: np.ndarray, axis: int = -1) -> np.ndarray:
    """int32 words of eight 4-bit values (value j at bits 4j, stored q + 8) -> int8 q.

    The values unpack along `axis` (the last for weights, the first for zero points).
    """
    words = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    shifts = np.arange(8, dtype=np.uint32) * 4
    q = ((words[..., None] >> shifts) & 0xF).astype(np.int8) - 8
    q = q.reshape(*words.shape[:-1], words.shape[-1] * 8)
    return np.moveaxis(q, -1, axis)


def dequant_int4(packed: np.ndarray, scale: np.ndarray, cols: int,
                 zero_point: np.ndarray | None = None) -> np.ndarray:
    """int4 pack-quantized rows -> float32 (rows, cols): (q - zero_point) * scale.

    `packed` (rows, ceil(cols / 8)) int32; `scale` (rows, groups) with groups = cols /
    group size (1: per channel); `zero_point` (rows, groups) int, already unpacked, or None
    (symmetric).
    """
    s = np.asarray(scale, dtype=np.float32)
    rows, groups = s.shape
    if cols % groups:
        raise ValueError(f"{cols} columns do not make {groups} equal groups")
    q = unpack_int4(packed)[:, :cols].reshape(rows, groups, cols // groups).astype(np.int32)
    if zero_point is not None:
        q = q - np.asarray(zero_point, dtype=np.int32)[:, :, None]
    return (q.astype(np.float32) * s[:, :, None]).reshape(rows, cols)


def dequant_int4_expert(packed: np.ndarray, scale: np.ndarray, cols: int,
                        zero_point: np.ndarray | None = None) -> np.ndarray:
    """One expert of stacked int4 pack-quantized experts -> float32 (out, cols).

    `packed` (out, ceil(cols / 8)) int32, `scale` (out, groups): the expert's slices of the
    stacked (E, out, ...) tensors; `zero_point` its (ceil(out / 8), groups) int32 slice,
    still packed along the output axis (eight rows a word), or None (symmetric).
    """
    zp = None
    if zero_point is not None:
        out_f = np.asarray(packed).shape[0]
        zp = unpack_int4(np.asarray(zero_point), axis=0)[:out_f]
    return dequant_int4(packed, scale, cols, zp)

"""encode's per-group coding compiled with numba: normalize, nearest code, level, refit sums.

The same values as the numpy steps of codec._encode_finite_rows, in one pass over the rotated
groups laid out group-axis first, (group_size, groups):
  u = x / s (s the float16 scale as float32; a group with s = 0 codes as u = 0.0),
  code = the number of float32 thresholds below u, q = levels[code] (0.0 on padding),
  <x, q> and <q, q> summed in order g = 0, 1, ... from 0.0, each product rounded,
and, for 2, 3 and 4 bits, the codes packed into each group's words as pack.pack_groups_np
packs them (code g at bit width * g). Exactly the float32 operations of the numpy path (no
fast-math, so no fused multiply-add), looping over whole rows of groups so that every step
is a vector instruction. The code tables of 2, 3 and 4 bits are symmetric about 0, so the
nearest level is found on |u| over the positive half (`_nearest_symmetric`: half the
selects, the same codes). Around that pass: the float16 scales before and after it, the
packed words in row order, and each row's error and norm in float64 (numpy's order kept).
`AVAILABLE` as in fast_hadamard (numba installed, not disabled).
"""

from __future__ import annotations

import functools

import numpy as np

from .fast_hadamard import AVAILABLE, _jit, compile_kernels

__all__ = ["AVAILABLE", "code_groups"]


def literal_unroll(steps):  # numba.literal_unroll once compiled (compile_kernels)
    return steps


@_jit
def _code_kernel(xt, s, steps, first, half, pad_g, pad_k, width, codes, words, wq, qq):
    gs, groups = xt.shape
    pack = width > 0  # 2, 3, 4 bits: code g of a group at bit width * g of its words
    zero = np.float32(0.0)  # float32 constants: a Python float would make the sums float64
    div = np.empty(groups, dtype=np.float32)
    crow = np.empty(groups, dtype=np.uint8)  # one code of every group
    for k in range(groups):
        div[k] = s[k] if s[k] > zero else np.float32(1.0)
        wq[k] = zero
        qq[k] = zero
    for g in range(gs):
        hi = pad_k if g >= pad_g else groups  # padding (g >= pad_g, k >= pad_k) has q = 0
        for k in range(groups):
            x = xt[g, k]
            u = x / div[k] if s[k] > zero else zero
            if half > 0:  # the same in every pass: hoisted by the compiler
                c, q = _nearest_symmetric(u, steps, first, half)
            else:
                c, q = _nearest(u, steps, first)
            if k >= hi:
                q = zero
            crow[k] = c
            wq[k] = wq[k] + x * q
            qq[k] = qq[k] + q * q
        if pack:  # in a loop of its own: both loops stay vector code
            _pack(crow, words, g * width, width)
        else:
            codes[g] = crow


@_jit
def _nearest(u, steps, first):
    """(code, level) of u: the number of thresholds below u (they are sorted) and its level;
    the steps are unrolled when compiled, a chain of selects (vector code)."""
    c, q = np.uint8(0), first
    for step in literal_unroll(steps):
        if u > step[0]:
            c, q = step[2], step[1]
    return c, q


@_jit
def _nearest_symmetric(u, steps, first, half):
    """_nearest for a table symmetric about 0 (2 * half levels, the middle threshold 0):
    the chain over the positive half only, on |u|. For u <= 0 the count of thresholds
    below u is half - 1 - #{t > 0: |u| >= t}, and |u| >= t is next_up(|u|) > t (the float
    after it: its bits + 1), so one chain serves both signs; the level is minus that of
    the mirrored code. The same codes and levels, ties and signed zeros included."""
    pos = u > np.float32(0.0)
    bits = np.float32(u).view(np.uint32) & np.uint32(0x7FFFFFFF)
    a = np.uint32(bits + (np.uint32(0) if pos else np.uint32(1))).view(np.float32)
    c, q = np.uint8(0), first
    for step in literal_unroll(steps):
        if a > step[0]:
            c, q = step[2], step[1]
    if pos:
        return np.uint8(half + c), q
    return np.uint8(half - 1 - c), -q


@_jit
def _pack(crow, words, bit, width):
    """Code k of crow into group k's words at bit `bit` (a 3-bit code may cross a word)."""
    w, shift = bit >> 5, np.uint32(bit & 31)
    word = words[w]
    for k in range(crow.shape[0]):
        word[k] |= np.uint32(crow[k]) << shift
    if shift + width > 32:
        word = words[w + 1]
        for k in range(crow.shape[0]):
            word[k] |= np.uint32(crow[k]) >> (32 - shift)


@functools.lru_cache(maxsize=16)
def _steps(mids: bytes, levels: bytes) -> tuple[tuple, np.float32, np.uint8]:
    """(steps, the level below the first step, half): steps are (threshold, level above it,
    its code), ascending: a tuple, one compiled kernel a width; built once a code table
    (~30 us a call, ~2% of a 4096-wide chunk's encode). For a table symmetric about 0 with
    an even number of levels (2, 3, 4 bits) the steps are its positive half and half is
    the number of levels above 0 (`_nearest_symmetric`); else half is 0 (ternary)."""
    m, lv = np.frombuffer(mids, np.float32), np.frombuffer(levels, np.float32)
    h = lv.size // 2
    if lv.size % 2 == 0 and m[h - 1] == 0 and (m == -m[::-1]).all() and (lv == -lv[::-1]).all():
        steps = tuple((np.float32(t), np.float32(lv[h + c + 1]), np.uint8(c + 1))
                      for c, t in enumerate(m[h:]))
        return steps, np.float32(lv[h]), np.uint8(h)  # uint8: int64 arithmetic is 8x wider
    steps = tuple((np.float32(t), np.float32(lv[c + 1]), np.uint8(c + 1)) for c, t in enumerate(m))
    return steps, np.float32(lv[0]), np.uint8(0)


def code_groups(xt: np.ndarray, s: np.ndarray, mids: np.ndarray, levels: np.ndarray,
                pad_g: int, pad_k: int, width: int | str):
    """(codes, <x, q>, <q, q>) of float32 groups xt (group_size, groups) with scales s.

    codes: for 2, 3, 4 bits the packed words of every group, (words per group, groups)
    uint32, as pack.pack_groups_np packs them; for ternary the uint8 codes (group_size,
    groups). Entries with g >= pad_g of groups k >= pad_k are padding: their level counts
    as 0.0.
    """
    gs, groups = xt.shape
    bits = 0 if width == "ternary" else int(width)
    codes = np.empty((gs, groups) if not bits else (0, 0), dtype=np.uint8)
    words = np.zeros((gs * bits // 32, groups) if bits else (0, 0), dtype=np.uint32)
    wq = np.empty(groups, dtype=np.float32)
    qq = np.empty(groups, dtype=np.float32)
    steps, first, half = _steps(np.asarray(mids, np.float32).tobytes(),
                                np.asarray(levels, np.float32).tobytes())
    compile_kernels()
    _code_kernel(np.ascontiguousarray(xt, np.float32), np.ascontiguousarray(s, np.float32),
                 steps, first, half, pad_g, pad_k, bits, codes, words, wq, qq)
    return (words if bits else codes), wq, qq


# ------------------------------------------------- a chunk's scales, before and after coding
# The numpy glue around the two kernels (the RMS to float16 and back, the refit's scales, the
# moves to (rows, groups) order) cost ~20% of a 4096-wide chunk's encode in small array
# operations; these kernels do the same float32 operations in one pass each. float16 is
# rounded here from the float32 bits (round to nearest, ties to even: numpy's astype).

_F16_MAX = np.float32(65504.0)
_TINY = np.float32(1e-30)


@_jit
def f16_bits(v):
    """numpy's float16 rounding of float32 v, as its bits (uint16): nearest, ties to even;
    beyond the range infinity, NaN a quiet NaN."""
    x = np.float32(v).view(np.uint32)
    sign = np.uint16((x >> np.uint32(16)) & np.uint32(0x8000))
    ax = x & np.uint32(0x7FFFFFFF)
    if ax > np.uint32(0x7F800000):  # NaN: numpy keeps the top payload bits, quiet
        return sign | np.uint16(0x7E00) | np.uint16((ax >> np.uint32(13)) & np.uint32(0x3FF))
    if ax >= np.uint32(0x477FF000):  # rounds to 65520 or more: infinity
        return sign | np.uint16(0x7C00)
    if ax < np.uint32(0x38800000):  # below 2^-14: a subnormal (or zero), exact steps of 2^-24
        a = np.uint32(ax).view(np.float32) * np.float32(16777216.0)  # exact: a power of two
        return sign | np.uint16(np.rint(a))
    r = ax - np.uint32(0x38000000)  # the exponent rebased; 13 bits dropped, ties to even
    r = r + np.uint32(0x0FFF) + ((r >> np.uint32(13)) & np.uint32(1))
    return sign | np.uint16(r >> np.uint32(13))


@_jit
def f16_value(h):
    """The float32 value of float16 bits h (finite: exact)."""
    sign = np.uint32(h & np.uint16(0x8000)) << np.uint32(16)
    e = np.uint32((h >> np.uint16(10)) & np.uint16(0x1F))
    m = np.uint32(h & np.uint16(0x3FF))
    if e == 0:  # subnormal or zero: m * 2^-24
        v = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    return np.uint32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
                     ).view(np.float32)


@_jit
def _rms_kernel(energy, rows, groups, gs, valid, s, rms):
    """energy (groups * rows, group-major, as the rotation lays them out) -> s (the float16
    RMS as float32) and rms (its float16 bits), same order; whether every RMS is finite.
    rms = sqrt(energy / count) in float32, count the group's valid columns (numpy's
    rms_from_energy_np)."""
    finite = True
    for k in range(groups):
        left = valid - k * gs
        count = np.float32(gs if left >= gs else (left if left > 1 else 1))
        for r in range(rows):
            i = k * rows + r
            h = f16_bits(np.sqrt(energy[i] / count))
            if (h & np.uint16(0x7C00)) == np.uint16(0x7C00):
                finite = False
            rms[i] = h
            s[i] = f16_value(h) if finite else np.float32(0.0)
    return finite


@_jit
def _refit_kernel(wq, qq, words, rows, groups, refit, scales, packed):
    """With `refit`, each group's float16 scale <w, q> / <q, q> (0 where <q, q> = 0),
    clipped to [0, 65504] (numpy's scales_from_sums_np), group-major; the packed words of
    the coding kernel (words a group, groups * rows) as rows (rows, groups * words)."""
    per = words.shape[0]
    for k in range(groups):
        for r in range(rows):
            i = k * rows + r
            if refit:
                a = wq[i]
                b = qq[i]
                v = a / (b if b > _TINY else _TINY) if b > np.float32(0.0) else np.float32(0.0)
                v = v if v > np.float32(0.0) else np.float32(0.0)
                v = v if v < _F16_MAX else _F16_MAX
                scales[i] = f16_bits(v)
            for w in range(per):
                packed[r, k * per + w] = words[w, i]


def group_scales(energy: np.ndarray, rows: int, groups: int, gs: int, valid: int):
    """(s float32, group-major; the float16 RMS as (rows, groups)) of a rotated chunk's
    group energies, or None where an RMS is not finite. The (rows, groups) arrays here are
    views of group-major memory: numpy then sums a row's groups in the order it always
    has (a C-ordered copy would sum them pairwise, other last bits)."""
    s = np.empty(groups * rows, dtype=np.float32)
    rms = np.empty(groups * rows, dtype=np.uint16)
    compile_kernels()
    if not _rms_kernel(np.ascontiguousarray(energy, np.float32).reshape(-1), rows, groups, gs,
                       valid, s, rms):
        return None
    return s, rms.view(np.float16).reshape(groups, rows).T


def refit_rows(wq: np.ndarray, qq: np.ndarray, words: np.ndarray, rows: int, groups: int,
               rms: np.ndarray | None):
    """(the float16 scales (rows, groups): refitted, or `rms` where given; the packed words
    (rows, groups * words a group))."""
    scales = np.empty(groups * rows, dtype=np.uint16)
    packed = np.empty((rows, groups * words.shape[0]), dtype=np.uint32)
    compile_kernels()
    _refit_kernel(wq, qq, words, rows, groups, rms is None, scales, packed)
    if rms is not None:
        return rms, packed
    return scales.view(np.float16).reshape(groups, rows).T, packed


@_jit
def _row_errors_kernel(energy, scales, wq, qq, rows, groups, err, norm):
    """codec._row_errors in one pass, the same float64 operations in the same order: each
    group's ||x||^2 - 2 s <x, q> + s^2 <q, q> (as numpy evaluates it: (xx - (2 s) xq) +
    (s s) q2), summed over a row's groups from the first, in order (numpy's sum along the
    strided axis of a group-major array), then max(., 0); and ||x||^2 summed the same way.
    Group-major inputs (k * rows + r), scales as float16 bits."""
    for r in range(rows):  # numpy's sum starts from the first group's value
        err[r] = _group_error(energy, scales, wq, qq, r)
        norm[r] = np.float64(energy[r])
    for k in range(1, groups):
        for r in range(rows):
            i = k * rows + r
            err[r] = err[r] + _group_error(energy, scales, wq, qq, i)
            norm[r] = norm[r] + np.float64(energy[i])
    for r in range(rows):  # np.maximum(err, 0.0): err where err >= 0 (-0.0 too) or NaN
        e = err[r]
        err[r] = e if (e >= 0.0 or e != e) else 0.0


@_jit
def _group_error(energy, scales, wq, qq, i):
    xx = np.float64(energy[i])
    sc = np.float64(f16_value(scales[i]))
    return (xx - (2.0 * sc) * np.float64(wq[i])) + (sc * sc) * np.float64(qq[i])


def row_errors(energy: np.ndarray, scales: np.ndarray, wq: np.ndarray, qq: np.ndarray,
               rows: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(each row's ||x - s q||^2, ||x||^2), float64, as codec._row_errors computes them, from
    a chunk's group-major energies, <x, q>, <q, q> and its float16 scales (rows, groups),
    a view of group-major memory as refit_rows returns them."""
    err = np.empty(rows, dtype=np.float64)
    norm = np.empty(rows, dtype=np.float64)
    bits = np.ascontiguousarray(scales.T).view(np.uint16).reshape(-1)  # group-major: no copy
    compile_kernels()
    _row_errors_kernel(energy.reshape(-1), bits, wq, qq, rows, groups, err, norm)
    return err, norm

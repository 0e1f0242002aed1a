"""encode's per-group coding compiled with numba: normalize, nearest code, level, refit sums.

The same values as the numpy steps of codec._encode_finite_rows, in one pass over the rotated
groups laid out group-axis first, (group_size, groups):
  u = x / s (s the float16 scale as float32; a group with s = 0 codes as u = 0.0),
  code = the number of float32 thresholds below u, q = levels[code] (0.0 on padding),
  <x, q> and <q, q> summed in order g = 0, 1, ... from 0.0, each product rounded,
and, for 2, 3 and 4 bits, the codes packed into each group's words as pack.pack_groups_np
packs them (code g at bit width * g). Exactly the float32 operations of the numpy path (no
fast-math, so no fused multiply-add), looping over whole rows of groups so that every step
is a vector instruction. `AVAILABLE` as in fast_hadamard (numba installed, not disabled).
"""

from __future__ import annotations

import functools

import numpy as np

from .fast_hadamard import AVAILABLE, _jit, compile_kernels

__all__ = ["AVAILABLE", "code_groups"]


def literal_unroll(steps):  # numba.literal_unroll once compiled (compile_kernels)
    return steps


@_jit
def _code_kernel(xt, s, steps, first, pad_g, pad_k, width, codes, words, wq, qq):
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
        bit = g * width
        w, shift = bit >> 5, np.uint32(bit & 31)
        spill = shift + width > 32  # 3 bits: a code across two words
        for k in range(groups):
            x = xt[g, k]
            u = x / div[k] if s[k] > zero else zero
            # code = the number of thresholds below u (they are sorted), q = its level: the
            # steps are unrolled when compiled, a chain of selects (vector code)
            c, q = np.uint8(0), first
            for step in literal_unroll(steps):
                if u > step[0]:
                    c, q = step[2], step[1]
            if k >= hi:
                q = zero
            crow[k] = c
            wq[k] = wq[k] + x * q
            qq[k] = qq[k] + q * q
        if pack:  # in a loop of its own: both loops stay vector code
            word = words[w]
            for k in range(groups):
                word[k] |= np.uint32(crow[k]) << shift
            if spill:
                word = words[w + 1]
                for k in range(groups):
                    word[k] |= np.uint32(crow[k]) >> (32 - shift)
        else:
            codes[g] = crow


@functools.lru_cache(maxsize=16)
def _steps(mids: bytes, levels: bytes) -> tuple:
    """(threshold, level above it, its code), ascending: a tuple, one compiled kernel a
    width; built once a code table (~30 us a call, ~2% of a 4096-wide chunk's encode)."""
    m, lv = np.frombuffer(mids, np.float32), np.frombuffer(levels, np.float32)
    return tuple((np.float32(t), np.float32(lv[c + 1]), np.uint8(c + 1)) for c, t in enumerate(m))


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
    steps = _steps(np.asarray(mids, np.float32).tobytes(),
                   np.asarray(levels, np.float32).tobytes())
    compile_kernels()
    _code_kernel(np.ascontiguousarray(xt, np.float32), np.ascontiguousarray(s, np.float32),
                 steps, np.float32(levels[0]), pad_g, pad_k, bits, codes, words, wq, qq)
    return (words if bits else codes), wq, qq

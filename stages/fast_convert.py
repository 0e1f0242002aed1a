"""bfloat16 bits to float32 in one compiled pass that also says whether every value is
finite: the conversion's read loop did this in three (widen, shift, isfinite), ~5% of a
job's CPU (issue 40).

A bfloat16 is the top half of a float32, so the float32 is its bits shifted left by 16
(exact); it is NaN or infinite when its exponent bits (0x7f80) are all set. `AVAILABLE`
as in fast_hadamard (numba installed, not disabled); without numba the same results come
from numpy.
"""

from __future__ import annotations

import numpy as np

from .fast_hadamard import AVAILABLE, _jit, compile_kernels

__all__ = ["AVAILABLE", "bf16_to_float32"]


@_jit
def _widen(bits, out):
    """out (as uint32) = bits << 16; returns whether no value has every exponent bit set.
    (b & 0x7f80) + 0x80 reaches 0x8000 only when those bits are all set: one OR a value,
    no branch, so the loop stays vector code."""
    seen = np.uint16(0)
    for i in range(bits.size):
        b = bits[i]
        out[i] = np.uint32(b) << np.uint32(16)
        seen |= (b & np.uint16(0x7F80)) + np.uint16(0x0080)
    return (seen & np.uint16(0x8000)) == np.uint16(0)


def bf16_to_float32(bits: np.ndarray) -> tuple[np.ndarray, bool]:
    """(float32 values of the bfloat16 bit patterns `bits` (uint16, any shape; same shape
    back), whether all of them are finite)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    if not AVAILABLE:
        x = (bits.astype(np.uint32) << 16).view(np.float32)
        return x, bool(np.isfinite(x).all())
    out = np.empty(bits.shape, dtype=np.uint32)
    compile_kernels()
    finite = _widen(bits.reshape(-1), out.reshape(-1))
    return out.view(np.float32), bool(finite)

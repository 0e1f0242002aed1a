"""CPU kernels for the dispatch table; imported when MLX runs on the CPU.

Registers the decode GEMV ("matvec") compiled with numba (`cpu_gemv`) when numba is
available; everything else, and every call it does not cover, runs the pure-MLX reference.
The kernel works on numpy views of the arrays, so a call evaluates its inputs first (the
CPU backend computes in order anyway).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import cpu_gemv, dispatch, reference


def matvec(x_rot, codes, scales, bits, group_size, out_features, padded_in, **_):
    if codes.ndim != 2 or x_rot.shape[-1] != padded_in or codes.shape[0] != out_features:
        raise NotImplementedError  # the reference raises the precise error
    lead = x_rot.shape[:-1]
    x = np.asarray(x_rot.astype(mx.float32)).reshape(-1, padded_in)
    book = np.asarray(reference.levels(bits))
    y = cpu_gemv.gemv(x, np.asarray(codes), np.asarray(scales), book, bits, group_size)
    return mx.array(y).reshape(*lead, out_features).astype(x_rot.dtype)


if cpu_gemv.available():
    dispatch.register("cpu", "matvec", matvec)

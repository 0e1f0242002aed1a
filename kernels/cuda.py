"""CUDA kernels for the dispatch table; imported when MLX runs on an NVIDIA GPU.

Implements the decode GEMV ("matvec") for 2, 3 and 4 bits with `cuda_gemv`; ternary,
prefill and gathered experts fall back to the reference. The kernel reads codes in its own
layout (3-bit codes as two planes, codes placed next to their activations), prepared once
per weight on first use and kept beside it.
"""

from __future__ import annotations

import math

import mlx.core as mx

from turboquant.stages import codebook_values, unpack_codes

from . import cuda_gemv, dispatch

# id(codes) -> (codes, kernel code plane, high-bit plane, scales padded to 64 codes)
_PREPARED: dict[int, tuple] = {}


def prepared(codes: mx.array, scales: mx.array, bits: int, group_size: int, padded_in: int):
    """The kernel's layout of one weight, built on first use."""
    hit = _PREPARED.get(id(codes))
    if hit is None or hit[0] is not codes:
        padded64 = math.ceil(padded_in / 64) * 64
        low, high = cuda_gemv.repack(unpack_codes(codes, bits, padded_in), bits, padded64)
        groups = padded64 // group_size
        if scales.shape[-1] < groups:
            pad = mx.zeros((scales.shape[0], groups - scales.shape[-1]), dtype=scales.dtype)
            scales = mx.concatenate([scales, pad], axis=-1)
        mx.eval(low, high, scales)
        hit = (codes, low, high, scales)
        _PREPARED[id(codes)] = hit
    return hit[1:]


def matvec(x_rot, codes, scales, bits, group_size, out_features, padded_in, **_):
    if bits == "ternary" or codes.ndim != 2:
        raise NotImplementedError
    low, high, scales64 = prepared(codes, scales, bits, group_size, padded_in)
    lead = x_rot.shape[:-1]
    x = x_rot.reshape(-1, padded_in).astype(mx.float16)
    padded64 = low.shape[-1] * (16 if bits != 4 else 8)
    if padded64 > padded_in:
        x = mx.pad(x, [(0, 0), (0, padded64 - padded_in)])
    rows = x.shape[0]
    y = cuda_gemv.gemv(
        x, low, high, scales64, codebook_values(bits),
        mx.zeros((rows,), dtype=mx.int32), mx.arange(rows, dtype=mx.int32),
        bits=bits, group_size=group_size, out_features=out_features, out_dtype=mx.float32,
    )
    return y.reshape(*lead, out_features)


dispatch.register("cuda", "matvec", matvec)

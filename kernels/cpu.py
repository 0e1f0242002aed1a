"""CPU kernels for the dispatch table; imported when MLX runs on the CPU.

Registers the numba kernels of `cpu_gemv` as "matvec" (decode, up to 8 tokens), "matmul"
(prefill: the same kernel on every row; 25x the reference GEMM at 256 tokens of a
4096x4096 3-bit matrix, whose dense product is the CPU wheel's reference BLAS),
"linear_group" (linears sharing an input: one evaluation of their rotated inputs) and
"gather_matmul" (a decode step's MoE experts, up to GATHER_MAX_PAIR_ROWS pairs x rows, in
one gathered call; prefill's grouped by expert, each expert's rows through "matmul") when
numba is available; embeddings and every call they do not cover run the pure-MLX
reference. These kernels compute inside the call (`dispatch.EAGER_BACKENDS`):
a model's head gives way to the reference for prefill (`dispatch.graph_only`), as mlx-lm
never evaluates a prefill chunk's logits.
The kernel works on numpy views of the arrays, so a call evaluates its inputs first (the
CPU backend computes in order anyway).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import cpu_gemv, dispatch, group, reference


def linear(x_rot, codes, scales, bits, group_size, out_features, padded_in, **_):
    if codes.ndim != 2 or x_rot.shape[-1] != padded_in or codes.shape[0] != out_features:
        raise NotImplementedError  # the reference raises the precise error
    lead = x_rot.shape[:-1]
    x = np.asarray(x_rot.astype(mx.float32)).reshape(-1, padded_in)
    book = _book(bits)
    y = cpu_gemv.gemv(x, np.asarray(codes), np.asarray(scales), book, bits, group_size)
    return mx.array(y).reshape(*lead, out_features).astype(x_rot.dtype)


def _book(bits) -> np.ndarray:
    """The codebook the kernels read (a trellis code computes its values: none)."""
    if reference.is_trellis(bits):
        return np.zeros(0, dtype=np.float32)
    return np.asarray(reference.levels(bits))


# pairs x rows at or below this many: the compiled gathered GEMV (a decode step's experts)
GATHER_MAX_PAIR_ROWS = 64


def gather(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, **kw):
    """Experts chosen per token (the reference's signature): a decode step's few pairs in
    one gathered GEMV; prefill's many grouped by expert as the reference groups them, each
    expert in use through the GEMV kernel on all its rows (`linear`, as dense prefill)."""
    try:
        batch, m, _ = reference.decode_pairs(x_rot, codes, indices, out_features, padded_in,
                                             GATHER_MAX_PAIR_ROWS)
    except NotImplementedError:  # prefill (or arguments the reference names the fault of)
        return reference.tq_gather_matmul(x_rot, codes, scales, indices, bits, group_size,
                                          out_features, padded_in, gemm=linear, **kw)
    x = mx.broadcast_to(x_rot.astype(mx.float32), (*batch, m, padded_in)).reshape(-1, m, padded_in)
    experts = mx.broadcast_to(indices, batch).reshape(-1).astype(mx.int64)
    mx.eval(x, experts)  # one synchronisation with MLX's graph for both
    book = _book(bits)
    y = cpu_gemv.gather_gemv(np.asarray(x), np.asarray(codes), np.asarray(scales),
                             np.asarray(experts), book, bits, group_size)
    return mx.array(y).reshape(*batch, m, out_features).astype(x_rot.dtype)


def linear_group(x, members, prepared=None, extras=group.NO_EXTRAS):
    """Linears sharing an input, for a decode step: every member's rotated input evaluated
    at once (one synchronisation with MLX's graph instead of one a member), then the GEMV of
    each; the reference's results and signature."""
    if (x.size // max(1, x.shape[-1]) > dispatch.MATVEC_MAX_TOKENS
            or any(m.codes.ndim != 2 for m in members)):
        raise NotImplementedError
    row = group.input_of(x, extras)
    rotated = [group.rotated_input(row, m) for m in members]
    mx.eval(rotated)
    outs = []
    for m, xr in zip(members, rotated):
        y = linear(xr, m.codes, m.scales, m.bits, m.group_size, m.out_features, m.padded_in)
        y = y.astype(x.dtype)
        outs.append(y if m.bias is None else y + m.bias)
    return group.with_residual(outs, extras)


if cpu_gemv.available():
    dispatch.register("cpu", "matvec", linear)
    dispatch.register("cpu", "matmul", linear)
    dispatch.register("cpu", "gather_matmul", gather)
    dispatch.register("cpu", "linear_group", linear_group)
    # trellis-coded weights through the same kernels (cpu_gemv computes their values)
    for op, fn in (("matvec", linear), ("matmul", linear), ("gather_matmul", gather),
                   ("linear_group", linear_group)):
        dispatch.register_trellis("cpu", op, fn)

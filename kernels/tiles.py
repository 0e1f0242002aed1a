"""Prefill's tiled product on a GPU backend: a weight's codes decoded a tile of rows at a
time into the dtype the product runs in, each tile multiplied by MLX's own GEMM.

Prefill is compute-bound (a 2048-token chunk does 2048 multiply-adds per weight), so a
code's decode is paid once per tile, not per token, and the product is the backend's
tuned GEMM (cuBLASLt on CUDA, MLX's Steel GEMM on Metal). The backend supplies the decode
(`dequantize(codes_rows, scales_rows, bits, group_size, padded_in, dtype) -> (rows,
padded_in)`, a kernel of its own);
this module chooses the dtype and the tiles and chains them:

- the product runs in x's dtype where it is float16 or bfloat16 (tensor cores, simdgroup
  matrices), in float32 otherwise;
- tiles hold at most `CHUNK` weights, the matrix split into as few of them as that takes,
  equal, rows rounded up to a multiple of `TILE_ROWS` (a product of 1170 columns ran at a
  third of the speed of 1024 on the H200);
- each tile's decode waits for x (the first) or the previous tile's product
  (`mx.depends`), so a matrix has at most a tile or two decoded at once, and MLX does not
  decode every layer's first tile ahead of the model.

MoE experts prefill the same way through MLX's gathered GEMM (`gathered_matmul`): the
experts in use decoded together (a run of at most `CHUNK` weights a launch), then
`mx.gather_mm` over every (token, expert) pair, one product for many experts where a
product per expert would be bound by its launches (on the H200, 2048 tokens of a
Qwen3-30B-A3B shape: 14-17K prompt tok/s against 8-10K per expert).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from . import reference

CHUNK = 1 << 26  # most weights decoded at once (128 MiB in bf16): 14336x4096 in one tile
TILE_ROWS = 128  # a tile's rows are a multiple of this when the matrix takes several


def compute_dtype(dtype):
    """What x and the decoded tiles are multiplied in: x's own dtype where the GEMM runs it
    on matrix units (fp16, bf16), float32 otherwise."""
    return dtype if dtype in (mx.float16, mx.bfloat16) else mx.float32


def rows_per_tile(out_features: int, padded_in: int, chunk: int | None = None) -> int:
    """Rows of a tile: the matrix in as few tiles of at most `chunk` weights as it takes,
    of equal rows rounded up to a multiple of `TILE_ROWS`, the last tile shorter."""
    tiles = -(-out_features * padded_in // (chunk or CHUNK))
    rows = -(-out_features // tiles)
    if tiles > 1 and rows > TILE_ROWS:
        rows = -(-rows // TILE_ROWS) * TILE_ROWS
    return min(out_features, rows)


def tiled_matmul(x_rot, codes, scales, bits, group_size, out_features, padded_in,
                 dequantize: Callable, *, chunk=None, after=None):
    """`reference.tq_matmul` (x_rot (..., padded_in), many tokens -> (..., out_features) in
    x's dtype) with the backend's `dequantize(codes_rows, scales_rows, bits, group_size,
    padded_in, dtype)` making each tile's weights.
    NotImplementedError for stacked experts or the wrong width (the reference names it)."""
    if codes.ndim != 2 or codes.shape[0] != out_features or x_rot.shape[-1] != padded_in:
        raise NotImplementedError
    reference.check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in)
    lead = x_rot.shape[:-1]
    dtype = compute_dtype(x_rot.dtype)
    x = x_rot.reshape(-1, padded_in).astype(dtype)
    rows = rows_per_tile(out_features, padded_in, chunk)
    parts, prev = [], x if after is None else after
    for r0 in range(0, out_features, rows):
        r1 = min(r0 + rows, out_features)
        w = dequantize(mx.depends(codes[r0:r1], prev), scales[r0:r1], bits, group_size,
                       padded_in, dtype)
        y = x @ w.T
        parts.append(y)
        prev = y
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y.reshape(*lead, out_features).astype(x_rot.dtype)


def gathered_matmul(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in,
                    dequantize: Callable, *, sorted_indices=False):
    """`reference.tq_gather_matmul`'s result in x_rot's dtype (prefill's many pairs) through
    MLX's `gather_mm`: the experts in use (one host read of the routing) decoded by the
    backend's `dequantize` (as `tiled_matmul`'s) in x's dtype, stacked, the routing
    renumbered to the stack. At most `CHUNK` weights are decoded at once (or one expert, if larger):
    where the experts in use hold more, the pairs run in expert order, a run of experts per
    launch, each launch's decode waiting for the previous product."""
    reference.check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in,
                         experts=True)
    batch = mx.broadcast_shapes(tuple(x_rot.shape[:-2]), tuple(indices.shape))
    routing = np.asarray(mx.broadcast_to(indices, batch).astype(mx.int32)).reshape(-1)
    used = np.unique(routing)
    per_launch = max(1, CHUNK // (out_features * padded_in))
    spec = (dequantize, bits, group_size, padded_in)
    if len(used) <= per_launch:
        w = _decoded_experts(codes, scales, used, spec, x_rot.dtype, x_rot)
        local = np.searchsorted(used, routing).astype(np.uint32).reshape(batch)
        return mx.gather_mm(x_rot, w.swapaxes(-1, -2), rhs_indices=mx.array(local),
                            sorted_indices=sorted_indices)
    m = x_rot.shape[-2]
    x = mx.broadcast_to(x_rot, (*batch, m, padded_in)).reshape(-1, m, padded_in)
    order = np.argsort(routing, kind="stable")
    in_order = bool(np.all(order == np.arange(len(order))))
    if not in_order:
        x = x[mx.array(order.astype(np.int32))]
    routed = routing[order]
    parts, prev = [], x
    for first in range(0, len(used), per_launch):
        experts = used[first:first + per_launch]
        lo = np.searchsorted(routed, experts[0], side="left")
        hi = np.searchsorted(routed, experts[-1], side="right")
        w = _decoded_experts(codes, scales, experts, spec, x.dtype, prev)
        local = mx.array(np.searchsorted(experts, routed[lo:hi]).astype(np.uint32))
        prev = mx.gather_mm(x[lo:hi], w.swapaxes(-1, -2), rhs_indices=local,
                            sorted_indices=True)
        parts.append(prev)
    y = mx.concatenate(parts, axis=0)
    if not in_order:
        y = y[mx.array(np.argsort(order).astype(np.int32))]
    return y.reshape(*batch, m, out_features)


def _decoded_experts(codes, scales, experts, spec: tuple, dtype, after):
    """(len(experts), out, padded_in) in `dtype`: the experts' weights decoded in one
    launch (`spec`: dequantize, bits, group_size, padded_in) that waits for `after`."""
    dequantize, bits, group_size, padded_in = spec
    picked = mx.array(experts.astype(np.int32))
    rows = len(experts) * codes.shape[1]
    w = dequantize(mx.depends(codes[picked], after).reshape(rows, -1),
                   scales[picked].reshape(rows, -1), bits, group_size, padded_in, dtype)
    return w.reshape(len(experts), codes.shape[1], -1)

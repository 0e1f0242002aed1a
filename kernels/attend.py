"""Attention of one new token over a KV cache's whole buffer, its length an array.

mlx-lm's `KVCache` keeps keys and values in buffers (B, kv_heads, S, D) allocated ahead of
the tokens; a decode step stores the new token's key and value at `position` and attends
over the first `position + 1` rows. When `position` is an array (a compiled step traced
once for every position), the rows to read cannot be a slice: `buffer_attention` reads the
whole buffer and ignores the rows past `position` (they may hold anything finite: zeros
or a trimmed cache's old tokens).

The reference masks them out of MLX's attention; backends register "buffer_attention"
with the same signature (`kernels/cuda_attend.py`: split-K over the buffer, the length read
on the GPU, so the rows past it cost nothing). The reference is what runs on the CPU and
the oracle of the tests.
"""

from __future__ import annotations

import mlx.core as mx

from . import dispatch


def buffer_attention(queries: mx.array, keys: mx.array, values: mx.array,
                     position: mx.array, scale: float, slot=None, store=None) -> mx.array:
    """queries (B, H, 1, D), keys (B, KVH, S, D), values (B, KVH, S, Dv) with H a multiple
    of KVH; position: an int32 scalar array, the query's position, its key and value
    already stored there. -> (B, H, 1, Dv), softmax(scale * q k^T) v over rows 0..position.
    `slot`: a kernel's scratch for this call site (calls that may run at once need
    different ones; the CUDA kernel's counters); the reference has none. `store`: the
    token's (key, value), each (B, KVH, 1, D), attended as if stored at `position`; a
    kernel with `stores_in_place` also writes them into the buffers (the reference
    cannot: the caller stores them itself)."""
    if store is not None:
        at = position.reshape(1, 1, 1, 1)
        keys = mx.put_along_axis(keys, at, store[0], axis=2)
        values = mx.put_along_axis(values, at, store[1], axis=2)
    size = keys.shape[2]
    mask = (mx.arange(size) <= position).reshape(1, 1, 1, size)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


dispatch.add_op("buffer_attention", buffer_attention)

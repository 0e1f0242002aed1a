"""Metal kernels through `mx.fast.metal_kernel`: the reference's GEMV, fused.

One simdgroup (32 threads) per output row and activation row. Lane l takes groups
l, l + 32, ...; per group it sums levels[code] * x over the group, multiplies the sum by
the group's scale (the reference's order: scales apply to group sums), and the lanes
reduce with `simd_sum`. Codes are unpacked in registers exactly as docs/FORMAT.md lays
them out, so no dense weight ever exists. The gathered variant is the same kernel with
the row block chosen per (token, expert) pair.

Registered for "matvec", "matmul" (prefill: `tiles.tiled_matmul`, whose tiles this
module's `dequantize` kernel decodes to x's dtype, one thread a weight, for MLX's GEMM) and
"gather_matmul" (few pairs: the gathered GEMV; a prefill's many: the experts in use
decoded by the same kernel, a run of them at a time, in the output's dtype, then MLX's
`gather_mm`: `tiles.gathered_matmul`, as on CUDA).
Importing this module off macOS is harmless: nothing registers without Metal.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import dispatch, reference, tiles

HEADER = """
template <int BITS, typename P>
inline uint tq_code(P w, uint k) {
    if (BITS == 2 || BITS == 4) {
        const uint per = 32u / uint(BITS);
        return (uint(w[k / per]) >> ((k % per) * uint(BITS))) & ((1u << uint(BITS)) - 1u);
    } else if (BITS == 3) {
        uint bit = 3u * (k % 32u);
        uint wi = (k / 32u) * 3u + bit / 32u;
        uint off = bit % 32u;
        uint v = uint(w[wi]) >> off;
        if (off > 29u) {
            v |= uint(w[wi + 1u]) << (32u - off);
        }
        return v & 7u;
    } else {  // ternary: 20 base-3 digits a word, least significant first
        uint word = uint(w[k / 20u]);
        uint d = k % 20u;
        for (uint i = 0u; i < d; ++i) {
            word /= 3u;
        }
        return word % 3u;
    }
}
"""

SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint row = threadgroup_position_in_grid.x;
    uint m = thread_position_in_grid.y;
    uint t = thread_position_in_grid.z;
    uint e = GATHER ? uint(indices[t]) : 0u;
    size_t r = size_t(e) * NROWS + row;
    auto crow = codes + r * NWORDS;
    auto srow = scales + r * NGROUPS;
    auto xrow = x + (size_t(t) * MROWS + m) * KDIM;
    float acc = 0.0f;
    for (uint g = lane; g < uint(NGROUPS); g += 32u) {
        float part = 0.0f;
        for (uint j = 0u; j < uint(GSIZE); ++j) {
            uint k = g * uint(GSIZE) + j;
            part += float(levels[tq_code<BITS>(crow, k)]) * float(xrow[k]);
        }
        acc += float(srow[g]) * part;
    }
    acc = simd_sum(acc);
    if (lane == 0u) {
        y[(size_t(t) * MROWS + m) * NROWS + row] = acc;
    }
"""


# prefill's decode (`tiles.tiled_matmul`): one thread per weight of a tile,
# levels[code] * scale rounded once to the product's dtype
DEQUANT_SOURCE = """
    uint col = thread_position_in_grid.x;
    uint row = thread_position_in_grid.y;
    if (col >= uint(KDIM)) {
        return;
    }
    auto crow = codes + size_t(row) * NWORDS;
    float s = float(scales[size_t(row) * NGROUPS + col / uint(GSIZE)]);
    w[size_t(row) * KDIM + col] = T(float(levels[tq_code<BITS>(crow, col)]) * s);
"""

DEQUANT_THREADS = 256


@functools.lru_cache(maxsize=None)
def _dequant_kernel():
    return mx.fast.metal_kernel(
        name="tq_dequant",
        input_names=["codes", "scales", "levels"],
        output_names=["w"],
        source=DEQUANT_SOURCE,
        header=HEADER,
    )


def dequantize(codes, scales, bits, group_size, padded_in, out_dtype=mx.float16):
    """Rows of rotated weights, levels[codes] * scale in `out_dtype`: (rows, padded_in),
    `reference.dequantize`'s values rounded once."""
    rows = codes.shape[0]
    (w,) = _dequant_kernel()(
        inputs=[codes, scales, reference.levels(bits)],
        template=[
            ("T", out_dtype),
            ("BITS", _bits_arg(bits)),
            ("NWORDS", codes.shape[-1]),
            ("NGROUPS", padded_in // group_size),
            ("GSIZE", group_size),
            ("KDIM", padded_in),
        ],
        grid=(padded_in, rows, 1),
        threadgroup=(min(DEQUANT_THREADS, padded_in), 1, 1),
        output_shapes=[(rows, padded_in)],
        output_dtypes=[out_dtype],
    )
    return w


def tq_matmul(x_rot, codes, scales, bits, group_size, out_features, padded_in, *, chunk=None,
              after=None, **_):
    """Prefill: `tiles.tiled_matmul` with this decode, each tile through MLX's GEMM."""
    return tiles.tiled_matmul(x_rot, codes, scales, bits, group_size, out_features, padded_in,
                              dequantize, chunk=chunk, after=after)


@functools.lru_cache(maxsize=None)
def _kernel():
    return mx.fast.metal_kernel(
        name="tq_gemv",
        input_names=["x", "codes", "scales", "levels", "indices"],
        output_names=["y"],
        source=SOURCE,
        header=HEADER,
    )


def _bits_arg(bits) -> int:
    return 0 if bits == "ternary" else int(bits)


def _launch(x, codes, scales, indices, bits, group_size, out_features, padded_in, gather):
    """x (T, M, K) float32 -> (T, M, N) float32."""
    t, m, _ = x.shape
    (y,) = _kernel()(
        inputs=[x, codes, scales, reference.levels(bits), indices],
        template=[
            ("BITS", _bits_arg(bits)),
            ("GATHER", gather),
            ("NROWS", out_features),
            ("NWORDS", codes.shape[-1]),
            ("NGROUPS", padded_in // group_size),
            ("GSIZE", group_size),
            ("KDIM", padded_in),
            ("MROWS", m),
        ],
        grid=(32 * out_features, m, t),
        threadgroup=(32, 1, 1),
        output_shapes=[(t, m, out_features)],
        output_dtypes=[mx.float32],
    )
    return y


def tq_matvec(x_rot, codes, scales, bits, group_size, out_features, padded_in, **_):
    reference.check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in)
    lead = x_rot.shape[:-1]
    x = x_rot.astype(mx.float32).reshape(1, -1, padded_in)
    dummy = mx.zeros((1,), dtype=mx.uint32)
    y = _launch(x, codes, scales, dummy, bits, group_size, out_features, padded_in, False)
    return y.reshape(*lead, out_features).astype(x_rot.dtype)


def tq_gather_matmul(
    x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, **kw
):
    reference.check_args(
        x_rot, codes, scales, bits, group_size, out_features, padded_in, experts=True
    )
    batch = mx.broadcast_shapes(tuple(x_rot.shape[:-2]), tuple(indices.shape))
    m = x_rot.shape[-2]
    pairs = 1
    for b in batch:
        pairs *= b
    if pairs == 0:
        raise NotImplementedError  # the reference returns the empty result
    if pairs * m > reference.GATHER_MAX_ROWS:  # prefill: the experts in use, MLX's gather_mm
        out_dtype = kw.get("out_dtype") or x_rot.dtype
        y = tiles.gathered_matmul(x_rot.astype(tiles.compute_dtype(out_dtype)), codes, scales,
                                  indices, bits, group_size, out_features, padded_in,
                                  dequantize, sorted_indices=kw.get("sorted_indices", False))
        return y.astype(out_dtype)
    x = mx.broadcast_to(x_rot, (*batch, m, padded_in)).reshape(pairs, m, padded_in)
    idx = mx.broadcast_to(indices, batch).reshape(-1).astype(mx.uint32)
    y = _launch(x.astype(mx.float32), codes, scales, idx, bits, group_size, out_features,
                padded_in, True)
    return y.reshape(*batch, m, out_features).astype(x_rot.dtype)


if mx.metal.is_available():
    dispatch.register("metal", "matvec", tq_matvec)
    dispatch.register("metal", "gather_matmul", tq_gather_matmul)
    dispatch.register("metal", "matmul", tq_matmul)

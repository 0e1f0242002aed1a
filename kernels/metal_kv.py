"""Metal decode attention over the compressed part of the TurboQuant KV cache.

`decode_attention(queries, parts, scale, mask)` is `kv_reference.tq_attention` with its
compressed span scored by one `mx.fast.metal_kernel` launch instead of the reference's
blocks (which decode every code to a float32 K and V block first); the fp16 sink and tail,
the merges and the single un-rotation stay the reference's MLX ops.

The kernel, split-K: one simdgroup (32 threads) per (chunk of TOKENS tokens, batch x KV
head), for the KV head's R query rows at once (each code read and looked up once for the
group). Lane l holds the rotated queries' dims l, l + 32, ... and walks the chunk a token
at a time: its part of each `q_rot . levels_k[codes]` (codes read straight from the packed
words), `simd_sum`, times the key's norm * scale / sqrt(k_dim); an online softmax per
row; and its value dims l, l + 32, ... accumulated as `p * vnorm / sqrt(v_dim) *
levels_v[code]` in the rotated domain. Per chunk it writes (max, sum, accumulator);
`merge_chunks` folds them into the reference's (max, sum, accumulator) piece.

Written without a Mac: `tests/test_kernels_metal_kv.py` compiles the kernel's header and
body as C++ (32 threads and a barrier stand in for a simdgroup and its `simd_sum`) and
checks it against the reference on Linux; its test on a real Metal device skips here.
`runtime.kv_attention` uses it on Metal only with TURBOQUANT_METAL_KV=1 until it has run
on a Mac. Raises NotImplementedError (the caller falls back to the reference) for more
than one query position, masks, head dims that are not multiples of 32 or over 256, and
more than 8 query heads per KV head.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from .kv_reference import NEG, KVParts, PackedKV, kv_levels, tq_attention

TOKENS = 128  # tokens a simdgroup walks (a chunk)
MAX_DIMS = 256  # head dims: 8 per lane at most
MAX_ROWS = 8  # query heads per KV head (GQA group) a simdgroup holds

HEADER = f"""
#define NEG_SCORE ({NEG!r}f)  // kv_reference.NEG: an empty chunk merges with weight zero

""" + """
// Code i of a packed head vector whose words are ws apart (kv_reference.pack_kv): 2, 4
// and 8 bits at bit BITS * (i % (32 / BITS)) of word i / (32 / BITS); 3 bits at bit
// 3 * (i % 32) of the 3 words of block i / 32, straddling two words for codes 10 and 21.
template <int BITS, typename P>
inline uint tq_kv_code(P row, long ws, uint i) {
    if (BITS == 3) {
        const uint bit = 3u * (i % 32u);
        const uint w = (i / 32u) * 3u + bit / 32u;
        const uint s = bit % 32u;
        uint c = uint(row[long(w) * ws]) >> s;
        if (s > 29u) {
            c |= uint(row[long(w + 1u) * ws]) << (32u - s);
        }
        return c & 7u;
    } else {
        const uint per = 32u / uint(BITS);
        return (uint(row[long(i / per) * ws]) >> ((i % per) * uint(BITS))) & ((1u << uint(BITS)) - 1u);
    }
}
"""

# inputs: q_rot (rows, KD) float32, rows = (b * KV + h) * R + r; k_codes, v_codes
# (B, KV, C, words) uint32 and k_norms, v_norms (B, KV, C) float16, strided; consts
# float32 [scale / sqrt(KD), 1 / sqrt(DV), kbook (2^BK), vbook (2^BV)].
# outputs: part_m, part_s (rows, NCH); part_acc (rows, NCH, DV).
# A simdgroup takes the R query rows of its KV head (GQA), so each code is read and looked
# up once for all of them.
SOURCE = """
    const uint lane = thread_index_in_simdgroup;
    const uint chunk = threadgroup_position_in_grid.x;
    const uint bk = threadgroup_position_in_grid.y;  // b * KV + h
    const long b = long(bk / uint(KV)), h = long(bk % uint(KV));
    const int C = int(k_codes_shape[2]);
    const long nch = long((C + TOKENS - 1) / TOKENS);
    const int t0 = int(chunk) * TOKENS;
    const int t1 = min(C, t0 + TOKENS);
    const long kc = b * k_codes_strides[0] + h * k_codes_strides[1];
    const long vc = b * v_codes_strides[0] + h * v_codes_strides[1];
    const long kn = b * k_norms_strides[0] + h * k_norms_strides[1];
    const long vn = b * v_norms_strides[0] + h * v_norms_strides[1];
    const float kscale = consts[0], vscale = consts[1];
    const int KL = KD / 32, VL = DV / 32;  // dims a lane
    float q[R][KL];
    float acc[R][VL];
    float m[R], l[R];
    for (int r = 0; r < R; ++r) {
        for (int j = 0; j < KL; ++j) {
            q[r][j] = q_rot[(long(bk) * R + r) * KD + long(lane) + 32 * j];
        }
        for (int j = 0; j < VL; ++j) {
            acc[r][j] = 0.0f;
        }
        m[r] = NEG_SCORE;
        l[r] = 0.0f;
    }
    for (int t = t0; t < t1; ++t) {
        auto krow = k_codes + kc + long(t) * k_codes_strides[2];
        float part[R];
        for (int r = 0; r < R; ++r) {
            part[r] = 0.0f;
        }
        for (int j = 0; j < KL; ++j) {
            const float x = consts[2 + tq_kv_code<BK>(krow, k_codes_strides[3], lane + 32u * uint(j))];
            for (int r = 0; r < R; ++r) {
                part[r] += q[r][j] * x;
            }
        }
        const float knorm = float(k_norms[kn + long(t) * k_norms_strides[2]]) * kscale;
        const float vnorm = float(v_norms[vn + long(t) * v_norms_strides[2]]) * vscale;
        float a[R], pv[R];
        for (int r = 0; r < R; ++r) {
            const float s = simd_sum(part[r]) * knorm;
            const float m_new = max(m[r], s);
            a[r] = exp(m[r] - m_new);
            const float p = exp(s - m_new);
            l[r] = l[r] * a[r] + p;
            pv[r] = p * vnorm;
            m[r] = m_new;
        }
        auto vrow = v_codes + vc + long(t) * v_codes_strides[2];
        for (int j = 0; j < VL; ++j) {
            const uint code = tq_kv_code<BV>(vrow, v_codes_strides[3], lane + 32u * uint(j));
            const float x = consts[2 + (1 << BK) + code];
            for (int r = 0; r < R; ++r) {
                acc[r][j] = acc[r][j] * a[r] + pv[r] * x;
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const long at = (long(bk) * R + r) * nch + long(chunk);
        if (lane == 0u) {
            part_m[at] = m[r];
            part_s[at] = l[r];
        }
        for (int j = 0; j < VL; ++j) {
            part_acc[at * DV + long(lane) + 32 * j] = acc[r][j];
        }
    }
"""

INPUTS = ["q_rot", "k_codes", "k_norms", "v_codes", "v_norms", "consts"]
OUTPUTS = ["part_m", "part_s", "part_acc"]


@functools.lru_cache(maxsize=None)
def _kernel():
    return mx.fast.metal_kernel(
        name="tq_kv_decode", input_names=INPUTS, output_names=OUTPUTS, source=SOURCE,
        header=HEADER, ensure_row_contiguous=False,  # the cache's parts are strided slices
    )


@functools.lru_cache(maxsize=64)
def consts(bits_k: int, bits_v: int, k_dim: int, v_dim: int, scale: float) -> mx.array:
    """The kernel's float32 constants: [scale / sqrt(k_dim), 1 / sqrt(v_dim), levels_k,
    levels_v]."""
    head = mx.array([scale / math.sqrt(k_dim), 1.0 / math.sqrt(v_dim)], dtype=mx.float32)
    return mx.concatenate([head, kv_levels(bits_k), kv_levels(bits_v)])


def check_shapes(k_dim: int, v_dim: int, rows: int = 1) -> None:
    """NotImplementedError where the kernel's lanes cannot hold the head dims, or a
    simdgroup the query rows of a KV head."""
    for d in (k_dim, v_dim):
        if d % 32 or d > MAX_DIMS:
            raise NotImplementedError(f"head dim {d}: the Metal kernel takes multiples of 32 "
                                      f"up to {MAX_DIMS}")
    if rows > MAX_ROWS:
        raise NotImplementedError(f"{rows} query heads per KV head: the Metal kernel takes "
                                  f"up to {MAX_ROWS}")


def merge_chunks(part_m: mx.array, part_s: mx.array, part_acc: mx.array):
    """Per-chunk (max, sum, accumulator) (rows, NCH[, DV]) -> one piece per row: the
    log-sum-exp merge over chunks (empty chunks hold NEG and weigh nothing)."""
    m = mx.max(part_m, axis=1, keepdims=True)
    w = mx.exp(part_m - m)
    s = mx.sum(part_s * w, axis=1, keepdims=True)
    acc = mx.sum(part_acc * w[..., None], axis=1)
    return m, s, acc


def compressed_piece(q_rot: mx.array, packed: PackedKV, scale: float):
    """The compressed span's (max, sum, accumulator in the rotated domain) for the
    reference's rotated queries q_rot (B, KV, R, 1, KD): shapes (B, KV, R, 1, 1) twice and
    (B, KV, R, 1, DV)."""
    b, kv, r, n_q, kd = q_rot.shape
    if n_q != 1:
        raise NotImplementedError("the Metal kernel takes one query position")
    check_shapes(packed.k_dim, packed.v_dim, r)
    rows, dv = b * kv * r, packed.v_dim
    nch = -(-packed.length // TOKENS)
    part_m, part_s, part_acc = _kernel()(
        inputs=[mx.contiguous(q_rot.reshape(rows, kd).astype(mx.float32)),
                packed.k_codes, packed.k_norms, packed.v_codes, packed.v_norms,
                consts(packed.bits_k, packed.bits_v, packed.k_dim, dv, float(scale))],
        template=[("KD", kd), ("DV", dv), ("BK", packed.bits_k), ("BV", packed.bits_v),
                  ("R", r), ("KV", kv), ("TOKENS", TOKENS)],
        grid=(32 * nch, b * kv, 1), threadgroup=(32, 1, 1),
        output_shapes=[(rows, nch), (rows, nch), (rows, nch, dv)],
        output_dtypes=[mx.float32] * 3,
    )
    m, s, acc = merge_chunks(part_m, part_s, part_acc)
    return (m.reshape(b, kv, r, 1, 1), s.reshape(b, kv, r, 1, 1),
            acc.reshape(b, kv, r, 1, dv))


def decode_attention(queries: mx.array, parts: KVParts, scale: float, mask=None) -> mx.array:
    """`tq_attention` for one query position with the compressed span on the Metal kernel
    (NotImplementedError: use the reference)."""
    if queries.shape[2] != 1:
        raise NotImplementedError("the Metal kernel takes one query position")
    if mask is not None and not isinstance(mask, str):
        raise NotImplementedError("masks are left to the reference")
    if parts.packed is not None:
        check_shapes(parts.packed.k_dim, parts.packed.v_dim,
                     queries.shape[1] // parts.packed.k_codes.shape[1])
    return tq_attention(queries, parts, scale, mask, compressed=compressed_piece)


__all__ = ["HEADER", "SOURCE", "compressed_piece", "decode_attention", "merge_chunks"]

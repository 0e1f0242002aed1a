"""Pure-MLX reference for the compressed KV cache: the CPU path and the oracle for kernels.

Codec, one head vector x of size d at a time (keys and values alike, each with its bits):

    y = rotate(x, seed)                 seeded Hadamard (stages.rotate), ||y|| = ||x||
    u = y / ||x|| * sqrt(d)             coordinates ~ N(0, 1) for any x after the rotation
    codes = nearest Lloyd-Max level of u for N(0, 1)        (2, 3, 4 or 8 bits)
    norm  = ||x|| (fp16), or with norm correction ||x|| * sqrt(d) / ||levels[codes]||,
            which makes the decoded vector's norm exact (the cache's default)
    decode: x ~ unrotate(levels[codes] * norm / sqrt(d))

Codes are packed per head vector into uint32 words: 2, 3, 4 bits as stages.pack_codes
(3 bits: 32 codes in three words), 8 bits four codes a word, code i at bit 8 * (i % 4)
(so on little-endian machines, which MLX runs on, the bytes are the codes).
8 bits uses the 8-bit Lloyd-Max codebook, computed like the others by stages.codebook: MSE
4.1e-5 on N(0, 1), against 8.8e-5 for the best uniform 256-level grid (+-4 sigma).

Attention never dequantizes the cache as a whole. For queries q (B, H, L, D):

    scores_c = (rotate(q) . levels[kcodes]) * knorm * scale / sqrt(d)     per key
    out_c    = sum_c p_c * vnorm_c / sqrt(d) * levels[vcodes_c]           rotated domain

Every part is walked in blocks of at most `CHUNK` float32 values (`CHUNK_GPU` on a GPU):
an online softmax carries max, sum and accumulator, and each block is ordered after the
previous one (`mx.depends`) so decoded blocks never pile up. The compressed span
accumulates in the rotated domain and `unrotate` runs once; the fp16 parts (sinks and
the hot window) accumulate in the original domain; the two merge by log-sum-exp.
GQA: queries are grouped (B, KV, H/KV, L, D), so each KV head is decoded once for its
group. The same function is the chunked prefill path (L > 1).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import mlx.core as mx

from turboquant.stages import (
    codebook_values,
    lloyd_max_mse,
    pack_codes,
    rotate,
    unpack_codes,
    unrotate,
)

KV_BITS = (2, 3, 4, 8)
CHUNK = 1 << 22  # float32 values per block on the CPU (16 MiB)
CHUNK_GPU = 1 << 26  # on a GPU: fewer, larger blocks (256 MiB), fewer kernel launches
NEG = -1e30  # masked score: finite, so a fully masked chunk merges with weight zero
FP16_MAX = 65504.0


def check_kv_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise ValueError(f"KV bits must be one of {KV_BITS}, got {bits!r}")
    return int(bits)


# ---------------------------------------------------------------------------- codec


@functools.lru_cache(maxsize=None)
def kv_levels(bits: int) -> mx.array:
    """Lloyd-Max levels for N(0, 1) in code order, float32."""
    return codebook_values(check_kv_bits(bits))


@functools.lru_cache(maxsize=None)
def _thresholds(bits: int) -> mx.array:
    lv = kv_levels(bits)
    return (lv[:-1] + lv[1:]) / 2


def kv_mse(bits: int) -> float:
    """Per-coordinate MSE of the codebook on N(0, 1): the codec's relative error."""
    return lloyd_max_mse(check_kv_bits(bits))


COUNT_LIMIT = 1 << 22  # kv_codes counts thresholds at once up to this many comparisons


def kv_codes(u: mx.array, bits: int) -> mx.array:
    """Index of the nearest level for every entry (uint8).

    The code is the number of thresholds below u, the same as stages.nearest_codes. Small
    inputs (a decode step's flush) count all 2**bits - 1 comparisons at once: four MLX ops,
    where a step of the cache is bound by the host's cost per op; large ones (prefill,
    8-bit codes) take a bits-step binary search, bits comparisons per entry. Same codes.
    """
    thr = _thresholds(check_kv_bits(bits))
    u = u.astype(mx.float32)
    if u.size * thr.size <= COUNT_LIMIT:
        return mx.sum(u[..., None] > thr, axis=-1).astype(mx.uint8)
    code = mx.zeros(u.shape, dtype=mx.int32)
    step = 1 << (bits - 1)
    while step:
        cand = code + step
        code = mx.where(u > thr[cand - 1], cand, code)
        step >>= 1
    return code.astype(mx.uint8)


def kv_words(head_dim: int, bits: int) -> int:
    """uint32 words of one packed head vector."""
    bits = check_kv_bits(bits)
    if bits == 3:
        return -(-head_dim // 32) * 3
    per = 32 // bits
    return -(-head_dim // per)


_SHIFT8 = mx.array([0, 8, 16, 24], dtype=mx.uint32)


def pack_kv(codes: mx.array, bits: int) -> mx.array:
    """uint8 codes (..., d) -> uint32 words (..., kv_words(d, bits))."""
    if check_kv_bits(bits) != 8:
        return pack_codes(codes, bits)
    d = codes.shape[-1]
    pad = -d % 4
    c = codes.astype(mx.uint32)
    if pad:
        c = mx.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, pad)])
    c = c.reshape(*c.shape[:-1], (d + pad) // 4, 4)
    return mx.sum(c << _SHIFT8, axis=-1).astype(mx.uint32)


def unpack_kv(words: mx.array, bits: int, head_dim: int) -> mx.array:
    """uint32 words (..., w) -> codes (..., head_dim); the inverse of pack_kv."""
    bits = check_kv_bits(bits)
    if bits == 3:
        return unpack_codes(words, 3, head_dim)
    if bits == 8:  # code i is byte i of the little-endian words
        c = words.view(mx.uint8)
        return c if c.shape[-1] == head_dim else c[..., :head_dim]
    per = 32 // bits
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    c = (words[..., None] >> shifts) & ((1 << bits) - 1)
    c = c.reshape(*words.shape[:-1], words.shape[-1] * per)
    return c if c.shape[-1] == head_dim else c[..., :head_dim]


def kv_quantize(
    x: mx.array, bits: int, seed: int, norm_correction: bool = False
) -> tuple[mx.array, mx.array]:
    """Head vectors x (..., d) -> (packed codes uint32 (..., words), norms float16 (...))."""
    bits = check_kv_bits(bits)
    d = x.shape[-1]
    y = rotate(x.astype(mx.float32), seed)
    norm = mx.sqrt(mx.sum(y * y, axis=-1))
    safe = mx.where(norm > 0, norm, 1.0)
    codes = kv_codes(y * (math.sqrt(d) / safe)[..., None], bits)
    if norm_correction:
        q = kv_levels(bits)[codes]
        qn = mx.sqrt(mx.sum(q * q, axis=-1))
        norm = norm * math.sqrt(d) / mx.where(qn > 0, qn, 1.0)
    norm = mx.minimum(norm, FP16_MAX)  # fp16 range; real K/V norms are far below
    return pack_kv(codes, bits), norm.astype(mx.float16)


def kv_dequantize(
    words: mx.array, norms: mx.array, bits: int, seed: int, head_dim: int, rotated: bool = False
) -> mx.array:
    """The decoded head vectors, float32 (..., head_dim); `rotated` skips the unrotate."""
    q = kv_levels(bits)[unpack_kv(words, bits, head_dim)]
    y = q * (norms.astype(mx.float32) / math.sqrt(head_dim))[..., None]
    return y if rotated else unrotate(y, seed)


# ---------------------------------------------------------------------------- attention


@dataclass
class PackedKV:
    """A compressed span of T tokens: codes (B, KV, T, words) uint32, norms (B, KV, T) fp16."""

    k_codes: mx.array
    k_norms: mx.array
    v_codes: mx.array
    v_norms: mx.array
    bits_k: int
    bits_v: int
    seed: int
    k_dim: int
    v_dim: int
    # what a decode kernel derived from this span and the call's other settings (say, a
    # launch layout), kept with the span: a cache reuses its view for `block` tokens
    launches: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def length(self) -> int:
        return self.k_codes.shape[2]


@dataclass
class KVParts:
    """What one attention call sees, in temporal (mask column) order:

    sink (fp16) | packed (compressed) | tail (fp16, the hot window and the newest tokens).
    Any part may be empty (None). Mask columns index the concatenation.
    """

    sink_k: mx.array | None
    sink_v: mx.array | None
    packed: PackedKV | None
    tail_k: mx.array | None
    tail_v: mx.array | None

    @property
    def lengths(self) -> tuple[int, int, int]:
        s = 0 if self.sink_k is None else self.sink_k.shape[2]
        c = 0 if self.packed is None else self.packed.length
        t = 0 if self.tail_k is None else self.tail_k.shape[2]
        return s, c, t

    @property
    def length(self) -> int:
        return sum(self.lengths)


def _group(x: mx.array, kv_heads: int) -> mx.array:
    """(B, H, L, D) -> (B, KV, H/KV, L, D)."""
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d)


def _mask5(mask, n_heads: int, kv_heads: int):
    """An mlx-lm mask array, shaped to broadcast against (B, KV, H/KV, L, T)."""
    if mask.ndim == 4:
        if mask.shape[1] == n_heads and n_heads != kv_heads:
            b, _, n, t = mask.shape
            return mask.reshape(b, kv_heads, n_heads // kv_heads, n, t)
        return mx.expand_dims(mask, 2)
    if mask.ndim == 3:  # (B, L, T)
        return mx.expand_dims(mask, (1, 2))
    return mask  # (T,) or (L, T): broadcasts on the trailing axes


def _masked(scores, mask, c0: int, c1: int, q_cols: mx.array | None):
    """Apply the mask to scores over columns [c0, c1)."""
    if q_cols is not None:  # "causal": query i is column T - L + i
        keep = q_cols[:, None] >= mx.arange(c0, c1)[None]
        return mx.where(keep, scores, NEG)
    if mask is None:
        return scores
    m = mask[..., c0:c1]
    if m.dtype == mx.bool_:
        return mx.where(m, scores, NEG)
    return scores + m.astype(scores.dtype)


def _piece(scores):
    """(running max, sum of exp, probabilities) of one block of scores."""
    m = mx.maximum(mx.max(scores, axis=-1, keepdims=True), NEG)  # -inf masks: no NaN
    p = mx.exp(scores - m)
    return m, mx.sum(p, axis=-1, keepdims=True), p


def _merge(a, b):
    """Log-sum-exp merge of two (max, sum, accumulator) pieces."""
    if a is None:
        return b
    (ma, la, oa), (mb, lb, ob) = a, b
    m = mx.maximum(ma, mb)
    wa, wb = mx.exp(ma - m), mx.exp(mb - m)
    return m, la * wa + lb * wb, oa * wa + ob * wb


def _chunk_tokens(b: int, kv: int, dims: int, q_rows: int, chunk: int | None) -> int:
    """Tokens per block: bound both the decoded K/V block and the score block."""
    limit = chunk or (CHUNK if mx.default_device().type == mx.cpu else CHUNK_GPU)
    return max(16, limit // (b * kv * max(dims, q_rows)))


def _after(x: mx.array, prev):
    """x, evaluated only once prev is: keeps decoded blocks from piling up."""
    return x if prev is None else mx.depends(x, prev)


def _compressed_blocks(qr, pk: "PackedKV", scale: float, mask, q_cols, s_len: int, rows: int,
                       chunk: int | None, prev):
    """The compressed span's (max, sum, accumulator in the rotated domain), walked in
    blocks of decoded codes (the scores against the rotated queries qr)."""
    b, kv, c_len = pk.k_codes.shape[:3]
    kbook, vbook = kv_levels(pk.bits_k), kv_levels(pk.bits_v)
    k_scale = pk.k_norms.astype(mx.float32) * (scale / math.sqrt(pk.k_dim))
    v_scale = pk.v_norms.astype(mx.float32) / math.sqrt(pk.v_dim)
    step = _chunk_tokens(b, kv, pk.k_dim + pk.v_dim, rows, chunk)
    comp = None
    for c0 in range(0, c_len, step):
        c1 = min(c0 + step, c_len)
        lk = kbook[unpack_kv(_after(pk.k_codes[:, :, c0:c1], prev), pk.bits_k, pk.k_dim)]
        scores = qr @ mx.expand_dims(lk, 2).swapaxes(-1, -2)
        scores = scores * k_scale[:, :, None, None, c0:c1]
        m, s, p = _piece(_masked(scores, mask, s_len + c0, s_len + c1, q_cols))
        lv = vbook[unpack_kv(pk.v_codes[:, :, c0:c1], pk.bits_v, pk.v_dim)]
        acc = (p * v_scale[:, :, None, None, c0:c1]) @ mx.expand_dims(lv, 2)
        comp = _merge(comp, (m, s, acc))
        prev = comp[2]
    return comp


def tq_attention(
    queries: mx.array,
    parts: KVParts,
    scale: float,
    mask=None,
    *,
    chunk: int | None = None,
    compressed=None,
) -> mx.array:
    """Attention of queries (B, H, L, D) over sink + compressed + tail -> (B, H, L, Dv).

    `mask`: None, "causal" (query i sits at column T - L + i), or an mlx-lm mask array
    (bool or additive) over the T columns of `parts` in temporal order. Every part is
    walked in blocks (`chunk` bounds a block's float32 values), so prefill stays bounded.
    `compressed(q_rot, packed, scale) -> (max, sum, accumulator)`, if given, scores the
    compressed span of an unmasked one-token step instead of those blocks (a kernel:
    `metal_kv.compressed_piece`); q_rot (B, KV, R, 1, D), the accumulator un-rotated here.
    """
    b, h, n_q, _ = queries.shape
    s_len, c_len, t_len = parts.lengths
    total = s_len + c_len + t_len
    if total == 0:
        raise ValueError("attention over an empty KV cache")
    if c_len:
        kv = parts.packed.k_codes.shape[1]
    else:
        kv = (parts.sink_k if parts.sink_k is not None else parts.tail_k).shape[1]
    if h % kv:
        raise ValueError(f"{h} query heads do not group over {kv} KV heads")
    q = _group(queries.astype(mx.float32), kv)  # (B, KV, R, L, D)
    q_cols = None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        q_cols = mx.arange(total - n_q, total) if n_q > 1 else None
        mask = None
    elif mask is not None:
        mask = _mask5(mask, h, kv)
    rows = h // kv * n_q

    fp, prev = None, None  # online softmax over the fp16 parts, original domain
    qs = q * scale
    for k, v, col in ((parts.sink_k, parts.sink_v, 0), (parts.tail_k, parts.tail_v, s_len + c_len)):
        if k is None:
            continue
        step = _chunk_tokens(b, kv, k.shape[-1] + v.shape[-1], rows, chunk)
        for a in range(0, k.shape[2], step):
            e = min(a + step, k.shape[2])
            kb = _after(k[:, :, a:e], prev).astype(mx.float32)
            scores = qs @ mx.expand_dims(kb, 2).swapaxes(-1, -2)
            m, s, p = _piece(_masked(scores, mask, col + a, col + e, q_cols))
            fp = _merge(fp, (m, s, p @ mx.expand_dims(v[:, :, a:e].astype(mx.float32), 2)))
            prev = fp[2]

    out = fp
    if c_len:
        pk = parts.packed
        qr = rotate(q, pk.seed)  # rotate the query once
        if compressed is not None and n_q == 1 and mask is None and q_cols is None:
            m, s, acc = compressed(qr, pk, scale)
        else:
            m, s, acc = _compressed_blocks(qr, pk, scale, mask, q_cols, s_len, rows, chunk, prev)
        out = _merge(out, (m, s, unrotate(acc, pk.seed)))  # un-rotate once

    _, s, acc = out
    o = acc / s
    return o.reshape(b, h, n_q, o.shape[-1]).astype(queries.dtype)


def dense_parts(parts: KVParts) -> tuple[mx.array, mx.array]:
    """Keys and values of every token, decoded, float32 (B, KV, T, D): for tests and debugging."""
    ks, vs = [], []
    if parts.sink_k is not None:
        ks.append(parts.sink_k.astype(mx.float32))
        vs.append(parts.sink_v.astype(mx.float32))
    if parts.packed is not None and parts.packed.length:
        pk = parts.packed
        ks.append(kv_dequantize(pk.k_codes, pk.k_norms, pk.bits_k, pk.seed, pk.k_dim))
        vs.append(kv_dequantize(pk.v_codes, pk.v_norms, pk.bits_v, pk.seed, pk.v_dim))
    if parts.tail_k is not None:
        ks.append(parts.tail_k.astype(mx.float32))
        vs.append(parts.tail_v.astype(mx.float32))
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


__all__ = [
    "CHUNK",
    "KVParts",
    "KV_BITS",
    "PackedKV",
    "check_kv_bits",
    "dense_parts",
    "kv_codes",
    "kv_dequantize",
    "kv_levels",
    "kv_mse",
    "kv_quantize",
    "kv_words",
    "pack_kv",
    "tq_attention",
    "unpack_kv",
]

"""Pure-MLX reference for every TurboQuant kernel: the CPU path and the oracle for CUDA/Metal.

All kernels take activations already rotated with the weight's seed and zero-padded to
`padded_in`, and packed codes and fp16 scales laid out as in docs/FORMAT.md:

    y[..., r] = sum_g scales[r, g] * sum_j levels[codes[r, g*gs + j]] * x_rot[..., g*gs + j]

No kernel materialises the dense matrix. Rows (output features) are decoded in chunks of
at most `chunk` weights (default `CHUNK`), and each chunk's decode is made to depend on
the previous chunk's result (`mx.depends`), so MLX's scheduler cannot decode every chunk
first and multiply afterwards: the peak stays at a few chunks, whatever the matrix size.

- `tq_matvec`: the GEMV path for decoding (a handful of tokens). Per chunk of rows it
  forms per-group dot products of the codebook values with x, then applies the scales to
  the group sums, which is the order a fused kernel computes in.
- `tq_matmul`: the tiled GEMM path for prefill. Per tile of rows it decodes levels times
  scales once and multiplies all tokens by the tile (one dense `matmul` per tile).
- `tq_gather_matmul`: experts stacked (E, out, ...) chosen per token by `indices`, like
  `mx.gather_mm`. Few (token, expert) pairs: gather the chosen experts' rows chunk by
  chunk. Many: group the pairs by expert (one host read of the indices) and run one GEMM
  per expert that is used.

Everything is computed in float32 and returned in x's dtype.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

CHUNK = 1 << 22  # weights decoded at once (16 MiB in float32)
GATHER_MAX_ROWS = 16  # gathered variant: above this many activation rows, group by expert

WIDTHS = (2, 3, 4, "ternary")


# ---------------------------------------------------------------------------- packing


def is_trellis(bits) -> bool:
    """A trellis code (stages.trellis.TrellisBits) where a scalar code has its width."""
    return type(bits).__name__ == "TrellisBits"


def check_bits(bits):
    if is_trellis(bits):
        return bits
    if bits not in WIDTHS or isinstance(bits, bool):
        raise ValueError(f"bits must be one of 2, 3, 4 or 'ternary', got {bits!r}")
    return bits


def words_per_row(n: int, bits) -> int:
    """uint32 words that hold n codes of this width (docs/FORMAT.md, packing); a trellis
    code's are those of the scalar code at its bits."""
    bits = check_bits(bits)
    if is_trellis(bits):
        bits = bits.bits
    if bits == "ternary":
        return -(-n // 20)
    if bits == 3:
        return -(-n // 32) * 3
    return -(-n * bits // 32)


@functools.lru_cache(maxsize=None)
def levels(bits) -> mx.array:
    """The codebook in code order, float32 (imported lazily: stages owns the codebooks)."""
    from turboquant.stages import codebook_values

    return codebook_values(check_bits(bits))


@functools.lru_cache(maxsize=None)
def _three_bit_plan() -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """For code j of a 96-bit block: its word, shift, and the straddling high part."""
    j = [3 * i for i in range(32)]
    word = [b // 32 for b in j]
    shift = [b % 32 for b in j]
    straddle = [s > 29 for s in shift]
    nxt = [min(w + 1, 2) for w in word]
    hi_shift = [(32 - s) % 32 for s in shift]
    u32 = mx.uint32
    return (
        mx.array(word, dtype=mx.int32),
        mx.array(shift, dtype=u32),
        mx.array(nxt, dtype=mx.int32),
        mx.array(hi_shift, dtype=u32),
        mx.array(straddle, dtype=u32),
    )


@functools.lru_cache(maxsize=None)
def _powers_of_three() -> mx.array:
    return mx.array([3**i for i in range(20)], dtype=mx.uint32)


def unpack(codes: mx.array, bits, n: int) -> mx.array:
    """Packed uint32 words (..., words) -> code indices uint32 (..., n)."""
    bits = check_bits(bits)
    lead = codes.shape[:-1]
    words = codes.shape[-1]
    if bits in (2, 4):
        per = 32 // bits
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        out = (codes[..., None] >> shifts) & mx.array((1 << bits) - 1, dtype=mx.uint32)
        out = out.reshape(*lead, words * per)
    elif bits == 3:
        word, shift, nxt, hi_shift, straddle = _three_bit_plan()
        blocks = codes.reshape(*lead, words // 3, 3)
        lo = mx.take(blocks, word, axis=-1) >> shift
        hi = (mx.take(blocks, nxt, axis=-1) << hi_shift) * straddle
        out = ((lo | hi) & mx.array(7, dtype=mx.uint32)).reshape(*lead, words // 3 * 32)
    else:
        out = (codes[..., None] // _powers_of_three()) % mx.array(3, dtype=mx.uint32)
        out = out.reshape(*lead, words * 20)
    return out[..., :n]


def unit_values(codes: mx.array, bits, padded_in: int) -> mx.array:
    """Each weight's value before its group scale, float32 (..., padded_in): the codebook's
    level, or a trellis code's computed value (stages.trellis.decode_words_mx: per weight
    an L-bit window of two words, a multiply-add, a shift-xor and a byte sum)."""
    if is_trellis(bits):
        from turboquant.stages.trellis import decode_words_mx

        return decode_words_mx(bits.code, codes, bits.block)[..., :padded_in]
    return levels(bits)[unpack(codes, bits, padded_in)]


def dequantize(codes: mx.array, scales: mx.array, bits, group_size: int, padded_in: int):
    """Rows of rotated weights: levels[codes] * scale, float32 (..., padded_in).

    The caller bounds the size: this decodes every row it is given.
    """
    q = unit_values(codes, bits, padded_in)
    lead = q.shape[:-1]
    q = q.reshape(*lead, padded_in // group_size, group_size)
    q = q * scales.astype(mx.float32)[..., None]
    return q.reshape(*lead, padded_in)


# ---------------------------------------------------------------------------- checks


def check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in, experts=False):
    check_bits(bits)
    if padded_in % group_size:
        raise ValueError(f"padded_in {padded_in} is not a multiple of group_size {group_size}")
    if x_rot.shape[-1] != padded_in:
        raise ValueError(
            f"x_rot has last axis {x_rot.shape[-1]}, expected padded_in={padded_in} "
            "(rotate, then zero-pad)"
        )
    lead = codes.shape[:-2] if experts else ()
    want_codes = (*lead, out_features, words_per_row(padded_in, bits))
    want_scales = (*lead, out_features, padded_in // group_size)
    if tuple(codes.shape[-2:]) != want_codes[-2:] or codes.dtype != mx.uint32:
        raise ValueError(f"codes {codes.shape} {codes.dtype}, expected uint32 {want_codes}")
    if tuple(scales.shape) != want_scales:
        raise ValueError(f"scales {scales.shape}, expected {want_scales}")


def _rows_per_chunk(cols: int, chunk: int | None, copies: int = 1) -> int:
    return max(1, (chunk or CHUNK) // max(1, cols * copies))


def _after(a: mx.array, prev: mx.array | None) -> mx.array:
    """a, evaluated only once prev is: keeps decoded chunks from piling up."""
    return a if prev is None else mx.depends(a, prev)


# ---------------------------------------------------------------------------- GEMV / GEMM


def tq_matvec(
    x_rot, codes, scales, bits, group_size, out_features, padded_in, *, chunk=None, after=None
):
    """GEMV (decode): x_rot (..., padded_in), few tokens -> (..., out_features)."""
    check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in)
    lead = x_rot.shape[:-1]
    groups = padded_in // group_size
    x = x_rot.astype(mx.float32).reshape(-1, 1, groups, group_size)  # (M, 1, G, gs)
    rows = _rows_per_chunk(padded_in, chunk, copies=x.shape[0])
    parts, prev = [], after
    for r0 in range(0, out_features, rows):
        r1 = min(r0 + rows, out_features)
        c = _after(codes[r0:r1], prev)
        q = unit_values(c, bits, padded_in).reshape(r1 - r0, groups, group_size)
        partial = (q * x).sum(axis=-1)  # (M, R, G): per-group dot products
        y = (partial * scales[r0:r1].astype(mx.float32)).sum(axis=-1)  # (M, R)
        parts.append(y)
        prev = y
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y.reshape(*lead, out_features).astype(x_rot.dtype)


def tq_matmul(
    x_rot, codes, scales, bits, group_size, out_features, padded_in, *, chunk=None, after=None
):
    """Tiled GEMM (prefill): x_rot (..., padded_in), many tokens -> (..., out_features)."""
    check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in)
    lead = x_rot.shape[:-1]
    x = x_rot.astype(mx.float32).reshape(-1, padded_in)
    rows = _rows_per_chunk(padded_in, chunk)
    parts, prev = [], after
    for r0 in range(0, out_features, rows):
        r1 = min(r0 + rows, out_features)
        w = dequantize(_after(codes[r0:r1], prev), scales[r0:r1], bits, group_size, padded_in)
        y = x @ w.T  # (M, R)
        parts.append(y)
        prev = y
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y.reshape(*lead, out_features).astype(x_rot.dtype)


# ---------------------------------------------------------------------------- gathered


def tq_gather_matmul(
    x_rot,
    codes,
    scales,
    indices,
    bits,
    group_size,
    out_features,
    padded_in,
    *,
    sorted_indices=False,
    chunk=None,
    out_dtype=None,
    gemm=None,
):
    """Experts chosen per token, like `mx.gather_mm(x, W.swapaxes(-1, -2), rhs_indices=...)`.

    x_rot (..., M, padded_in), codes (E, out, words), scales (E, out, groups), indices
    with a shape that broadcasts against x_rot.shape[:-2] -> (*batch, M, out_features),
    in `out_dtype` (x_rot's dtype unless given).
    `sorted_indices` is a hint only (the grouped path sorts anyway). `gemm`: what runs each
    expert's rows in the grouped path (`tq_matmul`'s signature; a backend's tiled product),
    `tq_matmul` unless given.
    """
    out_dtype = out_dtype or x_rot.dtype
    check_args(x_rot, codes, scales, bits, group_size, out_features, padded_in, experts=True)
    if x_rot.ndim < 2:
        raise ValueError(f"x_rot needs at least 2 dims (..., M, K), got {x_rot.shape}")
    batch = mx.broadcast_shapes(tuple(x_rot.shape[:-2]), tuple(indices.shape))
    m = x_rot.shape[-2]
    x = mx.broadcast_to(x_rot, (*batch, m, padded_in)).reshape(-1, m, padded_in)
    idx = mx.broadcast_to(indices, batch).reshape(-1).astype(mx.uint32)
    pairs = idx.shape[0]
    if pairs == 0:
        return mx.zeros((*batch, m, out_features), dtype=out_dtype)
    if pairs * m <= GATHER_MAX_ROWS:
        y = _gather_rows(x, codes, scales, idx, bits, group_size, out_features, padded_in, chunk)
    else:
        y = _grouped(x, codes, scales, idx, bits, group_size, out_features, padded_in, chunk,
                     gemm or tq_matmul)
    return y.reshape(*batch, m, out_features).astype(out_dtype)


def decode_pairs(x_rot, codes, indices, out_features, padded_in, max_pair_rows):
    """(batch, M, pairs) of a gathered call a backend's decode kernel takes: NotImplementedError
    (the caller falls back here, which raises the precise error) for malformed arguments,
    no pairs, or more than `max_pair_rows` pairs x rows (prefill)."""
    if (codes.ndim != 3 or x_rot.ndim < 2 or x_rot.shape[-1] != padded_in
            or codes.shape[1] != out_features):
        raise NotImplementedError
    batch = mx.broadcast_shapes(tuple(x_rot.shape[:-2]), tuple(indices.shape))
    m = x_rot.shape[-2]
    pairs = math.prod(batch)
    if pairs == 0 or pairs * m > max_pair_rows:
        raise NotImplementedError
    return batch, m, pairs


def _gather_rows(x, codes, scales, idx, bits, group_size, out_features, padded_in, chunk):
    """Few pairs: decode the chosen experts' rows, chunk by chunk, for every pair at once."""
    pairs = idx.shape[0]
    x = x.astype(mx.float32)  # (T, M, K)
    rows = _rows_per_chunk(padded_in, chunk, copies=pairs)
    parts, prev = [], None
    for r0 in range(0, out_features, rows):
        r1 = min(r0 + rows, out_features)
        c = _after(codes[idx, r0:r1], prev)  # (T, R, words)
        w = dequantize(c, scales[idx, r0:r1], bits, group_size, padded_in)  # (T, R, K)
        y = x @ w.swapaxes(-1, -2)  # (T, M, R)
        parts.append(y)
        prev = y
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _grouped(x, codes, scales, idx, bits, group_size, out_features, padded_in, chunk, gemm):
    """Many pairs: one GEMM per expert in use (`gemm`), over the rows routed to it."""
    pairs, m, _ = x.shape
    order = mx.argsort(idx)
    experts = idx[order].tolist()  # host read: which experts, and where their runs start
    xs = x[order].reshape(pairs * m, padded_in)
    parts, prev, start = [], None, 0
    while start < pairs:
        e = experts[start]
        stop = start
        while stop < pairs and experts[stop] == e:
            stop += 1
        y = gemm(
            xs[start * m : stop * m],
            codes[e],
            scales[e],
            bits,
            group_size,
            out_features,
            padded_in,
            chunk=chunk,
            after=prev,
        )
        parts.append(y)
        prev = y
        start = stop
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    inverse = mx.argsort(order)
    return y.reshape(pairs, m, out_features)[inverse]


def tq_embedding(ids, codes, scales, bits, group_size, padded_in):
    """Rotated, padded embedding rows for token ids: (..., padded_in) float32."""
    return dequantize(codes[ids], scales[ids], bits, group_size, padded_in)


__all__ = [
    "CHUNK",
    "GATHER_MAX_ROWS",
    "WIDTHS",
    "dequantize",
    "levels",
    "tq_embedding",
    "tq_gather_matmul",
    "tq_matmul",
    "tq_matvec",
    "unpack",
    "words_per_row",
]

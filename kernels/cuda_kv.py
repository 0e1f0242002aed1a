"""CUDA decode attention over the TurboQuant KV cache (`mx.fast.cuda_kernel`).

`decode_attention(queries, parts, scale, mask)` has `kv_reference.tq_attention`'s
signature and computes the same thing for one query position (L = 1), split-K
("flash-decoding") style, in two launches:

1. `tq_kv_partial`, grid (chunks, batch * kv_heads), 128 threads: each block first puts
   the R = H / KV query rows of its KV head (GQA: a KV head is decoded once for its group)
   in shared memory in float32: for the compressed span rotated in the block (signs, the
   Hadamard over P on each of the A segments, the A x A mix: `cuda_rotate`'s
   decomposition) times scale / sqrt(k_dim), for the fp16 parts times scale. It then
   walks its chunk of tokens in tiles of 128 with an online softmax. Scores: a thread per
   token, `knorm * sum_i q_rot[i] * levels_k[code_i]` (codes unpacked from the stored
   words, 32 codes = BITS words at a time); values: a thread per output dim,
   `sum_t p_t * vnorm_t / sqrt(v_dim) * levels_v[code_t,d]`, accumulated in the rotated
   domain. The last FPCH chunks of the grid walk the fp16 sink + tail tokens instead
   (plain dot products, original domain). It writes per chunk (max, sum) and the
   unnormalised accumulator.
2. `tq_kv_merge`, a block per (batch, query head): log-sum-exp merge of the chunks, the
   compressed accumulator un-rotated once (times unrotate(I)), plus the fp16 one, / sum.

Host cost is what decode on MLX's CUDA backend is bound by (every op and kernel call
costs microseconds to build and encode), so a call is kept lean: lengths are read at run
time from the inputs' shapes (`<name>_shape`), so a growing cache does not recompile;
template arguments are only the model's constants (dims, bits, heads, the rotation's
power-of-two factor) and a few flags, everything derivable is derived in the source;
the small float32 inputs (signs, mix, codebooks, scales) travel as one array; and all
that depends only on shapes and settings (`Layout`) is built once and reused for every
token until the chunk counts change. The cache's parts are slices of bigger buffers: the
kernels index them through their strides (`<name>_strides`,
`ensure_row_contiguous=False`), so nothing is copied. Masks: None, "causal", or an
mlx-lm mask array that is the same for every head (bool or additive, one row per batch
or one for all).

Raises NotImplementedError (the caller falls back to the reference) for: more than one
query position, nothing compressed yet, per-head masks, sink and tail of different
dtypes, and shapes too large for the kernel's shared memory / registers.
`tests/test_kv_cuda_layout.py` replays the kernels' index arithmetic in numpy on the CPU;
`tests/test_kernels_cuda_kv.py` checks them against the reference on the GPU. `SOURCES`
also holds `_MERGE_SPLIT` (the merge of calls of many chunks) and a candidate,
`_PARTIAL_VEC` (behind KV_PARTIAL_VEC until its GPU tests pass); the partial grid comes
from `plan_waves` where the SM count is known (KV_MERGE_SPLIT, KV_PLAN_WAVES: "0" turns
either off). The kernel lab (`benchmarks/cuda_lab.py`) times each kernel beside what it
replaced.

This module holds the entry points (`decode_attention`, `prepare`, `run`); the kernels'
CUDA C++ text is in `cuda_kv_sources`, the grid, the choice of kernel and the switches
(KV_*, FP_TOKENS_PER_CHUNK: set them there) in `cuda_kv_plan`, and what a call's launches
take besides the cache's arrays (`Layout`, the constant inputs) in `cuda_kv_layout`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from . import compiled, cuda_kv_plan, cuda_memory
from .cuda_kv_layout import Layout, _layout
from .cuda_kv_plan import NT
from .cuda_kv_sources import HEADER, SOURCES, kernel_name
from .kv_reference import NEG, KVParts


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    inputs, outputs, source = SOURCES[name]
    return compiled.cuda_kernel(
        name=kernel_name(name), input_names=inputs, output_names=outputs, source=source,
        header=HEADER,
        ensure_row_contiguous=False,  # the cache's parts are strided slices: no copies
    )


def mask_bias(mask, b: int, total: int):
    """(additive float32 bias (1 or B, total), per batch) for a mask, or (None, False).

    Bool masks become 0 / NEG (what the reference's `where(mask, s, NEG)` gives, since
    s + NEG == NEG in float32), additive masks are cast. Per-head or per-query masks
    raise NotImplementedError. The kernel reads the bias's row b when it has more than
    one row.
    """
    if mask is None:
        return None, False
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        return None, False  # one query sits at the last column: sees everything
    m = mask
    if m.shape[-1] != total:
        raise NotImplementedError(f"mask has {m.shape[-1]} columns, the cache {total}")
    if m.ndim == 1:
        m = m[None]
    elif m.ndim == 2:  # (L, T), L = 1
        if m.shape[0] != 1:
            raise NotImplementedError("mask rows must be 1 for one-token decode")
    elif m.ndim == 3:  # (B, L, T)
        if m.shape[1] != 1:
            raise NotImplementedError("mask rows must be 1 for one-token decode")
        m = m[:, 0]
    elif m.ndim == 4:  # (B, H or 1, L, T)
        if m.shape[1] != 1 or m.shape[2] != 1:
            raise NotImplementedError("per-head masks are left to the reference")
        m = m[:, 0, 0]
    else:
        raise NotImplementedError(f"mask of {m.ndim} dims")
    if m.shape[0] not in (1, b):
        raise NotImplementedError(f"mask batch {m.shape[0]} for batch {b}")
    if m.dtype == mx.bool_:
        bias = mx.where(m, mx.array(0.0, mx.float32), mx.array(NEG, mx.float32))
    else:
        bias = m.astype(mx.float32)
    return mx.contiguous(bias), bool(m.shape[0] == b and b > 1)


@dataclass
class Launch:
    """One call: its Layout and the partial kernel's inputs (in PARTIAL_INPUTS order);
    the numpy emulation replays it."""

    layout: Layout
    inputs: list


def _fp_dtype(parts: KVParts):
    """The dtype of the fp16 parts (float16 if there are none). A plain loop: it runs every
    decode step of every layer, and each comprehension is a Python call on the host."""
    dtype = None
    for x in (parts.sink_k, parts.sink_v, parts.tail_k, parts.tail_v):
        if x is None:
            continue
        if dtype is None:
            dtype = x.dtype
        elif x.dtype != dtype:
            raise NotImplementedError("sink and tail of different dtypes")
    return mx.float16 if dtype is None else dtype


def prepare(queries: mx.array, parts: KVParts, scale: float, mask=None) -> Launch:
    """Check that the kernels cover this call (else NotImplementedError) and lay it out."""
    b, h, n_q, d = queries.shape
    pk = parts.packed
    if n_q != 1:
        raise NotImplementedError("the decode kernel takes one query position")
    if pk is None or pk.length == 0:
        raise NotImplementedError("nothing compressed yet: the reference is cheap")
    kv = pk.k_codes.shape[1]
    if h % kv:
        raise ValueError(f"{h} query heads do not group over {kv} KV heads")
    if pk.k_codes.shape[0] != b or d != pk.k_dim:
        raise NotImplementedError("queries and cache disagree on batch or head_dim")
    s_len, c_len, t_len = parts.lengths
    bias = None if mask is None else mask_bias(mask, b, s_len + c_len + t_len)[0]
    p = cuda_kv_plan  # the switches are read on every call: tests and benchmarks set them
    sms = cuda_memory.sm_count() if p.KV_PLAN_WAVES else None
    f_len = s_len + t_len
    mma = p.use_mma(pk.k_dim, pk.v_dim, h // kv)
    partial = "mma" if mma else "vec" if p.KV_PARTIAL_VEC else "plain"
    batched = partial != "vec" and p.stage_batch(pk.bits_k, pk.bits_v)
    blocks = (p.mma_blocks_per_sm(pk.bits_k, pk.bits_v, batched) if mma
              else p.PARTIAL_BLOCKS_PER_SM)
    ncc, fpch = (p.plan_waves(b, kv, c_len, f_len, sms, p.FP_TOKENS_PER_CHUNK, blocks) if sms
                 else p.plan(b, kv, c_len, f_len))
    lay = _layout(b, h, kv, pk.k_dim, pk.v_dim, pk.bits_k, pk.bits_v, pk.seed, float(scale),
                  _fp_dtype(parts), queries.dtype, s_len > 0, t_len > 0, bias is not None,
                  ncc, fpch, p.KV_MERGE_SPLIT, partial, p.KV_MMA_EXACT, batched,
                  p.KV_MERGE_WIDE)
    return Launch(lay, _inputs(lay, queries, parts, bias))


def _inputs(lay: Layout, queries: mx.array, parts: KVParts, bias=None) -> list:
    """The partial kernel's inputs, in PARTIAL_INPUTS order."""
    pk, fp = parts.packed, lay.dummy_fp
    return [
        queries, lay.consts, pk.k_codes, pk.k_norms, pk.v_codes, pk.v_norms,
        fp if parts.sink_k is None else parts.sink_k, fp if parts.sink_v is None else parts.sink_v,
        fp if parts.tail_k is None else parts.tail_k, fp if parts.tail_v is None else parts.tail_v,
        lay.dummy_mask if bias is None else bias,
    ]


_F32X2 = [mx.float32, mx.float32]
_THREADS = (NT, 1, 1)


def run(launch: Launch) -> mx.array:
    """The two kernels of a prepared call -> (B, H, 1, Dv)."""
    return _run(launch.layout, launch.inputs)


def _run(L: Layout, inputs: list) -> mx.array:
    ml, acc = _kernel(L.partial_kernel)(
        inputs=inputs, template=L.partial_template, grid=L.partial_grid,
        threadgroup=_THREADS, output_shapes=L.partial_shapes, output_dtypes=_F32X2,
    )
    return _kernel(L.merge_kernel)(
        inputs=[ml, acc, L.unrot], template=L.merge_template, grid=L.merge_grid,
        threadgroup=(L.merge_threads, 1, 1), output_shapes=[L.out_shape],
        output_dtypes=[L.out_dtype],
    )[0]


def decode_attention(queries: mx.array, parts: KVParts, scale: float, mask=None) -> mx.array:
    """`tq_attention` for one query position, on CUDA (NotImplementedError: use the reference).

    A decode step without a mask takes its Layout from the packed span's `launches`, keyed
    on what else `prepare` reads (the query's shape, the fp16 parts' lengths as chunk
    counts, the switches): a cache reuses its span for `block` tokens, and `prepare`'s
    checks and helpers cost ~15 Python calls a layer a step on the host (the 2026-11-30 run)."""
    pk = parts.packed
    if mask is not None or pk is None or type(scale) is not float:
        return run(prepare(queries, parts, scale, mask))
    sink, tail = parts.sink_k, parts.tail_k
    s_len = 0 if sink is None else sink.shape[2]
    t_len = 0 if tail is None else tail.shape[2]
    p, fp_tokens = cuda_kv_plan, cuda_kv_plan.FP_TOKENS_PER_CHUNK
    key = (queries.shape, queries.dtype, scale, s_len, t_len > 0,
           (s_len + t_len + fp_tokens - 1) // fp_tokens,
           None if sink is None else sink.dtype, None if tail is None else tail.dtype,
           fp_tokens, p.KV_PLAN_WAVES, p.KV_PARTIAL_MMA, p.KV_PARTIAL_VEC, p.KV_STAGE_BATCH,
           p.KV_MERGE_SPLIT, p.KV_MMA_EXACT, p.TARGET_BLOCKS, p.KV_MERGE_WIDE)
    lay = pk.launches.get(key)
    if lay is None:
        launch = prepare(queries, parts, scale)
        pk.launches[key] = launch.layout
        return run(launch)
    return _run(lay, _inputs(lay, queries, parts))


__all__ = ["Launch", "decode_attention", "mask_bias", "prepare", "run"]

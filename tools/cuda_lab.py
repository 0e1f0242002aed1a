"""GPU time of the CUDA kernels alone: a standalone CUDA program, built from their sources.

MLX adds host time to every launch (`launch_cost.py`), so `kernels.py` measures the host
and the GPU together. This script writes the kernels as `mx.fast.cuda_kernel` would build
them (the source the runtime would launch, for one shape and configuration per variant)
into kernels.cu, and a host program main.cu that loads them from a CUBIN, fills random
operands, checks that the variants of one family give the same outputs, and times each
with CUDA events over many launches that cycle through enough weight copies to stream
from HBM. run.sh builds kernels.cu twice: with NVRTC and MLX's options (MLX's compiler:
its code can differ from nvcc's for the same source, NOTES.md) and with nvcc, and runs
both. It needs only the CUDA toolkit on the GPU machine: no MLX install there.

    python tools/cuda_lab.py --emit DIR      # here (MLX's CPU build is enough)
    python tools/cuda_lab.py --emit DIR --only 'mma_waves.*32768'   # a subset
    bash DIR/run.sh                                # on the GPU machine: results to stdout
                                                   # (`lab/`, the usual DIR, is git-ignored:
                                                   #  the device call carries it)
    TQ_LAB_BOTH=1 bash DIR/run.sh                  # then NVRTC's again on managed memory
    bash DIR/profile.sh kv_partial_32768           # after run.sh: ncu over one kernel

Variants: `gemv` (the GEMV on a rotated fp16 row, `cuda_gemv`) and `linear` (the fused
rotation + GEMV of `cuda_linear`), each at the shapes and rows-per-warp listed in
`VARIANTS`, and the KV decode kernels (`cuda_kv`'s partial and merge, one layer of an
8B-shaped model, K4/V3) at `KV_CONTEXTS` compressed tokens. The bandwidth column counts
the bytes that stream per launch (weight codes and scales; the cache's codes and norms).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # lab_mma, run from anywhere
from cuda_source import MLX_DEFAULT_HEADER, kernel_source  # noqa: E402

L2_BYTES = 60 * 2**20
LAUNCHES = 200

_C_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
            mx.uint32: "uint32_t", mx.int32: "int32_t"}


@dataclass
class Buffer:
    """One kernel argument: dtype, element count, how to fill it, whether it is a weight
    (a copy per launch slot, so launches stream it from HBM)."""

    dtype: object
    count: int
    fill: str  # bits | scale | norm | x | sign | const:V | levels:a,b,... (repeated) | zero
    weight: bool = False
    shape: tuple = ()  # for kernels that read `<name>_shape` / `_strides` (row-major here)


@dataclass
class Variant:
    name: str
    family: str  # variants of one family must give the same outputs
    func: str
    source: str  # the kernel's full text (header + __global__ function)
    grid: tuple[int, int, int]  # blocks
    block: int
    shared: int
    args: list[tuple[str, Buffer]] = field(default_factory=list)
    outputs: list[tuple[str, object, int]] = field(default_factory=list)

    @property
    def weight_bytes(self) -> int:
        return sum(b.count * _size(b.dtype) for _, b in self.args if b.weight)


def _size(dtype) -> int:
    return {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2, mx.uint32: 4, mx.int32: 4}[dtype]


def _no_mlx_kernels():
    """Sources only: building an MLX kernel object needs the CUDA backend."""
    mx.fast.cuda_kernel = lambda **_: None


def _weights(out_f: int, padded: int, bits: int) -> list[tuple[str, Buffer]]:
    words = {2: padded // 16, 3: padded // 16, 4: padded // 8}[bits]
    hwords = padded // 32 if bits == 3 else 1
    return [
        ("codes", Buffer(mx.uint32, out_f * words, "bits", True)),
        ("hplane", Buffer(mx.uint32, out_f * hwords, "bits", bits == 3)),
        ("scales", Buffer(mx.float16, out_f * padded // 64, "scale", True)),
    ]


def _values(values) -> Buffer:
    """A float32 input holding these values."""
    values = list(values)
    return Buffer(mx.float32, len(values), "levels:" + ",".join(f"{v:.9f}" for v in values))


def _levels(bits: int) -> Buffer:
    from turboquant.stages import codebook_values

    return _values(codebook_values(bits).tolist())


# Candidate main loops for the GEMV, spliced into its source by `gemv_variant(loop=...)`
# and timed beside it (same family, so their outputs are compared). "syncwarp": every lane
# runs the same trips and a __syncwarp() follows each fetch, which keeps NVRTC's ptxas
# from sinking the fetch below the decode after it (2026-11-29: that matched nvcc's order
# in the SASS but gained nothing under MLX; the lab tells the kernel's own time).
GEMV_LOOPS = {
    "syncwarp": ("""  for (int g = lane; g < GROUPS; g += 64) {
    if (g + 32 < GROUPS) TQ_FETCH(cwB, hwB, scB, g + 32);
    TQ_DECODE(cwA, hwA, scA, g);
    if (g + 32 >= GROUPS) break;
    if (g + 64 < GROUPS) TQ_FETCH(cwA, hwA, scA, g + 64);
    TQ_DECODE(cwB, hwB, scB, g + 32);
  }""", """  for (int g0 = 0; g0 < GROUPS; g0 += 64) {
    const int g = g0 + lane;
    if (g + 32 < GROUPS) TQ_FETCH(cwB, hwB, scB, g + 32);
    __syncwarp();
    if (g < GROUPS) TQ_DECODE(cwA, hwA, scA, g);
    if (g + 64 < GROUPS) TQ_FETCH(cwA, hwA, scA, g + 64);
    __syncwarp();
    if (g + 32 < GROUPS) TQ_DECODE(cwB, hwB, scB, g + 32);
  }"""),
}


# Candidate decode helpers for the GEMV's header (`gemv_variant(header=...)`): "mulhi"
# makes the right shifts of the code words multiplications (mul.hi by a power of two),
# which run on the FMA pipe: PRMT, LOP3 and SHF share the integer ALU pipe, issued at half
# rate, and a 3-bit decode step is mostly those (the 2026-11-30 run's SASS: 518 PRMT, 167 LOP3,
# 121 SHF against 256 HFMA2 and 74 IMAD).
_MULHI = """
__device__ __forceinline__ uint32_t tq_shr(uint32_t x, uint32_t pow2) {
  uint32_t d;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(d) : "r"(x), "r"(pow2));
  return d;
}
"""
_SHR_HELPER = ("// The PRMT instruction itself", _MULHI + "// The PRMT instruction itself")
_SHR_SELECTOR = ("tq_lookup4<BITS>(t, sel >> 16, a, b);",
                 "tq_lookup4<BITS>(t, tq_shr(sel, 0x10000u), a, b);")
HEADER_VARIANTS = {
    "mulhi": [_SHR_HELPER, _SHR_SELECTOR,
              ("(l4[b] >> 2) & 0x33333333u", "tq_shr(l4[b], 0x40000000u) & 0x33333333u"),
              ("(h >> 1);", "tq_shr(h, 0x80000000u);")],
    "mulhi16": [_SHR_HELPER, _SHR_SELECTOR],  # only the selector's upper half
}


def _header(name: str | None) -> str:
    from turboquant.kernels import cuda_gemv

    text = cuda_gemv.HEADER
    for before, after in HEADER_VARIANTS.get(name, []):
        assert before in text, f"the GEMV's header changed: update HEADER_VARIANTS[{name!r}]"
        text = text.replace(before, after)
    return text


def _spliced_loop(body: str, loop: str | None) -> str:
    if not loop:
        return body
    before, after = GEMV_LOOPS[loop]
    assert before in body, f"the GEMV's main loop changed: update GEMV_LOOPS[{loop!r}]"
    return body.replace(before, after)


def gemv_variant(out_f: int, in_f: int, bits: int, rpw: int, loop: str | None = None,
                 header: str | None = None) -> Variant:
    from turboquant.kernels import cuda_gemv

    launch = cuda_gemv.launch(bits=bits, group_size=64, out_features=out_f, padded=in_f,
                              nscales=in_f // 64, pairs=1, out_dtype=mx.float16,
                              rows_per_warp=rpw)
    func = (f"gemv_{out_f}x{in_f}_b{bits}_r{rpw}" + (f"_{loop}" if loop else "")
            + (f"_{header}" if header else ""))
    w = dict(_weights(out_f, in_f, bits))
    args = [("x", Buffer(mx.float16, in_f, "x")), ("codes", w["codes"]),
            ("hplane", w["hplane"]), ("scales", w["scales"]), ("levels", _levels(bits)),
            ("pair_expert", Buffer(mx.int32, 1, "zero")), ("pair_row", Buffer(mx.int32, 1, "zero")),
            ("bias", Buffer(mx.float32, 1, "zero"))]
    body = _spliced_loop(launch.body, loop)
    src = kernel_source(func, [a for a, _ in args], ["out0"], body,
                        [b.dtype for _, b in args], [mx.float16], [])
    text = _header(header) + src
    if header:  # its own names for its helpers: kernels.cu holds every variant's header
        text = text.replace("tq_", f"tq{header}_")
    return Variant(func, f"gemv_{out_f}x{in_f}_b{bits}", func, text,
                   (launch.grid[0] // launch.threads[0], 1, 1), launch.threads[0],
                   cuda_gemv.shared_bytes(1, in_f),
                   args, [("out0", mx.float16, out_f)])


# The fused kernel with its rotation replaced by a plain copy of the row (what the
# rotation costs it; outputs differ, so its own family)
_NO_ROTATION = """
    for (int i = t; i < OUTW; i += THREADS) TQ_PUT(i, i < N ? TQ_LOAD(i) : 0.f);
"""


def linear_variant(out_f: int, in_f: int, bits: int, loop: str | None = None,
                   rotate: bool = True, **options) -> Variant:
    """The fused launch of one TurboQuant linear, rotated as a weight of width in_f is;
    `loop` splices a candidate GEMV main loop (`GEMV_LOOPS`: the fused kernel runs the
    GEMV's rows)."""
    from turboquant.kernels import cuda_linear, cuda_rotate

    seed = 7  # the rotation of a weight with this seed: its segments and mixing matrix
    a, _ = cuda_rotate.factors(in_f, seed)
    mix = cuda_rotate._mixing(seed, in_f).reshape(-1).tolist()
    launch = cuda_linear.launch(n=in_f, a=a, padded=in_f, bits=bits, group_size=64,
                                ends=(out_f,), lead=(1,), in_dtype=mx.bfloat16,
                                out_dtype=mx.bfloat16, add_bias=False, **options)
    tag = "_".join([f"{k}{v}" for k, v in options.items()] + ([loop] if loop else []))
    func = f"linear_{out_f}x{in_f}_b{bits}{'_' + tag if tag else ''}"
    w = dict(_weights(out_f, in_f, bits))
    args = [("x", Buffer(mx.bfloat16, in_f, "x")), ("signs", Buffer(mx.float32, in_f, "sign")),
            ("mix", _values(mix)),
            ("codes", w["codes"]), ("hplane", w["hplane"]), ("scales", w["scales"]),
            ("levels", _levels(bits)), ("bias", Buffer(mx.float32, 1, "zero"))]
    header, _ = cuda_linear.source(1)
    body = _spliced_loop(launch.body, loop)
    if not rotate:
        from turboquant.kernels import cuda_rotate

        rotation = cuda_rotate.rotate_row(a)
        assert rotation in body
        body, func = body.replace(rotation, _NO_ROTATION), func + "_norotate"
    src = kernel_source(func, [a for a, _ in args], ["out0"], body,
                        [b.dtype for _, b in args], [mx.bfloat16], [])
    threads = cuda_linear.THREADS
    return Variant(func, f"linear_{out_f}x{in_f}_b{bits}" if rotate else func, func, header + src,
                   (launch.grid[0] // threads, launch.grid[1], 1), threads,
                   cuda_linear.shared_bytes(in_f, in_f), args, [("out0", mx.bfloat16, out_f)])


def mma_variant(out_f: int, in_f: int, bits: int, ksplit: int = 0, xsmem: bool = False,
                null: str = "") -> Variant:
    """The tensor-core GEMV candidate (`lab_mma`, 3-bit, its own layout in buffers of the
    GEMV's sizes): `ksplit` warps a tile (0: the layout decoded code by code, the family's
    reference), x staged in shared memory (`xsmem`); `null` "loads": its loads alone,
    "stream": a plain stream over the same bytes (each its own family)."""
    import lab_mma
    from turboquant.kernels import cuda_gemv

    assert bits == 3
    w = dict(_weights(out_f, in_f, bits))
    args = [("x", Buffer(mx.float16, in_f, "x")), ("codes", w["codes"]),
            ("hplane", w["hplane"]), ("scales", w["scales"]), ("levels", _levels(bits))]
    func, body = f"mma_{out_f}x{in_f}_b{bits}_k{ksplit}", lab_mma.MMA_BODY
    grid, block = (out_f // 16 * ksplit // 4, 1, 1), 128
    if not ksplit:
        func, body, grid = f"mmaref_{out_f}x{in_f}_b{bits}", lab_mma.REF_BODY, (out_f // 4, 1, 1)
    func += "_xs" if xsmem else ""
    if null == "loads":
        func, body = func + "_null", lab_mma.NULL_BODY
    if null == "stream":
        func, body, grid, block = f"stream_{out_f}x{in_f}", lab_mma.STREAM_BODY, (132 * 16, 1, 1), 256
    body = lab_mma.constants(out_f, in_f, xsmem, **({"KSPLIT": ksplit} if ksplit else {})) + body
    src = kernel_source(func, [a for a, _ in args], ["out0"], body,
                        [b.dtype for _, b in args], [mx.float16], [])
    return Variant(func, func if null else f"mma_{out_f}x{in_f}_b{bits}", func,
                   cuda_gemv.HEADER + lab_mma.MMA_HEADER + src, grid, block, 0,
                   args, [("out0", mx.float16, out_f)])


def kv_variants(context: int, bits_k: int = 4, bits_v: int = 3, kv: int = 8, r: int = 4,
                head_dim: int = 128, sink: int = 4, tail: int = 64,
                fp_tokens: tuple[int, ...] = ()) -> list[Variant]:
    """The KV decode kernels (`cuda_kv`: partial, then merge) for one layer of an 8B-shaped
    model at `context` compressed tokens, as `cuda_kv.prepare` lays them out (the cache's
    codes and norms are the weights that stream)."""
    from turboquant.kernels import cuda_kv, cuda_kv_plan, cuda_kv_sources
    from turboquant.kernels.kv_reference import KVParts, PackedKV, kv_words

    def zeros(*shape, dtype=mx.uint32):
        return mx.zeros(shape, dtype=dtype)

    packed = PackedKV(zeros(1, kv, context, kv_words(head_dim, bits_k)),
                      zeros(1, kv, context, dtype=mx.float16),
                      zeros(1, kv, context, kv_words(head_dim, bits_v)),
                      zeros(1, kv, context, dtype=mx.float16), bits_k, bits_v, 12345,
                      head_dim, head_dim)
    fp = [zeros(1, kv, n, head_dim, dtype=mx.float16) for n in (sink, sink, tail, tail)]
    parts = KVParts(fp[0], fp[1], packed, fp[2], fp[3])
    # the plain layout (`plan`'s grid, the one-thread-a-dim merge): what the variants below
    # are timed against
    switches = (cuda_kv_plan.KV_MERGE_SPLIT, cuda_kv_plan.KV_PLAN_WAVES,
                cuda_kv_plan.KV_PARTIAL_VEC, cuda_kv_plan.KV_PARTIAL_MMA,
                cuda_kv_plan.KV_MERGE_WIDE)
    cuda_kv_plan.KV_MERGE_SPLIT = cuda_kv_plan.KV_PLAN_WAVES = cuda_kv_plan.KV_PARTIAL_VEC = False
    cuda_kv_plan.KV_PARTIAL_MMA = cuda_kv_plan.KV_MERGE_WIDE = False
    try:
        launch = cuda_kv.prepare(zeros(1, kv * r, 1, head_dim, dtype=mx.bfloat16), parts,
                                 head_dim ** -0.5)
    finally:
        (cuda_kv_plan.KV_MERGE_SPLIT, cuda_kv_plan.KV_PLAN_WAVES, cuda_kv_plan.KV_PARTIAL_VEC,
         cuda_kv_plan.KV_PARTIAL_MMA, cuda_kv_plan.KV_MERGE_WIDE) = switches
    lay = launch.layout
    fills = {"queries": "x", "consts": _values(lay.consts.tolist()).fill, "k_codes": "bits",
             "v_codes": "bits", "k_norms": "norm", "v_norms": "norm", "mask": "zero"}
    streamed = {"k_codes", "k_norms", "v_codes", "v_norms"}
    args = [(name, Buffer(a.dtype, a.size, fills.get(name, "x"), name in streamed,
                          tuple(a.shape)))
            for name, a in zip(cuda_kv_sources.PARTIAL_INPUTS, launch.inputs)]
    tag = f"{context}_k{bits_k}v{bits_v}" if tail == 64 else f"{context}_t{tail}_k{bits_k}v{bits_v}"

    def variant(source: str, name: str, family: str, args, in_dtypes, out_dtypes, template,
                grid, block, outputs) -> Variant:
        """`cuda_kv.SOURCES[source]` as the kernel `name` (its own function name)."""
        inputs, output_names, body = cuda_kv_sources.SOURCES[source]
        return Variant(name, family, name,
                       cuda_kv_sources.HEADER + kernel_source(name, inputs, output_names, body,
                                                      in_dtypes, out_dtypes, template),
                       grid, block, 0, args, outputs)

    ml_shape, acc_shape = lay.partial_shapes
    in_dtypes = [b.dtype for _, b in args]

    def partial_outputs(nch: int) -> list[tuple[str, object, int]]:
        """part_ml and part_acc of a grid of `nch` chunks a KV head."""
        return [(n, mx.float32, math.prod((shape[0], nch, *shape[2:])))
                for n, shape in (("part_ml", ml_shape), ("part_acc", acc_shape))]

    exact = lay.partial_template + (("EXACT", True),)  # `_PARTIAL_MMA` with hi + lo products
    partial = variant(
        "tq_kv_partial", f"kv_partial_{tag}", f"kv_partial_{tag}", args, in_dtypes,
        [mx.float32] * 2, lay.partial_template,
        (lay.partial_grid[0] // cuda_kv_plan.NT, lay.partial_grid[1], 1), cuda_kv_plan.NT,
        [("part_ml", mx.float32, math.prod(ml_shape)),
         ("part_acc", mx.float32, math.prod(acc_shape))])
    candidate = variant(  # same family: its outputs are checked against the partial's
        "tq_kv_partial_vec", f"kv_partial_vec_{tag}", partial.family, args, in_dtypes,
        [mx.float32] * 2, lay.partial_template, partial.grid, partial.block, partial.outputs)
    mma = variant(  # the tensor-core candidate, checked against the partial too
        "tq_kv_partial_mma", f"kv_partial_mma_{tag}", partial.family, args, in_dtypes,
        [mx.float32] * 2, exact, partial.grid, partial.block, partial.outputs)
    # the candidate grid (`cuda_kv.plan_waves`, H200: 132 SMs): its own family, as its
    # chunk sums differ; only its time is compared
    ncc, fpch = cuda_kv_plan.plan_waves(1, kv, context, sink + tail, H200_SMS)
    waves = variant(
        "tq_kv_partial", f"kv_partial_waves_{tag}", f"kv_partial_waves_{tag}", args, in_dtypes,
        [mx.float32] * 2, lay.partial_template, (ncc + fpch, lay.partial_grid[1], 1),
        cuda_kv_plan.NT, partial_outputs(ncc + fpch))
    # the tensor-core candidate on its own wave-filling grid (fewer resident blocks)
    ncc, fpch = cuda_kv_plan.plan_waves(1, kv, context, sink + tail, H200_SMS,
                                   blocks_per_sm=cuda_kv_plan.MMA_BLOCKS_PER_SM)
    mma_waves = variant(
        "tq_kv_partial_mma", f"kv_partial_mma_waves_{tag}", f"kv_partial_mma_waves_{tag}",
        args, in_dtypes, [mx.float32] * 2, exact, (ncc + fpch, lay.partial_grid[1], 1),
        cuda_kv_plan.NT, partial_outputs(ncc + fpch))
    # the fp16 part in chunks of `fp_tokens` (`cuda_kv.FP_TOKENS_PER_CHUNK`): more blocks
    # for the sink + tail (the kernel splits it by whole tiles, so below TILE tokens a
    # chunk only adds empty blocks); own families (other chunk sums), only times compared
    fp_chunked = []
    for per_chunk in fp_tokens:
        fpch = cuda_kv_plan.plan(1, kv, context, sink + tail, per_chunk)[1]
        template = tuple((k, fpch if k == "FPCH" else v) for k, v in lay.partial_template)
        name = f"kv_partial_fp{per_chunk}_{tag}"
        outs = partial_outputs(lay.ncc + fpch)
        fp_chunked.append(variant(
            "tq_kv_partial", name, name, args, in_dtypes, [mx.float32] * 2, template,
            (lay.ncc + fpch, lay.partial_grid[1], 1), cuda_kv_plan.NT, outs))
        fp_chunked.append(variant(  # the tensor-core candidate, checked against it
            "tq_kv_partial_mma", f"kv_partial_mma_fp{per_chunk}_{tag}", name, args, in_dtypes,
            [mx.float32] * 2, template + (("EXACT", True),),
            (lay.ncc + fpch, lay.partial_grid[1], 1), cuda_kv_plan.NT, outs))
        # and on the runtime's grid (waves, fp16 chunks of per_chunk): the plain kernel, the
        # tensor-core one with hi + lo products and with fp16 products (the runtime's
        # default; same family as the exact one, so the lab prints their difference), and
        # the plain and fp16-product ones staging value codes 8 loads at a time (`_b8`, the
        # tensor-core one on the runtime's plan for it); then that one on the other plans of
        # PLAN_CANDIDATES (`_w<n>`: n resident blocks an SM), each its own family, as its
        # chunking differs: only times compare
        fp16x = (("EXACT", False),)
        b8_blocks = cuda_kv_plan.mma_blocks_per_sm(bits_k, bits_v, batched=True)
        runs = [("tq_kv_partial", cuda_kv_plan.PARTIAL_BLOCKS_PER_SM, (), ""),
                ("tq_kv_partial_b8", cuda_kv_plan.PARTIAL_BLOCKS_PER_SM, (), "_b8"),
                ("tq_kv_partial_mma", cuda_kv_plan.MMA_BLOCKS_PER_SM, (("EXACT", True),), ""),
                ("tq_kv_partial_mma", cuda_kv_plan.MMA_BLOCKS_PER_SM, fp16x, "_fp16x"),
                ("tq_kv_partial_mma_b8", b8_blocks, fp16x, "_fp16x_b8")]
        runs += [("tq_kv_partial_mma_b8", n, fp16x, f"_fp16x_b8_w{n}")
                 for n in PLAN_CANDIDATES if n != b8_blocks]
        for kernel, blocks, flag, suffix in runs:
            ncc, fpch = cuda_kv_plan.plan_waves(1, kv, context, sink + tail, H200_SMS, per_chunk,
                                           blocks)
            template = tuple((k, fpch if k == "FPCH" else v) for k, v in lay.partial_template)
            name = f"{kernel.removesuffix('_b8')[3:]}_waves_fp{per_chunk}_{tag}"
            family = name + suffix if "_w" in suffix else name
            fp_chunked.append(variant(
                kernel, name + suffix, family, args, in_dtypes,
                [mx.float32] * 2, template + flag, (ncc + fpch, lay.partial_grid[1], 1),
                cuda_kv_plan.NT, partial_outputs(ncc + fpch)))
    # positive sums (as softmax sums are), so that the merges' outputs compare stably
    margs = [("part_ml", Buffer(mx.float32, math.prod(ml_shape), "norm", False, ml_shape)),
             ("part_acc", Buffer(mx.float32, math.prod(acc_shape), "x", False, acc_shape)),
             ("unrot", Buffer(mx.float32, head_dim * head_dim, "x", False,
                              (head_dim, head_dim)))]
    merge = variant(
        "tq_kv_merge", f"kv_merge_{tag}", f"kv_merge_{tag}", margs, [mx.float32] * 3,
        [lay.out_dtype], lay.merge_template, (lay.merge_grid[0] // cuda_kv_plan.NT, 1, 1),
        cuda_kv_plan.NT, [("out", lay.out_dtype, math.prod(lay.out_shape))])
    split = cuda_kv_plan.split_per_dim(head_dim)
    merge_split = variant(  # same family as the merge: checked against it
        "tq_kv_merge_split", f"kv_merge_split_{tag}", merge.family, margs, [mx.float32] * 3,
        [lay.out_dtype], lay.merge_template, merge.grid, split * head_dim, merge.outputs)
    merge_wide = [variant(  # the candidate (KV_MERGE_WIDE): same family
        "tq_kv_merge_wide", f"kv_merge_wide_{tag}", merge.family, margs, [mx.float32] * 3,
        [lay.out_dtype], lay.merge_template, merge.grid, cuda_kv_plan.MERGE_WIDE_THREADS,
        merge.outputs)] if cuda_kv_plan.merge_wide_fits(head_dim) else []
    return [partial, candidate, mma, waves, mma_waves, merge, merge_split, *merge_wide,
            *fp_chunked]


# (kind, out, in, bits, options): what `--emit` writes by default (rows per warp of the
# GEMV as `cuda_gemv.rows_per_warp_for` picks them; the fused launches take their defaults)
VARIANTS = [
    *[("gemv", o, i, b, {"rpw": 4}) for o, i, b in (
        (28672, 8192, 3), (28672, 8192, 2), (28672, 8192, 4), (8192, 28672, 3),
        (8192, 8192, 3), (4096, 4096, 3))],
    *[("gemv", o, i, b, {"rpw": 4, "loop": "syncwarp"}) for o, i, b in (
        (28672, 8192, 3), (28672, 8192, 4), (8192, 28672, 3))],
    *[("gemv", o, i, b, {"rpw": 4, "header": h}) for o, i, b in (
        (28672, 8192, 3), (28672, 8192, 2), (28672, 8192, 4), (8192, 28672, 3), (4096, 4096, 3))
      for h in HEADER_VARIANTS],
    # the tensor-core candidate (2026-11-30: 37.6 us at 28672x8192 against the GEMV's
    # 38.4): its code-by-code check first (the family's reference); then its loads alone
    # and a plain stream of the same bytes (25.5 and 25.0 us: the speed of light)
    *[("mma", o, i, 3, opts) for o, i in ((28672, 8192), (8192, 28672), (4096, 4096))
      for opts in ({"ksplit": 0}, {"ksplit": 2}, {"ksplit": 4})],
    *[("mma", o, i, 3, {"ksplit": 4, "xsmem": True}) for o, i in ((28672, 8192), (4096, 4096))],
    ("mma", 28672, 8192, 3, {"ksplit": 2, "null": "loads"}),
    ("mma", 28672, 8192, 3, {"ksplit": 1, "null": "stream"}),
    ("linear", 28672, 8192, 3, {}), ("linear", 28672, 8192, 2, {}), ("linear", 28672, 8192, 4, {}),
    ("linear", 28672, 8192, 3, {"loop": "syncwarp"}),
    # what the rotation costs the fused kernel (2026-11-30: down_proj's 4096x14336 takes
    # longer than gate/up's 28672x4096, twice its weights)
    *[("linear", o, i, 3, {"rotate": False}) for o, i in ((4096, 14336), (28672, 4096))],
    ("linear", 4096, 14336, 3, {"rows_per_warp": 1}),
    # a Llama-3-8B layer: q/k/v (as one matrix), o_proj, gate/up, down_proj
    ("linear", 6144, 4096, 3, {}), ("linear", 4096, 4096, 3, {}),
    ("linear", 28672, 4096, 3, {}), ("linear", 4096, 14336, 3, {}),
]


KV_CONTEXTS = (1024, 32768)
H200_SMS = 132  # the device machine's GPU (the lab's wave-filling grid candidate)


# other K/V bits timed at the tail contexts by `--emit`: the 8-bit layers that
# `make_turboquant_cache` protects by default (the 2026-11-30 run's ncu at 32K: 180.7 us against
# 63.5 for K4/V3; nvcc gives that kernel 130 registers against 72)
KV_EXTRA_BITS = ((8, 8), (8, 3))
# other resident-block counts for the batched tensor-core kernel's wave plan, timed beside
# the runtime's (`cuda_kv.mma_blocks_per_sm`; 2026-11-30: K4/V3 43.7 us on 9 against 51.0
# on 6, K8/V8 101 on 6 against 119 on 8-9)
PLAN_CANDIDATES = (4, 5, 6, 7, 9)


def build(specs=VARIANTS, kv_contexts=KV_CONTEXTS, kv_tail_contexts=KV_CONTEXTS,
          tail_fp_tokens: tuple[int, ...] | None = None,
          kv_extra_bits: tuple[tuple[int, int], ...] = ()) -> list[Variant]:
    """The lab's variants; the tail contexts' fp16 chunk sizes are `tail_fp_tokens`
    (default: the runtime's, `cuda_kv.FP_TOKENS_PER_CHUNK`), and `kv_extra_bits` adds
    each (K, V) bits' kernels at the tail contexts."""
    from turboquant.kernels import cuda_kv_plan

    _no_mlx_kernels()
    out = []
    for kind, o, i, bits, options in specs:
        make = {"gemv": gemv_variant, "mma": mma_variant, "linear": linear_variant}[kind]
        out.append(make(o, i, bits, **options))
    for context in kv_contexts:
        out += kv_variants(context)
    for context in kv_tail_contexts:  # 4 sink + 188 tail tokens, near the longest fp16 part
        # the cache holds (window 128 + block 64), in chunks of a tile (the runtime's)
        for bits_k, bits_v in ((4, 3), *kv_extra_bits):
            out += kv_variants(context, bits_k, bits_v, tail=188,
                               fp_tokens=tail_fp_tokens or (cuda_kv_plan.FP_TOKENS_PER_CHUNK,))
    return out


def _fill_code(var: str, buf: Buffer, copies: int) -> str:
    ctype = _C_TYPES[buf.dtype]
    n = buf.count * copies
    kind, _, arg = buf.fill.partition(":")
    value = {
        "bits": "h[i] = next32();",
        "scale": "h[i] = __float2half(0.01f + 0.02f * unit());",
        "norm": f"h[i] = ({ctype})(0.5f + unit());",
        "x": f"h[i] = ({ctype})(2.f * unit() - 1.f);",
        "sign": "h[i] = (next32() & 1) ? 1.f : -1.f;",
        "const": f"h[i] = {arg}f;",
        "zero": f"h[i] = ({ctype})0;",
    }
    if kind == "levels":
        init = "{" + ",".join(f"{v}f" for v in arg.split(",")) + "}"
        line = f"{{ static const float lv[] = {init}; for (size_t i = 0; i < {n}; ++i) h[i] = lv[i % {buf.count}]; }}"
    else:
        line = f"for (size_t i = 0; i < {n}; ++i) {{ {value[kind]} }}"
    return (f"  {ctype}* {var} = nullptr;\n  {{ std::vector<{ctype}> hv({n}); {ctype}* h = hv.data();\n"
            f"    {line}\n    CK(lab_malloc((void**)&{var}, sizeof({ctype}) * {n}));\n"
            f"    CK(lab_fill({var}, h, sizeof({ctype}) * {n})); }}\n")


def _call_args(name: str, buf: Buffer, source: str) -> list[str]:
    """The pointer (into copy c when the buffer is a weight), then the shape, strides and
    ndim MLX passes when the kernel's source names them (`<name>_shape`, ...)."""
    args = [f"a_{name} + (size_t)(c) * {buf.count}" if buf.weight else f"a_{name}"]
    shape = buf.shape or (buf.count,)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if f"{name}_shape" in source:
        args.append("Shape{" + ", ".join(map(str, shape)) + "}")
    if f"{name}_strides" in source:
        args.append("Strides{" + ", ".join(map(str, strides)) + "}")
    if f"{name}_ndim" in source:
        args.append(str(len(shape)))
    return args


# The kernels' file compiles with NVRTC too (no C++ standard library headers there).
KERNEL_PRELUDE = MLX_DEFAULT_HEADER.replace(
    "#include <cstdint>\n",
    "#include <cuda/std/cstdint>\nusing cuda::std::int32_t; using cuda::std::int64_t;\n"
    "using cuda::std::uint32_t; using cuda::std::uint64_t;\n")


def kernels_file(variants: list[Variant]) -> str:
    """kernels.cu: the variants' kernels as MLX builds them (its header, then each source)."""
    parts = [KERNEL_PRELUDE]
    split = [v.source.partition("namespace mlx::core::cu {") for v in variants]
    headers = list(dict.fromkeys(h for h, _, _ in split))
    # a header another one includes (the GEMV's, inside the fused linear's) goes once
    parts += [h for h in headers if not any(h != o and h in o for o in headers)]
    parts += ["namespace mlx::core::cu {" + rest for _, _, rest in split]
    return "".join(parts)


MAIN_PRELUDE = r"""#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cmath>
#include <dlfcn.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#define MAX_NDIM 10
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)
// The driver API through dlopen (no link against libcuda: the machine's driver provides it)
static struct Driver {
  CUresult (*moduleLoad)(CUmodule*, const char*);
  CUresult (*functionCount)(unsigned int*, CUmodule);
  CUresult (*enumerateFunctions)(CUfunction*, unsigned int, CUmodule);
  CUresult (*funcGetName)(const char**, CUfunction);
  CUresult (*funcSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*launchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, CUstream, void**, void**);
  CUresult (*errorName)(CUresult, const char**);
} D;
template <typename F> static void lab_symbol(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) { printf("libcuda.so.1 has no %s\n", name); exit(1); }
}
static void lab_driver() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { printf("cannot load libcuda.so.1: %s\n", dlerror()); exit(1); }
  lab_symbol(lib, "cuModuleLoad", D.moduleLoad);
  lab_symbol(lib, "cuModuleGetFunctionCount", D.functionCount);
  lab_symbol(lib, "cuModuleEnumerateFunctions", D.enumerateFunctions);
  lab_symbol(lib, "cuFuncGetName", D.funcGetName);
  lab_symbol(lib, "cuFuncSetAttribute", D.funcSetAttribute);
  lab_symbol(lib, "cuLaunchKernel", D.launchKernel);
  lab_symbol(lib, "cuGetErrorName", D.errorName);
}
#define CKD(x) do { CUresult e_ = (x); if (e_ != CUDA_SUCCESS) { const char* m_ = "?"; \
  D.errorName(e_, &m_); printf("CUDA driver error %s at line %d\n", m_, __LINE__); exit(1); } } while (0)
static unsigned long long rng_state = 88172645463325252ull;
static uint32_t next32() { rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17; return (uint32_t)(rng_state >> 11); }
static float unit() { return (next32() & 0xffffff) / 16777216.f; }
// TQ_LAB_MANAGED=1: every buffer in managed memory (cudaMallocManaged), as MLX's CUDA
// allocator hands them out, instead of device memory (cudaMalloc), filled by cudaMemcpy;
// TQ_LAB_MANAGED=host: managed memory the host writes first (as MLX fills an array made
// from host data), so its pages migrate to the GPU when the first kernel touches them
static const char* lab_managed() { return getenv("TQ_LAB_MANAGED"); }
static cudaError_t lab_malloc(void** p, size_t bytes) {
  return lab_managed() ? cudaMallocManaged(p, bytes) : cudaMalloc(p, bytes);
}
static cudaError_t lab_fill(void* dst, const void* src, size_t bytes) {
  if (lab_managed() && strcmp(lab_managed(), "host") == 0) { memcpy(dst, src, bytes); return cudaSuccess; }
  return cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
}
template <typename T> static float tofloat(T v) { return (float)v; }
template <> float tofloat<__half>(__half v) { return __half2float(v); }
template <> float tofloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
// The kernel named `name` in the module: its mangled name holds "<length><name>E" (the
// parameter types mangle differently under NVRTC and nvcc: int64_t is long long in one)
static CUfunction lab_function(CUmodule mod, const char* name) {
  unsigned int n = 0;
  CKD(D.functionCount(&n, mod));
  std::vector<CUfunction> fs(n);
  CKD(D.enumerateFunctions(fs.data(), n, mod));
  const std::string token = std::to_string(strlen(name)) + name + "E";
  for (CUfunction f : fs) {
    const char* mangled = nullptr;
    CKD(D.funcGetName(&mangled, f));
    if (strstr(mangled, token.c_str())) return f;
  }
  printf("no kernel %s in the module\n", name);
  exit(1);
}

int main(int argc, char** argv) {
  if (argc < 2) { printf("usage: %s KERNELS.cubin\n", argv[0]); return 2; }
  CK(cudaFree(0));  // the runtime's primary context, current for the driver calls too
  lab_driver();
  CUmodule mod;
  CKD(D.moduleLoad(&mod, argv[1]));
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0)); CK(cudaEventCreate(&t1));
  std::vector<std::pair<std::string, std::vector<float>>> refs;
  printf("kernels from %s, buffers in %s memory\n", argv[1], lab_managed() ? (strcmp(lab_managed(), "host") == 0 ? "host-written managed" : "managed") : "device");
  printf("%-40s %10s %10s %12s\n", "variant", "us/launch", "GB/s", "max rel diff");
"""


def _launch_macro(v: Variant) -> str:
    """LAUNCH(c): the variant's kernel on weight copy c, through the driver API (each
    argument in a local, its address in the parameter array)."""
    values = ([arg for n, b in v.args for arg in _call_args(n, b, v.source)]
              + [f"o_{n}" for n, _, _ in v.outputs])
    bound = " ".join(f"auto p{i} = {e};" for i, e in enumerate(values))
    params = ", ".join(f"&p{i}" for i in range(len(values)))
    gx, gy, gz = v.grid
    return (f"#define LAUNCH(c) do {{ {bound} void* params[] = {{{params}}}; \\\n"
            f"    CKD(D.launchKernel(fn, {gx}, {gy}, {gz}, {v.block}, 1, 1, {v.shared}, 0, "
            f"params, nullptr)); }} while (0)")


def program(variants: list[Variant]) -> str:
    """main.cu: loads the kernels from a CUBIN (NVRTC's build, as MLX's, or nvcc's), fills
    operands, checks the variants of a family against each other and times each one."""
    parts = [MAIN_PRELUDE]
    for v in variants:
        copies = max(1, min(16, math.ceil(3 * L2_BYTES / max(1, v.weight_bytes))))
        body = [f"  {{ // {v.name}: the same operands for every variant of a family",
                "  rng_state = 88172645463325252ull;",
                f'  CUfunction fn = lab_function(mod, "{v.func}");']
        for name, buf in v.args:
            body.append(_fill_code(f"a_{name}", buf, copies if buf.weight else 1))
        for name, dtype, count in v.outputs:
            body.append(f"  {_C_TYPES[dtype]}* o_{name}; "
                        f"CK(lab_malloc((void**)&o_{name}, {count * _size(dtype)}));")
        if v.shared > 48 * 1024:
            body.append("  CKD(D.funcSetAttribute(fn, "
                        f"CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, {v.shared}));")
        body.append(_launch_macro(v))
        body.append("  LAUNCH(0); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());")
        body.append("  std::vector<float> got;  // every output, one after another")
        for out_name, out_dtype, out_count in v.outputs:
            ctype = _C_TYPES[out_dtype]
            body.append(f"""  {{ std::vector<{ctype}> hout({out_count});
    CK(cudaMemcpy(hout.data(), o_{out_name}, sizeof({ctype}) * {out_count}, cudaMemcpyDeviceToHost));
    for (auto h : hout) got.push_back(tofloat(h)); }}""")
        body.append(f"""  float diff = -1.f;
  for (auto& r : refs) if (r.first == "{v.family}") {{
    float md = 0.f, mx_ = 1e-30f;
    for (size_t i = 0; i < got.size(); ++i) {{ md = fmaxf(md, fabsf(got[i] - r.second[i])); mx_ = fmaxf(mx_, fabsf(r.second[i])); }}
    diff = md / mx_;
  }}
  if (diff < 0.f) refs.push_back({{"{v.family}", got}});
  for (int i = 0; i < 20; ++i) LAUNCH(i % {copies});
  CK(cudaEventRecord(t0));
  for (int i = 0; i < {LAUNCHES}; ++i) LAUNCH(i % {copies});
  CK(cudaEventRecord(t1)); CK(cudaEventSynchronize(t1)); CK(cudaGetLastError());
  float ms; CK(cudaEventElapsedTime(&ms, t0, t1));
  const float us = 1000.f * ms / {LAUNCHES};
  printf("%-40s %10.2f %10.1f %12s\\n", "{v.name}", us, {v.weight_bytes}.0 / us / 1e3,
         diff < 0.f ? "(reference)" : std::to_string(diff).c_str());
  fflush(stdout);
#undef LAUNCH""")
        for name, _ in v.args:
            body.append(f"  cudaFree(a_{name});")
        for name, _, _ in v.outputs:
            body.append(f"  cudaFree(o_{name});")
        body.append("  }")
        parts.append("\n".join(body) + "\n")
    parts.append("  return 0;\n}\n")
    return "".join(parts)


# kernels.cu through NVRTC (ctypes), with the options MLX passes: an sm_90 CUBIN, the
# toolkit's and CCCL's include folders. MLX's kernels come from this compiler, and its
# code can differ from nvcc's for the same source (NOTES.md in git history, 2026-11-29).
NVRTC_BUILD = r'''import ctypes, glob, os, sys
src, out = sys.argv[1], sys.argv[2]
home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
found = sorted(f for f in glob.glob(home + "/**/libnvrtc.so*", recursive=True) if "stubs" not in f)
lib = ctypes.CDLL(os.environ.get("NVRTC_LIB") or found[0])
prog = ctypes.c_void_p()
code = open(src, "rb").read()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"kernels.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90", ("--include-path=%s/include" % home).encode()]
opts += [("--include-path=" + d).encode()
         for d in glob.glob(home + "/**/include/cccl", recursive=True)[:1]]
status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
size = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
lib.nvrtcGetProgramLog(prog, log)
if status != 0:
    sys.exit("NVRTC failed:\n" + log.value.decode()[-4000:])
lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
cubin = ctypes.create_string_buffer(size.value)
lib.nvrtcGetCUBIN(prog, cubin)
open(out, "wb").write(cubin.raw)
'''


RUN_SH = r"""#!/usr/bin/env bash
# Build and run the kernel lab on the GPU machine (nvcc and the toolkit's NVRTC, no MLX):
# the kernels as MLX builds them (NVRTC) first, then the same source built by nvcc.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
home=${CUDA_HOME:-/usr/local/cuda}
nvrtc=${NVRTC_LIB:-$(find -L "$home"/ -name 'libnvrtc.so*' -not -path '*stubs*' | sort | head -1)}
export LD_LIBRARY_PATH=$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}  # its builtins library too
python3 "$here/nvrtc_build.py" "$here/kernels.cu" /tmp/tq_lab_nvrtc.cubin
nvcc -O3 -std=c++17 -arch=sm_90 -cubin -Xptxas -v "$here/kernels.cu" -o /tmp/tq_lab_nvcc.cubin \
  2> /tmp/tq_lab_build.txt || { cat /tmp/tq_lab_build.txt; exit 1; }
grep -E "registers|spill" /tmp/tq_lab_build.txt | grep -v "0 bytes spill" | sed 's/ptxas info    : //' || true
nvcc -O3 -std=c++17 "$here/main.cu" -o /tmp/tq_lab -ldl
/tmp/tq_lab /tmp/tq_lab_nvrtc.cubin
/tmp/tq_lab /tmp/tq_lab_nvcc.cubin
[ -z "${TQ_LAB_BOTH:-}" ] || TQ_LAB_MANAGED=1 /tmp/tq_lab /tmp/tq_lab_nvrtc.cubin  # managed memory
"""


# Nsight Compute over one lab kernel, after run.sh has built the program and both CUBINs.
PROFILE_SH = r"""#!/usr/bin/env bash
# bash DIR/profile.sh NAME_REGEX [nvrtc|nvcc]: where one kernel's time goes (stall reasons,
# source counters), from the CUBIN MLX's compiler builds unless told otherwise
set -eu
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --clock-control none --kernel-name-base function --kernel-name "regex:$1" \
  --launch-skip 5 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters --section Occupancy --section LaunchStats \
  /tmp/tq_lab "/tmp/tq_lab_${2:-nvrtc}.cubin"
"""


def select(variants: list[Variant], pattern: str | None) -> list[Variant]:
    """The variants whose names match `pattern` (a regular expression; None: all)."""
    if pattern is None:
        return variants
    wanted = re.compile(pattern)
    return [v for v in variants if wanted.search(v.name)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emit", type=Path, required=True, help="folder for the lab's files")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="emit only the variants whose names match (a shorter build and run)")
    args = ap.parse_args()
    args.emit.mkdir(parents=True, exist_ok=True)
    variants = select(build(kv_extra_bits=KV_EXTRA_BITS), args.only)
    if not variants:
        raise SystemExit(f"no variant matches --only {args.only!r}")
    (args.emit / "kernels.cu").write_text(kernels_file(variants))
    (args.emit / "main.cu").write_text(program(variants))
    (args.emit / "nvrtc_build.py").write_text(NVRTC_BUILD)
    (args.emit / "run.sh").write_text(RUN_SH)
    (args.emit / "profile.sh").write_text(PROFILE_SH)
    print(f"wrote {args.emit}/kernels.cu, main.cu ({len(variants)} variants), nvrtc_build.py, "
          f"run.sh and profile.sh; on the GPU machine: bash {args.emit}/run.sh, then "
          f"bash {args.emit}/profile.sh NAME_REGEX for Nsight Compute over one kernel")


if __name__ == "__main__":
    main()

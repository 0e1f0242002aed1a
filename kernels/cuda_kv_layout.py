"""What the two launches of a CUDA KV decode call (kernels/cuda_kv.py) take besides the
cache's arrays: `Layout` (template arguments, grids, output shapes, which kernels), built
once per shape and settings by `_layout`, and its constant inputs: `consts` (the queries'
rotation, both codebooks, the scales: `consts_layout` says where each sits), the
un-rotation matrix, and stand-ins for absent inputs. `fp16_operands` says whether a
layout's tensor-core products round their operands to fp16 (MMA_FP16_RTOL: what that may
move an output).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from turboquant.stages import unrotate

from . import cuda_memory, cuda_rotate
from .cuda_kv_plan import (MAX_ACC, MERGE_WIDE_THREADS, NT, SMEM_LIMIT, TILE, merge_wide_fits,
                           split_per_dim)
from .kv_reference import kv_levels, kv_words


@functools.lru_cache(maxsize=512)
def _unrotation(seed: int, v_dim: int) -> mx.array:
    """unrotate(I_v) float32: x = y @ unrot.

    Built on the CPU stream: on the GPU each layer's first decode step waited ~0.6 s here
    (measured on the H200 by `benchmarks/launch_cost.py --kv 1024 --profile`), while the
    CPU builds a 128 x 128 matrix in a few milliseconds."""
    with mx.stream(mx.cpu):
        unrot = np.asarray(unrotate(mx.eye(v_dim, dtype=mx.float32), seed))
    return cuda_memory.device_constant(mx.array(unrot))


def rotation(seed: int, k_dim: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(signs (k_dim,), mix (A, A), A, P) of the queries' rotation, k_dim = A * P:
    `cuda_rotate`'s decomposition of `stages.rotate` (NotImplementedError if A is too big)."""
    with mx.stream(mx.cpu):
        signs, mix, a, p = cuda_rotate.operands((seed,), k_dim)
        return np.asarray(signs)[0], np.asarray(mix)[0], a, p


def consts_layout(k_dim: int, a: int, bits_k: int, bits_v: int) -> dict[str, slice]:
    """Where each piece sits in the partial kernel's `consts` input (its pointer arithmetic)."""
    lk = k_dim + a * a
    lv = lk + (1 << bits_k)
    sc = lv + (1 << bits_v)
    return dict(signs=slice(0, k_dim), mix=slice(k_dim, lk), levels_k=slice(lk, lv),
                levels_v=slice(lv, sc), scales=slice(sc, sc + 2))


@functools.lru_cache(maxsize=512)
def _consts(seed: int, k_dim: int, bits_k: int, bits_v: int, scale: float) -> tuple[mx.array, int]:
    """(consts float32 [signs | mix | levels_k | levels_v | scale, scale / sqrt(k_dim)], P)."""
    signs, mix, _, p = rotation(seed, k_dim)
    with mx.stream(mx.cpu):
        lk, lv = (np.asarray(kv_levels(b).astype(mx.float32)) for b in (bits_k, bits_v))
    scales = np.array([scale, scale / math.sqrt(k_dim)], dtype=np.float32)
    c = mx.array(np.concatenate([signs, mix.reshape(-1), lk, lv, scales]).astype(np.float32))
    return cuda_memory.device_constant(c), p


@functools.lru_cache(maxsize=None)
def _dummy(dtype, ndim: int = 4) -> mx.array:
    """Stands in for an absent input (never read: its flag is off)."""
    return cuda_memory.device_constant(mx.zeros((1,) * ndim, dtype=dtype) + 0)


# What fp16 operands may move an output, relative to the largest |output|: a score's
# error (2^-10 of sum |q_i k_i| at most) reaches the weights through exp, so scores of up
# to ~8 give 8 * 2^-11 = 2^-8. The CPU replay measures 3e-4 to 9e-4 on its cases.
MMA_FP16_RTOL = 2.0 ** -8


def fp16_operands(layout: "Layout") -> bool:
    """Whether a call's partial kernel rounds its products' operands to fp16."""
    return dict(layout.partial_template).get("EXACT") is False


@dataclass(frozen=True)
class Layout:
    """What the two launches of a call need besides its per-token arrays: the same for
    every token of a layer until the chunk counts change, so `_layout` builds it once.

    consts, unrot, dummy_fp, dummy_mask: constant inputs (see `_PARTIAL`, `_MERGE`);
    *_template: template arguments; ncc, fpch: compressed and fp16 chunks of the partial
    grid (nch in all); grids and output shapes as the kernel calls take them."""

    b: int
    h: int
    kv: int
    r: int
    k_dim: int
    v_dim: int
    ncc: int
    fpch: int
    out_dtype: object
    consts: mx.array
    unrot: mx.array
    dummy_fp: mx.array
    dummy_mask: mx.array
    partial_template: tuple
    merge_template: tuple
    partial_grid: tuple
    partial_shapes: list
    merge_grid: tuple
    out_shape: tuple
    merge_kernel: str = "tq_kv_merge"
    merge_threads: int = NT
    partial_kernel: str = "tq_kv_partial"

    @property
    def nch(self) -> int:
        return self.ncc + self.fpch


@functools.lru_cache(maxsize=1024)
def _layout(b: int, h: int, kv: int, k_dim: int, v_dim: int, bits_k: int, bits_v: int,
            seed: int, scale: float, fp_dtype, out_dtype, has_sink: bool, has_tail: bool,
            has_mask: bool, ncc: int, fpch: int, merge_split: bool = False,
            partial: str = "plain", exact: bool = False, stage_batch: bool = False,
            merge_wide: bool = False) -> Layout:
    """The Layout of a call (NotImplementedError where the kernels do not fit it);
    `merge_split`: the merge with up to 8 threads a value dim (`_MERGE_SPLIT`);
    `merge_wide`: `_MERGE_WIDE` where `merge_wide_fits` (before `merge_split`);
    `partial`: the partial kernel, "plain" (`_PARTIAL`), "vec" (key rows in 16-byte loads,
    `_PARTIAL_VEC`) or "mma" (the tensor-core `_PARTIAL_MMA`, where `mma_fits`; `exact`:
    its hi + lo products, float32's accuracy, else fp16 operands); `stage_batch`: plain or
    mma with value codes staged 8 loads at a time (`_STAGE_V_BATCHED`, sources "_b8")."""
    r = h // kv
    if fp_dtype not in (mx.float16, mx.bfloat16, mx.float32):
        raise NotImplementedError(f"fp16 parts of dtype {fp_dtype}")
    wv = kv_words(v_dim, bits_v)
    smem = 4 * (r * k_dim + TILE * r + TILE + TILE * wv + (1 << bits_k) + (1 << bits_v) + 3 * r)
    if partial == "mma":  # the queries' fragments and the split level tables
        smem += 32 * k_dim + 4 * ((1 << bits_k) + (1 << bits_v))
    if smem > SMEM_LIMIT or r * -(-v_dim // NT) > MAX_ACC:
        raise NotImplementedError(f"group of {r} heads x head_dim {k_dim}/{v_dim} is too large")
    consts, p = _consts(seed, k_dim, bits_k, bits_v, scale)
    partial_template = (
        ("KD", k_dim), ("DV", v_dim), ("BK", bits_k), ("BV", bits_v), ("R", r), ("P", p),
        ("FPCH", fpch), ("HAS_SINK", has_sink), ("HAS_TAIL", has_tail), ("HAS_MASK", has_mask),
    ) + ((("EXACT", exact),) if partial == "mma" else ())
    nch, bkv = ncc + fpch, b * kv
    wide = merge_wide and merge_wide_fits(v_dim)
    split = split_per_dim(v_dim) if merge_split and not wide else 1
    merge_threads = MERGE_WIDE_THREADS if wide else split * v_dim if split > 1 else NT
    merge_kernel = ("tq_kv_merge_wide" if wide else "tq_kv_merge_split" if split > 1
                    else "tq_kv_merge")
    return Layout(
        b=b, h=h, kv=kv, r=r, k_dim=k_dim, v_dim=v_dim, ncc=ncc, fpch=fpch, out_dtype=out_dtype,
        consts=consts, unrot=_unrotation(seed, v_dim), dummy_fp=_dummy(fp_dtype),
        dummy_mask=_dummy(mx.float32, 2), partial_template=partial_template,
        merge_template=(("DV", v_dim), ("FPCH", fpch)),
        partial_grid=(nch * NT, bkv, 1), partial_shapes=[(bkv, nch, r, 2), (bkv, nch, r, v_dim)],
        merge_grid=(b * h * merge_threads, 1, 1), out_shape=(b, h, 1, v_dim),
        merge_kernel=merge_kernel, merge_threads=merge_threads,
        partial_kernel=("tq_kv_partial" + ("" if partial == "plain" else "_" + partial)
                        + ("_b8" if stage_batch else "")),  # a SOURCES name
    )


__all__ = ["MMA_FP16_RTOL", "Layout", "consts_layout", "fp16_operands", "rotation"]

"""Launch planning of the CUDA KV decode kernels (kernels/cuda_kv.py): how a call's tokens
split into the partial kernel's chunks, which kernel a call runs, and the switches that
choose them.

Every kernel runs NT threads a block (the wide and split merges aside) and a partial block
walks its chunk a TILE of tokens at a time. `plan` (or `plan_waves`, where the GPU's SM count
is known) gives a call its compressed and fp16 chunks, `chunk_tiles` a chunk its tiles;
`mma_fits`, `merge_wide_fits` and `use_mma` say which kernels take which heads. The KV_*
switches (and FP_TOKENS_PER_CHUNK, TARGET_BLOCKS) are read on every call: set them on this
module, not on cuda_kv.
"""

from __future__ import annotations

import functools
import os

from . import cuda_memory

NT = 128  # threads per block in every kernel
TILE = 128  # tokens a partial block scores at once (one per thread)
TARGET_BLOCKS = 1024  # partial blocks to aim for (H200: 132 SMs, several blocks each)
MAX_CHUNKS = 1024  # chunks per (batch, KV head); the merge keeps one weight each in smem
# fp16 (sink + tail) tokens per fp chunk: a tile. A block walks its chunk a tile at a time
# and the kernel splits the fp16 part by whole tiles, so the runtime's sink + tail (132-196
# tokens) in one chunk of 256 made one block walk 2 tiles while every compressed chunk at
# 1K walks 1: that block was the call's critical path (lab, the 2026-11-30 run, a 188-token tail:
# 60.8 us at 1K against 25.0 with a 64-token one; in chunks of a tile 41.1). Smaller chunks
# than a tile would only add empty blocks.
FP_TOKENS_PER_CHUNK = int(os.environ.get("TURBOQUANT_CUDA_KV_FP_TOKENS", str(TILE)))
MAX_FP_CHUNKS = 8
SMEM_LIMIT = 40 * 1024  # bytes of static shared memory the partial kernel may take
MAX_ACC = 64  # accumulators per thread (R * value dims per thread)


def mma_fits(k_dim: int, v_dim: int, r: int) -> bool:
    """Whether `_PARTIAL_MMA` takes these heads: whole 32-code blocks a lane (k_dim a
    multiple of 128), whole 16-row tiles a warp (v_dim of 64), query rows in the 8 columns."""
    return k_dim % 128 == 0 and v_dim % 64 == 0 and r <= 8


MERGE_WIDE_THREADS = 1024


def merge_wide_fits(v_dim: int) -> bool:
    """Whether `_MERGE_WIDE` takes heads of v_dim values (float4 rows that tile its block,
    its shared memory, and at least MAX_FP_CHUNKS chunk rows at a time)."""
    return (v_dim % 4 == 0 and MERGE_WIDE_THREADS % (v_dim // 4) == 0 and v_dim <= 256
            and MERGE_WIDE_THREADS // (v_dim // 4) >= MAX_FP_CHUNKS)


def plan(b: int, kv: int, c_len: int, f_len: int, fp_tokens: int | None = None
         ) -> tuple[int, int]:
    """(compressed chunks, fp16 chunks) of the partial kernel's grid for one call, with
    `fp_tokens` fp16 tokens a chunk (FP_TOKENS_PER_CHUNK unless given)."""
    tiles = -(-c_len // TILE)
    per_chunk = fp_tokens or FP_TOKENS_PER_CHUNK
    fpch = 0 if f_len == 0 else min(MAX_FP_CHUNKS, -(-f_len // per_chunk))
    ncc = max(1, min(tiles, TARGET_BLOCKS // (b * kv), MAX_CHUNKS - fpch))
    return ncc, fpch


PARTIAL_BLOCKS_PER_SM = 6  # the partial kernel's resident blocks on an sm_90 SM (76-79 registers)
MMA_BLOCKS_PER_SM = 6  # `_PARTIAL_MMA`'s (72 registers with nvcc for sm_90)
# the batched-staging tensor-core kernel's for values of at most 4 bits (56 registers for
# every mix of bits: 9 blocks fit). Lab, H200, 32K, runtime grid: K4/V3 43.7 us on this
# plan against 51.0 on the 6-block one (and 50.9 for full staging on a 7-block one), the
# same at 1K; K8/V3 57.3 against 67.4 (the 2026-11-30 run). 8-bit values stay on the 6-block plan:
# K8/V8 101 us there against 119 on a 9-block one.
MMA_B8_BLOCKS_PER_SM = 9

# Two of the lab's candidates (the 2026-11-29h run), on since their GPU tests passed with them
# (the 2026-11-30 run, `device_check.sh kv-candidates`: 21/21); "0" turns either off:
# the split merge (lab, 32K: 14.4 us against 23.3; 1K: 9.3 vs 8.8), for every call: with a
# threshold on the chunk count, a cache growing past it met a kernel not yet compiled in
# the middle of decoding (the 2026-11-30 run: 4K decode at 20 tok/s, ~1 s of NVRTC inside the
# timed steps)
KV_MERGE_SPLIT = os.environ.get("TURBOQUANT_CUDA_KV_MERGE_SPLIT", "1") == "1"


def split_per_dim(v_dim: int) -> int:
    """Threads per value dim of `_MERGE_SPLIT` (at most 8, a block of at most 1024)."""
    return min(8, 1024 // v_dim)

# `_MERGE_WIDE` as the merge where it fits, "0" turns it off (the split merge then): lab,
# H200, 32K: 5.7 us against the split merge's 10.2, 1K: 5.0 against 7.6 (the 2026-11-30 run)
KV_MERGE_WIDE = os.environ.get("TURBOQUANT_CUDA_KV_MERGE_WIDE", "1") == "1"

# the partial grid from `plan_waves` on this GPU's SM count (lab, 32K: 68.0 us against 81.6)
KV_PLAN_WAVES = os.environ.get("TURBOQUANT_CUDA_KV_PLAN_WAVES", "1") == "1"
# `_PARTIAL_VEC` as the partial kernel (lab, 32K: 71.6 us against 81.6, the same outputs);
# off until the KV GPU tests pass with it (`device_check.sh kv-vec`)
KV_PARTIAL_VEC = os.environ.get("TURBOQUANT_CUDA_KV_PARTIAL_VEC", "0") == "1"
# `_PARTIAL_MMA` where it fits (`mma_fits`, sm_80+), "0" turns it off: lab, the runtime's
# 188-token fp16 tail in chunks of a tile, 61.9 us at 32K against 78.3 (the plain kernel on
# its own wave grid), 29.1 at 1K against 41.1, outputs within 1e-6; the KV GPU tests pass
# with it (the 2026-11-30 run, `device_check.sh kv-mma`: 23/23)
KV_PARTIAL_MMA = os.environ.get("TURBOQUANT_CUDA_KV_PARTIAL_MMA", "1") == "1"
# `_PARTIAL_MMA`'s products: "1" carries every operand as fp16 hi + lo halves (three
# products, float32's accuracy); "0" (the default) rounds the operands to fp16 once (one
# product, float32 sums). fp16 keeps 11 significant bits: the decoded levels, the rotated
# queries and the softmax weights each move by at most 2^-11 relative, 4x finer than the
# bf16 K/V, queries and weights of the fp16 cache's own attention (cuDNN SDPA), and 30x
# under the 4-bit codes' own error (sqrt(kv_mse(4)) = 9.7%). The fp16 sink and tail enter
# the products as fp16 too: exact for bf16 and fp16 parts within fp16's range.
KV_MMA_EXACT = os.environ.get("TURBOQUANT_CUDA_KV_MMA_EXACT", "0") == "1"
# Whether the partial kernels (plain and tensor-core) take `_STAGE_V_BATCHED`: "auto" (the
# default) and "1" for every layer, "0" never. Lab, H200, 32K tokens, the runtime's grid
# and 188-token tail, fp16 operands: K8/V8 99.3-101.6 us batched against 150.7-155.3 (130
# registers -> 56; the layers the cache protects by default); K4/V3 43.7 against 50.9 and
# K8/V3 57.3 against ~66 (110 registers -> 56), both on the 9-block plan of values of at
# most 4 bits (the 2026-11-30 runs); the plain kernel the same within 2% either way. Until
# the 2026-11-30 run "auto" left K8/V3 and K8/V4 on full staging (on a 6-block plan where 4 fit).
# The KV GPU tests pass with "1".
KV_STAGE_BATCH = os.environ.get("TURBOQUANT_CUDA_KV_STAGE_BATCH", "auto")


def stage_batch(bits_k: int, bits_v: int) -> bool:
    """Whether a call of these bits stages its value codes 8 loads at a time."""
    return KV_STAGE_BATCH != "0"


def mma_blocks_per_sm(bits_k: int, bits_v: int, batched: bool) -> int:
    """Resident blocks an SM that the tensor-core kernel's wave plan counts on, for these
    bits and that kernel with (`batched`) or without batched value staging."""
    return MMA_B8_BLOCKS_PER_SM if batched and bits_v <= 4 else MMA_BLOCKS_PER_SM


def use_mma(k_dim: int, v_dim: int, r: int) -> bool:
    """Whether a call of these heads runs `_PARTIAL_MMA` on this GPU."""
    cc = cuda_memory.compute_capability()
    return KV_PARTIAL_MMA and mma_fits(k_dim, v_dim, r) and cc is not None and cc >= (8, 0)


def plan_waves(b: int, kv: int, c_len: int, f_len: int, sms: int,
               fp_tokens: int | None = None, blocks_per_sm: int = PARTIAL_BLOCKS_PER_SM
               ) -> tuple[int, int]:
    """`plan` on a GPU whose SM count is known (KV_PLAN_WAVES): the fewest compressed
    chunks that minimise waves x tiles per chunk on `sms` SMs, so the grid ends on a full wave
    instead of a short one (the 2026-11-29h run's ncu at 32K: 1032 blocks in 792 slots, 1.3 waves).
    Every block of a wave is taken to cost its tiles (the fp16 chunks' blocks cost less)."""
    _, fpch = plan(b, kv, c_len, f_len, fp_tokens)
    return _wave_chunks(b * kv, -(-c_len // TILE), fpch, sms * blocks_per_sm), fpch


@functools.lru_cache(maxsize=4096)
def _wave_chunks(bkv: int, tiles: int, fpch: int, slots: int) -> int:
    """`plan_waves`'s compressed chunks. Cached on the tile count, which changes once per
    TILE compressed tokens: keyed on the token counts (the fp16 tail grows every step), it
    missed on every decode step and walked up to MAX_CHUNKS candidates (the 2026-11-30 run: ~60 us
    of a token's host time at 32K)."""
    best = None
    for ncc in range(1, max(1, min(tiles, MAX_CHUNKS - fpch)) + 1):
        cost = -(-(ncc + fpch) * bkv // slots) * -(-tiles // ncc)
        if best is None or cost < best[0]:
            best = (cost, ncc)
    return best[1]


def chunk_tiles(tiles: int, n_chunks: int, c_idx: int) -> tuple[int, int]:
    """Tiles [first, end) that chunk c_idx of n_chunks walks (the kernel's arithmetic)."""
    tpc = -(-tiles // n_chunks)
    first = c_idx * tpc
    return first, min(tiles, first + tpc)

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
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from turboquant.stages import unrotate

from . import compiled, cuda_memory, cuda_rotate
from .kv_reference import NEG, KVParts, kv_levels, kv_words

NT = 128  # threads per block in every kernel
TILE = 128  # tokens a partial block scores at once (one per thread)
TARGET_BLOCKS = 1024  # partial blocks to aim for (H200: 132 SMs, several blocks each)
MAX_CHUNKS = 1024  # chunks per (batch, KV head); the merge keeps one weight each in smem
# fp16 (sink + tail) tokens per fp chunk: a tile. A block walks its chunk a tile at a time
# and the kernel splits the fp16 part by whole tiles, so the runtime's sink + tail (132-196
# tokens) in one chunk of 256 made one block walk 2 tiles while every compressed chunk at
# 1K walks 1: that block was the call's critical path (lab, session 10, a 188-token tail:
# 60.8 us at 1K against 25.0 with a 64-token one; in chunks of a tile 41.1). Smaller chunks
# than a tile would only add empty blocks.
FP_TOKENS_PER_CHUNK = int(os.environ.get("TURBOQUANT_CUDA_KV_FP_TOKENS", str(TILE)))
MAX_FP_CHUNKS = 8
SMEM_LIMIT = 40 * 1024  # bytes of static shared memory the partial kernel may take
MAX_ACC = 64  # accumulators per thread (R * value dims per thread)

_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define TQ_NEG (-1e30f)
#define TQ_NEG_INF (__uint_as_float(0xff800000u))

constexpr int TQ_NT = @NT@;        // threads per block
constexpr int TQ_TILE = @TILE@;    // tokens a partial block scores at once
constexpr int TQ_MAXCH = @MAXCH@;  // chunks per (batch, KV head) at most

// uint32 words of a packed head vector of d codes of `bits` bits (kv_reference.kv_words)
__host__ __device__ constexpr int tq_words(int d, int bits) {
  return bits == 3 ? (d + 31) / 32 * 3 : (d + 32 / bits - 1) / (32 / bits);
}

// The output element's type picks the conversion.
__device__ __forceinline__ void tq_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void tq_store(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void tq_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// Code j (0..31) of a block of 32 codes held in BITS words (the stored packing: 2/4/8 bits
// code j at bit BITS * (j % (32 / BITS)) of word j / (32 / BITS); 3 bits at bit 3j of the
// 96 bits w0 | w1 << 32 | w2 << 64, codes 10 and 21 straddling two words).
template <int BITS>
__device__ __forceinline__ uint32_t tq_block_code(const uint32_t* w, int j) {
  if (BITS == 3) {
    const int bit = 3 * j, k = bit >> 5, s = bit & 31;
    uint32_t c = w[k] >> s;
    if (s > 29) c |= w[k < 2 ? k + 1 : 2] << (32 - s);
    return c & 7u;
  } else {
    const int per = 32 / BITS;
    return (w[j / per] >> ((j % per) * BITS)) & ((1u << BITS) - 1u);
  }
}

// Where code i of a packed head vector sits: word index and bit shift.
template <int BITS>
__device__ __forceinline__ void tq_code_pos(int i, int& word, int& shift) {
  if (BITS == 3) {
    const int bit = 3 * (i & 31);
    word = 3 * (i >> 5) + (bit >> 5);
    shift = bit & 31;
  } else {
    const int per = 32 / BITS;
    word = i / per;
    shift = (i % per) * BITS;
  }
}

// The code at (word, shift) of a row whose words are ws elements apart.
template <int BITS>
__device__ __forceinline__ uint32_t tq_code_at(const uint32_t* row, long long ws, int word,
                                               int shift) {
  uint32_t c = row[word * ws] >> shift;
  if (BITS == 3 && shift > 29) c |= row[(word + 1) * ws] << (32 - shift);
  return c & ((1u << BITS) - 1u);
}

__device__ __forceinline__ float tq_warp_max(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float tq_warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- fp16 tensor-core helpers (`_PARTIAL_MMA`, sm_80+): with EXACT a float x is carried
// as the pair hi = half(x), lo = half(x - hi), and a product as hi*hi + hi*lo + lo*hi, which
// is x*y to ~2^-22 relative (float32's accuracy, not fp16's 2^-11); without it, hi alone

// a half2 as its 32 bits: .x (the lower index of a fragment pair) in the low half
__device__ __forceinline__ uint32_t tq_h2bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }

// (x0, x1) as the half2 pairs hi and lo
__device__ __forceinline__ void tq_split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 f = __half22float2(h);
  hi = tq_h2bits(h);
  lo = tq_h2bits(__floats2half2_rn(x0 - f.x, x1 - f.y));
}

// x as one word of a (hi | lo << 16) lookup table
__device__ __forceinline__ uint32_t tq_split1(float x) {
  const __half h = __float2half_rn(x);
  const __half l = __float2half_rn(x - __half2float(h));
  return (uint32_t)__half_as_ushort(h) | ((uint32_t)__half_as_ushort(l) << 16);
}

// two (hi | lo << 16) table words t0, t1 (fragment elements k, k + 1) as the pairs hi, lo
__device__ __forceinline__ void tq_pair(uint32_t t0, uint32_t t1, uint32_t& hi, uint32_t& lo) {
  hi = __byte_perm(t0, t1, 0x5410);
  lo = __byte_perm(t0, t1, 0x7632);
}

// d += a b, mma m16n8k16 (row-major A 16x16, column-major B 16x8), fp16 in, float32 sums.
// Fragments (g = lane / 4, c = lane % 4): a = {(g, 2c..2c+1), (g+8, 2c..), (g, 2c+8..),
// (g+8, 2c+8..)}, b = {(2c..2c+1, g), (2c+8.., g)}, d = {(g, 2c), (g, 2c+1), (g+8, 2c),
// (g+8, 2c+1)}
__device__ __forceinline__ void tq_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b. EXACT: both split, the three products that matter, smallest first; else the
// hi halves alone, fp16 operands (2^-11 relative each) with float32 sums, one product (the
// lo halves are then dead code)
template <bool EXACT>
__device__ __forceinline__ void tq_mma3(float (&d)[4], const uint32_t (&ah)[4],
                                        const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1,
                                        uint32_t bl0, uint32_t bl1) {
  if (EXACT) {
    tq_mma(d, al, bh0, bh1);
    tq_mma(d, ah, bl0, bl1);
  }
  tq_mma(d, ah, bh0, bh1);
}

// x = p[0, s, 2s, 3s] as floats (0 where !ok): one 8- or 16-byte load where the four are
// contiguous and aligned (an fp16 row's elements), else four
__device__ __forceinline__ void tq_cvt4(const __half*, uint2 v, float (&x)[4]) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
}
__device__ __forceinline__ void tq_cvt4(const __nv_bfloat16*, uint2 v, float (&x)[4]) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
  x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
}
template <typename T>  // 2-byte elements
__device__ __forceinline__ void tq_load4(const T* p, long long s, bool ok, float (&x)[4]) {
  if (!ok) {
    x[0] = x[1] = x[2] = x[3] = 0.f;
  } else if (s == 1 && (reinterpret_cast<unsigned long long>(p) & 7ull) == 0) {
    tq_cvt4(p, *reinterpret_cast<const uint2*>(p), x);
  } else {
    #pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = (float)p[e * s];
  }
}
__device__ __forceinline__ void tq_load4(const float* p, long long s, bool ok, float (&x)[4]) {
  if (!ok) {
    x[0] = x[1] = x[2] = x[3] = 0.f;
  } else if (s == 1 && (reinterpret_cast<unsigned long long>(p) & 15ull) == 0) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
  } else {
    #pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = p[e * s];
  }
}
""".replace("@NT@", str(NT)).replace("@TILE@", str(TILE)).replace("@MAXCH@", str(MAX_CHUNKS))

# Pieces both partial kernels share: a tile's value codes into shared memory, every load
# in flight at once (the value phase then reads no global memory), and the online softmax
# over a tile's scores (a warp per query row; sc becomes p * value scale).
_STAGE_V = r"""    if (!fp) {
      #pragma unroll
      for (int k = 0; k < (TILE * WV + NT - 1) / NT; ++k) {
        const int i = tid + k * NT;
        if (i < TILE * WV) {
          const int tt = tile * TILE + i / WV;
          vw[i] = tt < n_tok ? v_codes[vc_base + (long long)tt * v_codes_strides[2] +
                                       (long long)(i % WV) * v_codes_strides[3]] : 0u;
        }
      }
    }
"""

_ONLINE_SOFTMAX = r"""    // ---- online softmax, a warp per query row
    for (int r = warp; r < R; r += NWARPS) {
      float mx = TQ_NEG_INF;
      for (int u = lane; u < TILE; u += 32) mx = fmaxf(mx, sc[u * R + r]);
      mx = tq_warp_max(mx);
      const float m_old = m_s[r];
      const float m_new = fmaxf(fmaxf(m_old, mx), TQ_NEG);
      float sum = 0.f;
      for (int u = lane; u < TILE; u += 32) {
        const float p = expf(sc[u * R + r] - m_new);
        sum += p;
        sc[u * R + r] = p * vn[u];
      }
      sum = tq_warp_sum(sum);
      if (lane == 0) {
        const float a = expf(m_old - m_new);
        a_s[r] = a;
        l_s[r] = l_s[r] * a + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
"""


# One block per (chunk, b * KV + kv head). Chunks [0, ncc) walk the compressed span,
# [ncc, ncc + FPCH) the fp16 tokens (sinks then tail). queries (B, H, 1, KD) any float
# dtype, strided; consts float32 [signs KD | mix A*A | levels_k 2^BK | levels_v 2^BV |
# scale | scale / sqrt(KD)] (`consts_layout`). Outputs per (bk, chunk, r): part_ml = (max,
# sum of exp), part_acc = sum of exp * value (rotated domain for compressed chunks,
# original for fp16 chunks).
_PARTIAL = r"""
  constexpr int NT = TQ_NT, TILE = TQ_TILE;
  constexpr int NWARPS = NT / 32;
  constexpr int A = KD / P;                // the rotation: A segments of a power-of-two P
  constexpr int WK = tq_words(KD, BK);     // words of a packed key
  constexpr int WV = tq_words(DV, BV);     // words of a packed value
  constexpr int NBK = (KD + 31) / 32;      // 32-code blocks of a key
  constexpr int VSLOT = DV < NT ? DV : NT;  // threads per value group
  constexpr int VG = DV < NT ? NT / DV : 1; // token groups in the value phase
  constexpr int DPT = (DV + NT - 1) / NT;   // value dims per thread

  __shared__ __align__(16) float qs[R * KD];
  __shared__ __align__(16) float sc[TILE * R];  // scores, then p * value scale
  __shared__ float vn[TILE];
  __shared__ uint32_t vw[TILE * WV];  // the tile's value codes (compressed chunks)
  __shared__ float lk[1 << BK];
  __shared__ float lv[1 << BV];
  __shared__ float m_s[R], l_s[R], a_s[R];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunk = blockIdx.x, bk = blockIdx.y;
  const int KV = k_codes_shape[1];
  const int b = bk / KV, h = bk % KV;
  const int nch = gridDim.x;
  const int ncc = nch - FPCH;
  const bool fp = chunk >= ncc;

  const int C = k_codes_shape[2];
  const int S = HAS_SINK ? sink_k_shape[2] : 0;
  const int TT = HAS_TAIL ? tail_k_shape[2] : 0;
  const int n_tok = fp ? S + TT : C;
  const int n_chunks = fp ? FPCH : ncc;
  const int c_idx = fp ? chunk - ncc : chunk;
  const int tiles = (n_tok + TILE - 1) / TILE;
  const int tpc = (tiles + n_chunks - 1) / n_chunks;
  const int tile0 = c_idx * tpc;
  const int tile1 = min(tiles, tile0 + tpc);

  // ---- the R query rows of KV head h (query heads h * R + r) in float32: for fp16 chunks
  // times scale; for compressed ones times the signs, then the Hadamard over P on every
  // segment of P (radix-2 stages, all rows at once), then the A x A mix, times kscale
  const float* signs = consts;
  const float* mix = consts + KD;
  const float* levels_k = mix + A * A;
  const float* levels_v = levels_k + (1 << BK);
  const float scale = levels_v[1 << BV], kscale = levels_v[(1 << BV) + 1];
  const long long q_base = b * queries_strides[0] + (long long)h * R * queries_strides[1];
  for (int i = tid; i < R * KD; i += NT) {
    const int r = i / KD, d = i % KD;
    const float x = (float)queries[q_base + r * queries_strides[1] + d * queries_strides[3]];
    qs[i] = fp ? x * scale : x * signs[d];
  }
  for (int i = tid; i < (1 << BK); i += NT) lk[i] = levels_k[i];
  for (int i = tid; i < (1 << BV); i += NT) lv[i] = levels_v[i];
  if (tid < R) { m_s[tid] = TQ_NEG; l_s[tid] = 0.f; }
  __syncthreads();
  if (!fp) {  // the same for the whole block
    for (int lh = 0; (1 << lh) < P; ++lh) {
      const int hh = 1 << lh;
      for (int k = tid; k < R * KD / 2; k += NT) {
        const int i = ((k >> lh) << (lh + 1)) | (k & (hh - 1));
        const float u = qs[i], w = qs[i + hh];
        qs[i] = u + w;
        qs[i + hh] = u - w;
      }
      __syncthreads();
    }
    for (int i = tid; i < R * P; i += NT) {  // a thread per (row, column j of the segments)
      const int base = (i / P) * KD + i % P;
      float v[A];
      #pragma unroll
      for (int k = 0; k < A; ++k) v[k] = qs[base + k * P];
      #pragma unroll 1
      for (int a = 0; a < A; ++a) {
        float o = 0.f;
        #pragma unroll
        for (int k = 0; k < A; ++k) o += mix[a * A + k] * v[k];
        qs[base + a * P] = o * kscale;
      }
    }
  }

  const long long kc_base = b * k_codes_strides[0] + h * k_codes_strides[1];
  const long long kn_base = b * k_norms_strides[0] + h * k_norms_strides[1];
  const long long vc_base = b * v_codes_strides[0] + h * v_codes_strides[1];
  const long long vn_base = b * v_norms_strides[0] + h * v_norms_strides[1];
  const long long sk_base = b * sink_k_strides[0] + h * sink_k_strides[1];
  const long long sv_base = b * sink_v_strides[0] + h * sink_v_strides[1];
  const long long tk_base = b * tail_k_strides[0] + h * tail_k_strides[1];
  const long long tv_base = b * tail_v_strides[0] + h * tail_v_strides[1];
  const long long mrow = HAS_MASK ? (long long)(mask_shape[0] > 1 ? b : 0) * mask_shape[1] : 0;
  const float v_scale = 1.f / sqrtf((float)DV);

  // value phase: thread -> (token group, dims vd + k * VSLOT)
  const int vg = tid / VSLOT, vd = tid % VSLOT;
  int vword[DPT], vshift[DPT];
  #pragma unroll
  for (int k = 0; k < DPT; ++k) tq_code_pos<BV>(vd + k * VSLOT, vword[k], vshift[k]);
  float acc[DPT][R];
  #pragma unroll
  for (int k = 0; k < DPT; ++k) {
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[k][r] = 0.f;
  }
  __syncthreads();

  for (int tile = tile0; tile < tile1; ++tile) {
    // ---- the tile's value codes into shared memory, every load in flight at once (the
    // value phase then reads no global memory: one latency per tile, not one per token)
@STAGE_V@    // ---- scores: one token per thread
    const int t = tile * TILE + tid;
    const bool valid = t < n_tok;
    float s[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
    float vscale = 0.f, bias = 0.f;
    if (valid) {
      int col;
      if (!fp) {
        const uint32_t* krow = k_codes + kc_base + (long long)t * k_codes_strides[2];
        const long long ws = k_codes_strides[3];
        #pragma unroll
        for (int blk = 0; blk < NBK; ++blk) {
          uint32_t w[BK];
          #pragma unroll
          for (int k = 0; k < BK; ++k) w[k] = blk * BK + k < WK ? krow[(blk * BK + k) * ws] : 0u;
          #pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int i = blk * 32 + j;
            if (i < KD) {
              const float x = lk[tq_block_code<BK>(w, j)];
              #pragma unroll
              for (int r = 0; r < R; ++r) s[r] += qs[r * KD + i] * x;
            }
          }
        }
        const float kn = (float)k_norms[kn_base + (long long)t * k_norms_strides[2]];
        #pragma unroll
        for (int r = 0; r < R; ++r) s[r] *= kn;
        vscale = (float)v_norms[vn_base + (long long)t * v_norms_strides[2]] * v_scale;
        col = S + t;
      } else {
        auto krow = sink_k;  // sink and tail share a dtype
        long long ks;
        if (t < S) {
          krow = sink_k + sk_base + (long long)t * sink_k_strides[2];
          ks = sink_k_strides[3];
          col = t;
        } else {
          krow = tail_k + tk_base + (long long)(t - S) * tail_k_strides[2];
          ks = tail_k_strides[3];
          col = C + t;  // S + C + (t - S)
        }
        for (int i = 0; i < KD; ++i) {
          const float x = (float)krow[i * ks];
          #pragma unroll
          for (int r = 0; r < R; ++r) s[r] += qs[r * KD + i] * x;
        }
        vscale = 1.f;
      }
      if (HAS_MASK) bias = mask[mrow + col];
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) sc[tid * R + r] = valid ? s[r] + bias : TQ_NEG_INF;
    vn[tid] = vscale;
    __syncthreads();

@SOFTMAX@
    // ---- values: a thread per output dim (and token group)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const float a = a_s[r];
      #pragma unroll
      for (int k = 0; k < DPT; ++k) acc[k][r] *= a;
    }
    const int ntile = min(TILE, n_tok - tile * TILE);
    if (vg < VG) {
      for (int u = vg; u < ntile; u += VG) {
        const int t2 = tile * TILE + u;
        #pragma unroll
        for (int k = 0; k < DPT; ++k) {
          const int d = vd + k * VSLOT;
          if (d < DV) {
            float x;
            if (!fp) {
              x = lv[tq_code_at<BV>(vw + u * WV, 1, vword[k], vshift[k])];
            } else if (t2 < S) {
              x = (float)sink_v[sv_base + (long long)t2 * sink_v_strides[2] + d * sink_v_strides[3]];
            } else {
              x = (float)tail_v[tv_base + (long long)(t2 - S) * tail_v_strides[2] + d * tail_v_strides[3]];
            }
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[k][r] += sc[u * R + r] * x;
          }
        }
      }
    }
    __syncthreads();
  }

  // ---- token groups -> group 0 (sc is free: (VG - 1) * DV < TILE)
  if (VG > 1) {
    if (vg > 0 && vg < VG) {
      #pragma unroll
      for (int r = 0; r < R; ++r) sc[((vg - 1) * R + r) * DV + vd] = acc[0][r];
    }
    __syncthreads();
    if (vg == 0) {
      for (int g = 1; g < VG; ++g) {
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[0][r] += sc[((g - 1) * R + r) * DV + vd];
      }
    }
  }
  const size_t prow = ((size_t)bk * nch + chunk) * R;
  if (vg == 0) {
    #pragma unroll
    for (int k = 0; k < DPT; ++k) {
      const int d = vd + k * VSLOT;
      if (d < DV) {
        #pragma unroll
        for (int r = 0; r < R; ++r) part_acc[(prow + r) * DV + d] = acc[k][r];
      }
    }
  }
  if (tid < R) {
    part_ml[(prow + tid) * 2] = m_s[tid];
    part_ml[(prow + tid) * 2 + 1] = l_s[tid];
  }
""".replace("@STAGE_V@", _STAGE_V).replace("@SOFTMAX@", _ONLINE_SOFTMAX)

# A candidate partial kernel, timed and checked against `_PARTIAL` by the kernel lab
# (`benchmarks/cuda_lab.py`, family kv_partial_*), run by the runtime only behind
# KV_PARTIAL_VEC until it has passed the GPU tests: a thread reads its token's key row in
# 16-byte loads where the row allows it (contiguous, 16-byte aligned, whole 16-byte units:
# the same for every token of a block) instead of word by word. Session 8's ncu of
# `_PARTIAL` at 32K: 77% of its global sectors were excess (16 scattered 4-byte loads a
# row for K4/128) and its L1 66% busy. The words, and so the sums, are the same.
# `_PARTIAL` with two pieces replaced:
_VEC_FLAG = r"""  const float v_scale = 1.f / sqrtf((float)DV);
  const bool vec_keys = WK % 4 == 0 && k_codes_strides[3] == 1 && k_codes_strides[2] % 4 == 0 &&
      (reinterpret_cast<unsigned long long>(k_codes + kc_base) & 15ull) == 0;
"""

_VEC_ROW = r"""        const long long ws = k_codes_strides[3];
        constexpr int WK4 = (WK + 3) / 4;  // the row in whole 16-byte units
        uint32_t row[WK4 * 4];
        if (vec_keys) {
          #pragma unroll
          for (int k4 = 0; k4 < WK4; ++k4) {
            const uint4 q = reinterpret_cast<const uint4*>(krow)[k4];
            row[4 * k4] = q.x;
            row[4 * k4 + 1] = q.y;
            row[4 * k4 + 2] = q.z;
            row[4 * k4 + 3] = q.w;
          }
        } else {
          #pragma unroll
          for (int k = 0; k < WK; ++k) row[k] = krow[k * ws];
        }
        #pragma unroll
        for (int blk = 0; blk < NBK; ++blk) {
          uint32_t w[BK];
          #pragma unroll
          for (int k = 0; k < BK; ++k) w[k] = blk * BK + k < WK ? row[blk * BK + k] : 0u;
"""


def _spliced(source: str, pieces) -> str:
    """`source` with each piece [start, end) replaced (end None: to the end)."""
    for start, end, text in pieces:
        i = source.index(start)
        j = len(source) if end is None else source.index(end, i)
        source = source[:i] + text + source[j:]
    return source


_PARTIAL_VEC = _spliced(_PARTIAL, (
    ("  const float v_scale = 1.f / sqrtf((float)DV);\n", "\n  // value phase: thread", _VEC_FLAG),
    ("        const long long ws = k_codes_strides[3];",
     "          #pragma unroll\n          for (int j = 0; j < 32; ++j) {", _VEC_ROW),
))

# The runtime's partial kernel where it fits (KV_PARTIAL_MMA, `use_mma`: sm_80+), on the
# tensor cores; the kernel lab checks it against `_PARTIAL` and times both. `_PARTIAL`
# spends ~124 instructions a token at 32K (session 10's ncu: 32.4M for 256K tokens, issue
# slots 46% busy, L1 76%; this kernel 25.3M): a thread per token for the
# scores (128 code lookups and 512 shared-memory reads of the queries a key) and a thread
# per value dim (a lookup, a code and R weights from shared memory per token and dim).
# Here both products are mma m16n8k16 on fp16 fragments, with the codes decoded straight
# into fragments. Template EXACT: each float carried as hi + lo halves, three products
# (`tq_mma3`: float32's accuracy); without it, the fp16 operands alone and one product
# (what `KV_MMA_EXACT` chooses; see there):
# * scores S^T = K Q^T: a warp takes 32 tokens of the tile (2 M-tiles of 16), query rows
#   are the 8 columns (R <= 8 real). Dims are permuted so that a lane's A elements are
#   whole 32-code blocks of its tokens' keys: lane (g, c) holds dims c * KD/4 + 4 ks +
#   {0, 1 | 2, 3} in k-step ks, and the queries' B fragments (in shared memory, built
#   once a block) use the same order. fp16 chunks load their rows the same way.
# * values O^T = V^T P^T: a warp takes DV/4 dims (DV/64 M-tiles of 16), the tile's
#   tokens in k-steps of 16; lane g decodes dims warp * DV/4 + g * DV/32 + [0, DV/32) of
#   its 4 tokens a step (slot j = 2 mt + half: row g + 8 half of M-tile mt), from the
#   value codes staged in shared memory. The weights p * value scale are B (query row g).
# KD a multiple of 128, DV of 64, R <= 8 (`mma_fits`); `_PARTIAL`'s setup and softmax.
_MMA_BODY = r"""  // ---- tensor-core layout (see above)
  constexpr int KSTEPS = KD / 16, KPL = KD / 4;  // k-steps of the scores; a lane's key dims
  constexpr int NWL = KPL / 32 * BK;              // words of a lane's key codes
  constexpr int VWARP = DV / NWARPS, MTV = VWARP / 16, VPL = VWARP / 8;
  __shared__ __align__(16) uint4 qf[KSTEPS * 32];  // Q^T fragments: hi b01, hi b23, lo b01, lo b23
  __shared__ uint32_t lk2[1 << BK];                // levels as (hi | lo << 16)
  __shared__ uint32_t lv2[1 << BV];
  const int g = lane >> 2, c4 = lane & 3;
  __syncthreads();  // qs complete
  for (int i = tid; i < (1 << BK); i += NT) lk2[i] = tq_split1(lk[i]);
  for (int i = tid; i < (1 << BV); i += NT) lv2[i] = tq_split1(lv[i]);
  for (int i = tid; i < KSTEPS * 32; i += NT) {
    const int ks = i >> 5, gg = (i & 31) >> 2, cc = i & 3;
    uint4 f = make_uint4(0u, 0u, 0u, 0u);
    if (gg < R) {
      const float* q = qs + gg * KD + cc * KPL + 4 * ks;
      tq_split2(q[0], q[1], f.x, f.z);
      tq_split2(q[2], q[3], f.y, f.w);
    }
    qf[i] = f;
  }
  float acc[MTV][4];
  #pragma unroll
  for (int mt = 0; mt < MTV; ++mt) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
  }
  // the lane's value codes: bits [d0 * BV, (d0 + VPL) * BV) of a value row, in 2 words
  const int d0 = warp * VWARP + g * VPL;
  const int vword0 = (d0 * BV) >> 5, vsh = (d0 * BV) & 31;
  const bool vword1 = vword0 + 1 < WV;
  __syncthreads();

  for (int tile = tile0; tile < tile1; ++tile) {
@STAGE_V@    // ---- scores: warp tokens u = warp * 32 + mt * 16 + half * 8 + g
    #pragma unroll 1
    for (int mt = 0; mt < 2; ++mt) {  // one M-tile at a time: fewer registers, more blocks
      // the tokens' norms and mask bias, loaded before the products need the registers
      float kn[2], vscale[2], bias[2];
      #pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = tile * TILE + warp * 32 + mt * 16 + hf * 8 + g;
        kn[hf] = 1.f;
        vscale[hf] = bias[hf] = 0.f;
        if (t < n_tok) {
          int col;
          if (!fp) {
            kn[hf] = (float)k_norms[kn_base + (long long)t * k_norms_strides[2]];
            vscale[hf] = (float)v_norms[vn_base + (long long)t * v_norms_strides[2]] * v_scale;
            col = S + t;
          } else {
            vscale[hf] = 1.f;
            col = t < S ? t : C + t;
          }
          if (HAS_MASK) bias[hf] = mask[mrow + col];
        }
      }
      float s[4] = {0.f, 0.f, 0.f, 0.f};  // (token g, rows 2 c4 + {0, 1}), (token g + 8, ...)
      if (!fp) {
        const long long ws = k_codes_strides[3];
        uint32_t kw[2][NWL];
        #pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int t = tile * TILE + warp * 32 + mt * 16 + hf * 8 + g;
          const uint32_t* krow = k_codes + kc_base + (long long)t * k_codes_strides[2];
          #pragma unroll
          for (int k = 0; k < NWL; ++k) kw[hf][k] = t < n_tok ? krow[(c4 * NWL + k) * ws] : 0u;
        }
        #pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
          const uint4 q = qf[ks * 32 + lane];
          const int blk = (4 * ks) >> 5, j = (4 * ks) & 31;
          uint32_t ah[4], al[4];
          #pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const uint32_t* w = kw[hf] + blk * BK;
            tq_pair(lk2[tq_block_code<BK>(w, j)], lk2[tq_block_code<BK>(w, j + 1)], ah[hf], al[hf]);
            tq_pair(lk2[tq_block_code<BK>(w, j + 2)], lk2[tq_block_code<BK>(w, j + 3)],
                    ah[2 + hf], al[2 + hf]);
          }
          tq_mma3<EXACT>(s, ah, al, q.x, q.y, q.z, q.w);
        }
      } else {
        // token t's key row (sink or tail: they share a dtype) and its element stride
        auto key_row = [&](int t) {
          return t < S ? sink_k + sk_base + (long long)t * sink_k_strides[2]
                       : tail_k + tk_base + (long long)(t - S) * tail_k_strides[2];
        };
        auto key_stride = [&](int t) { return t < S ? sink_k_strides[3] : tail_k_strides[3]; };
        const int t0 = tile * TILE + warp * 32 + mt * 16 + g, t1 = t0 + 8;
        const auto rows0 = key_row(t0), rows1 = key_row(t1);
        const long long fs0 = key_stride(t0), fs1 = key_stride(t1);
        // unrolled, the fp16-operand build takes 110 registers instead of 72 (nvcc, sm_90)
        #pragma unroll (EXACT ? 4 : 1)
        for (int ks = 0; ks < KSTEPS; ++ks) {
          const uint4 q = qf[ks * 32 + lane];
          const int d = c4 * KPL + 4 * ks;
          float x0[4], x1[4];
          tq_load4(rows0 + d * fs0, fs0, t0 < n_tok, x0);
          tq_load4(rows1 + d * fs1, fs1, t1 < n_tok, x1);
          uint32_t ah[4], al[4];
          tq_split2(x0[0], x0[1], ah[0], al[0]);
          tq_split2(x1[0], x1[1], ah[1], al[1]);
          tq_split2(x0[2], x0[3], ah[2], al[2]);
          tq_split2(x1[2], x1[3], ah[3], al[3]);
          tq_mma3<EXACT>(s, ah, al, q.x, q.y, q.z, q.w);
        }
      }
      #pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int u = warp * 32 + mt * 16 + hf * 8 + g;
        const bool valid = tile * TILE + u < n_tok;
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = 2 * c4 + i;
          if (r < R) sc[u * R + r] = valid ? s[2 * hf + i] * kn[hf] + bias[hf] : TQ_NEG_INF;
        }
        if (c4 == 0) vn[u] = vscale[hf];
      }
    }
    __syncthreads();

@SOFTMAX@
    // ---- values: k-steps of 16 tokens u0 + {0, 1 | 8, 9}, u0 = ts * 16 + 2 c4
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 2 * c4 + (i & 1);
      const float a = r < R ? a_s[r] : 1.f;
      #pragma unroll
      for (int mt = 0; mt < MTV; ++mt) acc[mt][i] *= a;
    }
    const int ntile = min(TILE, n_tok - tile * TILE);
    #pragma unroll 1
    for (int ts = 0; ts < TILE / 16; ++ts) {
      if (ts * 16 >= ntile) break;  // the same for the whole block
      const int u0 = ts * 16 + 2 * c4;
      uint32_t bh0 = 0u, bh1 = 0u, bl0 = 0u, bl1 = 0u;
      if (g < R) {
        tq_split2(sc[u0 * R + g], sc[(u0 + 1) * R + g], bh0, bl0);
        tq_split2(sc[(u0 + 8) * R + g], sc[(u0 + 9) * R + g], bh1, bl1);
      }
      uint32_t vt[4][VPL];  // the lane's 4 tokens x VPL dims: table words, or floats' bits
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int u = u0 + (e & 1) + 8 * (e >> 1);
        if (!fp) {
          const uint32_t* row = vw + u * WV;
          const unsigned long long bits =
              ((unsigned long long)(vword1 ? row[vword0 + 1] : 0u) << 32 | row[vword0]) >> vsh;
          #pragma unroll
          for (int k = 0; k < VPL; ++k) vt[e][k] = lv2[(uint32_t)(bits >> (k * BV)) & ((1u << BV) - 1u)];
        } else {
          const int t = tile * TILE + u;
          auto row = t < S ? sink_v + sv_base + (long long)t * sink_v_strides[2]
                           : tail_v + tv_base + (long long)(t - S) * tail_v_strides[2];
          const long long vs = t < S ? sink_v_strides[3] : tail_v_strides[3];
          if (VPL % 4 == 0) {  // whole groups of 4 dims: vector loads where the row allows
            #pragma unroll
            for (int k = 0; k < VPL; k += 4) {
              float x[4];
              tq_load4(row + (d0 + k) * vs, vs, t < n_tok, x);
              #pragma unroll
              for (int e4 = 0; e4 < 4; ++e4) vt[e][(k + e4) % VPL] = __float_as_uint(x[e4]);
            }
          } else {
            #pragma unroll
            for (int k = 0; k < VPL; ++k)
              vt[e][k] = __float_as_uint(t < n_tok ? (float)row[(d0 + k) * vs] : 0.f);
          }
        }
      }
      #pragma unroll
      for (int mt = 0; mt < MTV; ++mt) {
        uint32_t ah[4], al[4];  // rows g (dim 2 mt), g + 8 (dim 2 mt + 1); tokens e 0,1 | 2,3
        #pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int k = 2 * mt + hf;
          if (!fp) {
            tq_pair(vt[0][k], vt[1][k], ah[hf], al[hf]);
            tq_pair(vt[2][k], vt[3][k], ah[2 + hf], al[2 + hf]);
          } else {
            tq_split2(__uint_as_float(vt[0][k]), __uint_as_float(vt[1][k]), ah[hf], al[hf]);
            tq_split2(__uint_as_float(vt[2][k]), __uint_as_float(vt[3][k]), ah[2 + hf], al[2 + hf]);
          }
        }
        tq_mma3<EXACT>(acc[mt], ah, al, bh0, bh1, bl0, bl1);
      }
    }
    __syncthreads();
  }

  const size_t prow = ((size_t)bk * nch + chunk) * R;
  #pragma unroll
  for (int mt = 0; mt < MTV; ++mt) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 2 * c4 + (i & 1);
      if (r < R) part_acc[(prow + r) * DV + d0 + 2 * mt + (i >> 1)] = acc[mt][i];
    }
  }
  if (tid < R) {
    part_ml[(prow + tid) * 2] = m_s[tid];
    part_ml[(prow + tid) * 2 + 1] = l_s[tid];
  }
""".replace("@STAGE_V@", _STAGE_V).replace("@SOFTMAX@", _ONLINE_SOFTMAX)

_PARTIAL_MMA = _spliced(_PARTIAL, (
    ("  // value phase: thread -> (token group", None, _MMA_BODY),
))

# `_STAGE_V` with its loop unrolled by 8 loads instead of fully (KV_STAGE_BATCH). Fully
# unrolled, nvcc keeps the loop's addresses in registers across the tiles: the tensor-core
# kernel takes 72 registers for K4/V3 and 130 for K8/V8 (3 blocks an SM), the plain one 72
# and 164 for K8/V8; unrolled by 8, 56 and about 40 (nvcc, sm_90, session 11). Fewer loads
# are in flight a thread (8 instead of 12 for 3-bit values, 32 for 8-bit), more warps an SM.
_STAGE_V_BATCHED = _STAGE_V.replace("      #pragma unroll\n", "      #pragma unroll 8\n", 1)
assert _STAGE_V_BATCHED != _STAGE_V
assert _PARTIAL.count(_STAGE_V) == _PARTIAL_MMA.count(_STAGE_V) == 1


def mma_fits(k_dim: int, v_dim: int, r: int) -> bool:
    """Whether `_PARTIAL_MMA` takes these heads: whole 32-code blocks a lane (k_dim a
    multiple of 128), whole 16-row tiles a warp (v_dim of 64), query rows in the 8 columns."""
    return k_dim % 128 == 0 and v_dim % 64 == 0 and r <= 8


# One block per (b * KV + kv head) * R + r. part_ml (BKV, NCH, R, 2), part_acc
# (BKV, NCH, R, DV), unrot (DV, DV) f32 -> out (B, H, 1, DV) in the queries' dtype.
# A merge block's query row (block row = (b * KV + kv head) * R + r) and chunk counts.
_MERGE_ROW = r"""  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row = blockIdx.x;
  const int R = part_ml_shape[2];
  const int bk = row / R, r = row % R;
  const int nch = part_ml_shape[1];
  const int ncc = nch - FPCH;
"""

_MERGE = r"""
  constexpr int NT = TQ_NT, MAXCH = TQ_MAXCH;
  constexpr int NWARPS = NT / 32;
  __shared__ float w[MAXCH];
  __shared__ float rot[DV];
  __shared__ float red[NWARPS];
""" + _MERGE_ROW + r"""
  float mx = TQ_NEG;
  for (int c = tid; c < nch; c += NT) mx = fmaxf(mx, part_ml[(((size_t)bk * nch + c) * R + r) * 2]);
  mx = tq_warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int i = 1; i < NWARPS; ++i) mx = fmaxf(mx, red[i]);
  __syncthreads();

  float sum = 0.f;
  for (int c = tid; c < nch; c += NT) {
    const size_t i = (((size_t)bk * nch + c) * R + r) * 2;
    const float e = expf(part_ml[i] - mx);
    w[c] = e;
    sum += part_ml[i + 1] * e;
  }
  sum = tq_warp_sum(sum);
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  sum = 0.f;
  for (int i = 0; i < NWARPS; ++i) sum += red[i];
  const float inv = 1.f / sum;

  for (int d = tid; d < DV; d += NT) {
    float a = 0.f;
    #pragma unroll 8
    for (int c = 0; c < ncc; ++c) a += part_acc[(((size_t)bk * nch + c) * R + r) * DV + d] * w[c];
    rot[d] = a * inv;
  }
  __syncthreads();
  for (int d = tid; d < DV; d += NT) {
    float o = 0.f;
    for (int c = ncc; c < nch; ++c) o += part_acc[(((size_t)bk * nch + c) * R + r) * DV + d] * w[c];
    o *= inv;
    #pragma unroll 8
    for (int i = 0; i < DV; ++i) o += rot[i] * unrot[i * DV + d];
    tq_store(out + (size_t)row * DV + d, o);
  }
"""

# The split merge (replayed by tests/test_kv_cuda_layout.py; the runtime's for every call,
# KV_MERGE_SPLIT):
# Q = blockDim.x / DV threads per output dim (Q <= 8) split the chunk sums and the
# un-rotation, so a block keeps Q times more loads in flight (the merge runs one block per
# query row: 32 blocks for an 8B layer, 23 us at 32K in the lab). `_MERGE` with its block
# size read at run time and its last phase (from the compressed chunks' sums on) replaced:
_SPLIT_SIZES = r"""  constexpr int MAXCH = TQ_MAXCH;
  const int NT = blockDim.x, NWARPS = NT >> 5;
"""

_SPLIT_SHARED = r"""  __shared__ float red[32];
  __shared__ float part[8 * DV];  // the Q partial sums of every dim
"""

_SPLIT_SUMS = r"""  const int Q = NT / DV, d = tid % DV, q = tid / DV;
  // compressed chunks: thread (d, q) sums chunks q, q + Q, ...
  float a = 0.f;
  #pragma unroll 8
  for (int c = q; c < ncc; c += Q) a += part_acc[(((size_t)bk * nch + c) * R + r) * DV + d] * w[c];
  part[q * DV + d] = a;
  __syncthreads();
  if (q == 0) {
    float t = 0.f;
    for (int k = 0; k < Q; ++k) t += part[k * DV + d];
    rot[d] = t * inv;
  }
  __syncthreads();
  // the un-rotation, rows i = q, q + Q, ... of it; q 0 adds the fp16 chunks
  float o = 0.f;
  if (q == 0) {
    for (int c = ncc; c < nch; ++c) o += part_acc[(((size_t)bk * nch + c) * R + r) * DV + d] * w[c];
    o *= inv;
  }
  #pragma unroll 16
  for (int i = q; i < DV; i += Q) o += rot[i] * unrot[i * DV + d];
  part[q * DV + d] = o;
  __syncthreads();
  if (q == 0) {
    float t = 0.f;
    for (int k = 0; k < Q; ++k) t += part[k * DV + d];
    tq_store(out + (size_t)row * DV + d, t);
  }
"""

_MERGE_SPLIT = _spliced(_MERGE, (
    ("  constexpr int NT = TQ_NT, MAXCH", "  __shared__ float w[MAXCH];", _SPLIT_SIZES),
    ("  __shared__ float red[NWARPS];", "  const int tid = threadIdx.x", _SPLIT_SHARED),
    ("  for (int d = tid; d < DV; d += NT) {\n    float a", None, _SPLIT_SUMS),
))

# The wide merge (KV_MERGE_WIDE, the runtime's where it fits since session 13). Session 13's
# ncu at 32K put the split merge at 18.5 us a layer beside the partial kernel's 57.7 (and
# the fp16 cache's whole attention at ~50): its phases are L2 round trips and block-wide
# reductions on 32 blocks. This one does fewer of each in a block of 1024 threads:
# (max, sum) of the chunks in one pass with an online combine (the split merge: two
# passes and two 32-step serial loops), the chunk sums as float4 loads of G = DV / 4
# threads a chunk row (Q = 1024 / G rows at a time: ~5 loads a thread at 32K, one round
# trip, against ~17 scalar ones), the fp16 chunks by threads q < FPCH in the same pass, and
# the un-rotation as float4 rows of unrot; the Q partial sums of a dim are reduced in two
# levels (DV / G, then 1024 / DV values) instead of one thread summing Q. Takes DV a
# multiple of 4 with 1024 % (DV / 4) == 0 and DV <= 256 (`merge_wide_fits`).
_MERGE_WIDE = r"""
  constexpr int MAXCH = TQ_MAXCH, NT = 1024, NWARPS = NT / 32, G = DV / 4, Q = NT / G;
  constexpr int P = NT / DV;  // partitions of the first reduction level
  __shared__ float w[MAXCH];
  __shared__ float red_m[NWARPS], red_s[NWARPS];
  __shared__ float4 part[NT];         // thread (d4, q)'s partial sums: float q * DV + 4 * d4
  __shared__ float4 part_fp[8 * G];   // fp16 chunk q's terms (q < FPCH <= 8)
  __shared__ float red2[NT];
  __shared__ float rot[DV];
""" + _MERGE_ROW + r"""  const int d4 = tid % G, q = tid / G;

  // 1. (max, sum) of the chunks, thread c holding chunk c (nch <= MAXCH <= NT)
  float mc = TQ_NEG, m = TQ_NEG, s = 0.f;
  if (tid < nch) {
    const size_t i = (((size_t)bk * nch + tid) * R + r) * 2;
    mc = m = part_ml[i];
    s = part_ml[i + 1];
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, o), so = __shfl_xor_sync(0xffffffffu, s, o);
    const float mn = fmaxf(m, mo);
    s = s * expf(m - mn) + so * expf(mo - mn);
    m = mn;
  }
  if (lane == 0) { red_m[warp] = m; red_s[warp] = s; }
  __syncthreads();
  m = red_m[lane];  // NWARPS == 32: every warp combines the 32 warps' pairs itself
  s = red_s[lane];
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, o), so = __shfl_xor_sync(0xffffffffu, s, o);
    const float mn = fmaxf(m, mo);
    s = s * expf(m - mn) + so * expf(mo - mn);
    m = mn;
  }
  const float inv = 1.f / s;
  if (tid < nch) w[tid] = expf(mc - m);
  __syncthreads();

  // 2. chunk sums: thread (d4, q) takes chunk rows q, q + Q, ... of the compressed chunks
  // and fp16 chunk ncc + q
  const float4* acc4 = reinterpret_cast<const float4*>(part_acc);
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  #pragma unroll 8
  for (int c = q; c < ncc; c += Q) {
    const float4 x = acc4[(((size_t)bk * nch + c) * R + r) * G + d4];
    const float wc = w[c];
    a.x += x.x * wc; a.y += x.y * wc; a.z += x.z * wc; a.w += x.w * wc;
  }
  part[tid] = a;
  if (q < FPCH) {
    const float4 x = acc4[(((size_t)bk * nch + ncc + q) * R + r) * G + d4];
    const float wc = w[ncc + q];
    part_fp[q * G + d4] = make_float4(x.x * wc, x.y * wc, x.z * wc, x.w * wc);
  }
  __syncthreads();
  const float* part_f = reinterpret_cast<const float*>(part);
  const int e = tid % DV, p = tid / DV;  // dim e, rows [p * Q / P, (p + 1) * Q / P)
  float t = 0.f;
  #pragma unroll
  for (int k = p * (Q / P); k < (p + 1) * (Q / P); ++k) t += part_f[k * DV + e];
  red2[tid] = t;
  __syncthreads();
  float fp = 0.f;
  if (tid < DV) {
    float u = 0.f;
    #pragma unroll
    for (int k = 0; k < P; ++k) u += red2[k * DV + tid];
    rot[tid] = u * inv;
    const float* fp_f = reinterpret_cast<const float*>(part_fp);
    #pragma unroll
    for (int k = 0; k < FPCH; ++k) fp += fp_f[k * DV + tid];
    fp *= inv;
  }
  __syncthreads();

  // 3. the un-rotation: thread (d4, q) takes rows q, q + Q, ... of unrot
  const float4* unrot4 = reinterpret_cast<const float4*>(unrot);
  float4 o4 = make_float4(0.f, 0.f, 0.f, 0.f);
  #pragma unroll
  for (int i = q; i < DV; i += Q) {
    const float4 x = unrot4[i * G + d4];
    const float ri = rot[i];
    o4.x += x.x * ri; o4.y += x.y * ri; o4.z += x.z * ri; o4.w += x.w * ri;
  }
  part[tid] = o4;
  __syncthreads();
  t = 0.f;
  #pragma unroll
  for (int k = p * (Q / P); k < (p + 1) * (Q / P); ++k) t += part_f[k * DV + e];
  red2[tid] = t;
  __syncthreads();
  if (tid < DV) {
    float u = fp;
    #pragma unroll
    for (int k = 0; k < P; ++k) u += red2[k * DV + tid];
    tq_store(out + (size_t)row * DV + tid, u);
  }
"""
MERGE_WIDE_THREADS = 1024


def merge_wide_fits(v_dim: int) -> bool:
    """Whether `_MERGE_WIDE` takes heads of v_dim values (float4 rows that tile its block,
    its shared memory, and at least MAX_FP_CHUNKS chunk rows at a time)."""
    return (v_dim % 4 == 0 and MERGE_WIDE_THREADS % (v_dim // 4) == 0 and v_dim <= 256
            and MERGE_WIDE_THREADS // (v_dim // 4) >= MAX_FP_CHUNKS)


PARTIAL_INPUTS = ["queries", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "sink_k",
                  "sink_v", "tail_k", "tail_v", "mask"]
MERGE_INPUTS = ["part_ml", "part_acc", "unrot"]
SOURCES = {  # name -> (inputs, outputs, source): also what the nvcc compile check wraps
    "tq_kv_partial": (PARTIAL_INPUTS, ["part_ml", "part_acc"], _PARTIAL),
    "tq_kv_merge": (MERGE_INPUTS, ["out"], _MERGE),
    "tq_kv_partial_vec": (PARTIAL_INPUTS, ["part_ml", "part_acc"], _PARTIAL_VEC),  # KV_PARTIAL_VEC
    "tq_kv_merge_split": (MERGE_INPUTS, ["out"], _MERGE_SPLIT),  # KV_MERGE_SPLIT
    "tq_kv_merge_wide": (MERGE_INPUTS, ["out"], _MERGE_WIDE),  # KV_MERGE_WIDE
    "tq_kv_partial_mma": (PARTIAL_INPUTS, ["part_ml", "part_acc"], _PARTIAL_MMA),  # KV_PARTIAL_MMA
    # KV_STAGE_BATCH: the same kernels staging value codes 8 loads at a time
    "tq_kv_partial_b8": (PARTIAL_INPUTS, ["part_ml", "part_acc"],
                         _PARTIAL.replace(_STAGE_V, _STAGE_V_BATCHED)),
    "tq_kv_partial_mma_b8": (PARTIAL_INPUTS, ["part_ml", "part_acc"],
                             _PARTIAL_MMA.replace(_STAGE_V, _STAGE_V_BATCHED)),
}
HEADER = _HEADER


def kernel_name(name: str) -> str:
    """`name` plus a hash of its source: MLX caches compiled kernels on disk by name
    (and template values) only, so an edited source must get a new name."""
    inputs, outputs, source = SOURCES[name]
    text = "\0".join([_HEADER, source, *inputs, *outputs]).encode()
    return f"{name}_{hashlib.sha256(text).hexdigest()[:10]}"


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    inputs, outputs, source = SOURCES[name]
    return compiled.cuda_kernel(
        name=kernel_name(name), input_names=inputs, output_names=outputs, source=source,
        header=_HEADER,
        ensure_row_contiguous=False,  # the cache's parts are strided slices: no copies
    )


# ---------------------------------------------------------------------------- host side


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
# same at 1K; K8/V3 57.3 against 67.4 (session 13). 8-bit values stay on the 6-block plan:
# K8/V8 101 us there against 119 on a 9-block one.
MMA_B8_BLOCKS_PER_SM = 9

# Two of the lab's candidates (session 8), on since their GPU tests passed with them
# (session 9, `device_check.sh kv-candidates`: 21/21); "0" turns either off:
# the split merge (lab, 32K: 14.4 us against 23.3; 1K: 9.3 vs 8.8), for every call: with a
# threshold on the chunk count, a cache growing past it met a kernel not yet compiled in
# the middle of decoding (session 10: 4K decode at 20 tok/s, ~1 s of NVRTC inside the
# timed steps)
KV_MERGE_SPLIT = os.environ.get("TURBOQUANT_CUDA_KV_MERGE_SPLIT", "1") == "1"


def split_per_dim(v_dim: int) -> int:
    """Threads per value dim of `_MERGE_SPLIT` (at most 8, a block of at most 1024)."""
    return min(8, 1024 // v_dim)

# `_MERGE_WIDE` as the merge where it fits, "0" turns it off (the split merge then): lab,
# H200, 32K: 5.7 us against the split merge's 10.2, 1K: 5.0 against 7.6 (session 13)
KV_MERGE_WIDE = os.environ.get("TURBOQUANT_CUDA_KV_MERGE_WIDE", "1") == "1"

# the partial grid from `plan_waves` on this GPU's SM count (lab, 32K: 68.0 us against 81.6)
KV_PLAN_WAVES = os.environ.get("TURBOQUANT_CUDA_KV_PLAN_WAVES", "1") == "1"
# `_PARTIAL_VEC` as the partial kernel (lab, 32K: 71.6 us against 81.6, the same outputs);
# off until the KV GPU tests pass with it (`device_check.sh kv-vec`)
KV_PARTIAL_VEC = os.environ.get("TURBOQUANT_CUDA_KV_PARTIAL_VEC", "0") == "1"
# `_PARTIAL_MMA` where it fits (`mma_fits`, sm_80+), "0" turns it off: lab, the runtime's
# 188-token fp16 tail in chunks of a tile, 61.9 us at 32K against 78.3 (the plain kernel on
# its own wave grid), 29.1 at 1K against 41.1, outputs within 1e-6; the KV GPU tests pass
# with it (session 10, `device_check.sh kv-mma`: 23/23)
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
# most 4 bits (sessions 12, 13); the plain kernel the same within 2% either way. Until
# session 13 "auto" left K8/V3 and K8/V4 on full staging (on a 6-block plan where 4 fit).
# The KV GPU tests pass with "1".
KV_STAGE_BATCH = os.environ.get("TURBOQUANT_CUDA_KV_STAGE_BATCH", "auto")
# What fp16 operands may move an output, relative to the largest |output|: a score's
# error (2^-10 of sum |q_i k_i| at most) reaches the weights through exp, so scores of up
# to ~8 give 8 * 2^-11 = 2^-8. The CPU replay measures 3e-4 to 9e-4 on its cases.
MMA_FP16_RTOL = 2.0 ** -8


def fp16_operands(layout: "Layout") -> bool:
    """Whether a call's partial kernel rounds its products' operands to fp16."""
    return dict(layout.partial_template).get("EXACT") is False


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
    instead of a short one (session 8's ncu at 32K: 1032 blocks in 792 slots, 1.3 waves).
    Every block of a wave is taken to cost its tiles (the fp16 chunks' blocks cost less)."""
    _, fpch = plan(b, kv, c_len, f_len, fp_tokens)
    return _wave_chunks(b * kv, -(-c_len // TILE), fpch, sms * blocks_per_sm), fpch


@functools.lru_cache(maxsize=4096)
def _wave_chunks(bkv: int, tiles: int, fpch: int, slots: int) -> int:
    """`plan_waves`'s compressed chunks. Cached on the tile count, which changes once per
    TILE compressed tokens: keyed on the token counts (the fp16 tail grows every step), it
    missed on every decode step and walked up to MAX_CHUNKS candidates (session 11: ~60 us
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
    sms = cuda_memory.sm_count() if KV_PLAN_WAVES else None
    f_len = s_len + t_len
    mma = use_mma(pk.k_dim, pk.v_dim, h // kv)
    partial = "mma" if mma else "vec" if KV_PARTIAL_VEC else "plain"
    batched = partial != "vec" and stage_batch(pk.bits_k, pk.bits_v)
    blocks = mma_blocks_per_sm(pk.bits_k, pk.bits_v, batched) if mma else PARTIAL_BLOCKS_PER_SM
    ncc, fpch = (plan_waves(b, kv, c_len, f_len, sms, FP_TOKENS_PER_CHUNK, blocks) if sms
                 else plan(b, kv, c_len, f_len))
    lay = _layout(b, h, kv, pk.k_dim, pk.v_dim, pk.bits_k, pk.bits_v, pk.seed, float(scale),
                  _fp_dtype(parts), queries.dtype, s_len > 0, t_len > 0, bias is not None,
                  ncc, fpch, KV_MERGE_SPLIT, partial, KV_MMA_EXACT, batched, KV_MERGE_WIDE)
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
    checks and helpers cost ~15 Python calls a layer a step on the host (session 13)."""
    pk = parts.packed
    if mask is not None or pk is None or type(scale) is not float:
        return run(prepare(queries, parts, scale, mask))
    sink, tail = parts.sink_k, parts.tail_k
    s_len = 0 if sink is None else sink.shape[2]
    t_len = 0 if tail is None else tail.shape[2]
    key = (queries.shape, queries.dtype, scale, s_len, t_len > 0,
           (s_len + t_len + FP_TOKENS_PER_CHUNK - 1) // FP_TOKENS_PER_CHUNK,
           None if sink is None else sink.dtype, None if tail is None else tail.dtype,
           FP_TOKENS_PER_CHUNK, KV_PLAN_WAVES, KV_PARTIAL_MMA, KV_PARTIAL_VEC, KV_STAGE_BATCH,
           KV_MERGE_SPLIT, KV_MMA_EXACT, TARGET_BLOCKS, KV_MERGE_WIDE)
    lay = pk.launches.get(key)
    if lay is None:
        launch = prepare(queries, parts, scale)
        pk.launches[key] = launch.layout
        return run(launch)
    return _run(lay, _inputs(lay, queries, parts))


__all__ = ["HEADER", "Launch", "Layout", "SOURCES", "chunk_tiles", "consts_layout",
           "decode_attention", "kernel_name", "mask_bias", "plan", "prepare", "rotation", "run"]

"""The CUDA C++ text of the KV decode kernels (kernels/cuda_kv.py): the header they share,
the partial kernels (plain, 16-byte key loads, tensor cores; value codes staged all at once
or 8 loads at a time) and the merges (plain, split, wide), as `SOURCES`: name -> (inputs,
outputs, source).

The header bakes in cuda_kv_plan's NT, TILE and MAX_CHUNKS. `kernel_name` adds a hash of
the source to a kernel's name (MLX caches compiled kernels by name). Plain text:
the nvcc compile check and the kernel lab (`benchmarks/cuda_lab.py`) read it as it is.
"""

from __future__ import annotations

import hashlib

from .cuda_kv_plan import MAX_CHUNKS, NT, TILE

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
# the same for every token of a block) instead of word by word. the 2026-11-29h run's ncu of
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
# spends ~124 instructions a token at 32K (the 2026-11-30 run's ncu: 32.4M for 256K tokens, issue
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
# and 164 for K8/V8; unrolled by 8, 56 and about 40 (nvcc, sm_90, the 2026-11-30 run). Fewer loads
# are in flight a thread (8 instead of 12 for 3-bit values, 32 for 8-bit), more warps an SM.
_STAGE_V_BATCHED = _STAGE_V.replace("      #pragma unroll\n", "      #pragma unroll 8\n", 1)
assert _STAGE_V_BATCHED != _STAGE_V
assert _PARTIAL.count(_STAGE_V) == _PARTIAL_MMA.count(_STAGE_V) == 1


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

# The wide merge (KV_MERGE_WIDE, the runtime's where it fits since the 2026-11-30 run). the 2026-11-30 run's
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


__all__ = ["HEADER", "MERGE_INPUTS", "PARTIAL_INPUTS", "SOURCES", "kernel_name"]

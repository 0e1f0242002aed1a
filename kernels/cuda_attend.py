"""CUDA "buffer_attention": one new token attends over a KV buffer, its length an array.

`buffer_attention(queries, keys, values, position, scale)` computes what
`kernels.attend.buffer_attention` (the reference) does, reading only rows 0..position of
the buffers: `position` is read on the GPU, so one launch (and one trace of a compiled
step) serves every position. One launch, split-K over the buffer as flash-decoding does:

- grid (chunks, batch * kv_heads), 128 threads. A block takes the R = H / KVH query rows
  of its KV head (GQA: each key is read once for the group) over one chunk of rows. Its
  threads are workers of D / 8 lanes, each lane 8 of a row's dims (one 16-byte load of
  the key, one of the value: coalesced), a worker every W-th row of the chunk with an
  online softmax in registers (two rows a step, their four loads in flight together);
  rows at or past the length are skipped. The block then merges its workers through
  shared memory.
- One chunk: that block writes the output. Several: each block writes its partial (max,
  sum, unnormalised output), then counts itself done on its (batch, KV head)'s counter;
  the last block of a group merges the group's partials (`_COMBINE`: the maxima and
  weights over the chunks thread-parallel, then a float4 of outputs a thread over the
  chunks, eight chunks' loads in flight) and resets the counter for the next launch (a
  persistent int32 array per `slot`: launches in order on one stream may share one,
  launches that may run at once must not). No second launch, so a layer's attention is
  one operation to encode. (Until 2026-12-01 every thread of that block took the maxima
  over all chunks serially and its warps a chunk at a time: ~64 dependent L2 loads at 4K
  rows, suspected of the whole step's loss after a long prompt.)
  MERGE "launch" (TURBOQUANT_CUDA_ATTEND_MERGE=launch) merges in a second launch instead,
  no counters (see `_JOIN`): written to bisect a stall seen on the H200, checked by the
  CPU emulation (`tests/cuda_emulation.py`).

- Blocks whose chunk starts past the length return at once (only the chunks in use
  count and merge; one in use: its block writes the output). `plan` lengthens chunks
  so a launch stays near WAVE_BLOCKS blocks. Workers load 4 rows at once (2 for R > 4).
- `store=(k, v)`: the block holding the position writes the token's key and value into
  the buffers (in place: the whole step's store, no scatter) and reads that row from
  its inputs.
- Ordering (issue 35): MLX's CUDA graphs order a kernel after the
  last writer of each input buffer only, never after earlier readers, and this launch's
  store into the buffers is invisible to them. Two launches of one layer with no data
  between them (a decode fed its tokens, not sampling them) then ran at once: the later
  one read a row before the earlier one stored it, and, sharing a slot, they counted into
  one counter, so a block merged before its group's partials were written and the count
  stayed stale for every launch after (the whole step's errors of 0.19-0.80 on the H200).
  `after` orders a launch after the writer of an array (the whole step: the layer's last
  launch output). Within a launch the merge is the usual one: every thread fences its
  partial before one thread counts (`__threadfence`, `atomicAdd`), the last block fences
  again and reads the partials through L2 (`__ldcg`), then resets the counter.
- `position` should not be a scalar from MLX's CUDA pool of arrays of <= 8 bytes
  (managed memory the host writes): reading it stalled every block ~15 us on the H200.
  The whole step passes a view of a 16-byte buffer made on the GPU (`fuse._offset_array`);
  then (ncu, real clocks, 8B heads, 2026-12-04) a launch took 10.5 us over a 1024-row
  buffer at position 255 and 16.1-17.9 us over 4352 rows, against cuDNN's 21.4 + 3.7
  (with a host scalar: 23-24 and 31-33 us).

Keys and values are float16 or bfloat16 of one head dim D with D / 8 a power of two
(8..256: the dims of every model mlx-lm runs), R * 8 <= 64 accumulators a lane; anything
else raises NotImplementedError (`supports` says so up front: the compiled whole step
checks it, since the reference's masked MLX attention is no fallback on CUDA there).
"""

from __future__ import annotations

import functools
import hashlib
import os

import mlx.core as mx

from . import attend  # noqa: F401 (adds the op before it is registered)
from . import compiled, dispatch

NT = 128  # threads a block
CHUNK_TOKENS = 64  # rows a block walks (grown for long buffers: at most MAX_CHUNKS)
MAX_CHUNKS = 256  # chunks a (batch, KV head) group: what its last block merges
WAVE_BLOCKS = 1024  # blocks a launch aims at (an H200 holds ~4 a SM): longer chunks past it
MAX_GROUPS = 1024  # batch * kv_heads: the counters a slot keeps
MAX_ROWS = 8  # query rows a KV head (R): 8 dims each a lane, accumulated in registers
# how a long buffer's chunks are merged: "block" (the last block of a group, through a
# done-counter: one launch) or "launch" (a second launch, no counters; one operation more)
MERGE = os.environ.get("TURBOQUANT_CUDA_ATTEND_MERGE", "block")

_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define TQ_NEG (-1e30f)

// eight 2-byte elements of one 16-byte load as floats
__device__ __forceinline__ void tq_cvt8(const __half*, uint4 v, float (&x)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
  #pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 f = __half22float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
}
__device__ __forceinline__ void tq_cvt8(const __nv_bfloat16*, uint4 v, float (&x)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  #pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 f = __bfloat1622float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
}
__device__ __forceinline__ void tq_store(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void tq_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// One row of a worker's online softmax: the row's key and value pieces (8 dims a lane),
// the R query pieces; the score summed over the worker's PPR lanes (every lane of the
// warp takes part: `ok` false adds nothing).
// A float4 of a group's merged outputs: the partials at `p` (chunk c at p + c * R * D)
// of chunks c0, c0 + step, ... below `used`, each times its weight (chunk c's at w[c * R]),
// eight chunks' loads in flight.
template <int R, int D>
__device__ __forceinline__ float4 tq_combine(const float* p, const float* w, int c0, int step,
                                             int used) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  int c = c0;
  for (; c + 7 * step < used; c += 8 * step) {
    float4 x[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = __ldcg(reinterpret_cast<const float4*>(p + (size_t)(c + j * step) * R * D));
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float e = w[(c + j * step) * R];
      a.x += x[j].x * e; a.y += x[j].y * e; a.z += x[j].z * e; a.w += x[j].w * e;
    }
  }
  for (; c < used; c += step) {
    const float4 x = __ldcg(reinterpret_cast<const float4*>(p + (size_t)c * R * D));
    const float e = w[c * R];
    a.x += x.x * e; a.y += x.y * e; a.z += x.z * e; a.w += x.w * e;
  }
  return a;
}

template <typename T, int R, int PPR>
__device__ __forceinline__ void tq_attend_row(const T* type, uint4 kraw, uint4 vraw, bool ok,
                                              const float (&q)[R][8], float (&m)[R],
                                              float (&l)[R], float (&acc)[R][8]) {
  float k[8], v[8], s[R];
  tq_cvt8(type, kraw, k);
  tq_cvt8(type, vraw, v);
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    s[r] = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) s[r] += q[r][j] * k[j];
  }
  #pragma unroll
  for (int o = PPR / 2; o > 0; o >>= 1)
    #pragma unroll
    for (int r = 0; r < R; ++r) s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
  if (!ok) return;
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const float mn = fmaxf(m[r], s[r]);
    const float keep = __expf(m[r] - mn), p = __expf(s[r] - mn);
    l[r] = l[r] * keep + p;
    #pragma unroll
    for (int j = 0; j < 8; ++j) acc[r][j] = acc[r][j] * keep + p * v[j];
    m[r] = mn;
  }
}
"""

# Template: T (the buffers' and the output's element), D, R (query rows a KV head), CH
# (rows a chunk). TQ_SCALE is put in front. Outputs: out, and the partials (ml, part).
# _PARTIAL: a block's chunk, merged over its workers: the output itself when the rows in
# use are one chunk (`alone`), else the chunk's partial. A block whose chunk starts past
# the length returns at once: only the `used` chunks count and merge.
# @STORE@: with the new token's key and value as inputs (new_keys, new_values), the block
# holding row `at` (the position) writes them into the buffers (in place) and reads that
# row from them, so no other operation stores the token; without: `at` is -1.
_PARTIAL = r"""
  constexpr int NT = @NT@;
  constexpr int PPR = D / 8, W = NT / PPR;  // lanes a row, workers a block
  constexpr int STEP = R <= 4 ? 4 : 2;       // rows a worker loads at once
  __shared__ float qs[R * D];
  __shared__ float wm[W * R], wl[W * R];     // each worker's max and sum, a query row
  __shared__ float wacc[W * R * D + (NT / 32) * R];  // and its unnormalised output
  const int tid = threadIdx.x, worker = tid / PPR, piece = tid % PPR;
  const int chunk = blockIdx.x, chunks = gridDim.x, bk = blockIdx.y;
  const int kvh = keys_shape[1], S = keys_shape[2];
  const int H = kvh * R, b = bk / kvh, g = bk % kvh;
  const int len = min(position[0] + 1, S);
  const int used = min(chunks, (len + CH - 1) / CH);  // chunks holding rows 0..position
  const int start = chunk * CH, end = min(start + CH, len);
  const bool alone = @ALONE@;  // this block's output is the output itself
  if (start >= len) return;
@STORE@
  for (int i = tid; i < R * D; i += NT)
    qs[i] = (float)queries[(size_t)(b * H + g * R) * D + i] * TQ_SCALE;
  __syncthreads();
  float q[R][8], m[R], l[R], acc[R][8];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = TQ_NEG;
    l[r] = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) { q[r][j] = qs[r * D + piece * 8 + j]; acc[r][j] = 0.f; }
  }
  const T* kb = keys + (size_t)bk * S * D + piece * 8;
  const T* vb = values + (size_t)bk * S * D + piece * 8;
  // every lane runs the same steps (the score's shuffles need the whole warp); a worker
  // takes rows worker, worker + W, ... of the chunk, STEP rows' loads in flight together
  for (int t0 = start; t0 < end; t0 += STEP * W) {
    uint4 kr[STEP], vr[STEP];
    bool ok[STEP];
    #pragma unroll
    for (int s = 0; s < STEP; ++s) {
      const int t = t0 + worker + s * W;
      ok[s] = t < end;
      kr[s] = make_uint4(0, 0, 0, 0);
      vr[s] = kr[s];
      if (ok[s]) {
        kr[s] = *reinterpret_cast<const uint4*>(t == at ? kn : kb + (size_t)t * D);
        vr[s] = *reinterpret_cast<const uint4*>(t == at ? vn : vb + (size_t)t * D);
      }
    }
    #pragma unroll
    for (int s = 0; s < STEP; ++s) tq_attend_row<T, R, PPR>(keys, kr[s], vr[s], ok[s], q, m, l, acc);
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    if (piece == 0) { wm[worker * R + r] = m[r]; wl[worker * R + r] = l[r]; }
    #pragma unroll
    for (int j = 0; j < 8; ++j) wacc[(worker * R + r) * D + piece * 8 + j] = acc[r][j];
  }
  __syncthreads();

  // the block's workers merged: output (r, d) a thread at a time
  const size_t group = (size_t)bk * chunks;
  for (int i = tid; i < R * D; i += NT) {
    const int r = i / D, d = i % D;
    float mx = TQ_NEG;
    #pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, wm[w * R + r]);
    float sum = 0.f, o = 0.f;
    #pragma unroll
    for (int w = 0; w < W; ++w) {
      const float e = __expf(wm[w * R + r] - mx);
      sum += wl[w * R + r] * e;
      o += wacc[(w * R + r) * D + d] * e;
    }
    if (alone) {
      tq_store(out + (size_t)(b * H + g * R + r) * D + d, o / sum);
    } else {
      part[((group + chunk) * R + r) * D + d] = o;
      if (d == 0) { ml[((group + chunk) * R + r) * 2] = mx; ml[((group + chunk) * R + r) * 2 + 1] = sum; }
    }
  }
  if (alone) return;
"""
_STORE = r"""
  const int at = len - 1;
  const T* kn = new_keys + (size_t)bk * D + piece * 8;
  const T* vn = new_values + (size_t)bk * D + piece * 8;
  if (start <= at && at < end && tid < D / 8) {
    const size_t row = ((size_t)bk * S + at) * D / 8;
    reinterpret_cast<uint4*>(const_cast<T*>(keys))[row + tid] =
        reinterpret_cast<const uint4*>(new_keys + (size_t)bk * D)[tid];
    reinterpret_cast<uint4*>(const_cast<T*>(values))[row + tid] =
        reinterpret_cast<const uint4*>(new_values + (size_t)bk * D)[tid];
  }
"""
_NO_STORE = "  const int at = -1;\n  const T* kn = keys;\n  const T* vn = values;\n"

# _COMBINE: a (batch, KV head) group's partials (ml, part) of chunks 0..used-1 merged into
# the output, float4 outputs first4..first4+count4-1 (of R * D / 4): the maxima and the
# weights over the chunks thread-parallel (a chunk a thread, a block reduction, the
# weights in shared memory), then each thread a float4 of outputs over the chunks, eight
# chunks' loads in flight; fewer outputs than threads: the chunks split over `split`
# threads an output, summed through shared memory. Needs tid, NT, b, g, H, group, used
# and shared `wts` (MAXC * R floats), `red` (NWARPS * R), `spill` (NT * 4).
_COMBINE = r"""
  constexpr int NWARPS = NT / 32;
  const int lane = tid & 31, warp = tid >> 5;
  float lm[R], ls[R], gmax[R], norm[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) { lm[r] = TQ_NEG; ls[r] = 0.f; }
  for (int c = tid; c < used; c += NT)
    #pragma unroll
    for (int r = 0; r < R; ++r) lm[r] = fmaxf(lm[r], __ldcg(ml + ((group + c) * R + r) * 2));
  #pragma unroll
  for (int r = 0; r < R; ++r)
    for (int o = 16; o > 0; o >>= 1) lm[r] = fmaxf(lm[r], __shfl_xor_sync(0xffffffffu, lm[r], o));
  if (lane == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) red[warp * R + r] = lm[r];
  __syncthreads();
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    gmax[r] = TQ_NEG;
    #pragma unroll
    for (int w = 0; w < NWARPS; ++w) gmax[r] = fmaxf(gmax[r], red[w * R + r]);
  }
  __syncthreads();  // the maxima are read: `red` takes the sums
  for (int c = tid; c < used; c += NT)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t at = ((group + c) * R + r) * 2;
      const float e = __expf(__ldcg(ml + at) - gmax[r]);
      wts[c * R + r] = e;
      ls[r] += __ldcg(ml + at + 1) * e;
    }
  #pragma unroll
  for (int r = 0; r < R; ++r)
    for (int o = 16; o > 0; o >>= 1) ls[r] += __shfl_xor_sync(0xffffffffu, ls[r], o);
  if (lane == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) red[warp * R + r] = ls[r];
  __syncthreads();
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    norm[r] = 0.f;
    #pragma unroll
    for (int w = 0; w < NWARPS; ++w) norm[r] += red[w * R + r];
  }
  const float* pg = part + group * R * D;
  if (count4 >= NT) {
    for (int o4 = tid; o4 < count4; o4 += NT) {
      const int i = (first4 + o4) * 4, r = i / D;
      const float4 a = tq_combine<R, D>(pg + i, wts + r, 0, 1, used);
      T* y = out + (size_t)(b * H + g * R) * D + i;
      tq_store(y, a.x / norm[r]); tq_store(y + 1, a.y / norm[r]);
      tq_store(y + 2, a.z / norm[r]); tq_store(y + 3, a.w / norm[r]);
    }
  } else {
    const int split = NT / count4, o4 = tid % count4, s = tid / count4;
    const int i = (first4 + o4) * 4, r = i / D;
    if (s < split) {
      const float4 a = tq_combine<R, D>(pg + i, wts + r, s, split, used);
      spill[tid * 4] = a.x; spill[tid * 4 + 1] = a.y; spill[tid * 4 + 2] = a.z; spill[tid * 4 + 3] = a.w;
    }
    __syncthreads();
    if (s == 0) {
      float a[4] = {0.f, 0.f, 0.f, 0.f};
      for (int t = 0; t < split; ++t)
        #pragma unroll
        for (int k = 0; k < 4; ++k) a[k] += spill[(t * count4 + o4) * 4 + k];
      T* y = out + (size_t)(b * H + g * R) * D + i;
      #pragma unroll
      for (int k = 0; k < 4; ++k) tq_store(y + k, a[k] / norm[r]);
    }
  }
"""

# MERGE "block": one launch; the last block of a group to finish merges it (its done-count
# on the group's counter, which it resets for the next launch). Blocks past the length
# returned at once: the used chunks count.
_SOURCE = _PARTIAL.replace("@ALONE@", "used == 1") + r"""
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* done = const_cast<int*>(counter) + bk;
    last = atomicAdd(done, 1) == used - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  constexpr int MAXC = @MAX_CHUNKS@;
  const int first4 = 0, count4 = R * D / 4;
  // shared memory the workers' merge no longer needs: MAXC * R + NWARPS * R + NT * 4
  // floats <= W * R * D (= 8 * NT * R)
  float* wts = wacc;
  float* red = wacc + MAXC * R;
  float* spill = red + (NT / 32) * R;
""" + _COMBINE + r"""
  if (tid == 0) const_cast<int*>(counter)[bk] = 0;  // ready for the next launch
"""

# MERGE "launch": the partial kernel (_SPLIT: no counters, a chunk past the length returns
# at once) and a second launch that merges the chunks in use (_JOIN: _COMBINE over NT
# float4s of outputs a block, grid (ceil(R * D / (4 * NT)) * NT, batch * kv_heads)).
_SPLIT = _PARTIAL.replace("@ALONE@", "false")
_JOIN = r"""
  constexpr int NT = @NT@, MAXC = @MAX_CHUNKS@;
  __shared__ float wts[MAXC * R], red[(NT / 32) * R], spill[NT * 4];
  const int tid = threadIdx.x, bk = blockIdx.y, chunks = ml_shape[1];
  const int H = KVH * R, b = bk / KVH, g = bk % KVH;
  const int used = min(chunks, (position[0] + CH) / CH);  // chunks holding rows 0..position
  const size_t group = (size_t)bk * chunks;
  const int first4 = blockIdx.x * NT, count4 = min(NT, R * D / 4 - first4);
""" + _COMBINE


def supports(q_shape: tuple, k_shape: tuple, v_shape: tuple, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes these shapes (else the call raises NotImplementedError)."""
    b, h, l, d = q_shape
    kvh = k_shape[1]
    pieces = d // 8
    if not (dtype in (mx.float16, mx.bfloat16) and l == 1 and kvh > 0 and h % kvh == 0
            and h // kvh <= MAX_ROWS and b * kvh <= MAX_GROUPS and d % 8 == 0
            and 1 <= pieces <= 32 and pieces & (pieces - 1) == 0
            and k_shape[3] == d and tuple(v_shape) == tuple(k_shape)):
        return False
    r, workers = h // kvh, NT // pieces
    floats = r * d + 2 * workers * r + workers * r * d + NT // 32 * r
    return 4 * floats <= 48 * 1024  # static shared memory


def plan(size: int, groups: int = 1) -> tuple[int, int]:
    """(rows a chunk, chunks) for a buffer of `size` rows over `groups` (batch x KV heads):
    CHUNK_TOKENS rows a chunk, doubled while a group would pass MAX_CHUNKS chunks or the
    grid WAVE_BLOCKS blocks (the last block's merge takes a round of loads per eight
    chunks, a worker one per STEP rows: at 16K rows and 8 groups, 128 chunks of 128 rows
    rather than 256 of 64)."""
    limit = max(1, min(MAX_CHUNKS, WAVE_BLOCKS // max(1, groups)))
    chunk = CHUNK_TOKENS
    while -(-size // chunk) > limit:
        chunk *= 2
    return chunk, -(-size // chunk)


def _filled(body: str) -> str:
    """A kernel body with its block size and chunk bound written in."""
    return body.replace("@NT@", str(NT)).replace("@MAX_CHUNKS@", str(MAX_CHUNKS))


def _named(prefix: str, source: str, inputs=()) -> str:
    """A kernel's name from its source and inputs: MLX keeps one compiled module a name,
    so kernels whose signatures differ must not share one."""
    text = _HEADER + source + ",".join(inputs)
    return f"{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def kernel_source(scale: float, merge: str = "block", store: bool = False, after: bool = False):
    """(input names, source) of the attention kernel: with its last-block merge ("block"),
    or the partials only ("launch": `_join_kernel` merges them); with `store`, the new
    token's key and value as inputs, written into the buffers by the launch; with
    `after`, an input the kernel never reads (`buffer_attention`'s `after`)."""
    body = (_SOURCE if merge == "block" else _SPLIT).replace(
        "@STORE@", _STORE if store else _NO_STORE)
    source = f"  constexpr float TQ_SCALE = {float(scale)!r}f;\n" + _filled(body)
    inputs = ["queries", "keys", "values", "position"] + (["counter"] if merge == "block" else [])
    inputs += ["new_keys", "new_values"] if store else []
    return inputs + (["after"] if after else []), source


@functools.cache
def _kernel(scale: float, merge: str = "block", store: bool = False, after: bool = False):
    inputs, source = kernel_source(scale, merge, store, after)
    return compiled.cuda_kernel(
        name=_named("tq_attend" if merge == "block" else "tq_attend_split", source, inputs),
        input_names=inputs, output_names=["out", "ml", "part"], source=source, header=_HEADER)


@functools.cache
def _join_kernel():
    source = _filled(_JOIN)
    return compiled.cuda_kernel(
        name=_named("tq_attend_join", source), input_names=["ml", "part", "position"],
        output_names=["out"], source=source, header=_HEADER)


@functools.cache
def _counters(slot) -> mx.array:
    """Slot `slot`'s done-counters of the groups, zero between launches (each launch's last
    blocks reset theirs). Launches that may run at once (independent ones in a CUDA graph)
    must not share a slot: the whole step gives each layer its own."""
    counters = mx.zeros((MAX_GROUPS,), mx.int32)
    mx.eval(counters)
    return counters


def buffer_attention(queries: mx.array, keys: mx.array, values: mx.array,
                     position: mx.array, scale: float, slot=None, store=None,
                     after: mx.array | None = None) -> mx.array:
    """`kernels.attend.buffer_attention` on CUDA (see the module docstring). `slot` names
    the counters the launch uses (`_counters`); None: a zeroed array of its own. With
    MERGE "launch" a second launch merges the chunks instead (no counters). `store`: the
    new token's (key, value), each (B, KV heads, 1, D), written at `position` into
    `keys` and `values` themselves by the launch (`stores_in_place`): the buffers are its
    inputs, not outputs, so MLX neither copies them nor knows they changed; the caller
    orders later reads after this call (`mx.depends` on its output).

    `after`: an array the launch takes as an input and never reads, so that it runs after
    the operation that wrote it. MLX's CUDA graphs order a kernel only after the last
    writer of each of its inputs' buffers: two launches over the same buffers (and the
    same slot's counters) with no data between them may run at once. The whole step
    passes the last step's launch output of the same layer (`orders_after`)."""
    if not supports(queries.shape, keys.shape, values.shape, keys.dtype) or \
            queries.dtype != keys.dtype or values.dtype != keys.dtype:
        raise NotImplementedError(f"buffer attention of q {queries.shape} {queries.dtype} "
                                  f"over k {keys.shape}, v {values.shape} {keys.dtype}")
    if position.dtype != mx.int32 or position.size != 1:
        raise NotImplementedError(f"buffer attention's position must be one int32, not {position}")
    b, h, _, d = queries.shape
    kvh, size = keys.shape[1], keys.shape[2]
    if store is not None and any(x.shape != (b, kvh, 1, d) or x.dtype != keys.dtype
                                 for x in store):
        raise NotImplementedError(f"buffer attention's stored key and value must be "
                                  f"{(b, kvh, 1, d)} {keys.dtype}, not "
                                  f"{[(x.shape, x.dtype) for x in store]}")
    r = h // kvh
    chunk, chunks = plan(size, b * kvh)
    merge = MERGE if chunks > 1 else "block"  # one chunk: no merge, no counter touched
    inputs = [queries, keys, values, position]
    if merge == "block":
        inputs.append(_counters(slot) if slot is not None else mx.zeros((b * kvh,), mx.int32))
    inputs += list(store) if store is not None else []
    inputs += [after] if after is not None else []
    out, ml, part = _kernel(scale, merge, store is not None, after is not None)(
        inputs=inputs, template=[("T", keys.dtype), ("D", d), ("R", r), ("CH", chunk)],
        grid=(chunks * NT, b * kvh, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(b, h, 1, d), (b * kvh, chunks, r, 2), (b * kvh, chunks, r, d)],
        output_dtypes=[keys.dtype, mx.float32, mx.float32])
    if merge == "block":
        return out
    return _join_kernel()(
        inputs=[ml, part, position],
        template=[("T", keys.dtype), ("D", d), ("R", r), ("CH", chunk), ("KVH", kvh)],
        grid=(-(-r * d // (4 * NT)) * NT, b * kvh, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(b, h, 1, d)], output_dtypes=[keys.dtype])[0]


buffer_attention.supports = supports  # the whole step asks before it traces a call
buffer_attention.stores_in_place = True  # `store` writes into the buffers themselves
buffer_attention.orders_after = True  # `after`: ordered after that array's writer
dispatch.register("cuda", "buffer_attention", buffer_attention)

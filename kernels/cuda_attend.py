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
  the last block of a group merges the group's partials and resets the counter for the
  next launch (a persistent int32 array per `slot`: launches in order on one stream
  may share one, launches that may run at once must not). No second launch, so a
  layer's attention is one operation to encode.
  MERGE "launch" (TURBOQUANT_CUDA_ATTEND_MERGE=launch) merges in a second launch instead,
  no counters, the merge spread over several blocks a group (see `_JOIN`): written to
  bisect a stall seen on the H200 and for long buffers, checked by the CPU emulation
  (`tests/cuda_emulation.py`), not yet run on a GPU.

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
from . import dispatch

NT = 128  # threads a block
CHUNK_TOKENS = 64  # rows a block walks (grown for long buffers: at most MAX_CHUNKS)
MAX_CHUNKS = 256  # chunks a (batch, KV head) group: what its last block merges
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
# _PARTIAL: a block's chunk, merged over its workers: the output itself when the buffer
# is one chunk, else the chunk's partial.
_PARTIAL = r"""
  constexpr int NT = @NT@;
  constexpr int PPR = D / 8, W = NT / PPR;  // lanes a row, workers a block
  __shared__ float qs[R * D];
  __shared__ float wm[W * R], wl[W * R];     // each worker's max and sum, a query row
  __shared__ float wacc[W * R * D + (NT / 32) * R];  // and its unnormalised output
  const int tid = threadIdx.x, worker = tid / PPR, piece = tid % PPR;
  const int chunk = blockIdx.x, chunks = gridDim.x, bk = blockIdx.y;
  const int kvh = keys_shape[1], S = keys_shape[2];
  const int H = kvh * R, b = bk / kvh, g = bk % kvh;
  const int len = min(position[0] + 1, S);
  const int start = chunk * CH, end = min(start + CH, len);
@EARLY_EXIT@
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
  // every lane runs the same steps (the score's shuffles need the whole warp)
  for (int t0 = start; t0 < end; t0 += 2 * W) {
    const int t1 = t0 + worker, t2 = t1 + W;
    const bool ok1 = t1 < end, ok2 = t2 < end;
    uint4 k1 = make_uint4(0, 0, 0, 0), v1 = k1, k2 = k1, v2 = k1;
    if (ok1) { k1 = *reinterpret_cast<const uint4*>(kb + (size_t)t1 * D);
               v1 = *reinterpret_cast<const uint4*>(vb + (size_t)t1 * D); }
    if (ok2) { k2 = *reinterpret_cast<const uint4*>(kb + (size_t)t2 * D);
               v2 = *reinterpret_cast<const uint4*>(vb + (size_t)t2 * D); }
    tq_attend_row<T, R, PPR>(keys, k1, v1, ok1, q, m, l, acc);
    tq_attend_row<T, R, PPR>(keys, k2, v2, ok2, q, m, l, acc);
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
    if (chunks == 1) {
      tq_store(out + (size_t)(b * H + g * R + r) * D + d, o / sum);
    } else {
      part[((group + chunk) * R + r) * D + d] = o;
      if (d == 0) { ml[((group + chunk) * R + r) * 2] = mx; ml[((group + chunk) * R + r) * 2 + 1] = sum; }
    }
  }
  if (chunks == 1) return;
"""

# _MERGE: one block merges a (batch, KV head) group's partials (ml, part) of the chunks in
# use into the output: warp w the chunks w, w + NWARPS, ... (weights from their maxima),
# a lane every 32nd output, then the warps' sums through `wsum` (shared memory). Needs
# tid, NT, b, g, H, group, chunks, len and `wsum` of NWARPS * (R * D + R) floats.
_MERGE = r"""
  constexpr int NWARPS = NT / 32, ITEMS = (R * D + 31) / 32;
  const int used = min(chunks, (len + CH - 1) / CH), lane = tid & 31, warp = tid >> 5;
  float gmax[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    gmax[r] = TQ_NEG;
    for (int c = 0; c < used; ++c) gmax[r] = fmaxf(gmax[r], __ldcg(ml + ((group + c) * R + r) * 2));
  }
  float o[ITEMS], sum[R];
  #pragma unroll
  for (int k = 0; k < ITEMS; ++k) o[k] = 0.f;
  #pragma unroll
  for (int r = 0; r < R; ++r) sum[r] = 0.f;
  for (int c = warp; c < used; c += NWARPS) {
    float e[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t at = ((group + c) * R + r) * 2;
      e[r] = __expf(__ldcg(ml + at) - gmax[r]);
      sum[r] += __ldcg(ml + at + 1) * e[r];
    }
    const float* pc = part + (group + c) * R * D;
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int i = lane + 32 * k;
      if (i < R * D) o[k] += __ldcg(pc + i) * e[i / D];
    }
  }
  __syncthreads();  // what shared memory held before is read: it takes the warps' sums
  #pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int i = lane + 32 * k;
    if (i < R * D) wsum[warp * R * D + i] = o[k];
  }
  if (lane == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) wsum[NWARPS * R * D + warp * R + r] = sum[r];
  __syncthreads();
  for (int i = tid; i < R * D; i += NT) {
    const int r = i / D;
    float total = 0.f, norm = 0.f;
    #pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      total += wsum[w * R * D + i];
      norm += wsum[NWARPS * R * D + w * R + r];
    }
    tq_store(out + (size_t)(b * H + g * R) * D + i, total / norm);
  }
"""

# MERGE "block": one launch; the last block of a group to finish merges it (its done-count
# on the group's counter, which it resets for the next launch).
_SOURCE = _PARTIAL.replace("@EARLY_EXIT@", "") + r"""
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* done = const_cast<int*>(counter) + bk;
    last = atomicAdd(done, 1) == chunks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float* wsum = wacc;  // NWARPS * (R * D + R) floats <= W * R * D
""" + _MERGE + r"""
  if (tid == 0) const_cast<int*>(counter)[bk] = 0;  // ready for the next launch
"""

# MERGE "launch": the partial kernel (_SPLIT: no counters) and a second launch that merges
# the partials (_JOIN), several blocks a (batch, KV head) group, NT outputs a block: grid
# (ceil(R * D / NT) * NT, batch * kv_heads). Each block takes the group's maxima and
# weights over the chunks thread-parallel (a chunk a thread, a block reduction, the
# weights in shared memory), then each thread one output over every chunk, eight chunks'
# loads in flight. The merge is spread over the GPU instead of one block a group, which
# a long buffer's many chunks make the slow tail of the one-launch kernel.
# (a chunk past the length returns at once: the join reads the chunks in use only)
_SPLIT = _PARTIAL.replace("@EARLY_EXIT@", "  if (start >= len) return;")
_JOIN = r"""
  constexpr int NT = @NT@, NWARPS = NT / 32, MAXC = @MAX_CHUNKS@;
  __shared__ float red[NWARPS * R];  // the warps' maxima, then their sums
  __shared__ float wts[MAXC * R];     // each chunk's weight, a query row
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bk = blockIdx.y, chunks = ml_shape[1];
  const int H = KVH * R, b = bk / KVH, g = bk % KVH;
  const int used = min(chunks, (position[0] + CH) / CH);  // chunks holding rows 0..position
  const size_t group = (size_t)bk * chunks;
  float lm[R], ls[R], gmax[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) { lm[r] = TQ_NEG; ls[r] = 0.f; }
  for (int c = tid; c < used; c += NT)
    #pragma unroll
    for (int r = 0; r < R; ++r) lm[r] = fmaxf(lm[r], ml[((group + c) * R + r) * 2]);
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
      const float e = __expf(ml[at] - gmax[r]);
      wts[c * R + r] = e;
      ls[r] += ml[at + 1] * e;
    }
  #pragma unroll
  for (int r = 0; r < R; ++r)
    for (int o = 16; o > 0; o >>= 1) ls[r] += __shfl_xor_sync(0xffffffffu, ls[r], o);
  if (lane == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) red[warp * R + r] = ls[r];
  __syncthreads();
  const int i = blockIdx.x * NT + tid;  // this thread's output: row r, dim i % D
  if (i >= R * D) return;
  const int r = i / D;
  float norm = 0.f;
  #pragma unroll
  for (int w = 0; w < NWARPS; ++w) norm += red[w * R + r];
  const float* pc = part + group * R * D + i;
  float o[8];
  #pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = 0.f;
  int c = 0;
  for (; c + 8 <= used; c += 8)
    #pragma unroll
    for (int j = 0; j < 8; ++j) o[j] += pc[(size_t)(c + j) * R * D] * wts[(c + j) * R + r];
  for (; c < used; ++c) o[0] += pc[(size_t)c * R * D] * wts[c * R + r];
  float total = 0.f;
  #pragma unroll
  for (int j = 0; j < 8; ++j) total += o[j];
  tq_store(out + (size_t)(b * H + g * R) * D + i, total / norm);
"""


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


def plan(size: int) -> tuple[int, int]:
    """(rows a chunk, chunks) for a buffer of `size` rows."""
    chunk = CHUNK_TOKENS
    while -(-size // chunk) > MAX_CHUNKS:
        chunk *= 2
    return chunk, -(-size // chunk)


def _named(prefix: str, source: str) -> str:
    return f"{prefix}_{hashlib.sha256((_HEADER + source).encode()).hexdigest()[:12]}"


@functools.cache
def _kernel(scale: float, merge: str = "block"):
    """The attention kernel: with its last-block merge ("block"), or the partials only
    ("launch": `_join_kernel` merges them)."""
    body = _SOURCE if merge == "block" else _SPLIT
    source = f"  constexpr float TQ_SCALE = {float(scale)!r}f;\n" + body.replace("@NT@", str(NT))
    inputs = ["queries", "keys", "values", "position"] + (["counter"] if merge == "block" else [])
    return mx.fast.cuda_kernel(
        name=_named("tq_attend" if merge == "block" else "tq_attend_split", source),
        input_names=inputs, output_names=["out", "ml", "part"], source=source, header=_HEADER)


@functools.cache
def _join_kernel():
    source = _JOIN.replace("@NT@", str(NT)).replace("@MAX_CHUNKS@", str(MAX_CHUNKS))
    return mx.fast.cuda_kernel(
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
                     position: mx.array, scale: float, slot=None) -> mx.array:
    """`kernels.attend.buffer_attention` on CUDA (see the module docstring). `slot` names
    the counters the launch uses (`_counters`); None: a zeroed array of its own. With
    MERGE "launch" a second launch merges the chunks instead (no counters)."""
    if not supports(queries.shape, keys.shape, values.shape, keys.dtype) or \
            queries.dtype != keys.dtype or values.dtype != keys.dtype:
        raise NotImplementedError(f"buffer attention of q {queries.shape} {queries.dtype} "
                                  f"over k {keys.shape}, v {values.shape} {keys.dtype}")
    if position.dtype != mx.int32 or position.size != 1:
        raise NotImplementedError(f"buffer attention's position must be one int32, not {position}")
    b, h, _, d = queries.shape
    kvh, size = keys.shape[1], keys.shape[2]
    r = h // kvh
    chunk, chunks = plan(size)
    merge = MERGE if chunks > 1 else "block"  # one chunk: no merge, no counter touched
    inputs = [queries, keys, values, position]
    if merge == "block":
        inputs.append(_counters(slot) if slot is not None else mx.zeros((b * kvh,), mx.int32))
    out, ml, part = _kernel(scale, merge)(
        inputs=inputs, template=[("T", keys.dtype), ("D", d), ("R", r), ("CH", chunk)],
        grid=(chunks * NT, b * kvh, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(b, h, 1, d), (b * kvh, chunks, r, 2), (b * kvh, chunks, r, d)],
        output_dtypes=[keys.dtype, mx.float32, mx.float32])
    if merge == "block":
        return out
    return _join_kernel()(
        inputs=[ml, part, position],
        template=[("T", keys.dtype), ("D", d), ("R", r), ("CH", chunk), ("KVH", kvh)],
        grid=(-(-r * d // NT) * NT, b * kvh, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(b, h, 1, d)], output_dtypes=[keys.dtype])[0]


buffer_attention.supports = supports  # the whole step asks before it traces a call
dispatch.register("cuda", "buffer_attention", buffer_attention)

"""The trellis encoder's Viterbi on CUDA: the CPU reference's paths, bit for bit.

`encode_rows_gpu(code, x, group_size, block)` returns what `stages.trellis.encode_rows`
returns (words, float16 scales, squared errors): the group RMS, the gain and the scale refit
run on the host exactly as there; the two Viterbi passes of every (row, block) run here,
one CUDA thread block per (row, block) and pass: a free Viterbi over the block rotated by
half its length, whose state at the block's last step fixes where the circle closes, then
the Viterbi constrained to that closing (docs/FORMAT.md; `stages.trellis.encode_block`).

Costs are float32 as in the reference, and never stored per state: with m = 2^(L - kV)
predecessor sets, step t's cost of state s is `d_t(s) + B_t[s mod m]`, where B_t[p] is the
best cost of step t - 1 over the 2^kV states p 2^kV + i (the min-over-predecessors
factoring). A block keeps B_{t-1} and B_t in shared memory (2 m floats: 128 KiB at L = 16,
k = 2) and recomputes d_t(s) from s: the state's byte sum (multiply-add, shift-xor, dp4a)
indexes a table of the step's squared distances by byte sum (1021 entries: the computed
codebook has no more values), built each step with the reference's operations
(`(y - v) * (y - v)`, v the correctly rounded `(sum - 510) / BYTESUM_STD`). So every cost
is the reference's float32 value; the minimum over a set's 2^kV states keeps the first
(lowest i), the final state the lowest among equal costs, as np.argmin and the numba loop
do. Back-pointers (kV <= 8 bits) go to global memory, four to a 32-bit word; one thread
traces the path back.

Shared memory is what binds: a warp's 32 lookups of the distance table are random, so the
table is kept in up to 32 copies side by side (lane l reads copy l mod copies: 16 copies
at L = 16, k = 2, 32 otherwise), and the predecessor costs are read 16 bytes at a time from
a swizzled layout without bank conflicts. Work: 2 passes x (T / V) steps x 2^L states for T
weights, about 10 instructions and 2-3 shared-memory cycles a warp a state
(`estimate_rate`: ~21 M weights/s at L = 16, k = 2, ~25 M at k = 3, 4 on an H200, if
nothing else binds).
"""

from __future__ import annotations

import functools
import hashlib
import os

import mlx.core as mx
import numpy as np

from turboquant.stages import trellis
from turboquant.stages.trellis import TrellisCode, TrellisRows

from . import compiled
from .cuda_gemv import constants_source
from .cuda_trellis import _float, header

MAX_SHARED_BYTES = 200 * 1024
SCRATCH_BYTES = 1 << 31  # back-pointers of one launch's thread blocks (global memory)
LUT = 1024  # byte sums 0..1020

# inputs: y (items, STEPS * VALUES) float32 (gain-divided rows, one block an item),
# closing (items,) int32 (read when CLOSED); outputs: path (items, STEPS) int32 states,
# back (items, STEPS, M / 4) uint32 (byte r of word q: the best predecessor of set
# q + r M / 4 at that step)
_SOURCE = r"""
  constexpr int N = 1 << STATE;
  constexpr int KV = BITS * VALUES;
  constexpr int FAN = 1 << KV;
  constexpr int M = N >> KV;
  constexpr int Q = M / 4;
  constexpr int LUT = 1024;
  const float TQ_INF = __uint_as_float(0x7f800000u);
  extern __shared__ __align__(16) float tq_shared[];
  float* best_a = tq_shared;  // M costs, swizzled (tq_sw)
  float* best_b = tq_shared + M;
  float* value = tq_shared + 2 * M;  // LUT: the value of a byte sum
  float* dist = value + LUT;         // VALUES * LUT * REP: the step's squared distances
  __shared__ float red_c[32];
  __shared__ int red_s[32];
  const int item = blockIdx.x, tid = threadIdx.x, slot = tid & (REP - 1);
  const float* yi = y + (size_t)item * STEPS * VALUES;
  const int close = CLOSED ? closing[item] : -1;
  for (int b = tid; b < LUT; b += THREADS) value[b] = tq_div_rn((float)(b - 510), STD);
  // before step 0: 0 where the circle may start, infinity elsewhere
  for (int p = tid; p < M; p += THREADS) best_a[tq_sw(p)] = (CLOSED && p != close) ? TQ_INF : 0.f;
  __syncthreads();
  float* prev = best_a;
  float* next = best_b;
  for (int t = 1; t <= STEPS; ++t) {
    // step t - 1's squared distance of every value (the source step rolled by SHIFT),
    // REP copies side by side: lane l reads copy l % REP, so lanes meet in fewer banks
    const float* yt = yi + ((t - 1 + SHIFT) % STEPS) * VALUES;
    for (int b = tid; b < VALUES * LUT; b += THREADS) {
      const float diff = yt[b / LUT] - value[b % LUT];
      const float d = tq_mul_rn(diff, diff);
      float4* o = reinterpret_cast<float4*>(dist + (size_t)b * REP);
      #pragma unroll
      for (int u = 0; u < REP / 4; ++u) o[u] = make_float4(d, d, d, d);
    }
    __syncthreads();
    if (t == STEPS) break;
    for (int q = tid; q < Q; q += THREADS) {
      uint32_t word = 0;
      #pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int p = q + r * Q;
        const uint32_t s0 = (uint32_t)p * FAN;
        float b = 0.f;
        int h = 0;
        if (M >= FAN) {  // the set's predecessors: FAN costs in a row, 4 a load
          const float4* prev4 = reinterpret_cast<const float4*>(prev);
          const int u0 = (int)((s0 & (M - 1)) >> 2);
          #pragma unroll 4
          for (int j = 0; j < FAN / 4; ++j) {
            const float4 pv = prev4[tq_sw_unit(u0 + j)];
            const float pc[4] = {pv.x, pv.y, pv.z, pv.w};
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = 4 * j + e;
              const float c = tq_trellis_cost(s0 + i, dist, slot) + pc[e];
              if (i == 0 || c < b) { b = c; h = i; }
            }
          }
        } else {
          for (int i = 0; i < FAN; ++i) {
            const float c = tq_trellis_cost(s0 + i, dist, slot) + prev[tq_sw((s0 + i) & (M - 1))];
            if (i == 0 || c < b) { b = c; h = i; }
          }
        }
        next[tq_sw(p)] = b;
        word |= (uint32_t)h << (8 * r);
      }
      back[((size_t)item * STEPS + t) * Q + q] = word;
    }
    __syncthreads();
    float* swap = prev;
    prev = next;
    next = swap;
  }
  // the last step: the state of least cost (the lowest among equal ones), allowed ones only
  float bc = TQ_INF;
  int bs = 0x7fffffff;
  for (int s = tid; s < N; s += THREADS) {
    if (CLOSED && (s >> KV) != close) continue;
    const float c = tq_trellis_cost((uint32_t)s, dist, slot) + prev[tq_sw(s & (M - 1))];
    if (c < bc || (c == bc && s < bs)) { bc = c; bs = s; }
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float oc = __shfl_xor_sync(0xffffffffu, bc, o);
    const int os = __shfl_xor_sync(0xffffffffu, bs, o);
    if (oc < bc || (oc == bc && os < bs)) { bc = oc; bs = os; }
  }
  if ((tid & 31) == 0) { red_c[tid >> 5] = bc; red_s[tid >> 5] = bs; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < THREADS / 32; ++w)
      if (red_c[w] < bc || (red_c[w] == bc && red_s[w] < bs)) { bc = red_c[w]; bs = red_s[w]; }
    // back through the pointers this block wrote (visible after the barrier above)
    int s = bs;
    path[(size_t)item * STEPS + STEPS - 1] = s;
    for (int t = STEPS - 1; t > 0; --t) {
      const int p = s & (M - 1);
      const uint32_t word = back[((size_t)item * STEPS + t) * Q + (p % Q)];
      s = (p << KV) | (int)((word >> (8 * (p / Q))) & 0xffu);
      path[(size_t)item * STEPS + t - 1] = s;
    }
  }
"""

_HELPERS = r"""
// Correctly rounded products (no contraction into a neighbour's add).
__device__ __forceinline__ float tq_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// A state's squared distance to the step's values: dist holds REP copies of each byte
// sum's distance side by side (copy `slot`), value j's table after value j - 1's; summed
// in value order from the first, as the reference.
template <int V, int R, int VER>
__device__ __forceinline__ float tq_trellis_cost_v(uint32_t s, const float* dist, int slot) {
  float d = dist[tq_trellis_sum<VER>(s, 0) * R + slot];
  if (V == 2) d = d + dist[(1024 + tq_trellis_sum<VER>(s, 1)) * R + slot];
  return d;
}
#define tq_trellis_cost(s, dist, slot) \
  tq_trellis_cost_v<VALUES, REP, VERSION>((s), (dist), (slot))

// Where cost x of a set lives: its 16-byte unit u at u ^ ((u >> 3) & 7), so the 8 lanes of
// a phase reading 16-byte units 1, 2 or 4 apart meet 8 different bank quads.
__device__ __forceinline__ int tq_sw_unit(int u) { return u ^ ((u >> 3) & 7); }
__device__ __forceinline__ int tq_sw(int x) { return (tq_sw_unit(x >> 2) << 2) | (x & 3); }
"""


def copies_for(code: TrellisCode) -> int:
    """Copies of the distance table side by side (32, 16, 8, 4): the most that fit beside
    the costs; 0 if even 4 do not. 32 copies: a warp's lookups meet no bank twice."""
    for rep in (32, 16, 8, 4):
        if shared_bytes(code, rep) <= MAX_SHARED_BYTES:
            return rep
    return 0


def supported(code: TrellisCode) -> bool:
    """Whether a thread block holds the code's predecessor sets (2 m floats in shared
    memory, m = 2^(L - kV) >= 4 for the packed back-pointers) and 4 distance tables."""
    return (1 << code.keep_bits) >= 4 and copies_for(code) > 0


def shared_bytes(code: TrellisCode, rep: int | None = None) -> int:
    rep = copies_for(code) if rep is None else rep
    return 4 * (2 * (1 << code.keep_bits) + LUT + LUT * code.values * rep)


def threads_for(code: TrellisCode) -> int:
    """A thread per 4 predecessor sets, in whole warps, at most 1024."""
    return min(1024, max(32, (1 << code.keep_bits) // 4))


def source(code: TrellisCode, steps: int, shift: int, closed: bool) -> str:
    """The pass's body with its constants: `shift` rolls the block (the free pass over the
    half-rotated block), `closed` constrains the circle to the `closing` input."""
    constants = [("BITS", code.bits), ("STATE", code.state_bits), ("VALUES", code.values),
                 ("VERSION", code.version), ("STEPS", steps), ("SHIFT", shift), ("CLOSED", closed),
                 ("THREADS", threads_for(code)), ("REP", copies_for(code))]
    std = f"  constexpr float STD = {_float(trellis.BYTESUM_STD)};\n"
    return constants_source(constants) + std + _SOURCE


def kernel_header() -> str:
    return header() + _HELPERS


@functools.lru_cache(maxsize=None)
def _kernel(body: str, shared: int):
    head = kernel_header()
    tag = hashlib.sha256((head + body).encode()).hexdigest()[:12]
    return compiled.cuda_kernel(name=f"tq_trellis_viterbi_{tag}", input_names=["y", "closing"],
                                output_names=["path", "back"], source=body, header=head,
                                shared_memory=shared)


def viterbi_pass(code: TrellisCode, y: mx.array, closing: mx.array | None, shift: int = 0):
    """Best paths (items, steps) int32 of blocks y (items, steps, V) float32, rolled by
    `shift` steps; `closing` (items,) int32 constrains each circle, None leaves it free.
    `trellis.viterbi`'s paths (of the rolled blocks)."""
    items, steps, _ = y.shape
    closed = closing is not None
    if closing is None:
        closing = mx.zeros((items,), dtype=mx.int32)
    threads = threads_for(code)
    body = source(code, steps, shift, closed)
    m = 1 << code.keep_bits
    return _kernel(body, shared_bytes(code))(
        inputs=[y.reshape(items, -1), closing], grid=(items * threads, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[(items, steps), (items, steps, m // 4)],
        output_dtypes=[mx.int32, mx.uint32])[0]


def encode_blocks_gpu(code: TrellisCode, y: np.ndarray) -> np.ndarray:
    """`trellis.encode_block(code, y)` (exact=False) on the GPU: tail-biting state paths
    (rows, T / V) int64 of gain-divided blocks y (rows, T), the same paths bit for bit."""
    if not supported(code):
        raise NotImplementedError(
            f"the GPU Viterbi holds 2^(L - kV) >= 4 predecessor sets in shared memory: "
            f"L={code.state_bits}, k={code.bits}, V={code.values} does not fit; use "
            "stages.trellis.encode_rows (CPU)")
    rows, block = y.shape
    steps = block // code.values
    m = 1 << code.keep_bits
    per_launch = max(1, SCRATCH_BYTES // (steps * m))  # back-pointer bytes an item
    yv = np.ascontiguousarray(y, dtype=np.float32).reshape(rows, steps, code.values)
    half = steps // 2
    out = []
    for r0 in range(0, rows, per_launch):
        part = mx.array(yv[r0:r0 + per_launch])
        rolled = viterbi_pass(code, part, None, shift=half)
        # rolled step steps-1-half is the block's last step: the circle closes on its high bits
        closing = (rolled[:, steps - 1 - half] >> code.step_bits).astype(mx.int32)
        out.append(np.array(viterbi_pass(code, part, closing)))
    return np.concatenate(out, axis=0).astype(np.int64)


def available() -> bool:
    """Whether the converter may code trellis rows here: MLX's CUDA backend is present and
    TURBOQUANT_TRELLIS_GPU=1. Off by default until a run on a GPU has shown this encoder's
    words equal the CPU's (tests/test_kernels_cuda_trellis_encode.py): a conversion's bytes
    must not depend on the machine."""
    cuda = getattr(mx, "cuda", None)
    return (os.environ.get("TURBOQUANT_TRELLIS_GPU") == "1" and cuda is not None
            and cuda.is_available())


def encode_rows_gpu(code: TrellisCode, x: np.ndarray, group_size: int, block: int = 256,
                    valid: int | None = None) -> TrellisRows:
    """`stages.trellis.encode_rows(code, x, group_size, block, valid=valid)` with the Viterbi
    on the GPU: the same words, scales and errors. x (rows, n) rotated, padded rows."""
    return trellis.encode_rows(code, x, group_size, block, valid=valid, paths=gpu_paths)


def gpu_paths(code: TrellisCode, y: np.ndarray, block: int, table, exact: bool = False
              ) -> np.ndarray:
    """`stages.trellis.block_paths` on the GPU: the full blocks of every row in one launch,
    the shorter last ones in another."""
    rows, n = y.shape
    full = n // block
    paths = []
    if full:
        blocks = y[:, :full * block].reshape(rows * full, block)
        paths.append(encode_blocks_gpu(code, blocks).reshape(rows, full, -1)
                     .reshape(rows, -1))
    if n % block:
        paths.append(encode_blocks_gpu(code, y[:, full * block:]))
    return np.concatenate(paths, axis=1)


OPS_PER_STATE = 10  # instructions a state and step: hash (IMAD, SHF, LOP3, DP4A), table
# index, two adds, compare and two selects (the source above)
# shared-memory cycles a warp's lookup of the distance table costs, by copies: 32 random
# lanes over 32 banks meet ~3.5 times in the busiest bank; with c copies, 32 / c lanes share
CONFLICTS = {32: 1.0, 16: 2.0, 8: 2.6, 4: 3.5}


def estimate_rate(code: TrellisCode, sms: int = 132, clock_hz: float = 1.98e9,
                  lanes: int = 128) -> float:
    """Weights a second the GPU Viterbi can code at best: 2 passes x 2^L states a step, V
    weights a step. A state costs OPS_PER_STATE instructions over `lanes` lanes a clock
    and an SM, and per warp the distance lookup (`CONFLICTS`) plus one cycle of cost reads
    (16-byte loads, swizzled: no conflicts) of shared memory; whichever binds. H200."""
    shared = CONFLICTS[copies_for(code)] * code.values + 1.0
    per_clock = min(lanes / OPS_PER_STATE, 32 / shared)  # states a clock an SM
    states_per_weight = 2 * (1 << code.state_bits) / code.values
    return sms * clock_hz * per_clock / states_per_weight


__all__ = ["encode_blocks_gpu", "encode_rows_gpu", "estimate_rate", "supported", "viterbi_pass"]

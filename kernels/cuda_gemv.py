"""CUDA decode GEMV for TurboQuant weights through `mx.fast.cuda_kernel`.

Same algorithm as the reference (sum over groups of scale * sum levels[code] * x_rot),
arranged so a code costs about two integer instructions:

- the codebook lives in four registers as the low and high bytes of its fp16 levels, and
  `__byte_perm` looks up four codes at once (a selector nibble is a code: 3 bits index
  8 bytes; 4-bit codes use two lookups merged by the code's top bit);
- codes reach the selectors with one mask: 2- and 4-bit codes already sit in nibbles in
  the stored layout; 3-bit codes are repacked once at load into a 2-bit plane (stored
  layout) and a 1-bit plane whose bits are pre-placed at nibble bit 2 (`repack_3bit`);
- products accumulate in half2 over 16 codes, then in fp32 with the group scale;
- one warp per 4 rows (activations loaded once for all), each lane one group of 64 codes
  per step (16-byte code loads), the next step's weights fetched into a second register
  buffer while the lane decodes this one;
- activations stay in natural order: `repack` permutes the codes instead; a single
  matrix stages its fp16 row in shared memory (coalesced loads, swizzled), since a lane
  reading 128 contiguous bytes per group from global memory touches 32 cache lines per
  load instruction (H200, 28672x8192 3-bit: 45 -> 38 us).

Rows are padded to a multiple of 64 codes (padding codes meet zero activations).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import compiled, cuda_memory

GROUP_CODES = 64  # codes a lane handles per step
ROWS_PER_WARP = 4  # most rows a warp runs: its two register buffers of weights fit in ~96 registers
WARPS_WANTED = 512  # below this many warps a matrix runs fewer rows per warp
WARPS_PER_BLOCK = 4

HEADER = r"""
#include <cuda_fp16.h>

__device__ __forceinline__ void tq_tables(const float* levels, int n, uint32_t t[8]) {
  // t[0..1]: low bytes of fp16 levels 0..7, t[2..3]: high bytes; t[4..7]: levels 8..15.
  #pragma unroll
  for (int i = 0; i < 8; ++i) t[i] = 0;
  for (int i = 0; i < n; ++i) {
    unsigned short h = __half_as_ushort(__float2half_rn(levels[i]));
    int bank = (i / 8) * 4;
    int j = i % 8;
    t[bank + j / 4] |= (uint32_t)(h & 0xff) << (8 * (j % 4));
    t[bank + 2 + j / 4] |= (uint32_t)(h >> 8) << (8 * (j % 4));
  }
}

// The PRMT instruction itself: __byte_perm clears bit 3 of every selector nibble first (one
// more instruction per lookup); the selectors here already have it clear.
__device__ __forceinline__ uint32_t tq_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Four codes (selector nibbles 0..3, bit 3 clear below 4 bits) -> two half2 of their levels.
template <int BITS>
__device__ __forceinline__ void tq_lookup4(const uint32_t t[8], uint32_t sel,
                                           __half2& a, __half2& b) {
  uint32_t lo, hi;
  if (BITS == 4) {
    uint32_t s = sel & 0x7777u;
    uint32_t merge = 0x3210u | ((sel & 0x8888u) >> 1);
    lo = tq_prmt(tq_prmt(t[0], t[1], s), tq_prmt(t[4], t[5], s), merge);
    hi = tq_prmt(tq_prmt(t[2], t[3], s), tq_prmt(t[6], t[7], s), merge);
  } else {
    lo = tq_prmt(t[0], t[1], sel);
    hi = tq_prmt(t[2], t[3], sel);
  }
  uint32_t ua = tq_prmt(lo, hi, 0x5140u);
  uint32_t ub = tq_prmt(lo, hi, 0x7362u);
  a = *reinterpret_cast<__half2*>(&ua);
  b = *reinterpret_cast<__half2*>(&ub);
}

// Eight codes in selector nibbles 0..7 against eight halves of x.
template <int BITS>
__device__ __forceinline__ __half2 tq_dot8(const uint32_t t[8], uint32_t sel, uint4 xv,
                                           __half2 acc) {
  __half2 a, b;
  tq_lookup4<BITS>(t, sel, a, b);  // PRMT reads the low 16 bits
  acc = __hfma2(a, *reinterpret_cast<__half2*>(&xv.x), acc);
  acc = __hfma2(b, *reinterpret_cast<__half2*>(&xv.y), acc);
  tq_lookup4<BITS>(t, sel >> 16, a, b);
  acc = __hfma2(a, *reinterpret_cast<__half2*>(&xv.z), acc);
  acc = __hfma2(b, *reinterpret_cast<__half2*>(&xv.w), acc);
  return acc;
}

__device__ __forceinline__ float tq_hsum(__half2 v) {
  float2 f = __half22float2(v);
  return f.x + f.y;
}

// The scales of codes 0-31 and 32-63 of 64-code group g in a row's scales (groups of GS).
template <int GS>
__device__ __forceinline__ float2 tq_scales(const __half* sr, int g) {
  static_assert(GS == 32 || GS == 64 || GS == 128, "groups of 32, 64 or 128 weights");
  if (GS == 32) return __half22float2(__ldg(reinterpret_cast<const __half2*>(sr) + g));
  const float s = __half2float(__ldg(sr + (GS == 64 ? g : g / 2)));
  return make_float2(s, s);
}

// acc + the codes of 16-code block b (0-3) of a 64-code group (words cw, 3-bit high plane
// hw) against the 16 halves of x in x0 and x1 (see x_permutation for which meets which).
template <int BITS>
__device__ __forceinline__ __half2 tq_block16(const uint32_t t[8], const uint4* cw, uint2 hw,
                                              int b, uint4 x0, uint4 x1, __half2 acc) {
  if (BITS == 4) {
    const uint32_t w8[8] = {cw[0].x, cw[0].y, cw[0].z, cw[0].w,
                            cw[BITS == 4].x, cw[BITS == 4].y, cw[BITS == 4].z, cw[BITS == 4].w};
    acc = tq_dot8<4>(t, w8[2 * b], x0, acc);
    return tq_dot8<4>(t, w8[2 * b + 1], x1, acc);
  }
  const uint32_t l4[4] = {cw[0].x, cw[0].y, cw[0].z, cw[0].w};
  if (BITS == 2) {
    acc = tq_dot8<2>(t, l4[b] & 0x33333333u, x0, acc);
    return tq_dot8<2>(t, (l4[b] >> 2) & 0x33333333u, x1, acc);
  }
  const uint32_t h = (b >> 1) ? hw.y : hw.x;
  const uint32_t he = (b & 1) ? (h << 2) : h;
  const uint32_t ho = (b & 1) ? (h << 1) : (h >> 1);
  acc = tq_dot8<3>(t, (l4[b] & 0x33333333u) | (he & 0x44444444u), x0, acc);
  return tq_dot8<3>(t, ((l4[b] >> 2) & 0x33333333u) | (ho & 0x44444444u), x1, acc);
}
"""

# The rows of one warp, shared with the fused linear kernel (`cuda_linear`): rows
# [row0, row0 + ROWS_PER_WARP) of `expert` (those below OUT) against the activations
# TQ_X(g, i) (uint4 i of 64-code group g), each finished row v stored by TQ_STORE (which
# may read the warp's other sums total[r'], bias not added); needs lane, pair, seg, t.
#
# Each lane runs 64-code groups g = lane, lane + 32, ...; the weights of a group (code
# words, high bits, scales of every row) are fetched one group ahead, into one of two
# register buffers, so a lane's loads are in flight while it decodes the group before.
# ROWS_SETUP declares the buffers and fetches the first group (the fused kernel does it
# before it rotates, so the rotation hides those loads); ROWS_RESET starts a new row0;
# ROWS_LOOP decodes and stores.
ROWS_RESET = r"""
  // the warp reads rows [wrow, wrow + ROWS_PER_WARP): its own, moved back from the end
  // of the matrix where they would run past it (rows before row0 are never stored)
  wrow = max(0, min(row0, OUT - ROWS_PER_WARP));
  #pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) total[r] = 0.f;
  if (lane < GROUPS) TQ_FETCH(cwA, hwA, scA, lane);
"""

ROWS_SETUP = r"""
  constexpr int GROUPS = PADDED / 64;
  constexpr int CWORDS = BITS == 4 ? 2 : 1;  // 16-byte code words per row and group
  constexpr int RLAST = (OUT < ROWS_PER_WARP ? OUT : ROWS_PER_WARP) - 1;  // last row read
  const uint4* cbase = reinterpret_cast<const uint4*>(codes) + (size_t)expert * OUT * GROUPS * CWORDS;
  const uint2* hbase = reinterpret_cast<const uint2*>(hplane) + (size_t)expert * OUT * GROUPS;
  const __half* sbase = scales + (size_t)expert * OUT * NSCALES;
  float total[ROWS_PER_WARP];
  int wrow;
  uint4 cwA[ROWS_PER_WARP][CWORDS], cwB[ROWS_PER_WARP][CWORDS];
  uint2 hwA[ROWS_PER_WARP], hwB[ROWS_PER_WARP];
  float2 scA[ROWS_PER_WARP], scB[ROWS_PER_WARP];  // scales of codes 0-31 and 32-63
  // group g of every row into one buffer: one address per array, rows at constant offsets
  #define TQ_FETCH(cw, hw, sc, g) { \
      const uint4* cr = cbase + ((size_t)wrow * GROUPS + (g)) * CWORDS; \
      const uint2* hr = hbase + (size_t)wrow * GROUPS + (g); \
      const __half* sr = sbase + (size_t)wrow * NSCALES; \
      _Pragma("unroll") for (int r = 0; r < ROWS_PER_WARP; ++r) { \
        const int q = r < RLAST ? r : RLAST; \
        cw[r][0] = __ldg(cr + q * GROUPS * CWORDS); \
        if (CWORDS == 2) cw[r][CWORDS - 1] = __ldg(cr + q * GROUPS * CWORDS + 1); \
        if (BITS == 3) hw[r] = __ldg(hr + q * GROUPS); \
        sc[r] = tq_scales<GS>(sr + q * NSCALES, (g)); \
      } \
    }
""" + ROWS_RESET

ROWS_LOOP = r"""
  // one buffer's group g against x: per 16-code block b, x loaded once for all rows;
  // products summed in half2 over each 32-code half (one scale), then in fp32
  #define TQ_DECODE(cw, hw, sc, g) \
    _Pragma("unroll") for (int h = 0; h < 2; ++h) { \
      __half2 acc[ROWS_PER_WARP]; \
      _Pragma("unroll") for (int r = 0; r < ROWS_PER_WARP; ++r) acc[r] = __float2half2_rn(0.f); \
      _Pragma("unroll") for (int b = 2 * h; b < 2 * h + 2; ++b) { \
        const uint4 x0 = TQ_X(g, 2 * b), x1 = TQ_X(g, 2 * b + 1); \
        _Pragma("unroll") for (int r = 0; r < ROWS_PER_WARP; ++r) \
          acc[r] = tq_block16<BITS>(t, cw[r], hw[r], b, x0, x1, acc[r]); \
      } \
      _Pragma("unroll") for (int r = 0; r < ROWS_PER_WARP; ++r) \
        total[r] += (h ? sc[r].y : sc[r].x) * tq_hsum(acc[r]); \
    }
  for (int g = lane; g < GROUPS; g += 64) {
    if (g + 32 < GROUPS) TQ_FETCH(cwB, hwB, scB, g + 32);
    TQ_DECODE(cwA, hwA, scA, g);
    if (g + 32 >= GROUPS) break;
    if (g + 64 < GROUPS) TQ_FETCH(cwA, hwA, scA, g + 64);
    TQ_DECODE(cwB, hwB, scB, g + 32);
  }
  // every lane gets every row's sum, so a store may read the warp's other rows (total[r ^ 1])
  #pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) total[r] += __shfl_xor_sync(0xffffffffu, total[r], o);
  }
  #pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    float v = total[r];
    const int row = wrow + r;
    if (lane == 0 && row >= row0 && row < OUT) {
      if (HAS_BIAS) v += static_cast<float>(bias[row]);
      TQ_STORE
    }
  }
"""

ROWS = ROWS_SETUP + ROWS_LOOP

# Inputs: x (pairs' rows of the permuted, padded activations, fp16), codes planes, scales,
# levels, pair_expert (which expert a pair reads), pair_row (which x row).
_SOURCE = r"""
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int pair = blockIdx.y;
  const int row0 = warp * ROWS_PER_WARP;
  // a group of linears sharing one input: rows [END_{s-1}, END_s) are member s, which
  // reads x block s (its own rotation) and writes output s
  int seg = 0;
  if (SEGS > 1) seg += row0 >= END0;
  if (SEGS > 2) seg += row0 >= END1;
  const uint4* xr = reinterpret_cast<const uint4*>(
      x + ((size_t)seg * XROWS + pair_row[pair]) * PADDED);
  // one member: the block's row goes to shared memory first, read with coalesced loads
  // and swizzled as the fused kernel stores it (a lane's 128 contiguous bytes of x per
  // group would otherwise touch 32 cache lines per load instruction)
  extern __shared__ __align__(16) uint4 tq_xs[];
  if (SEGS == 1) {
    for (int i = threadIdx.x; i < PADDED / 8; i += blockDim.x)
      tq_xs[(i & ~7) | ((i & 7) ^ ((i >> 3) & 7))] = __ldg(xr + i);
    __syncthreads();
  }
  if (row0 >= OUT) return;
  uint32_t t[8];
  tq_tables(levels, 1 << BITS, t);
  const int expert = pair_expert[pair];
  #define TQ_X(g, i) (SEGS == 1 ? tq_xs[(g) * 8 + ((i) ^ ((g) & 7))] : __ldg(xr + (g) * 8 + (i)))
""" + ROWS


# Where a finished row goes: output s holds rows [END_{s-1}, END_s) of the group.
STORES = {
    1: "out0[(size_t)pair * OUT + row] = (OutT)v;",
    2: "if (seg == 0) out0[(size_t)pair * END0 + row] = (OutT)v;\n"
       "      else out1[(size_t)pair * (OUT - END0) + row - END0] = (OutT)v;",
    3: "if (seg == 0) out0[(size_t)pair * END0 + row] = (OutT)v;\n"
       "      else if (seg == 1) out1[(size_t)pair * (END1 - END0) + row - END0] = (OutT)v;\n"
       "      else out2[(size_t)pair * (OUT - END1) + row - END1] = (OutT)v;",
}


INPUTS = ["x", "codes", "hplane", "scales", "levels", "pair_expert", "pair_row", "bias"]


def kernel_source(segments: int) -> str:
    """The kernel's body for a group of `segments` members, its constants not yet defined
    (`launch` writes them in front)."""
    return _SOURCE.replace("TQ_STORE", STORES[segments])


_CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}


def constants_source(constants: list[tuple[str, object]]) -> str:
    """C++ for a launch's constants: what MLX would write for template arguments. They go
    into the source instead: MLX spends host time on every template argument of every call
    (`tools/launch_cost.py`)."""
    lines = []
    for name, value in constants:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {_CUDA_TYPES[value]};")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def _body(segments: int, constants: tuple) -> str:
    """The kernel's source with these constants, built once per launch shape (a caller
    that makes its launch on every call, as `gemv` does, reuses it)."""
    return constants_source(constants) + kernel_source(segments)


@functools.lru_cache(maxsize=None)
def _kernel(segments: int, shared: int, body: str):
    # the source's hash in the name: MLX caches built kernels on disk by name
    tag = hashlib.sha256((HEADER + body).encode()).hexdigest()[:12]
    return compiled.cuda_kernel(
        name=f"tq_gemv{segments}_{tag}",
        input_names=INPUTS,
        output_names=[f"out{s}" for s in range(segments)],
        source=body,
        header=HEADER,
        shared_memory=shared,
    )


def shared_bytes(segments: int, padded: int) -> int:
    """Dynamic shared memory of a block: a single matrix stages its fp16 row there."""
    return 2 * padded if segments == 1 else 0


def rows_per_warp_for(out_features: int) -> int:
    """Most rows per warp (4, 2, 1) that still gives the GPU `WARPS_WANTED` warps. More
    rows per warp read x fewer times (H200, `tools/cuda_lab.py`: 28672x8192 3-bit
    47 us at 4 rows, 73 us at 2; 4096x4096 7.1 us at 4, 8.1 at 2)."""
    for rpw in (ROWS_PER_WARP, 2):
        if out_features // rpw >= WARPS_WANTED:
            return rpw
    return 1


def x_permutation(bits: int, padded: int) -> np.ndarray:
    """Column order in which the kernel consumes activations for this width."""
    idx = np.arange(padded)
    if bits == 4:
        return idx
    blocks = idx.reshape(-1, 16)
    return np.concatenate([blocks[:, 0::2], blocks[:, 1::2]], axis=1).reshape(-1)


def _pad_codes(codes: mx.array, padded: int) -> mx.array:
    """uint8 codes (rows, n) -> (rows, padded), padding with code 0."""
    n = codes.shape[-1]
    if n == padded:
        return codes
    pad = mx.zeros((*codes.shape[:-1], padded - n), dtype=codes.dtype)
    return mx.concatenate([codes, pad], axis=-1)


def _pack_fields(fields: mx.array, width: int) -> mx.array:
    """Pack (rows, m, 32 // width) small unsigned fields into uint32 words, field j at width*j."""
    shifts = mx.arange(fields.shape[-1], dtype=mx.uint32) * width
    return mx.sum(fields.astype(mx.uint32) << shifts, axis=-1).astype(mx.uint32)


def repack(codes_u8: mx.array, bits: int, padded: int) -> tuple[mx.array, mx.array]:
    """Unpacked codes (rows, n) -> (code plane, 1-bit plane) in the kernel's layout.

    2 and 4 bits: the stored layout (nibble-aligned), 1-bit plane unused.
    3 bits: low two bits in the 2-bit layout; high bits so that for 16-code block b of a
    32-code word, nibble k holds [b1 even, b1 odd, b0 even, b0 odd] high bits of code pair k.
    """
    c = _pad_codes(codes_u8, padded)
    rows = c.shape[0]
    # place the code of activation j where the kernel multiplies activation j
    c = c[:, mx.array(np.argsort(x_permutation(bits, padded)))]
    if bits in (2, 4):
        per = 32 // bits
        return _pack_fields(c.reshape(rows, -1, per), bits), mx.zeros((1,), mx.uint32)
    low = _pack_fields((c & 3).reshape(rows, -1, 16), 2)
    high = (c >> 2).reshape(rows, -1, 2, 8, 2)  # word, block b, pair k, even/odd
    # bit position inside nibble k: block 0 even -> 2, odd -> 3; block 1 even -> 0, odd -> 1
    pos = mx.array([[2, 3], [0, 1]], dtype=mx.uint32).reshape(1, 1, 2, 1, 2)
    k = mx.arange(8, dtype=mx.uint32).reshape(1, 1, 1, 8, 1)
    bitpos = 4 * k + pos
    hplane = mx.sum(high.astype(mx.uint32) << bitpos, axis=(2, 3, 4)).astype(mx.uint32)
    return low, hplane


@dataclass(frozen=True)
class Launch:
    """Everything of one GEMV launch but its arrays: built once, called per token. `body`
    is its kernel's source, specialised with the values in `constants`."""

    kernel: object
    body: str
    constants: list
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shapes: tuple[tuple[int, int], ...]
    dtypes: tuple
    single: bool  # one output array, not a list

    def __call__(self, x_perm, codes, hplane, scales, levels, pair_expert, pair_row, bias):
        outs = self.kernel(
            inputs=[x_perm, codes, hplane, scales, levels, pair_expert, pair_row, bias],
            grid=self.grid, threadgroup=self.threads,
            output_shapes=self.shapes, output_dtypes=self.dtypes,
        )
        return outs[0] if self.single else outs

    def bound(self):
        """f(inputs=[...]) -> the list of outputs: the kernel with this launch's grid, block
        and outputs bound, for a caller that launches it every token (a partial: no Python
        frame of its own)."""
        return functools.partial(self.kernel, grid=self.grid, threadgroup=self.threads,
                                 output_shapes=self.shapes, output_dtypes=self.dtypes)


def launch(
    *,
    bits: int,
    group_size: int,
    out_features: int,
    padded: int,
    nscales: int,
    pairs: int,
    out_dtype=mx.float16,
    rows_per_warp: int | None = None,
    ends: tuple[int, ...] = (),
    x_rows: int = 0,
    add_bias: bool = False,
) -> Launch:
    """The launch `gemv` makes, for callers that keep it (see `gemv` for the arguments;
    `x_rows` is the number of rows in each member's block of a group's x)."""
    segments = len(ends) or 1
    rows_per_warp = rows_per_warp or rows_per_warp_for(out_features)
    if segments > len(STORES):
        raise ValueError(f"at most {len(STORES)} members in a group, got {segments}")
    bounds = list(ends[:-1]) + [out_features] * 2
    if any(b % rows_per_warp for b in bounds[: segments - 1]):
        raise ValueError(f"group boundaries {ends} must be multiples of {rows_per_warp}")
    widths = [e - b for b, e in zip([0, *ends[:-1]], ends)] if ends else [out_features]
    warps = -(-out_features // rows_per_warp)
    threads = 32 * WARPS_PER_BLOCK
    grid_x = -(-warps * 32 // threads) * threads
    constants = (
        ("BITS", bits),
        ("GS", group_size),
        ("OUT", out_features),
        ("PADDED", padded),
        ("NSCALES", nscales),
        ("ROWS_PER_WARP", rows_per_warp),
        ("SEGS", segments),
        ("END0", bounds[0]),
        ("END1", bounds[1]),
        ("XROWS", x_rows),
        ("HAS_BIAS", bool(add_bias)),
        ("OutT", out_dtype),
    )
    body = _body(segments, constants)
    return Launch(_kernel(segments, shared_bytes(segments, padded), body), body, list(constants),
                  (grid_x, pairs, 1), (threads, 1, 1), [(pairs, w) for w in widths],
                  [out_dtype] * segments, not ends)


def gemv(
    x_perm: mx.array,
    codes: mx.array,
    hplane: mx.array,
    scales: mx.array,
    levels: mx.array,
    pair_expert: mx.array,
    pair_row: mx.array,
    *,
    bits: int,
    group_size: int,
    out_features: int,
    out_dtype=mx.float16,
    rows_per_warp: int | None = None,
    ends: tuple[int, ...] = (),
    bias: mx.array | None = None,
) -> mx.array | list[mx.array]:
    """(pairs, out_features): for each pair p, W[pair_expert[p]] @ x[pair_row[p]].

    x_perm: (rows_x, padded) float16, rotated and zero-padded, in natural order (`repack`
    already placed each code where the kernel meets its activation).
    codes/hplane: from `repack`; scales: (E*out, padded // group_size) float16, padded.

    `rows_per_warp`: `rows_per_warp_for(out_features)` unless given.

    A group (`ends` given): the rows are the members' weights stacked, member s owning
    rows [ends[s-1], ends[s]) (`ends[-1] == out_features`, every boundary a multiple of
    `rows_per_warp`), x_perm is (members, rows_x, padded), one rotation per member, and
    the result is one array per member. `bias` (out_features,) is added before the store.
    """
    run = launch(
        bits=bits, group_size=group_size, out_features=out_features, padded=x_perm.shape[-1],
        nscales=scales.shape[-1], pairs=pair_expert.shape[0], out_dtype=out_dtype,
        rows_per_warp=rows_per_warp, ends=ends,
        x_rows=x_perm.shape[-2] if x_perm.ndim == 3 else 0, add_bias=bias is not None,
    )
    return run(x_perm, codes, hplane, scales, levels, pair_expert, pair_row,
               bias if bias is not None else _no_bias())


@functools.lru_cache(maxsize=None)
def _no_bias() -> mx.array:
    return cuda_memory.device_constant(mx.zeros((1,), dtype=mx.float32))

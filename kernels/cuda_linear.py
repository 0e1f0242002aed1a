"""One CUDA launch per TurboQuant linear (or group sharing an input): rotate, then GEMV.

Each block rotates its token's activation row with its member's seed into shared memory
(`cuda_rotate.ROTATE_ROW`: signs, Hadamard stages, segment mix, fp16), then its warps run
the GEMV rows of `cuda_gemv.ROWS` against that row, one tile of rows after another (up to
`tiles_for` tiles, so big matrices rotate once per 128 rows). Each warp fetches its first
weights before the rotation starts, so the rotation hides their latency. Every block
repeats the rotation of one row, and in exchange a decode step pays one kernel call per
group instead of two: on MLX's CUDA backend each call costs the host several microseconds
to build and to encode (`tools/launch_cost.py`), and decode is bound by that host
time.

A block's rows lie in one member (the member boundaries are multiples of the rows a block
runs), so a block rotates with one seed. The fp16 row is stored swizzled in 16-byte units
(unit i of 64-code group g at g * 8 + (i ^ (g & 7))), so the eight lanes of a shared-memory
phase read eight different bank quads.

A launch can also do a decoder layer's work around the product (`group.Extras`): RMSNorm
the row as it loads it (a block-wide sum of squares first), gate it (silu(gate) * up, for
down_proj), and add a residual to the value it stores, so a layer's norms, SwiGLU and
residual adds cost no launches of their own. The launch's constants (sizes, bits, dtypes,
flags) are written into the source rather than passed as template arguments: MLX spends
host time on every template argument of every call.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import mlx.core as mx

from . import compiled, cuda_gemv, cuda_rotate

WARPS_PER_BLOCK = 8
THREADS = 32 * WARPS_PER_BLOCK

_HEADER = cuda_gemv.HEADER + cuda_rotate.HEADER + r"""
// Position of activation i of the padded row in the swizzled fp16 buffer.
__device__ __forceinline__ int tq_swizzle(int i) {
  const int unit = i >> 3, g = unit >> 3;
  return (((g << 3) | ((unit & 7) ^ (g & 7))) << 3) | (i & 7);
}

__device__ __forceinline__ float tq_swiglu(float gate, float up) {
  return gate / (1.f + __expf(-gate)) * up;
}
"""

# How a block loads its row: TQ_LOAD(i), defined after whatever it needs.
_LOAD = {
    "plain": "#define TQ_LOAD(i) static_cast<float>(xr[i])",
    # the sum of squares over the block (in buf, before the rotation fills it), then
    # x * rsqrt(mean + eps) * w; nw holds the weight and then eps, float32
    "norm": r"""float ss = 0.f;
    for (int i = t; i < N; i += THREADS) { const float v = static_cast<float>(xr[i]); ss += v * v; }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((t & 31) == 0) buf[t >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) ss += buf[w];
    __syncthreads();
    const float rinv = rsqrtf(ss / N + nw[N]);
    #define TQ_LOAD(i) (static_cast<float>(xr[i]) * rinv * nw[i])""",
    "gate": r"""const InT* ur = up + (size_t)pair * N;
    #define TQ_LOAD(i) tq_swiglu(static_cast<float>(xr[i]), static_cast<float>(ur[i]))""",
}
_RESIDUAL = "v += static_cast<float>(res[(size_t)pair * OUT + row]);\n      "

# A q/k/v group with its first two members' rows in RoPE pairs (`cuda.pair_order`): the
# stacked row 2i + h of a head of PAIRS rows is that head's row i + h * PAIRS / 2, so
# both rows of a pair are one warp's (an even number of rows a warp, from an even row).
# Each is stored at its own row; TQ_ROPE may rotate it first.
_PAIRED_STORE = r"""if (PAIRS && seg < 2) {
        const int local = row - (seg ? END0 : 0), j = local % PAIRS;
        const int dst = local - j + (j >> 1) + (j & 1) * (PAIRS / 2);
        TQ_ROPE
        if (seg == 0) out0[(size_t)pair * END0 + dst] = (OutT)v;
        else out1[(size_t)pair * (END1 - END0) + dst] = (OutT)v;
      } else {
        TQ_STORE
      }"""

# RoPE (non-traditional) of the pair (i, i + PAIRS / 2) at position rope_pos[0]: the angle
# rope_pos * rope_inv[i], taken to [-pi, pi] in two steps (exact enough for any position)
# before the fast sine and cosine; x_i' = x_i cos - x_{i+P/2} sin, x_{i+P/2}' = x_{i+P/2} cos
# + x_i sin, the partner being the warp's other row of the pair.
_ROPE = r"""{
          float partner = total[r ^ 1];
          if (HAS_BIAS) partner += static_cast<float>(bias[row ^ 1]);
          const float theta = static_cast<float>(rope_pos[0]) * rope_inv[j >> 1];
          const float turns = rintf(theta * 0.15915494309189535f);
          const float angle = fmaf(-turns, -1.7484555e-7f, fmaf(-turns, 6.28318548f, theta));
          float sn, cs;
          __sincosf(angle, &sn, &cs);
          v = v * cs + ((j & 1) ? partner : -partner) * sn;
        }"""

# Inputs: x (tokens, N) in any float dtype, signs (S, N), mix (S, A, A), code planes,
# scales (OUT, PADDED / GS), levels, bias (OUT,) float32 (unread without HAS_BIAS).
_SOURCE = r"""
  constexpr int P = N / A;
  constexpr int OUTW = PADDED;
  constexpr int THREADS = 32 * WARPS;
  constexpr int NSCALES = PADDED / GS;
  constexpr int NB = (N + 3) & ~3;  // keeps the fp16 row 16-byte aligned
  extern __shared__ __align__(16) float tq_shared[];
  const int block_row0 = blockIdx.x * TILES * WARPS * ROWS_PER_WARP;
  if (block_row0 >= OUT) return;
  const int pair = blockIdx.y;
  const int expert = TQ_EXPERT;
  // member seg owns rows [END_{seg-1}, END_seg): its seed rotates the row, its output stores
  int seg = 0;
  if (SEGS > 1) seg += block_row0 >= END0;
  if (SEGS > 2) seg += block_row0 >= END1;
  __half* xs = reinterpret_cast<__half*>(tq_shared + NB);
  const int lane = threadIdx.x & 31;
  int row0 = block_row0 + (threadIdx.x >> 5) * ROWS_PER_WARP;
  uint32_t t[8];
  tq_tables(levels, 1 << BITS, t);
""" + cuda_gemv.ROWS_SETUP + r"""
  {  // the weights of the first group are on their way while the block rotates its row
    float* buf = tq_shared;
    const int t = threadIdx.x;
    const InT* xr = x + (size_t)TQ_XROW * N;
    const float* sg = signs + (size_t)seg * N;
    const float* mix_s = mix + (size_t)seg * A * A;
    TQ_LOAD_ROW
    #define TQ_PUT(i, v) xs[tq_swizzle(i)] = __float2half_rn(v)
    TQ_ROTATE_ROW
    #undef TQ_LOAD
    #undef TQ_PUT
  }
  __syncthreads();
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  #define TQ_X(g, i) xs4[(g) * 8 + ((i) ^ ((g) & 7))]
  // the block's TILES tiles of WARPS * ROWS_PER_WARP rows, one rotation for all of them
  for (int tile = 0; row0 < OUT;) {
""" + cuda_gemv.ROWS_LOOP + r"""
    if (++tile == TILES) break;
    row0 += WARPS * ROWS_PER_WARP;
    if (row0 >= OUT) break;
""" + cuda_gemv.ROWS_RESET + r"""
  }
"""


def shared_bytes(n: int, padded: int) -> int:
    """Dynamic shared memory of a block: the float row and the fp16 padded row."""
    return 4 * ((n + 3) // 4 * 4) + 2 * padded


WEIGHTS = ["signs", "mix", "codes", "hplane", "scales", "levels", "bias"]


GATHER = ["pair_expert", "pair_row"]

PLAIN = (False, False, False, False)


def inputs(mode: tuple[bool, bool, bool, bool] = PLAIN, gather: bool = False) -> list[str]:
    """The kernel's inputs for `group.Extras.mode` (norm, gate, residual, rope): the row x,
    the up row (gate), the norm weight + eps (norm), the residual, RoPE's position (int32)
    and inverse frequencies (float32), then the weights; `gather` (experts): then each
    output row's expert and x row."""
    norm, gate, residual, rope = mode
    return ["x", *(["up"] if gate else []), *(["nw"] if norm else []),
            *(["res"] if residual else []), *(["rope_pos", "rope_inv"] if rope else []),
            *WEIGHTS, *(GATHER if gather else [])]


def source(segments: int, mode: tuple[bool, bool, bool, bool] = PLAIN,
           gather: bool = False, a: int = 1, pairs: bool = False) -> tuple[str, str]:
    """(header, body) of the kernel for a group of `segments` members doing `mode`'s
    extras, its constants not yet defined (`launch` writes them in front). `gather`: the
    experts of a switch layer, stacked by rows, output row p reading expert
    pair_expert[p]'s rows against x row pair_row[p]. `a`: the rotation's segments
    (`cuda_rotate.rotate_row`). `pairs`: the first two members' rows are in RoPE pairs
    (`_PAIRED_STORE`), which mode's rope rotates."""
    norm, gate, residual, rope = mode
    load = _LOAD["norm" if norm else "gate" if gate else "plain"]
    store = (_RESIDUAL if residual else "") + cuda_gemv.STORES[segments]
    if pairs:
        store = (_PAIRED_STORE.replace("TQ_ROPE", _ROPE if rope else "")
                 .replace("TQ_STORE", store))
    return _HEADER, (_SOURCE.replace("TQ_LOAD_ROW", load)
                     .replace("TQ_ROTATE_ROW", cuda_rotate.rotate_row(a))
                     .replace("TQ_STORE", store)
                     .replace("TQ_EXPERT", "pair_expert[pair]" if gather else "0")
                     .replace("TQ_XROW", "pair_row[pair]" if gather else "pair"))


@functools.lru_cache(maxsize=None)
def _kernel(segments: int, shared: int, mode: tuple[bool, bool, bool, bool], body: str,
            gather: bool = False):
    # the source's hash in the name: MLX caches built kernels on disk by name
    tag = hashlib.sha256((_HEADER + body).encode()).hexdigest()[:12]
    return compiled.cuda_kernel(
        name=f"tq_linear{segments}_{tag}",
        input_names=inputs(mode, gather),
        output_names=[f"out{s}" for s in range(segments)],
        source=body,
        header=_HEADER,
        shared_memory=shared,
    )


def rows_per_warp_for(ends: tuple[int, ...]) -> int:
    """`cuda_gemv.rows_per_warp_for` the stacked rows, lowered until every member boundary
    falls between blocks (1 always does: members are multiples of 8 rows, `group.fusable`)."""
    rpw = cuda_gemv.rows_per_warp_for(ends[-1])
    while rpw > 1 and any(e % (WARPS_PER_BLOCK * rpw) for e in ends[:-1]):
        rpw //= 2
    return rpw


BLOCKS_WANTED = 200  # about 1.5 blocks per SM of an H100/H200


def tiles_for(ends: tuple[int, ...], rows_per_warp: int) -> int:
    """Tiles per block (4, 2, 1): the most that still leave `BLOCKS_WANTED` blocks with
    member boundaries between blocks. A block rotates its row once for all its tiles (H200,
    `tools/cuda_lab.py`: 28672x8192 3-bit 54 us at 4 tiles, 62 at 2, 69 at 1)."""
    tile_rows = WARPS_PER_BLOCK * rows_per_warp
    for tiles in (4, 2):
        if (ends[-1] // (tile_rows * tiles) >= BLOCKS_WANTED
                and not any(e % (tile_rows * tiles) for e in ends[:-1])):
            return tiles
    return 1


def pairable(ends: tuple[int, ...], head: int, rows_per_warp: int) -> bool:
    """Whether the first two members' rows can be stored in RoPE pairs of heads of `head`
    rows: whole even heads, and a warp's rows (from an even row) holding whole pairs."""
    widths = (ends[0], ends[1] - ends[0]) if len(ends) > 1 else ()
    return (len(widths) == 2 and head > 0 and head % 2 == 0 and rows_per_warp % 2 == 0
            and all(w % head == 0 for w in widths))


def fits(n: int, padded: int, a: int) -> bool:
    """Whether one block holds the row (the mix keeps A values per thread in registers)."""
    return (shared_bytes(n, padded) <= cuda_rotate.MAX_SHARED_BYTES
            and a <= cuda_rotate.MAX_FACTOR)


@dataclass(frozen=True)
class Launch:
    """One fused launch of a group for a given input shape: built once, called per token.
    `body` is its kernel's source, specialised with the values in `constants`."""

    kernel: object
    body: str
    constants: list
    grid: tuple[int, int, int]
    shapes: list
    dtypes: list

    def __call__(self, *arrays: mx.array) -> list[mx.array]:
        """arrays: in the order of `inputs(mode)`."""
        return self.kernel(
            inputs=list(arrays), grid=self.grid, threadgroup=(THREADS, 1, 1),
            output_shapes=self.shapes, output_dtypes=self.dtypes,
        )

    def bound(self):
        """f(inputs=[...]): the kernel with this launch's grid, block and outputs bound, for
        a caller that launches it every token (a partial: no Python frame of its own)."""
        return functools.partial(self.kernel, grid=self.grid, threadgroup=(THREADS, 1, 1),
                                 output_shapes=self.shapes, output_dtypes=self.dtypes)


def launch(*, n: int, a: int, padded: int, bits: int, group_size: int, ends: tuple[int, ...],
           lead: tuple[int, ...], in_dtype, out_dtype, add_bias: bool,
           mode: tuple[bool, bool, bool, bool] = PLAIN,
           rows_per_warp: int | None = None, tiles: int | None = None,
           gather: bool = False, pairs: int = 0) -> Launch:
    """The launch for members with stacked row ends `ends` on inputs of leading shape
    `lead` (tokens = its product) and last axis n, rotated as A segments of n / A, doing
    the extras of `mode` (`group.Extras.mode`). A block runs `tiles` tiles of
    WARPS_PER_BLOCK * rows_per_warp rows after one rotation (`rows_per_warp_for` and
    `tiles_for` unless given); member boundaries must fall between blocks. `gather`: a
    switch layer's experts (one member, no extras, lead = its (pair, row) count), inputs
    then `GATHER`. `pairs`: the head size of the first two members' rows, stored in RoPE
    pairs (`_PAIRED_STORE`; 0: in their order), which mode's rope rotates."""
    if mode[2] and len(ends) > 1:
        raise ValueError("a residual is added to the output of a single member")
    if mode[3] and not pairs:
        raise ValueError("RoPE needs a group's first two members' rows in pairs")
    if len(ends) > len(cuda_gemv.STORES):
        raise ValueError(f"at most {len(cuda_gemv.STORES)} members in a group, got {len(ends)}")
    if n % a or padded % 64 or padded < n:
        raise ValueError(f"bad rotation/padding: n={n}, A={a}, padded={padded}")
    rpw = rows_per_warp or rows_per_warp_for(ends)
    tiles = tiles or tiles_for(ends, rpw)
    out = ends[-1]
    bounds = list(ends[:-1]) + [out] * 2
    block_rows = WARPS_PER_BLOCK * rpw * tiles
    if any(e % block_rows for e in ends[:-1]):
        raise ValueError(f"member ends {ends} must be multiples of a block's {block_rows} rows")
    if pairs and not pairable(ends, pairs, rpw):
        raise ValueError(f"rows {ends} cannot be stored in RoPE pairs of heads of {pairs} "
                         f"rows at {rpw} rows a warp")
    constants = [
        ("InT", in_dtype), ("OutT", out_dtype), ("N", n), ("A", a), ("PADDED", padded),
        ("BITS", bits), ("GS", group_size), ("OUT", out), ("ROWS_PER_WARP", rpw),
        ("WARPS", WARPS_PER_BLOCK), ("TILES", tiles), ("SEGS", len(ends)), ("END0", bounds[0]),
        ("END1", bounds[1]), ("HAS_BIAS", bool(add_bias)), ("PAIRS", pairs),
    ]
    widths = [e - b for b, e in zip([0, *ends[:-1]], ends)]
    if gather and (len(ends) > 1 or any(mode)):
        raise ValueError("gathered experts are one member without extras")
    body = (cuda_gemv.constants_source(constants)
            + source(len(ends), mode, gather, a, pairs=bool(pairs))[1])
    return Launch(
        kernel=_kernel(len(ends), shared_bytes(n, padded), tuple(mode), body, gather),
        body=body,
        constants=constants,
        grid=(-(-out // block_rows) * THREADS, math.prod(lead), 1),
        shapes=[(*lead, w) for w in widths],
        dtypes=[out_dtype] * len(ends),
    )

"""CUDA kernels for trellis-coded weights (docs/FORMAT.md, "Trellis code"): the decode GEMV
and prefill's tile decode, through `mx.fast.cuda_kernel`.

A weight's value is computed, not looked up: its state is the L-bit window of its block's
bit stream that ends with its step's bits, then `h = S * MUL + ADD; h ^= h >> 16` and the
sum of h's four bytes, centred and divided by BYTESUM_STD (`stages.trellis`). A lane works
on a chunk of 32 consecutive weights of a row: its k words plus the word before them (the
block's last word for a block's first chunk: the stream is a circle), so every state of the
chunk lies in two registers at a shift known when the kernel is compiled (the loop over the
32 weights is unrolled): a funnel shift, a mask, a multiply-add, a shift-xor (version 1;
`TrellisCode.version` 2 has none) and one dp4a a
weight (its accumulator the bits of the float 2^23, so the sum comes out as the float
2^23 + s), a subtraction of 2^23 + 510 (exact) and a multiply-add with the activation. A
chunk never straddles a group (groups are multiples of 32), so its sum is scaled once;
1 / BYTESUM_STD is applied to the row's total.

- `matvec` (decode, a few tokens): x_rot (tokens, padded_in), already rotated and padded, as
  the reference's "matvec" takes it. A block stages its token's row in shared memory (float32,
  16-byte units swizzled so the eight lanes of a shared-memory phase read eight different
  bank quads), then each warp runs `rows_per_warp` rows at a time, the lanes over the chunks;
  a block per tile (the GPU balances them), striding over tiles beyond 16 blocks an SM.
- `dequantize` (prefill): rows of rotated weights `scale * v` in bf16/fp16/float32, a chunk a
  thread, for `tiles.tiled_matmul` and MLX's GEMM (`matmul`). In float32 it equals
  `stages.trellis.decode_rows` bit for bit (the division is correctly rounded, as numpy's).
- `linear`: x (tokens, in_features) rotated by `cuda_rotate` (the scalar path's rotation
  kernel and plan), then `matvec` (up to `dispatch.MATVEC_MAX_TOKENS` tokens) or `matmul`.

Nothing here changes with the scalar kernels: a trellis tensor is a separate launch.
"""

from __future__ import annotations

import functools
import hashlib

import mlx.core as mx
import numpy as np

from turboquant.stages import trellis
from turboquant.stages.rotate import rotate as rotate_rows
from turboquant.stages.trellis import TrellisCode

from . import compiled, cuda_memory, cuda_rotate, tiles
from .cuda_gemv import constants_source

WARPS = 8
THREADS = 32 * WARPS
MAX_SHARED_BYTES = cuda_rotate.MAX_SHARED_BYTES  # the staged float32 row
BLOCKS_PER_SM = 16  # beyond this many GEMV blocks an SM, blocks stride over the row tiles
MATVEC_MAX_TOKENS = 8  # above this many tokens `linear` decodes tiles for MLX's GEMM


def _float(v: float) -> str:
    """A float32 constant as C++ source that parses to exactly that float32."""
    return f"{float(np.float32(v)):.9g}f"


HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The sum of a word's four bytes (dp4a on the GPU).
__device__ __forceinline__ uint32_t tq_bytesum(uint32_t h) {
#ifdef __CUDA_ARCH__
  return __dp4a(h, 0x01010101u, 0u);
#else
  return (h & 0xffu) + ((h >> 8) & 0xffu) + ((h >> 16) & 0xffu) + (h >> 24);
#endif
}

// A correctly rounded float division (the tile decode's, as numpy's).
__device__ __forceinline__ float tq_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The byte sum of state s's value j (0 or 1): multiply-add, shift-xor (trellis version 1;
// version 2 has none), byte sum.
template <int VER>
__device__ __forceinline__ uint32_t tq_trellis_sum(uint32_t s, int j) {
  uint32_t h = j ? s * TQ_MUL1 + TQ_ADD1 : s * TQ_MUL0 + TQ_ADD0;
  if (VER == 1) h ^= h >> 16;
  return tq_bytesum(h);
}

// The byte sum of state s's value j minus 510, as a float, exactly: dp4a adds the bytes to
// the bits of the float 2^23, which are then the bits of 2^23 + sum (sum < 2^23).
template <int VER>
__device__ __forceinline__ float tq_trellis_centred(uint32_t s, int j) {
  uint32_t h = j ? s * TQ_MUL1 + TQ_ADD1 : s * TQ_MUL0 + TQ_ADD0;
  if (VER == 1) h ^= h >> 16;
#ifdef __CUDA_ARCH__
  const uint32_t bits = __dp4a(h, 0x01010101u, 0x4B000000u);
#else
  const uint32_t bits = 0x4B000000u + tq_bytesum(h);
#endif
  return __uint_as_float(bits) - 8389118.0f;
}

// The words of chunk `chunk` (weights 32 chunk .. 32 chunk + 31 of a row of N weights cut
// into blocks of B): c[0] the word before them in the block's circle, c[1..K] theirs.
template <int K, int B, int N>
__device__ __forceinline__ void tq_trellis_words(const uint32_t* row, int chunk,
                                                 uint32_t c[K + 1]) {
  const int col = chunk * 32;
  const int b0 = col / B * B;
  const int size = (N - b0) < B ? (N - b0) : B;
  const int w = chunk * K;
  c[0] = row[col == b0 ? (b0 * K / 32) + size * K / 32 - 1 : w - 1];
  #pragma unroll
  for (int i = 0; i < K; ++i) c[i + 1] = row[w + i];
}

// The state of weight j (0..31) of a chunk from its words: the L bits that end with its
// step's bits, `32 + (j / V + 1) K V` bits into c.
template <int K, int L, int V>
__device__ __forceinline__ uint32_t tq_trellis_state(const uint32_t c[K + 1], int j) {
  const int start = 32 + (j / V + 1) * K * V - L;
  const int w = start >> 5, sh = start & 31;
  uint32_t s = c[w] >> sh;
  if (sh + L > 32) s |= c[w + 1] << (32 - sh);
  return s & ((1u << L) - 1u);
}
"""


def header() -> str:
    """HEADER with the computed codebook's constants (`stages.trellis.MUL`, `ADD`)."""
    defs = "".join(f"#define TQ_{name}{j} {int(v)}u\n"
                   for name, values in (("MUL", trellis.MUL), ("ADD", trellis.ADD))
                   for j, v in enumerate(values))
    return HEADER.replace("#include <cuda_bf16.h>\n", "#include <cuda_bf16.h>\n" + defs, 1)


# Inputs: x (tokens, PADDED) in any float dtype, rotated and padded; codes (OUT, WORDS)
# uint32; scales (OUT, PADDED / GS) float16. Output (tokens, OUT).
_GEMV = r"""
  constexpr int CHUNKS = PADDED / 32;
  constexpr int NSCALES = PADDED / GS;
  constexpr int TILE = WARPS * ROWS;
  const int OUT = codes_shape[0];  // read, not compiled in: one kernel serves every height
  extern __shared__ __align__(16) float xs[];
  const int token = blockIdx.y;
  const InT* xr = x + (size_t)token * PADDED;
  // float4 unit u of chunk c at c * 8 + (u ^ (c & 7))
  for (int i = threadIdx.x; i < PADDED; i += WARPS * 32) {
    const int c = i >> 5, u = (i >> 2) & 7;
    xs[(c << 5) | ((u ^ (c & 7)) << 2) | (i & 3)] = static_cast<float>(xr[i]);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  for (int tile = blockIdx.x; tile * TILE < OUT; tile += gridDim.x) {
    const int row0 = tile * TILE + warp * ROWS;
    if (row0 >= OUT) break;  // the warp's own exit: no block-wide sync follows
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    for (int chunk = lane; chunk < CHUNKS; chunk += 32) {
      float xv[32];
      #pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float4 f = x4[chunk * 8 + (u ^ (chunk & 7))];
        xv[4 * u] = f.x;
        xv[4 * u + 1] = f.y;
        xv[4 * u + 2] = f.z;
        xv[4 * u + 3] = f.w;
      }
      const int g = chunk * 32 / GS;
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + r < OUT ? row0 + r : OUT - 1;  // a clamped row is not stored
        uint32_t c[BITS + 1];
        tq_trellis_words<BITS, BLOCK, PADDED>(codes + (size_t)row * WORDS, chunk, c);
        float p0 = 0.f, p1 = 0.f;
        #pragma unroll
        for (int j = 0; j < 32; j += 2) {
          const uint32_t s0 = tq_trellis_state<BITS, STATE, VALUES>(c, j);
          const uint32_t s1 = tq_trellis_state<BITS, STATE, VALUES>(c, j + 1);
          p0 += tq_trellis_centred<VERSION>(s0, j % VALUES) * xv[j];
          p1 += tq_trellis_centred<VERSION>(s1, (j + 1) % VALUES) * xv[j + 1];
        }
        acc[r] += (p0 + p1) * __half2float(scales[(size_t)row * NSCALES + g]);
      }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = acc[r];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && row0 + r < OUT) out[(size_t)token * OUT + row0 + r] = (OutT)(v * INV_STD);
    }
  }
"""

# Inputs: codes (rows, WORDS) uint32, scales (rows, PADDED / GS) float16; output (rows,
# PADDED): scale * (sum - 510) / BYTESUM_STD, a chunk of 32 weights a thread.
_DECODE = r"""
  constexpr int CHUNKS = PADDED / 32;
  constexpr int NSCALES = PADDED / GS;
  const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (size_t)codes_shape[0] * CHUNKS) return;
  const int row = (int)(t / CHUNKS), chunk = (int)(t % CHUNKS);
  uint32_t c[BITS + 1];
  tq_trellis_words<BITS, BLOCK, PADDED>(codes + (size_t)row * WORDS, chunk, c);
  const float s = __half2float(scales[(size_t)row * NSCALES + chunk * 32 / GS]);
  alignas(16) OutT v[32];
  #pragma unroll
  for (int j = 0; j < 32; ++j) {
    const uint32_t st = tq_trellis_state<BITS, STATE, VALUES>(c, j);
    const float centred = static_cast<float>((int)tq_trellis_sum<VERSION>(st, j % VALUES) - 510);
    v[j] = (OutT)(tq_div_rn(centred, STD) * s);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + (size_t)row * PADDED + chunk * 32);
  const uint4* src = reinterpret_cast<const uint4*>(v);
  #pragma unroll
  for (int i = 0; i < (int)(sizeof(v) / 16); ++i) dst[i] = src[i];
"""


def check(code: TrellisCode, block: int, group_size: int, padded_in: int) -> None:
    """The layouts the kernels run: whole chunks of 32 weights in one block and one group."""
    code.check_block(block)
    if padded_in % 32 or padded_in % group_size or group_size % 32:
        raise ValueError(f"padded_in {padded_in} and group_size {group_size}: both must be "
                         "multiples of 32 and padded_in of group_size")


def code_constants(code: TrellisCode, block: int, group_size: int, padded_in: int) -> list:
    """The constants a trellis kernel's source is specialised with."""
    check(code, block, group_size, padded_in)
    return [("BITS", code.bits), ("STATE", code.state_bits), ("VALUES", code.values),
            ("VERSION", code.version), ("BLOCK", block), ("GS", group_size), ("PADDED", padded_in),
            ("WORDS", padded_in * code.bits // 32)]


def _with_floats(body: str) -> str:
    return (f"  constexpr float STD = {_float(trellis.BYTESUM_STD)};\n"
            f"  constexpr float INV_STD = {_float(1.0 / trellis.BYTESUM_STD)};\n" + body)


@functools.lru_cache(maxsize=None)
def _kernel(kind: str, body: str, shared: int):
    head = header()
    tag = hashlib.sha256((head + body).encode()).hexdigest()[:12]
    inputs = ["x", "codes", "scales"] if kind == "gemv" else ["codes", "scales"]
    return compiled.cuda_kernel(name=f"tq_trellis_{kind}_{tag}", input_names=inputs,
                                output_names=["out"], source=body, header=head,
                                shared_memory=shared)


WARPS_WANTED = 4096  # ~32 warps on each of an H200's 132 SMs


def rows_per_warp_for(out_features: int) -> int:
    """Rows a warp runs at once (4, 2, 1): the most that still leaves WARPS_WANTED warps.
    The decode is bound by its instructions (~8 a weight), not by x's shared-memory reads
    that more rows a warp share, so warps to hide latency come first."""
    for rows in (4, 2):
        if out_features // rows >= WARPS_WANTED:
            return rows
    return 1


def gemv_source(code: TrellisCode, block: int, group_size: int, padded_in: int,
                out_features: int, in_dtype, out_dtype, rows: int | None = None) -> str:
    """The GEMV's body with its constants (also what the nvcc checks compile); the height
    only picks the rows a warp runs (the kernel reads it from the codes' shape)."""
    rows = rows or rows_per_warp_for(out_features)
    constants = code_constants(code, block, group_size, padded_in) + [
        ("ROWS", rows), ("WARPS", WARPS), ("InT", in_dtype), ("OutT", out_dtype)]
    return constants_source(constants) + _with_floats(_GEMV)


def decode_source(code: TrellisCode, block: int, group_size: int, padded_in: int,
                  out_dtype) -> str:
    """The tile decode's body with its constants (rows are read from the codes' shape)."""
    constants = code_constants(code, block, group_size, padded_in) + [("OutT", out_dtype)]
    return constants_source(constants) + _with_floats(_DECODE)


def _blocks(tiles_needed: int) -> int:
    sms = cuda_memory.sm_count() or 132
    return max(1, min(tiles_needed, BLOCKS_PER_SM * sms))


def _check_operands(x_rot, codes, scales, code, group_size, out_features, padded_in):
    words = padded_in * code.bits // 32
    if tuple(codes.shape) != (out_features, words) or codes.dtype != mx.uint32:
        raise ValueError(f"trellis codes {codes.shape} {codes.dtype}: expected uint32 "
                         f"({out_features}, {words}) for {code.bits}-bit rows of {padded_in}")
    if tuple(scales.shape) != (out_features, padded_in // group_size):
        raise ValueError(f"trellis scales {scales.shape}: expected "
                         f"({out_features}, {padded_in // group_size})")
    if x_rot is not None and x_rot.shape[-1] != padded_in:
        raise ValueError(f"x_rot has last axis {x_rot.shape[-1]}, expected padded_in "
                         f"{padded_in} (rotate, then zero-pad)")


@functools.lru_cache(maxsize=None)
def gemv_launch(code: TrellisCode, block: int, group_size: int, padded_in: int,
                out_features: int, dtype, tokens: int, rows_per_warp: int | None = None):
    """f(inputs=[x, codes, scales]) -> [y]: the GEMV for this shape with its grid and
    outputs bound, built once (what a layer calls every token; `matvec` checks, then calls
    it). x (tokens, padded_in) in `dtype`, y (tokens, out_features) in `dtype`."""
    rows = rows_per_warp or rows_per_warp_for(out_features)
    body = gemv_source(code, block, group_size, padded_in, out_features, dtype, dtype, rows)
    kernel = _kernel("gemv", body, 4 * padded_in)
    blocks = _blocks(-(-out_features // (WARPS * rows)))
    return functools.partial(kernel, grid=(blocks * THREADS, tokens, 1),
                             threadgroup=(THREADS, 1, 1),
                             output_shapes=[(tokens, out_features)], output_dtypes=[dtype])


def matvec(x_rot: mx.array, codes: mx.array, scales: mx.array, code: TrellisCode, block: int,
           group_size: int, out_features: int, padded_in: int,
           rows_per_warp: int | None = None) -> mx.array:
    """y = W x for a trellis-coded W: x_rot (..., padded_in) rotated and zero-padded, codes
    (out_features, padded_in * k / 32) uint32, scales (out_features, padded_in / group_size)
    float16 -> (..., out_features) in x_rot's dtype. One launch (`gemv_launch`): a GPU
    thread block per row tile and token (`rows_per_warp`: rows a warp runs at once,
    `rows_per_warp_for`)."""
    _check_operands(x_rot, codes, scales, code, group_size, out_features, padded_in)
    if 4 * padded_in > MAX_SHARED_BYTES:
        raise NotImplementedError(f"a row of {padded_in} does not fit a block's shared memory")
    lead = x_rot.shape[:-1]
    x = x_rot.reshape(-1, padded_in)
    if scales.dtype != mx.float16:
        scales = scales.astype(mx.float16)
    run = gemv_launch(code, block, group_size, padded_in, out_features, x.dtype, x.shape[0],
                      rows_per_warp)
    return run(inputs=[x, codes, scales])[0].reshape(*lead, out_features)


OUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def dequantize(codes: mx.array, scales: mx.array, code: TrellisCode, block: int,
               group_size: int, padded_in: int, out_dtype=mx.bfloat16) -> mx.array:
    """Rows of rotated weights scale * v in `out_dtype`, (rows, padded_in): in float32
    `stages.trellis.decode_rows`'s values exactly, else rounded once."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    rows = codes.shape[0]
    _check_operands(None, codes, scales, code, group_size, rows, padded_in)
    body = decode_source(code, block, group_size, padded_in, out_dtype)
    threads = rows * (padded_in // 32)
    return _kernel("decode", body, 0)(
        inputs=[codes, scales.astype(mx.float16)],
        grid=(-(-threads // 128) * 128, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[(rows, padded_in)], output_dtypes=[out_dtype])[0]


def matmul(x_rot: mx.array, codes: mx.array, scales: mx.array, code: TrellisCode, block: int,
           group_size: int, out_features: int, padded_in: int, *, chunk=None, after=None):
    """Prefill: `tiles.tiled_matmul` with this module's decode (tiles of rows in x's dtype
    where it is fp16/bf16, then MLX's GEMM)."""
    _check_operands(x_rot, codes, scales, code, group_size, out_features, padded_in)

    def decode(c, s, _bits, gs, padded, dtype):
        return dequantize(c, s, code, block, gs, padded, dtype)

    return tiles.tiled_matmul(x_rot, codes, scales, code.bits, group_size, out_features,
                              padded_in, decode, chunk=chunk, after=after)


def linear(x: mx.array, codes: mx.array, scales: mx.array, code: TrellisCode, block: int,
           group_size: int, out_features: int, padded_in: int, seed: int) -> mx.array:
    """A trellis-coded linear layer on CUDA: x (..., in_features) -> (..., out_features) in
    x's dtype. The input is rotated with the tensor's `seed` by `cuda_rotate.rotate` (the
    scalar code's rotation: the same signs, Hadamard and plan), zero-padded to padded_in in
    float32, then `matvec` (at most MATVEC_MAX_TOKENS tokens) or `matmul`. Sizes the
    rotation kernel does not cover (`cuda_rotate.operands`) rotate with MLX's ops."""
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n)
    few = x2.shape[0] <= MATVEC_MAX_TOKENS
    dtype = mx.float32 if few else tiles.compute_dtype(x.dtype)
    try:
        x_rot = cuda_rotate.rotate(x2, (seed,), padded_in, out_dtype=dtype)[0]
    except NotImplementedError:  # a rotation the kernel does not cover: MLX's ops
        x_rot = mx.pad(rotate_rows(x2.astype(mx.float32), seed),
                       [(0, 0), (0, padded_in - n)]).astype(dtype)
    if few:
        y = matvec(x_rot, codes, scales, code, block, group_size, out_features, padded_in)
    else:
        y = matmul(x_rot, codes, scales, code, block, group_size, out_features, padded_in)
    return y.astype(x.dtype).reshape(*lead, out_features)


def reference_matvec(x_rot, codes, scales, code: TrellisCode, block: int, group_size: int,
                     out_features: int, padded_in: int) -> mx.array:
    """What `matvec` computes, in MLX ops (float32): the decode of
    `stages.trellis.decode_words_mx` times the scales, then a product."""
    _check_operands(x_rot, codes, scales, code, group_size, out_features, padded_in)
    v = trellis.decode_words_mx(code, codes, block).reshape(out_features, -1, group_size)
    w = (v * scales.astype(mx.float32)[..., None]).reshape(out_features, padded_in)
    return (x_rot.astype(mx.float32) @ w.T).astype(x_rot.dtype)


# ---------------------------------------------------------------------------- emulation


def emulate_chunk_sums(code: TrellisCode, block: int, row: np.ndarray, chunk: int) -> list[int]:
    """`tq_trellis_words` + `tq_trellis_state` + the byte sum in Python, step for step: the
    32 byte sums of chunk `chunk` of one row's words (the kernels' index arithmetic,
    checked against the reference on machines without a GPU)."""
    k, n = code.bits, len(row) * 32 // code.bits
    w = [int(v) for v in row]
    col = chunk * 32
    b0 = col // block * block
    size = min(n - b0, block)
    c = [w[b0 * k // 32 + size * k // 32 - 1] if col == b0 else w[chunk * k - 1]]
    c += w[chunk * k:chunk * k + k]
    out = []
    for j in range(32):
        start = 32 + (j // code.values + 1) * code.step_bits - code.state_bits
        wi, sh = start >> 5, start & 31
        s = c[wi] >> sh
        if sh + code.state_bits > 32:
            s |= (c[wi + 1] << (32 - sh)) & 0xFFFFFFFF
        s &= (1 << code.state_bits) - 1
        h = (s * trellis.MUL[j % code.values] + trellis.ADD[j % code.values]) & 0xFFFFFFFF
        if code.version == 1:
            h ^= h >> 16
        out.append(sum((h >> (8 * i)) & 0xFF for i in range(4)))
    return out


__all__ = ["decode_source", "dequantize", "emulate_chunk_sums", "gemv_launch", "gemv_source",
           "linear", "matmul", "matvec", "reference_matvec"]

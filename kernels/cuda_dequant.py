"""CUDA prefill for TurboQuant weights: the decode of `tiles.tiled_matmul`, stored codes
to x's dtype a tile of rows at a time, each tile then multiplied by MLX's GEMM (cuBLASLt,
tensor cores in bf16/fp16).

The kernel reads the stored layout of docs/FORMAT.md directly (no second layout for
prefill): each thread writes 8 consecutive weights of a row, levels[code] * scale rounded
once to the output dtype, as one 16-byte store (two for float32). 8 codes never straddle a
group (group sizes are multiples of 32), so a thread reads one scale; its codes lie in one
word (2 and 4 bits), two adjacent words of a 96-bit block (3 bits: a 64-bit window) or up
to two base-3 words (ternary). In float32 it decodes exactly the reference's values.
"""

from __future__ import annotations

import functools
import hashlib

import mlx.core as mx
import numpy as np

from . import compiled, reference, tiles
from .cuda_gemv import constants_source

SPAN = 8  # consecutive weights a thread writes
THREADS = 256

_TERNARY = 5  # BITS value the kernel's source uses for ternary codes

HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Codes SPAN (8) from column `col` of one row's stored words (docs/FORMAT.md).
template <int BITS>
__device__ __forceinline__ void tq_codes8(const uint32_t* w, int col, uint32_t c[8]) {
  if (BITS == 2 || BITS == 4) {
    constexpr int per = 32 / BITS;
    uint32_t word = w[col / per] >> ((col % per) * BITS);
    #pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = (word >> (i * BITS)) & ((1u << BITS) - 1u);
  } else if (BITS == 3) {
    // 32 codes in a block of 3 words; code j at bits 3j..3j+2 of the block
    int block = col / 32, bit = 3 * (col % 32);
    int first = block * 3 + bit / 32, shift = bit % 32;
    unsigned long long v = w[first];
    if (first + 1 < block * 3 + 3) v |= (unsigned long long)w[first + 1] << 32;
    v >>= shift;
    #pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = (uint32_t)(v >> (3 * i)) & 7u;
  } else {  // ternary: 20 base-3 digits a word, least significant first
    int word_index = col / 20, digit = col % 20;
    uint32_t word = w[word_index];
    for (int d = 0; d < digit; ++d) word /= 3u;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (digit + i == 20) word = w[word_index + 1];
      c[i] = word % 3u;
      word /= 3u;
    }
  }
}
"""

# inputs: codes (rows, WORDS) uint32, scales (rows, NSCALES) fp16, levels (<= 16) float32
_SOURCE = r"""
  constexpr int SPANS = PADDED / 8;
  __shared__ float book[16];
  if (threadIdx.x < NLEVELS) book[threadIdx.x] = levels[threadIdx.x];
  __syncthreads();
  size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (size_t)codes_shape[0] * SPANS) return;
  int row = (int)(t / SPANS), col = (int)(t % SPANS) * 8;
  uint32_t c[8];
  tq_codes8<BITS>(codes + (size_t)row * WORDS, col, c);
  float s = __half2float(scales[(size_t)row * NSCALES + col / GS]);
  alignas(16) OutT v[8];
  #pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = (OutT)(book[c[i]] * s);
  uint4* dst = reinterpret_cast<uint4*>(out + (size_t)row * PADDED + col);
  const uint4* src = reinterpret_cast<const uint4*>(v);
  #pragma unroll
  for (int i = 0; i < (int)(sizeof(v) / 16); ++i) dst[i] = src[i];
"""

OUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def kernel_bits(bits) -> int:
    """The `BITS` constant of the kernel's source for codes of `bits`."""
    return _TERNARY if bits == "ternary" else bits


def constants(bits, group_size: int, padded_in: int, out_dtype) -> tuple:
    """The kernel's constants (a tile's rows are not one: its codes' shape says them, so
    one build serves every tile of a width)."""
    return (
        ("BITS", kernel_bits(bits)),
        ("GS", group_size),
        ("PADDED", padded_in),
        ("WORDS", reference.words_per_row(padded_in, bits)),
        ("NSCALES", padded_in // group_size),
        ("NLEVELS", len(_levels(bits))),
        ("OutT", out_dtype),
    )


@functools.lru_cache(maxsize=None)
def _body(constants: tuple) -> str:
    return constants_source(list(constants)) + _SOURCE


@functools.lru_cache(maxsize=None)
def _kernel(body: str):
    tag = hashlib.sha256((HEADER + body).encode()).hexdigest()[:12]
    return compiled.cuda_kernel(
        name=f"tq_dequant_{tag}",
        input_names=["codes", "scales", "levels"],
        output_names=["out"],
        source=body,
        header=HEADER,
    )


@functools.lru_cache(maxsize=None)
def _levels(bits) -> mx.array:
    return reference.levels(bits).astype(mx.float32)


def dequantize(codes: mx.array, scales: mx.array, bits, group_size: int, padded_in: int,
               out_dtype=mx.bfloat16) -> mx.array:
    """Rows of rotated weights, levels[codes] * scale in `out_dtype`: (rows, padded_in),
    `reference.dequantize`'s values rounded once."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    rows = codes.shape[0]
    body = _body(constants(bits, group_size, padded_in, out_dtype))
    threads = rows * (padded_in // SPAN)
    grid = -(-threads // THREADS) * THREADS
    return _kernel(body)(
        inputs=[codes, scales.astype(mx.float16), _levels(bits)],
        grid=(grid, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, padded_in)], output_dtypes=[out_dtype],
    )[0]


def matmul(x_rot, codes, scales, bits, group_size, out_features, padded_in, *, chunk=None,
           after=None, **_):
    """`reference.tq_matmul` (prefill) on CUDA: `tiles.tiled_matmul` with this kernel's
    decode."""
    return tiles.tiled_matmul(x_rot, codes, scales, bits, group_size, out_features, padded_in,
                              dequantize, chunk=chunk, after=after)


def gather_matmul(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, *,
                  sorted_indices=False):
    """Prefill's experts on CUDA: `tiles.gathered_matmul` with this kernel's decode (in
    x_rot's dtype, then MLX's `gather_mm`)."""
    return tiles.gathered_matmul(x_rot, codes, scales, indices, bits, group_size, out_features,
                                 padded_in, dequantize, sorted_indices=sorted_indices)


# ---------------------------------------------------------------------------- emulation


def emulate_codes8(words: np.ndarray, col: int, bits) -> list[int]:
    """`tq_codes8` in Python, step for step: the 8 codes from column `col` of one row's
    stored words (the kernel's index arithmetic, checked on machines without a GPU)."""
    w = [int(v) for v in words]
    if bits in (2, 4):
        per = 32 // bits
        word = w[col // per] >> ((col % per) * bits)
        return [(word >> (i * bits)) & ((1 << bits) - 1) for i in range(8)]
    if bits == 3:
        block, bit = col // 32, 3 * (col % 32)
        first, shift = block * 3 + bit // 32, bit % 32
        v = w[first]
        if first + 1 < block * 3 + 3:
            v |= w[first + 1] << 32
        v >>= shift
        return [(v >> (3 * i)) & 7 for i in range(8)]
    index, digit = col // 20, col % 20
    word = w[index] // 3**digit
    out = []
    for i in range(8):
        if digit + i == 20:
            word = w[index + 1]
        out.append(word % 3)
        word //= 3
    return out


__all__ = ["dequantize", "emulate_codes8", "gather_matmul", "matmul"]

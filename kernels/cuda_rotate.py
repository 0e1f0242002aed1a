"""CUDA activation side of a TurboQuant linear: sign flip, Hadamard, fp16 cast, zero pad.

One kernel turns x (rows, n) in any float dtype into the GEMV's input: for each of S
rotation seeds, T(s * x) in float16 (or the dtype prefill multiplies in), zero-padded to a
width the GEMV reads. It replaces the five to eight MLX ops (cast, multiply,
hadamard_transform, pad, cast, ...) that each TurboQuant linear paid for on its
activations, and rotates once for all the members of a group (q/k/v, gate/up), each with
its own seed.

Every rotation of `stages.rotate` has the form n = A * P with P a power of two: the
Hadamard over P runs on each of the A contiguous segments, and an A x A matrix then mixes
the segments column by column:

- P <= 8192 and no other factor: A = 1;
- n = m * P with m in 12, 20, 28: the m-factor of mx.hadamard_transform;
- n = d * P with d odd (or too few factors of two): the seeded dense orthogonal factor;
- a power of two above 8192: A = n / 8192 and a Sylvester Hadamard over the outer axis.

`operands` builds the signs and the mixing matrices on the host (the overall scale folded
into the matrix); the block of one (row, seed) keeps the whole row in shared memory in
float32, runs the radix-2 stages there, then each thread mixes its columns in registers.
`emulate` does the same arithmetic in numpy, so the CPU tests check the decomposition.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os

import mlx.core as mx
import numpy as np

from turboquant.stages.rotate import _MLX_MAX_POW2, _hadamard_signs, _plan

from . import compiled, cuda_gemv, cuda_memory

THREADS = 512
MAX_SHARED_BYTES = 200 * 1024  # H100/H200 allow 227 KB of shared memory per block
MAX_FACTOR = 32  # a thread holds this many segment values in registers
# TURBOQUANT_CUDA_MIX_SHARED=0: mixed rotations read their mix from global memory, as
# before 2026-11-30 (`rotate_row`)
MIX_SHARED = os.environ.get("TURBOQUANT_CUDA_MIX_SHARED", "1") != "0"

# Device functions ROTATE_ROW calls: a kernel using it puts this in its header.
HEADER = r"""
#include <cuda_fp16.h>

// The three radix-2 stages of a Hadamard of size 8, in place.
__device__ __forceinline__ void tq_hadamard8(float v[8]) {
  #pragma unroll
  for (int s = 1; s < 8; s <<= 1) {
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j & s) continue;
      const float a = v[j], b = v[j + s];
      v[j] = a + b;
      v[j + s] = a - b;
    }
  }
}
"""

# The rotation of one row, shared with the fused linear kernel (`cuda_linear`): the row's
# values TQ_LOAD(i) times the signs `sg` into the float buffer `buf` (16-byte aligned),
# the Hadamard stages, the A x A mix `mix_s`; TQ_PUT(i, v) stores rotated value i (padding
# up to OUTW is stored as zeros).
ROTATE_ROW = r"""
  // the Hadamard over P, on every segment at once: three radix-2 stages per pass while
  // three remain (a thread takes 8 values h apart through registers), then one per pass;
  // the first pass runs on the loaded values, before they reach shared memory
  int lh = 0;
  if (P >= 8) {
    for (int k = t; k < N / 8; k += THREADS) {
      float v[8];
      #pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = TQ_LOAD(8 * k + j) * sg[8 * k + j];
      tq_hadamard8(v);
      float4* o4 = reinterpret_cast<float4*>(buf + 8 * k);
      o4[0] = make_float4(v[0], v[1], v[2], v[3]);
      o4[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    lh = 3;
  } else {
    for (int i = t; i < N; i += THREADS) buf[i] = TQ_LOAD(i) * sg[i];
  }
  __syncthreads();
  for (; (8 << lh) <= P; lh += 3) {
    const int h = 1 << lh;
    for (int k = t; k < N / 8; k += THREADS) {
      const int i = ((k >> lh) << (lh + 3)) | (k & (h - 1));
      float v[8];
      #pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = buf[i + j * h];
      tq_hadamard8(v);
      #pragma unroll
      for (int j = 0; j < 8; ++j) buf[i + j * h] = v[j];
    }
    __syncthreads();
  }
  for (; (1 << lh) < P; ++lh) {
    const int h = 1 << lh;
    for (int k = t; k < N / 2; k += THREADS) {
      const int i = ((k >> lh) << (lh + 1)) | (k & (h - 1));
      const float a = buf[i], b = buf[i + h];
      buf[i] = a + b;
      buf[i + h] = a - b;
    }
    __syncthreads();
  }
  for (int j = t; j < P; j += THREADS) {
    float v[A];
    #pragma unroll
    for (int k = 0; k < A; ++k) v[k] = buf[k * P + j];
    #pragma unroll 4
    for (int a = 0; a < A; ++a) {
      float acc = 0.f;
      #pragma unroll
      for (int k = 0; k < A; ++k) acc += mix_s[a * A + k] * v[k];
      TQ_PUT(a * P + j, acc);
    }
  }
  for (int i = N + t; i < OUTW; i += THREADS) TQ_PUT(i, 0.f);
"""


def rotate_row(a: int) -> str:
    """ROTATE_ROW for A segments. Mixed segments (A > 1) first stage the A x A mix in shared
    memory: every thread reads every entry at each of its columns, which from global memory
    is a load per multiply-add (H200, `tools/cuda_lab.py`: the fused down_proj launch
    of 4096x14336, A = 28, 32.7 -> 25.9 us with the same outputs). A = 1 keeps the text,
    as does `MIX_SHARED` off."""
    if a == 1 or not MIX_SHARED:
        return ROTATE_ROW
    text = ROTATE_ROW
    for before, after in (
            ("  int lh = 0;\n", "  __shared__ float tq_mix[MAX_A * MAX_A];  // read after the syncs below\n"
                                "  for (int i = t; i < A * A; i += THREADS) tq_mix[i] = mix_s[i];\n"
                                "  int lh = 0;\n"),
            ("acc += mix_s[a * A + k] * v[k];", "acc += tq_mix[a * A + k] * v[k];")):
        assert before in text
        text = text.replace(before, after)
    return text.replace("MAX_A", str(MAX_FACTOR))


_SOURCE = r"""
  TQ_SHARED_BUFFER
  const int row = blockIdx.x;
  const int s = blockIdx.y;
  const int t = threadIdx.x;
  const InT* xr = x + (size_t)row * N;
  const float* sg = signs + (size_t)s * N;
  const float* mix_s = mix + (size_t)s * A * A;
  OutT* o = out + ((size_t)s * gridDim.x + row) * OUTW;
  #define TQ_LOAD(i) static_cast<float>(xr[i])
  #define TQ_PUT(i, v) o[i] = static_cast<OutT>(v)
""" + ROTATE_ROW


STATIC_SHARED_BYTES = 48 * 1024  # above this a block's buffer must be dynamic (opt-in)


def dynamic_row_bytes(n: int, a: int) -> int:
    """Dynamic shared memory for the row of a rotation of size n in A segments: 0 where the
    row fits in static memory beside the mix `rotate_row(a)` stages (4 KB when A > 1)."""
    staged_mix = 4 * MAX_FACTOR * MAX_FACTOR if a > 1 and MIX_SHARED else 0
    return 4 * n if 4 * n + staged_mix > STATIC_SHARED_BYTES else 0


def kernel_source(dynamic: bool, a: int = 1) -> str:
    """The kernel's body for A segments, its row buffer in dynamic or static shared memory."""
    buffer = ("extern __shared__ __align__(16) float buf[];" if dynamic
              else "__shared__ __align__(16) float buf[N];")
    return _SOURCE.replace("TQ_SHARED_BUFFER", buffer).replace(ROTATE_ROW, rotate_row(a))


@functools.lru_cache(maxsize=None)
def _body(dynamic: bool, constants: tuple) -> str:
    """The kernel's source with these constants, built once per launch shape."""
    return cuda_gemv.constants_source(constants) + kernel_source(dynamic, dict(constants)["A"])


@functools.lru_cache(maxsize=None)
def _kernel(dynamic_bytes: int, body: str):
    """The kernel of `body` (`kernel_source` with its constants in front), its row buffer
    in dynamic shared memory of `dynamic_bytes` (0: static)."""
    # the source's hash in the name: MLX caches built kernels on disk by name
    tag = hashlib.sha256(body.encode()).hexdigest()[:12]
    return compiled.cuda_kernel(
        name=f"tq_rotate_{tag}",
        input_names=["x", "signs", "mix"],
        output_names=["out"],
        source=body,
        header=HEADER,
        shared_memory=dynamic_bytes,
    )


def factors(n: int, seed: int) -> tuple[int, int]:
    """(A, P) of the rotation of size n: A segments of a power-of-two P. Raises
    NotImplementedError for the one shape the kernel leaves to MLX (m * 2^k, 2^k > 8192)."""
    _, dense, m, p = _plan(seed, n)
    if dense is not None:
        return dense.shape[0], p
    if p > _MLX_MAX_POW2:
        if m > 1:
            raise NotImplementedError(f"rotation of size {n}: {m} x {p} has no CUDA path")
        return p // _MLX_MAX_POW2, _MLX_MAX_POW2
    return m, p


def _mixing(seed: int, n: int) -> np.ndarray:
    """The A x A segment mix of one rotation, the whole scale folded in, float32."""
    _, dense, m, p = _plan(seed, n)
    if dense is not None:  # Hadamard over p scaled by 1/sqrt(p), then Q
        return np.asarray(dense, dtype=np.float64) / math.sqrt(p)
    if p > _MLX_MAX_POW2:  # (outer, 8192): Sylvester Hadamard over the outer axis
        outer = p // _MLX_MAX_POW2
        return _sylvester(outer) / math.sqrt(p)
    if m == 1:
        return np.ones((1, 1)) / math.sqrt(p)
    with mx.stream(mx.cpu):  # MLX's CUDA hadamard_transform does not build for 2^0 * m
        signs = _hadamard_signs(m)
    return signs.astype(np.float64) / math.sqrt(m * p)


def _sylvester(k: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < k:
        h = np.block([[h, h], [h, -h]])
    return h


def operands(seeds: tuple[int, ...], n: int) -> tuple[mx.array, mx.array, int, int]:
    """(signs (S, n), mix (S, A, A), A, P) for rotating one input with each seed."""
    shapes = {factors(n, s) for s in seeds}
    if len(shapes) != 1:
        raise NotImplementedError(f"seeds {seeds} split size {n} differently: {shapes}")
    a, p = shapes.pop()
    if a > MAX_FACTOR or 4 * n > MAX_SHARED_BYTES:
        raise NotImplementedError(f"rotation of size {n} ({a} x {p}) is too large for one block")
    signs = np.stack([np.asarray(_plan(s, n)[0]) for s in seeds]).astype(np.float32)
    mix = np.stack([_mixing(s, n) for s in seeds]).astype(np.float32)
    return (cuda_memory.device_constant(mx.array(signs)),
            cuda_memory.device_constant(mx.array(mix)), a, p)


@functools.lru_cache(maxsize=1024)
def _cached_operands(seeds: tuple[int, ...], n: int):
    signs, mix, a, p = operands(seeds, n)
    mx.eval(signs, mix)
    return signs, mix, a, p


def rotate(x: mx.array, seeds: tuple[int, ...], width: int, out_dtype=mx.float16) -> mx.array:
    """x (rows, n) -> (S, rows, width) in `out_dtype` (the GEMV's float16 unless given):
    each seed's rotation, zero-padded."""
    rows, n = x.shape
    signs, mix, a, p = _cached_operands(tuple(seeds), n)
    return launch(n, a, p, width, len(seeds), rows, x.dtype, out_dtype=out_dtype)(x, signs, mix)


OUT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def launch(n: int, a: int, p: int, width: int, seeds: int, rows: int, in_dtype,
           squeeze: bool = False, out_dtype=mx.float16):
    """The launch `rotate` makes, as a function of (x, signs, mix): built once by
    callers that keep it (a TurboQuant linear on every token). x may have any leading
    shape with `rows` rows in all; `squeeze` drops the seed axis of a single seed."""
    if width < n:
        raise ValueError(f"width {width} is narrower than the input ({n})")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    dynamic = dynamic_row_bytes(n, a)
    constants = (("InT", in_dtype), ("N", n), ("P", p), ("A", a), ("OUTW", width),
                 ("THREADS", THREADS), ("OutT", out_dtype))
    # the constants go into the source: MLX spends host time on every template argument
    kernel = _kernel(dynamic, _body(dynamic > 0, constants))
    grid, threads = (rows * THREADS, seeds, 1), (THREADS, 1, 1)
    shapes = [(rows, width)] if squeeze and seeds == 1 else [(seeds, rows, width)]
    dtypes = [out_dtype]

    def run(x: mx.array, signs: mx.array, mix: mx.array) -> mx.array:
        return kernel(inputs=[x, signs, mix], grid=grid, threadgroup=threads,
                      output_shapes=shapes, output_dtypes=dtypes)[0]

    return run


def hadamard_passes(p: int) -> list[tuple[int, int]]:
    """(first stage, radix) of the kernel's passes over a Hadamard of size p: radix 8
    while three stages remain, then radix 2."""
    passes, lh = [], 0
    while (8 << lh) <= p:
        passes.append((lh, 8))
        lh += 3
    while (1 << lh) < p:
        passes.append((lh, 2))
        lh += 1
    return passes


def emulate(x: np.ndarray, signs: np.ndarray, mix: np.ndarray, a: int, p: int,
            width: int) -> np.ndarray:
    """The kernel's arithmetic in numpy (float32): (rows, n) -> (S, rows, width)."""
    rows, n = x.shape
    out = np.zeros((len(signs), rows, width), dtype=np.float32)
    for s in range(len(signs)):
        buf = (x.astype(np.float32) * signs[s]).reshape(rows, n)
        for lh, radix in hadamard_passes(p):
            h = 1 << lh
            k = np.arange(n // radix)
            i = ((k >> lh) << (lh + radix.bit_length() - 1)) | (k & (h - 1))
            v = [buf[:, i + j * h].copy() for j in range(radix)]
            step = 1
            while step < radix:
                for j in range(radix):
                    if not j & step:
                        v[j], v[j + step] = v[j] + v[j + step], v[j] - v[j + step]
                step <<= 1
            for j in range(radix):
                buf[:, i + j * h] = v[j]
        seg = buf.reshape(rows, a, p)
        out[s, :, :n] = np.einsum("ak,rkj->raj", mix[s], seg).reshape(rows, n)
    return out

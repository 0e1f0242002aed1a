"""An `mx.fast.cuda_kernel` kernel run on the CPU, so its logic is tested without a GPU.

The kernel function is the one `tests/cuda_source.py` rebuilds (MLX's signature and
template arguments), compiled as C++20 by the host compiler over a few shims: a block's
CUDA threads are fibers of one OS thread (ucontext), each run in turn, in thread order,
until it waits at a barrier; `__syncthreads` a barrier of the block, a warp shuffle two
barriers of the warp around a shared slot, `__shared__` a static (one block runs at a
time: blocks run one after another, in grid order unless shuffled), atomics and fences
the host's, half and bfloat16 as their bits with round-to-nearest-even conversions.
(Fibers rather than a std::thread a CUDA thread: the same runs, deterministic, and not
7-12x slower when the machine is busy, as a barrier of 128 OS threads was in the suite.)

Two source rewrites (`for_the_host`): the inline PTX the kernels use as C++ (`_ASM`),
`extern __shared__` arrays as pointers into the launch's dynamic shared memory.

What it checks: indexing, the split of work over threads, warps and blocks, arithmetic, and
state that outlives a launch (an input the kernel writes comes back too); blocks in any
order (`CudaKernelOnCPU.shuffle`: a seed, the launch's blocks run in an order drawn from
it, so any block of a merge may be the last); two launches' blocks interleaved over shared
inputs (`run_pair`: what two launches running at once may do). What it does not: blocks
running at once (one block at a time), memory ordering between blocks, speed, registers
(nvcc does those: `cuda_source.compile_with_nvcc`). A missing `__syncthreads` shows when a
thread, run before later ones, reads what they have yet to write or overwrites what they
have yet to read (`tests/test_cuda_emulation.py`): of the attention kernel's eight
barriers, each removed in turn, six failed 8-54 of 55 cases and two none (with a thread a
CUDA thread those two failed none either; dropping the merge's counter reset or a chunk of
its merge failed 7 and 15 of 27 cases). A `return` before a `__syncthreads` must be taken
by the whole block (as the kernels here do): else the driver stops with "every live thread
waits at a barrier". `mma.sync` (m16n8k16, fp16 in, float32 sums: the KV kernels) gathers
the warp's 32 fragments through shared slots and sums each output in order; with a fragment
mapped wrong the KV kernel's tensor-core cases failed, mapped right its exact (hi + lo)
products meet float32's tolerance. Strided inputs arrive as contiguous copies with their
row-major strides.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

import cuda_source

CXX = shutil.which("g++") or shutil.which("clang++")

# numpy's view of each MLX dtype's bytes (half and bfloat16 as their bits)
_NUMPY = {mx.float32: np.float32, mx.float16: np.uint16, mx.bfloat16: np.uint16,
          mx.int32: np.int32, mx.uint32: np.uint32}

# what <cuda_fp16.h>, <cuda_bf16.h>, <cooperative_groups.h> and the CUDA built-ins give
_SHIMS = r"""
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <array>
#include <ucontext.h>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline dim3 threadIdx, blockIdx;  // the running fiber's (the driver sets them)
inline dim3 blockDim, gridDim;
inline int tq_emu_tid;  // x + y * blockDim.x + ...
// a block's threads are fibers of one OS thread: each runs until it waits at a barrier, then
// the next (in thread order) runs; `tq_emu_arrivals` counts arrivals, so the driver sees a
// round in which no thread moves (every one waiting: a deadlock)
inline ucontext_t tq_emu_scheduler;
inline ucontext_t* tq_emu_fibers;
inline uint64_t tq_emu_arrivals;
inline void tq_emu_yield() { swapcontext(&tq_emu_fibers[tq_emu_tid], &tq_emu_scheduler); }
struct tq_emu_barrier {
  int expected = 0, arrived = 0;
  volatile unsigned phase = 0;  // read again after each turn away
  void arrive_and_wait() {
    ++tq_emu_arrivals;
    if (++arrived == expected) { arrived = 0; ++phase; return; }
    for (const unsigned mine = phase; phase == mine;) tq_emu_yield();
  }
};
inline tq_emu_barrier* tq_emu_block_barrier;
inline tq_emu_barrier* tq_emu_warp_barriers;
inline uint64_t* tq_emu_slots;
inline uint32_t* tq_emu_mma_slots;  // 6 words a thread: its A and B fragments

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__
#define __restrict__
#define __align__(n) __attribute__((aligned(n)))
#define __expf expf
namespace cooperative_groups {}
inline char* tq_emu_dynamic_shared;  // `extern __shared__` arrays (rewritten to use it)

template <typename T> T __ldg(const T* p) { return *p; }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// PRMT's default mode: byte i of the result is byte (s >> 4i) & 7 of {y, x} (x low)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t both = (uint64_t(y) << 32) | x;
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) out |= unsigned((both >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return out;
}

inline void __syncthreads() { tq_emu_block_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float __ldcg(const float* p) { return *(const volatile float*)p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline void tq_emu_warp_sync() { tq_emu_warp_barriers[tq_emu_tid / 32].arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  const int tid = tq_emu_tid, warp = tid / 32, partner = warp * 32 + ((tid % 32) ^ lane_mask);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  tq_emu_slots[tid] = bits;
  tq_emu_warp_barriers[warp].arrive_and_wait();
  T out;
  std::memcpy(&out, &tq_emu_slots[partner], sizeof(T));
  tq_emu_warp_barriers[warp].arrive_and_wait();
  return out;
}

struct float2 { float x, y; };
// mma.sync m16n8k16, row-major A, column-major B, fp16 in, float32 sums: the warp's 32
// fragments gathered (g = lane / 4, c = lane % 4: a = {(g, 2c..), (g+8, 2c..), (g, 2c+8..),
// (g+8, 2c+8..)}, b = {(2c.., g), (2c+8.., g)}, d = {(g, 2c), (g, 2c+1), (g+8, 2c),
// (g+8, 2c+1)}, the lower half of a word the lower index)
inline float tq_emu_half(uint32_t word, int upper) {
  _Float16 h;
  const uint16_t bits = uint16_t(upper ? word >> 16 : word & 0xffffu);
  std::memcpy(&h, &bits, 2);
  return float(h);
}
void tq_emu_warp_sync();
inline void tq_emu_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int tid = tq_emu_tid, warp = tid / 32, lane = tid % 32;
  uint32_t* mine = tq_emu_mma_slots + 6 * tid;
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  tq_emu_warp_sync();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const uint32_t* s = tq_emu_mma_slots + 6 * (warp * 32 + l);
    const int g = l / 4, c = l % 4;
    for (int j = 0; j < 2; ++j) {
      A[g][2 * c + j] = tq_emu_half(s[0], j);
      A[g + 8][2 * c + j] = tq_emu_half(s[1], j);
      A[g][2 * c + 8 + j] = tq_emu_half(s[2], j);
      A[g + 8][2 * c + 8 + j] = tq_emu_half(s[3], j);
      B[2 * c + j][g] = tq_emu_half(s[4], j);
      B[2 * c + 8 + j][g] = tq_emu_half(s[5], j);
    }
  }
  tq_emu_warp_sync();
  const int g = lane / 4, c = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
  for (int i = 0; i < 4; ++i) {
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += A[rows[i]][k] * B[k][cols[i]];
    d[i] += sum;
  }
}

struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float4 __ldcg(const float4* p) { return {__ldcg(&p->x), __ldcg(&p->y), __ldcg(&p->z), __ldcg(&p->w)}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// (a constructor from float: `static_cast<__half>(v)` must round, not take v's integer part)
struct __half {
  uint16_t bits;
  __half() = default;
  __half(float f) { _Float16 h = (_Float16)f; std::memcpy(&bits, &h, 2); }
  operator float() const { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
};
struct __half2 { __half x, y; };
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __half2float(__half h) { return float(h); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float2 __half22float2(__half2 h) { return {float(h.x), float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half(a), __float2half(b)}; }
inline __half2 __float2half2_rn(float a) { return {__float2half(a), __float2half(a)}; }
// one rounding of a * b + c to half, as HFMA2 (a * b is exact in float)
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return {__float2half(float(a.x) * float(b.x) + float(c.x)),
          __float2half(float(a.y) * float(b.y) + float(c.y))};
}

struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }  // round to nearest even
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {float(h.x), float(h.y)}; }

namespace mlx::core::cu {
using Shape = std::array<int32_t, 10>;
using Strides = std::array<int64_t, 10>;
}
"""

# runs the grid: argv = folder; spec.txt there gives grid and block sizes and each input's
# shape; in<i>.bin hold the inputs, out<i>.bin get the outputs, inout<i>.bin the inputs
# as the launch left them
_DRIVER = r"""
#include <cstdio>
#include <fstream>
#include <new>
#include <string>
#include <vector>

static std::vector<char> tq_read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
static void tq_write(const std::string& path, const std::vector<char>& data) {
  std::ofstream(path, std::ios::binary).write(data.data(), data.size());
}

// what a fiber's call of the kernel reads: the inputs' shapes, the launch's buffers
static std::vector<mlx::core::cu::Shape> shapes;
static std::vector<mlx::core::cu::Strides> strides;  // row-major: the inputs arrive contiguous
static std::vector<int> ndims;
static char** P;
static char** Q;
static std::vector<char> tq_done;

static void tq_thread_main(int t) {
  mlx::core::cu::@NAME@(@ARGS@);
  tq_done[t] = 1;  // returns to the scheduler (uc_link)
}

int main(int argc, char** argv) {
  const std::string dir = argv[1];
  std::ifstream spec(dir + "/spec.txt");
  unsigned blocks[3], threads[3];
  spec >> blocks[0] >> blocks[1] >> blocks[2] >> threads[0] >> threads[1] >> threads[2];
  std::vector<std::vector<char>> ins, outs;
  for (int i = 0; i < @INPUTS@; ++i) {
    ins.push_back(tq_read(dir + "/in" + std::to_string(i) + ".bin"));
    mlx::core::cu::Shape shape{};
    mlx::core::cu::Strides stride{};
    int ndim;
    spec >> ndim;
    for (int d = 0; d < ndim; ++d) spec >> shape[d];
    for (int d = ndim - 1, step = 1; d >= 0; step *= shape[d], --d) stride[d] = step;
    shapes.push_back(shape);
    strides.push_back(stride);
    ndims.push_back(ndim);
  }
  for (int i = 0; i < @OUTPUTS@; ++i) {
    size_t bytes;
    spec >> bytes;
    outs.emplace_back(bytes, char(0xff));  // unwritten outputs read as NaN
  }
  gridDim = {blocks[0], blocks[1], blocks[2]};
  blockDim = {threads[0], threads[1], threads[2]};
  const int nt = threads[0] * threads[1] * threads[2], warps = (nt + 31) / 32;
  tq_emu_barrier block_barrier;
  block_barrier.expected = nt;
  std::vector<tq_emu_barrier> warp_barriers(warps);
  for (int w = 0; w < warps; ++w) warp_barriers[w].expected = min(32, nt - 32 * w);
  std::vector<uint64_t> slots(nt);
  tq_emu_block_barrier = &block_barrier;
  tq_emu_warp_barriers = warp_barriers.data();
  tq_emu_slots = slots.data();
  tq_emu_dynamic_shared = new (std::align_val_t(16)) char[@SHARED@ + 16];
  std::vector<uint32_t> mma_slots(6 * nt);
  tq_emu_mma_slots = mma_slots.data();
  // a second launch (pair.txt: a flag an input, 1 shared with the first launch, 0 its own
  // b_in<i>.bin), its outputs b_out<i>.bin
  std::vector<std::vector<char>> ins_b(ins.size()), outs_b = outs;
  std::vector<char*> pa, pb, qa, qb;
  bool pair = false;
  {
    std::ifstream shared(dir + "/pair.txt");
    for (size_t i = 0; i < ins.size(); ++i) {
      int flag = 1;
      pair = bool(shared >> flag) || pair;
      if (!flag) ins_b[i] = tq_read(dir + "/b_in" + std::to_string(i) + ".bin");
      pa.push_back(ins[i].data());
      pb.push_back(flag ? ins[i].data() : ins_b[i].data());
    }
    for (size_t i = 0; i < outs.size(); ++i) { qa.push_back(outs[i].data()); qb.push_back(outs_b[i].data()); }
  }
  // the blocks' order: order.txt's (launch, linear index x + X * (y + Y * z)) pairs if
  // there is one, else the grid's order
  std::vector<std::pair<int, unsigned>> order;
  {
    std::ifstream given(dir + "/order.txt");
    for (int l; given >> l;) { unsigned i; given >> i; order.emplace_back(l, i); }
    if (order.empty())
      for (unsigned i = 0; i < blocks[0] * blocks[1] * blocks[2]; ++i) order.emplace_back(0, i);
  }
  // each block: a fiber a thread, run in turns (thread order) from barrier to barrier
  const size_t stack = 256 << 10;
  char* stacks = new char[stack * nt];
  std::vector<ucontext_t> fibers(nt);
  tq_emu_fibers = fibers.data();
  tq_done.assign(nt, 0);
  for (auto [l, i] : order) {
    P = l ? pb.data() : pa.data();
    Q = l ? qb.data() : qa.data();
    blockIdx = {i % blocks[0], i / blocks[0] % blocks[1], i / (blocks[0] * blocks[1])};
    for (int t = 0; t < nt; ++t) {
      getcontext(&fibers[t]);
      fibers[t].uc_stack.ss_sp = stacks + t * stack;
      fibers[t].uc_stack.ss_size = stack;
      fibers[t].uc_link = &tq_emu_scheduler;
      makecontext(&fibers[t], (void (*)())tq_thread_main, 1, t);
      tq_done[t] = 0;
    }
    for (int live = nt; live;) {
      const uint64_t arrivals = tq_emu_arrivals;
      const int before = live;
      for (int t = 0; t < nt; ++t) {
        if (tq_done[t]) continue;
        tq_emu_tid = t;
        threadIdx = {unsigned(t % threads[0]), unsigned(t / threads[0] % threads[1]),
                     unsigned(t / (threads[0] * threads[1]))};
        swapcontext(&tq_emu_scheduler, &fibers[t]);
        live -= tq_done[t];
      }
      if (live && live == before && arrivals == tq_emu_arrivals) {
        std::fprintf(stderr, "emulation: block %u: every live thread waits at a barrier that "
                     "%d threads never reach (a return before __syncthreads?)\n", i, live);
        return 3;
      }
    }
  }
  for (size_t i = 0; i < outs.size(); ++i) tq_write(dir + "/out" + std::to_string(i) + ".bin", outs[i]);
  for (size_t i = 0; i < ins.size(); ++i) tq_write(dir + "/inout" + std::to_string(i) + ".bin", ins[i]);
  for (size_t i = 0; pair && i < outs.size(); ++i) tq_write(dir + "/b_out" + std::to_string(i) + ".bin", outs_b[i]);
  for (size_t i = 0; pair && i < ins.size(); ++i)
    if (!ins_b[i].empty()) tq_write(dir + "/b_inout" + std::to_string(i) + ".bin", ins_b[i]);
  return 0;
}
"""


# inline PTX the kernels use, as the shims' C++ (the emulation's only source rewrites, with
# `extern __shared__` arrays made pointers into the launch's dynamic shared memory)
_ASM = {
    'asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));':
        "d = __byte_perm(a, b, sel);",
    'asm volatile(\n'
    '      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "\n'
    '      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"\n'
    '      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])\n'
    '      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));':
        "tq_emu_mma(d, a, b0, b1);",
}
_EXTERN_SHARED = re.compile(r"extern __shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[\];")


def for_the_host(text: str) -> str:
    """A kernel's source with its PTX and dynamic shared memory in the shims' terms."""
    for ptx, cpp in _ASM.items():
        text = text.replace(ptx, cpp)
    assert "asm(" not in text and "asm volatile" not in text, "PTX the emulation lacks"
    return _EXTERN_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(tq_emu_dynamic_shared);", text)


def _builds(folder: str, name: str, text: str) -> subprocess.CompletedProcess | None:
    src = Path(folder) / f"{name}.cpp"
    src.write_text(text)
    try:
        return subprocess.run([CXX, "-std=c++20", "-w", str(src), "-o",
                               str(Path(folder) / name)], capture_output=True, text=True,
                              timeout=120)
    except OSError:
        return None


@functools.cache
def available() -> bool:
    """Whether a host compiler builds C++20 with `_Float16` and ucontext's fibers: else
    the emulated tests skip. A compiler that does but fails on the shims raises: the shims
    are broken, and the tests must not skip quietly."""
    if CXX is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        probe = _builds(folder, "cxx20", "#include <ucontext.h>\n"
                        "int main() { _Float16 h = 1; ucontext_t c; getcontext(&c);"
                        " return int(h) - 1; }\n")
        if probe is None or probe.returncode != 0:
            return False
        shims = _builds(folder, "shims", _SHIMS + "int main() { return 0; }\n")
        if shims is None or shims.returncode != 0:
            raise RuntimeError("tests/cuda_emulation.py: the shims do not compile with "
                               f"{CXX}:\n{shims.stderr[-3000:] if shims else ''}")
        return True


class EmulatedKernel:
    """A kernel of `mx.fast.cuda_kernel` (its header, source, input and output names and
    dtypes, template arguments) compiled for the CPU into `folder`."""

    def __init__(self, folder: Path, name: str, header: str, source: str, inputs, input_dtypes,
                 outputs, output_dtypes, template, shared_memory: int = 0):
        self.folder, self.input_dtypes = Path(folder), list(input_dtypes)
        self.output_dtypes = list(output_dtypes)
        function = cuda_source.kernel_source(name, inputs, outputs, for_the_host(source),
                                              input_dtypes, output_dtypes, template)
        args = []
        for i, (n, dt) in enumerate(zip(inputs, input_dtypes)):
            args.append(f"(const {cuda_source._CUDA_TYPES[dt]}*)P[{i}]")
            if n + "_shape" in source:
                args.append(f"shapes[{i}]")
            if n + "_strides" in source:  # a strided view arrives as a contiguous copy
                args.append(f"strides[{i}]")
            if n + "_ndim" in source:
                args.append(f"ndims[{i}]")
        args += [f"({cuda_source._CUDA_TYPES[dt]}*)Q[{i}]"
                 for i, dt in enumerate(output_dtypes)]
        driver = (_DRIVER.replace("@INPUTS@", str(len(inputs)))
                  .replace("@OUTPUTS@", str(len(outputs))).replace("@NAME@", name)
                  .replace("@ARGS@", ", ".join(args))
                  .replace("@SHARED@", str(shared_memory)))
        text = for_the_host(header) + function + driver
        tag = hashlib.sha256(text.encode()).hexdigest()[:12]
        include = self.folder / "include"
        include.mkdir(parents=True, exist_ok=True)
        (include / "tq_emu_shims.h").write_text(_SHIMS)
        for shimmed in ("cuda_fp16.h", "cuda_bf16.h", "cooperative_groups.h"):
            (include / shimmed).write_text('#pragma once\n#include "tq_emu_shims.h"\n')
        src = self.folder / f"{name}_{tag}.cpp"
        self.exe = self.folder / f"{name}_{tag}"
        if self.exe.exists():  # built before in this folder
            return
        src.write_text('#include "tq_emu_shims.h"\n' + text)
        res = subprocess.run(
            [CXX, "-std=c++20", "-O1", "-w", "-fno-strict-aliasing",
             "-I", str(include), str(src), "-o", str(self.exe)],
            capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{CXX} failed on {src}:\n{res.stderr[-4000:]}"

    def __call__(self, inputs: list[np.ndarray], output_shapes, grid, threadgroup,
                 shuffle: int | None = None):
        """(outputs, inputs as the launch left them), numpy arrays (half and bfloat16 as
        uint16 bits). `grid` counts threads, as `mx.fast.cuda_kernel`'s does. `shuffle`:
        the blocks run in an order drawn from that seed, not in grid order (any block of
        a group may then be its last)."""
        run = Path(tempfile.mkdtemp(prefix=f"{self.exe.name}_run", dir=self.folder))
        blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
        if shuffle is not None:
            order = np.random.default_rng(shuffle).permutation(int(np.prod(blocks)))
            (run / "order.txt").write_text(" ".join(f"0 {i}" for i in order))
        spec = [*blocks, *threadgroup]
        for i, (x, dt) in enumerate(zip(inputs, self.input_dtypes)):
            x = np.ascontiguousarray(x, dtype=_NUMPY[dt])
            (run / f"in{i}.bin").write_bytes(x.tobytes())
            spec += [x.ndim, *x.shape]
        sizes = [int(np.prod(s)) * np.dtype(_NUMPY[dt]).itemsize
                 for s, dt in zip(output_shapes, self.output_dtypes)]
        (run / "spec.txt").write_text(" ".join(str(v) for v in spec + sizes))
        subprocess.run([str(self.exe), str(run)], check=True, timeout=300)
        outs = [np.frombuffer((run / f"out{i}.bin").read_bytes(), _NUMPY[dt]).reshape(s)
                for i, (s, dt) in enumerate(zip(output_shapes, self.output_dtypes))]
        back = [np.frombuffer((run / f"inout{i}.bin").read_bytes(), _NUMPY[dt])
                .reshape(np.shape(x)) for i, (x, dt) in enumerate(zip(inputs, self.input_dtypes))]
        return outs, back


def run_pair(kernel: EmulatedKernel, first: list[np.ndarray], second: list[np.ndarray | None],
             output_shapes, grid, threadgroup, order: list[tuple[int, int]]):
    """Two launches of `kernel` over one grid, their blocks in `order` ((launch 0 or 1,
    linear block index) pairs): what two kernel launches running at once may do. The
    second launch's inputs are `second`'s, None where it shares the first's (the same
    memory: a buffer both read and write). Returns (outputs, inputs as left) of each."""
    run = Path(tempfile.mkdtemp(prefix=f"{kernel.exe.name}_pair", dir=kernel.folder))
    blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
    spec = [*blocks, *threadgroup]
    for i, (x, y, dt) in enumerate(zip(first, second, kernel.input_dtypes)):
        x = np.ascontiguousarray(x, dtype=_NUMPY[dt])
        (run / f"in{i}.bin").write_bytes(x.tobytes())
        if y is not None:
            (run / f"b_in{i}.bin").write_bytes(np.ascontiguousarray(y, _NUMPY[dt]).tobytes())
        spec += [x.ndim, *x.shape]
    sizes = [int(np.prod(s)) * np.dtype(_NUMPY[dt]).itemsize
             for s, dt in zip(output_shapes, kernel.output_dtypes)]
    (run / "spec.txt").write_text(" ".join(str(v) for v in spec + sizes))
    (run / "pair.txt").write_text(" ".join("1" if y is None else "0" for y in second))
    (run / "order.txt").write_text(" ".join(f"{launch} {i}" for launch, i in order))
    subprocess.run([str(kernel.exe), str(run)], check=True, timeout=300)

    def read(prefix, shapes, dtypes):
        return [np.frombuffer((run / f"{prefix}{i}.bin").read_bytes(), _NUMPY[dt]).reshape(s)
                for i, (s, dt) in enumerate(zip(shapes, dtypes))]

    shapes = [np.shape(x) for x in first]
    ins_a = read("inout", shapes, kernel.input_dtypes)
    ins_b = [a if y is None else
             np.frombuffer((run / f"b_inout{i}.bin").read_bytes(), _NUMPY[dt]).reshape(s)
             for i, (a, y, s, dt) in enumerate(zip(ins_a, second, shapes, kernel.input_dtypes))]
    return ((read("out", output_shapes, kernel.output_dtypes), ins_a),
            (read("b_out", output_shapes, kernel.output_dtypes), ins_b))


def bits(x: mx.array) -> np.ndarray:
    """An MLX array as numpy (half and bfloat16 as their bits)."""
    return np.array(x.view(mx.uint16)) if x.dtype in (mx.float16, mx.bfloat16) else np.array(x)


def from_bits(x: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """`bits` undone."""
    return mx.array(x).view(dtype) if dtype in (mx.float16, mx.bfloat16) else mx.array(x)


class CudaKernelOnCPU:
    """What `mx.fast.cuda_kernel(...)` returns, run by the emulation: put in its place
    (`patch`), a kernel wrapper runs unchanged on the CPU, its own launch plan included.
    Kernels are compiled once per source, template and input dtypes; `last_inputs` holds
    the inputs as the last launch left them (state a kernel keeps in an input)."""

    shuffle: int | None = None  # a seed: launches run their blocks in an order drawn from it

    def __init__(self, folder: Path, name: str, input_names, output_names, source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 shared_memory: int = 0):
        assert not atomic_outputs, "the emulation has no atomic outputs"
        self.folder, self.name, self.source, self.header = folder, name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.shared_memory = shared_memory
        self.compiled: dict = {}
        self.last_inputs: list[np.ndarray] = []

    def __call__(self, inputs, grid, threadgroup, output_shapes, output_dtypes, template=(),
                 init_value=None, verbose=False, stream=None):
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        dtypes = [x.dtype for x in inputs]
        key = (tuple(map(str, dtypes)), tuple((k, str(v)) for k, v in template),
               tuple(map(str, output_dtypes)))
        if key not in self.compiled:
            self.compiled[key] = EmulatedKernel(
                self.folder, self.name, self.header, self.source,
                self.input_names, dtypes, self.output_names, output_dtypes, list(template),
                self.shared_memory)
        if init_value is not None:
            raise NotImplementedError("init_value: the emulation leaves outputs unwritten (NaN)")
        kernel = self.compiled[key]
        outs, self.last_inputs = kernel([bits(x) for x in inputs], output_shapes, grid,
                                        threadgroup, self.shuffle)
        return [from_bits(np.array(o), dt) for o, dt in zip(outs, output_dtypes)]


def patch(monkeypatch, folder: Path) -> list[CudaKernelOnCPU]:
    """`mx.fast.cuda_kernel` made `CudaKernelOnCPU`; returns the kernels made since."""
    made: list[CudaKernelOnCPU] = []

    def cuda_kernel(**kwargs):
        kernel = CudaKernelOnCPU(folder, **kwargs)
        made.append(kernel)
        return kernel

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    return made


def folder_or_skip(tmp_path_factory, name: str) -> Path:
    """A folder for a test module's built kernels; the module skips without a compiler."""
    import pytest

    if not available():
        pytest.skip("needs a C++20 compiler (g++ or clang++) to emulate the kernels")
    return tmp_path_factory.mktemp(name)


@contextlib.contextmanager
def emulating(monkeypatch, folder: Path, forget):
    """`patch` for the block, with `forget()` (dropping the caches that hold built
    kernels) called before and after, so no emulated kernel outlives it nor a real one
    is used inside; yields the kernels made."""
    forget()
    made = patch(monkeypatch, folder)
    try:
        yield made
    finally:
        forget()

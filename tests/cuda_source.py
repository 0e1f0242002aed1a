"""What `mx.fast.cuda_kernel` compiles, rebuilt on the host so nvcc can check a kernel's
source without a GPU (tests skip when nvcc is not installed)."""

from __future__ import annotations

import os
import subprocess

import mlx.core as mx

_CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
               mx.uint32: "uint32_t", mx.int32: "int32_t", mx.bool_: "bool"}

# stands in for mlx/backend/cuda/device/utils.cuh, which the CPU wheel does not ship
MLX_DEFAULT_HEADER = r"""
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
#define MAX_NDIM 10
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def kernel_source(func: str, inputs, outputs, source: str, input_dtypes, output_dtypes,
                  template) -> str:
    """The kernel function mx.fast.cuda_kernel generates (mlx/backend/cuda/custom_kernel.cpp,
    build_kernel) for these inputs, outputs and template arguments."""
    s = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void {func}(\n"
    for name, dt in zip(inputs, input_dtypes):
        s += f"    const {_CUDA_TYPES[dt]}* {name},\n"
        if name + "_shape" in source:
            s += f"    const __grid_constant__ Shape {name}_shape,\n"
        if name + "_strides" in source:
            s += f"    const __grid_constant__ Strides {name}_strides,\n"
        if name + "_ndim" in source:
            s += f"    const __grid_constant__ int {name}_ndim,\n"
    s += ",\n".join(f"    {_CUDA_TYPES[dt]}* {n}" for n, dt in zip(outputs, output_dtypes))
    s += ") {\n"
    for k, v in template:
        if isinstance(v, bool):
            s += f"  constexpr bool {k} = {'true' if v else 'false'};\n"
        elif isinstance(v, int):
            s += f"  constexpr int {k} = {v};\n"
        else:
            s += f"  using {k} = {_CUDA_TYPES[v]};\n"
    return s + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"


# how `kernel_source` begins a kernel and ends it
_KERNEL_START = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;"
_KERNEL_END = "} // namespace mlx::core::cu"


def split_kernels(source: str, parts: int) -> list[str]:
    """`source` as up to `parts` sources that each hold what precedes its first kernel (the
    headers) and every `parts`-th of its `kernel_source` kernels (neighbours, often alike,
    apart); `source` whole where anything but kernels follows the first kernel."""
    first = source.find(_KERNEL_START)
    if first < 0 or parts < 2:
        return [source]
    header, kernels = source[:first], source[first:].split(_KERNEL_START)[1:]
    if any(not k.rstrip().endswith(_KERNEL_END) for k in kernels):
        return [source]
    count = min(parts, len(kernels))
    return [header + "".join(_KERNEL_START + k for k in kernels[i::count]) for i in range(count)]


def compile_with_nvcc(source: str, tmp_path, name: str = "kernels") -> None:
    """Compile MLX's default header + `source` for sm_90; fail on errors or register spills.
    Its kernels are compiled in as many nvcc processes at once as there are cores
    (`split_kernels`): ptxas, the slow part, runs on one core a process."""
    runs = []
    for i, part in enumerate(split_kernels(source, os.cpu_count() or 1)):
        path = tmp_path / f"{name}{i}.cu"
        path.write_text(MLX_DEFAULT_HEADER + part)
        runs.append(subprocess.Popen(
            ["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(path), "-o",
             str(tmp_path / f"{name}{i}.o"), "-Xptxas", "-warn-spills"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, f"nvcc failed:\n{stderr[-4000:]}"
        assert "spill" not in stderr, stderr[-2000:]


def nvcc_registers(source: str, tmp_path, name: str = "kernel") -> int:
    """Registers a thread of the one kernel in `source` takes, as nvcc (ptxas) reports them
    for sm_90."""
    import re

    path = tmp_path / f"{name}.cu"
    path.write_text(MLX_DEFAULT_HEADER + source)
    res = subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", str(path), "-o",
         str(tmp_path / f"{name}.cubin"), "-Xptxas", "-v"],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, f"nvcc failed:\n{res.stderr[-4000:]}"
    found = re.findall(r"Used (\d+) registers", res.stderr)
    assert len(found) == 1, res.stderr[-2000:]
    return int(found[0])

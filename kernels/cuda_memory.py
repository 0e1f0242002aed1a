"""Keep what the CUDA kernels read in pages that live on the GPU.

MLX's CUDA build allocates arrays in managed memory (cudaMallocManaged). The 3-bit GEMV
28672x8192 took 49-50 us under MLX and 38 from cuMemAlloc'd memory, the same CUBIN in the
same process. Advising the weights (or x, or the outputs) to live on the GPU changed
nothing; giving the launch's 44 bytes of small operands (codebook, pair indices, bias)
pages of their own on the GPU took MLX's own launch from 64.5 to 50.2 us per call, graph
building included (`tools/gemv_in_mlx.py`, `benchmarks/kernels.py --loop`, raw
outputs in benchmarks/results/gemv-in-mlx-h200.txt). The likely reason: arrays of a few
bytes share managed pages (MLX pools small allocations) with scalars the host writes, so
those pages keep leaving the GPU, and every thread block that reads such an operand waits.

`device_constant(a)` copies such an operand into a buffer of its own, at an offset that
gives it whole GPU pages, and advises those pages to live on the GPU (`prefer_gpu`).
Both need the CUDA driver (libcuda) and managed memory and otherwise leave the arrays as
they are. The advice only says where pages should live: the host can still read them, so
no result changes. TURBOQUANT_CUDA_PREFER_GPU=0 turns both off.
"""

from __future__ import annotations

import ctypes
import functools
import os

import mlx.core as mx
import numpy as np

ENABLED = os.environ.get("TURBOQUANT_CUDA_PREFER_GPU", "1") != "0"

_POINTER_IS_MANAGED = 8  # CU_POINTER_ATTRIBUTE_IS_MANAGED
_ADVISE_SET_PREFERRED_LOCATION = 3  # CU_MEM_ADVISE_SET_PREFERRED_LOCATION
_RANGE_PREFERRED_LOCATION = 2  # CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION


@functools.cache
def _driver() -> tuple[ctypes.CDLL, int, ctypes.c_void_p] | None:
    """(libcuda, device 0) with its primary context (the one MLX runs in), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(device), 0):
        return None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
        return None
    return lib, device.value, context


def _current() -> tuple[ctypes.CDLL, int] | None:
    """The driver with MLX's context current on this thread, or None."""
    found = _driver()
    if found is None:
        return None
    lib, device, context = found
    return (lib, device) if lib.cuCtxSetCurrent(context) == 0 else None


def address(a: mx.array) -> int:
    """Where an array's data starts: evaluated, viewed through numpy without a copy (MLX's
    managed buffers are addressable from the host)."""
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: the same bytes as uint16
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.asarray(a).__array_interface__["data"][0]


def _managed(lib: ctypes.CDLL, ptr: int) -> bool:
    flag = ctypes.c_uint(0)
    status = lib.cuPointerGetAttribute(ctypes.byref(flag), _POINTER_IS_MANAGED,
                                       ctypes.c_uint64(ptr))
    return status == 0 and flag.value == 1


def prefer_gpu(arrays) -> int:
    """Advise each array's pages to live on the GPU and prefetch them there; returns the
    bytes advised (0 off CUDA, on memory that is not managed, or when turned off)."""
    if not ENABLED or mx.default_device().type != mx.gpu:
        return 0
    found = _current()
    if found is None:
        return 0
    lib, device = found
    advised = 0
    for a in arrays:
        if a is None or a.nbytes == 0:
            continue
        ptr = address(a)
        if not _managed(lib, ptr):
            continue
        start, size = ctypes.c_uint64(ptr), ctypes.c_size_t(a.nbytes)
        if lib.cuMemAdvise(start, size, _ADVISE_SET_PREFERRED_LOCATION, device) == 0:
            lib.cuMemPrefetchAsync(start, size, device, None)
            advised += a.nbytes
    return advised


PAGE_BYTES = 64 * 1024  # the GPU's large page: a constant gets whole pages of its own


def isolated(a: mx.array) -> tuple[mx.array, mx.array]:
    """(view, buffer): `a`'s values at byte offset PAGE_BYTES of a zero buffer that ends at
    least PAGE_BYTES after them, so every page the view touches belongs to the buffer."""
    flat = a.reshape(-1)
    pad = mx.zeros((PAGE_BYTES // a.dtype.size,), a.dtype)
    lead = pad.size
    buffer = mx.concatenate([pad, flat, pad])
    view = buffer[lead:lead + flat.size].reshape(a.shape)
    mx.eval(buffer, view)
    return view, buffer


def device_constant(a: mx.array) -> mx.array:
    """`a`, evaluated; on CUDA in pages of its own that are advised to live on the GPU
    (for small operands that every thread block of a kernel reads)."""
    mx.eval(a)
    if not ENABLED or mx.default_device().type != mx.gpu or _current() is None:
        return a
    view, buffer = isolated(a)
    prefer_gpu([buffer])
    return view


def _attribute(attribute: int) -> int | None:
    """A CUdevice_attribute of device 0, or None without the CUDA driver."""
    found = _driver()
    if found is None:
        return None
    lib, device, _ = found
    value = ctypes.c_int(0)
    status = lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device)
    return value.value if status == 0 else None


@functools.cache
def sm_count() -> int | None:
    """The GPU's multiprocessor count (device 0), or None without the CUDA driver."""
    return _attribute(16)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT


@functools.cache
def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of device 0, or None without the CUDA driver."""
    major, minor = _attribute(75), _attribute(76)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*
    return None if major is None or minor is None else (major, minor)


def preferred_location(a: mx.array) -> int | None:
    """The device the driver prefers for an array's pages (-2: none set); None off CUDA or
    when the memory is not managed (what the tests check)."""
    found = _current()
    if found is None:
        return None
    lib, _ = found
    ptr = address(a)
    if not _managed(lib, ptr):
        return None
    value = ctypes.c_int(-99)
    status = lib.cuMemRangeGetAttribute(ctypes.byref(value), ctypes.c_size_t(4),
                                        _RANGE_PREFERRED_LOCATION, ctypes.c_uint64(ptr),
                                        ctypes.c_size_t(a.nbytes))
    return value.value if status == 0 else None

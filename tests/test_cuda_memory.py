"""kernels/cuda_memory.py: small kernel operands in pages of their own, on the GPU.

The address, the page-owning copy and the CPU's no-op run everywhere; the advice itself
only where MLX runs on an NVIDIA GPU (on the GPU machine:
`python3 -P -m pytest tests/test_cuda_memory.py`).
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import cuda, cuda_memory

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()


@pytest.mark.parametrize("dtype", [mx.uint32, mx.float16, mx.bfloat16, mx.float32])
def test_address_is_where_the_arrays_bytes_are(dtype):
    a = (mx.arange(1000) * 7 + 3).astype(dtype)
    want = np.asarray(a.view(mx.uint16) if dtype == mx.bfloat16 else a).tobytes()
    assert ctypes.string_at(cuda_memory.address(a), a.nbytes) == want


def test_address_of_a_lazy_array_evaluates_it():
    a = mx.ones((64,), dtype=mx.float32) * 2.5
    got = np.frombuffer(ctypes.string_at(cuda_memory.address(a), a.nbytes), np.float32)
    assert (got == 2.5).all()


@pytest.mark.skipif(CUDA, reason="the CPU's no-op")
def test_off_cuda_nothing_is_advised():
    a = mx.zeros((1 << 16,), dtype=mx.uint32)
    assert cuda_memory.prefer_gpu([a, None]) == 0


@pytest.mark.parametrize("shape", [(1,), (3,), (8, 5), (20000,)])
def test_an_isolated_constant_owns_whole_pages_around_its_values(shape):
    a = mx.arange(int(np.prod(shape)), dtype=mx.float32).reshape(shape) + 1
    view, buffer = cuda_memory.isolated(a)
    assert view.shape == a.shape and view.dtype == a.dtype
    assert (np.asarray(view) == np.asarray(a)).all()
    start = cuda_memory.address(view) - cuda_memory.address(buffer)
    assert start == cuda_memory.PAGE_BYTES  # the view is the buffer's memory, not a copy
    assert buffer.nbytes - start - a.nbytes >= cuda_memory.PAGE_BYTES


@pytest.mark.skipif(CUDA, reason="the CPU's path")
def test_off_cuda_a_device_constant_is_the_array_itself():
    a = mx.zeros((1,), dtype=mx.int32)
    assert cuda_memory.device_constant(a) is a


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
def test_the_gemvs_small_operands_live_on_the_gpu_in_pages_of_their_own():
    expert, row = cuda._pair_arrays(1)
    for small in (cuda._levels(3), expert, row, cuda.cuda_gemv._no_bias()):
        assert cuda_memory.preferred_location(small) == 0
    fresh = mx.zeros((1 << 20,), dtype=mx.uint32) + 1  # no advice given
    assert cuda_memory.preferred_location(fresh) in (-2, None)


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
def test_advised_arrays_keep_their_values():
    a = mx.random.randint(0, 1 << 30, (1 << 20,), dtype=mx.int32)
    before = np.asarray(a).copy()
    assert cuda_memory.prefer_gpu([a]) == a.nbytes
    assert (np.asarray(a + 0) == before).all()

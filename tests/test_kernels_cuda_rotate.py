"""The CUDA rotation kernel's decomposition, checked on the CPU.

`kernels/cuda_rotate.py` rotates activations as A segments of a power-of-two Hadamard
mixed by an A x A matrix, with signs and matrices built on the host. `emulate` runs the
kernel's index arithmetic in numpy; it must agree with `stages.rotate` for every kind of
size (power of two, 12/20/28 factor, dense odd factor, above 8192). The kernel itself is
compared with the reference on the GPU (tests/test_kernels_cuda_linear.py).
"""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import cuda_rotate
from turboquant.stages import rotate

SIZES = [64, 96, 100, 768, 1280, 1728, 1792, 4096, 5120, 13824, 14336, 16384]


@pytest.mark.parametrize("n", SIZES)
def test_emulated_kernel_matches_rotate(n):
    seeds = (3, 11, 2**63 + 5)
    x = np.random.default_rng(n).standard_normal((2, n)).astype(np.float32)
    signs, mix, a, p = cuda_rotate.operands(seeds, n)
    assert a * p == n and p & (p - 1) == 0
    width = -(-n // 64) * 64 + 64
    got = cuda_rotate.emulate(x, np.array(signs), np.array(mix), a, p, width)
    for s, seed in enumerate(seeds):
        want = np.array(rotate(mx.array(x), seed))
        np.testing.assert_allclose(got[s, :, :n], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        assert not got[s, :, n:].any()  # zero padding


def test_hadamard_passes_cover_every_stage_once():
    assert cuda_rotate.hadamard_passes(8192) == [(0, 8), (3, 8), (6, 8), (9, 8), (12, 2)]
    assert cuda_rotate.hadamard_passes(512) == [(0, 8), (3, 8), (6, 8)]
    assert cuda_rotate.hadamard_passes(4) == [(0, 2), (1, 2)]
    assert cuda_rotate.hadamard_passes(1) == []
    for p in (2, 16, 32, 64, 128, 1024, 2048, 4096):
        stages = [lh + j for lh, radix in cuda_rotate.hadamard_passes(p)
                  for j in range(radix.bit_length() - 1)]
        assert stages == list(range(p.bit_length() - 1))


def test_factors_by_kind():
    assert cuda_rotate.factors(4096, 1) == (1, 4096)
    assert cuda_rotate.factors(14336, 1) == (28, 512)  # 7 * 2048 -> m = 28
    assert cuda_rotate.factors(13824, 1) == (27, 512)  # dense factor
    assert cuda_rotate.factors(32768, 1) == (4, 8192)  # above MLX's largest power of two


def test_sizes_beyond_one_block_fall_back():
    with pytest.raises(NotImplementedError):
        cuda_rotate.operands((1,), 12 * 16384)  # m-factor with 2^k > 8192
    with pytest.raises(NotImplementedError):
        cuda_rotate.operands((1,), 65536)  # 256 KiB of float32: over one block's shared memory
    with pytest.raises(NotImplementedError):
        cuda_rotate.operands((1,), 1000)  # 125 x 8: too many segments for one thread's registers


def test_mixed_rotations_stage_their_mix_in_shared_memory():
    """A > 1: the A x A mix is copied to shared memory once a block and read from there
    (from global memory every multiply-add was a load); A = 1 keeps the kernel's text, so
    the kernels of unmixed sizes stay the ones already built and tested."""
    from turboquant.kernels import cuda_linear

    assert cuda_rotate.rotate_row(1) == cuda_rotate.ROTATE_ROW
    mixed = cuda_rotate.rotate_row(28)
    assert "tq_mix[i] = mix_s[i];" in mixed and "acc += tq_mix[a * A + k] * v[k];" in mixed
    assert "mix_s[a * A + k]" not in mixed and f"tq_mix[{cuda_rotate.MAX_FACTOR} * " in mixed
    for n, a, dynamic in ((4096, 1, False), (14336, 28, True), (13824, 27, True)):
        constants = (("InT", mx.bfloat16), ("N", n), ("P", n // a), ("A", a), ("OUTW", n),
                     ("THREADS", cuda_rotate.THREADS), ("OutT", mx.float16))
        body = cuda_rotate._body(dynamic, constants)
        assert ("tq_mix[" in body) == (a > 1), n
        fused = cuda_linear.source(1, a=a)[1]
        assert ("tq_mix[" in fused) == (a > 1) and "TQ_ROTATE_ROW" not in fused


def test_mix_in_shared_memory_can_be_switched_off(monkeypatch):
    """TURBOQUANT_CUDA_MIX_SHARED=0 (read at import into `MIX_SHARED`): the mix read from
    global memory as before, for comparison on a GPU."""
    monkeypatch.setattr(cuda_rotate, "MIX_SHARED", False)
    assert cuda_rotate.rotate_row(28) == cuda_rotate.ROTATE_ROW


def test_rows_beside_a_staged_mix_fit_the_static_shared_memory(tmp_path):
    """12288 = 12 x 1024: its 48 KB row fits static shared memory alone, not beside the 4 KB
    mix a mixed rotation stages, so it goes dynamic; every size's kernel builds."""
    import shutil

    assert cuda_rotate.dynamic_row_bytes(12288, 12) == 4 * 12288
    assert cuda_rotate.dynamic_row_bytes(8192, 1) == 0 and cuda_rotate.dynamic_row_bytes(6144, 12) == 0
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    from cuda_source import compile_with_nvcc, kernel_source

    src = ""
    # float16 for the GEMV; prefill's rotations write the dtype its GEMM multiplies in
    for n, out in ((12288, mx.float16), (13824, mx.float16), (6144, mx.float16),
                   (4096, mx.float16), (4096, mx.bfloat16), (14336, mx.float32)):
        a, p = cuda_rotate.factors(n, 1)
        constants = [("InT", mx.bfloat16), ("N", n), ("P", p), ("A", a), ("OUTW", n),
                     ("THREADS", cuda_rotate.THREADS), ("OutT", out)]
        body = cuda_rotate.kernel_source(cuda_rotate.dynamic_row_bytes(n, a) > 0, a)
        src += kernel_source(f"tq_rotate_{n}_{len(src)}", ["x", "signs", "mix"], ["out"], body,
                             [mx.bfloat16, mx.float32, mx.float32], [out], constants)
    compile_with_nvcc(cuda_rotate.HEADER + src, tmp_path, "rotate")

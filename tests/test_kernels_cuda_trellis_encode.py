"""The GPU Viterbi (`kernels/cuda_trellis_encode.py`) against the CPU reference: the same
paths, words, scales and errors, bit for bit, ties included (the computed codebook has
only 1021 distinct values, so equal costs are everywhere).

The `check_*` functions run on the GPU here at L = 16 (skipped off MLX's CUDA backend) and
on the CPU by the emulation at small L (`tests/test_kernels_cuda_trellis_emulated.py`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import cuda_trellis_encode as enc
from turboquant.stages import trellis
from turboquant.stages.trellis import TrellisCode

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
on_gpu = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")


def sample_rows(rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows, one of them with a few large entries and one constant (ties)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    if rows > 2:
        x[1, ::7] *= 6.0
        x[2] = 0.5
    return x


def check_blocks(state_bits: int, bits: int, values: int, rows: int, block: int, seed: int = 0,
                 version: int = 1):
    """`encode_blocks_gpu` gives `trellis.encode_block`'s paths."""
    code = TrellisCode(state_bits, bits, values, version)
    y = sample_rows(rows, block, seed) / np.float32(code.gain)
    want = trellis.encode_block(code, y)
    got = enc.encode_blocks_gpu(code, y)
    np.testing.assert_array_equal(got, want)


def check_rows(state_bits: int, bits: int, values: int, rows: int, n: int, block: int,
               group_size: int = 32, valid: int | None = None, seed: int = 1):
    """`encode_rows_gpu` gives `trellis.encode_rows`'s result (a shorter last block too)."""
    code = TrellisCode(state_bits, bits, values)
    x = sample_rows(rows, n, seed)
    if valid is not None:
        x[:, valid:] = 0.0
    want = trellis.encode_rows(code, x, group_size, block, valid=valid)
    got = enc.encode_rows_gpu(code, x, group_size, block, valid=valid)
    np.testing.assert_array_equal(got.words, want.words)
    np.testing.assert_array_equal(got.scales, want.scales)
    np.testing.assert_array_equal(got.sq_error, want.sq_error)
    np.testing.assert_array_equal(got.sq_norm, want.sq_norm)


# ---------------------------------------------------------------------------- everywhere


def test_what_fits_a_thread_block():
    assert enc.supported(TrellisCode(16, 2)) and enc.supported(TrellisCode(16, 4, 2))
    assert enc.copies_for(TrellisCode(16, 2)) == 16 and enc.copies_for(TrellisCode(16, 3)) == 32
    assert enc.shared_bytes(TrellisCode(16, 2)) == 4 * (2 * 2**14 + 1024 + 16 * 1024)
    assert not enc.supported(TrellisCode(18, 2))  # 2^16 sets: 512 KiB of costs
    assert not enc.supported(TrellisCode(9, 4, 2))  # 2 sets: under the 4 a word packs
    with pytest.raises(NotImplementedError, match="CPU"):
        enc.encode_blocks_gpu(TrellisCode(18, 2), np.zeros((1, 256), np.float32))
    assert enc.threads_for(TrellisCode(16, 2)) == 1024
    assert enc.threads_for(TrellisCode(8, 2)) == 32


def test_the_rate_estimate_names_the_bound():
    # L = 16 on an H200: 16 copies of the table at 2 bits (shared memory binds), 32 at 3
    # (instructions bind)
    assert 2.0e7 < enc.estimate_rate(TrellisCode(16, 2)) < enc.estimate_rate(TrellisCode(16, 3))
    assert enc.estimate_rate(TrellisCode(16, 3)) < 2.6e7


# ---------------------------------------------------------------------------- on the GPU


@on_gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gpu_paths_match_the_cpu_at_l16(bits):
    check_blocks(16, bits, 1, 6, 256, seed=bits)


@on_gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gpu_rows_match_the_cpu_at_l16(bits):
    check_rows(16, bits, 1, 3, 320, 256, group_size=64, valid=300, seed=bits)


@on_gpu
def test_gpu_two_values_a_step():
    check_rows(16, 3, 2, 3, 256, 256, group_size=64)

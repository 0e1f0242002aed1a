"""The trellis CUDA kernels on the CPU (`tests/cuda_emulation.py`): the checks of
`tests/test_kernels_cuda_trellis.py` at small shapes, blocks shuffled, so a change to a
kernel's source or launch plan is tested without a GPU; and every source compiled by nvcc
for sm_90 where it is installed (register spills fail). What the emulation leaves out
(dp4a and the correctly rounded division: the host computes them plainly; races, speed)
the GPU tests check.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from turboquant.kernels import cuda_rotate, cuda_trellis, cuda_trellis_encode
from turboquant.stages.trellis import TrellisCode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_emulation  # noqa: E402
import cuda_source  # noqa: E402
import test_kernels_cuda_trellis as gpu  # noqa: E402
import test_kernels_cuda_trellis_encode as enc  # noqa: E402


def _forget_kernels():
    for built in (cuda_trellis._kernel, cuda_trellis.gemv_launch, cuda_trellis_encode._kernel,
                  cuda_rotate._kernel):
        built.cache_clear()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return cuda_emulation.folder_or_skip(tmp_path_factory, "cuda_trellis_emulated")


@pytest.fixture
def emulated(monkeypatch, folder):
    with cuda_emulation.emulating(monkeypatch, folder, _forget_kernels):
        monkeypatch.setattr(cuda_emulation.CudaKernelOnCPU, "shuffle", 5)
        monkeypatch.setattr(cuda_trellis, "_blocks", lambda tiles: min(tiles, 2))  # strides
        yield


@pytest.mark.parametrize("bits, state_bits, values, block", [
    (2, 16, 1, 256), (3, 16, 1, 256), (4, 16, 1, 256), (3, 12, 2, 128), (4, 9, 2, 64),
    (2, 20, 1, 32),
])
def test_the_gemv(emulated, bits, state_bits, values, block):
    # 320 wide: blocks of `block` and a shorter last one; 40 rows: a partial tile
    gpu.check_matvec(bits, state_bits, values, 40, 320, block, group_size=32, tokens=2,
                     rows_per_warp=2)


@pytest.mark.parametrize("bits, state_bits, values, block", [(3, 16, 1, 256), (4, 9, 2, 64)])
def test_version_2_the_gemv_and_the_tile_decode(emulated, bits, state_bits, values, block):
    """Trellis version 2 (no shift-xor): the same kernels with VERSION 2 give its reference
    (a kernel that kept the shift-xor would give version 1's values)."""
    gpu.check_matvec(bits, state_bits, values, 40, 320, block, group_size=32, tokens=2,
                     rows_per_warp=2, version=2)
    gpu.check_dequantize(bits, state_bits, values, 5, 320, block, version=2)


def test_the_gemv_in_bf16(emulated):
    gpu.check_matvec(3, 16, 1, 16, 256, 256, dtype=mx.bfloat16, rows_per_warp=1)


@pytest.mark.parametrize("bits, state_bits, values, block", [
    (2, 16, 1, 256), (3, 16, 1, 256), (4, 16, 1, 256), (3, 10, 2, 96)])
def test_the_tile_decode_is_exact(emulated, bits, state_bits, values, block):
    gpu.check_dequantize(bits, state_bits, values, 5, 320, block)


def test_the_prefill_tiles(emulated):
    gpu.check_matmul(3, 24, 256, 256, tokens=10, chunk=8 * 256)


@pytest.mark.parametrize("tokens, in_f", [(1, 200), (9, 200), (2, 250)])
def test_the_rotated_linear(emulated, tokens, in_f):
    # 200 = 25 x 8: the rotation kernel; 250 = 125 x 2: MLX's ops rotate
    gpu.check_linear(3, 16, in_f, 256, 256, tokens=tokens)


def _sources():
    """Every kernel of this module at the shapes the runtime and the benchmark use."""
    out = []
    for bits in (2, 3, 4):
        for values, state_bits, version in ((1, 16, 1), (2, 16, 1), (1, 16, 2), (2, 16, 2)):
            code = TrellisCode(state_bits, bits, values, version)
            body = cuda_trellis.gemv_source(code, 256, 64, 8192, 28672, mx.float32, mx.float32)
            out.append(("gemv", body, ["x", "codes", "scales"],
                        [mx.float32, mx.uint32, mx.float16], mx.float32))
            body = cuda_trellis.decode_source(code, 256, 64, 4096, mx.bfloat16)
            out.append(("decode", body, ["codes", "scales"], [mx.uint32, mx.float16],
                        mx.bfloat16))
    return out


def test_the_sources_compile_with_nvcc(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    text = cuda_trellis.header()
    for i, (kind, body, inputs, dtypes, out_dtype) in enumerate(_sources()):
        text += cuda_source.kernel_source(f"tq_trellis_{kind}{i}", inputs, ["out"], body, dtypes,
                                          [out_dtype], ())
    cuda_source.compile_with_nvcc(text, tmp_path, "trellis")


# ---------------------------------------------------------------------------- the Viterbi


@pytest.mark.parametrize("state_bits, bits, values, block", [
    (8, 2, 1, 64), (10, 3, 1, 96), (10, 4, 1, 64), (10, 2, 2, 64), (9, 3, 2, 64)])
def test_the_viterbi_paths(emulated, state_bits, bits, values, block):
    enc.check_blocks(state_bits, bits, values, 4, block, seed=state_bits + bits)


def test_version_2_the_viterbi_paths(emulated):
    enc.check_blocks(10, 3, 1, 4, 96, seed=5, version=2)


@pytest.mark.parametrize("state_bits, bits, values", [(8, 3, 1), (10, 2, 1), (10, 4, 2)])
def test_the_encoded_rows(emulated, state_bits, bits, values):
    # 160 wide: a block of 128 and one of 32; padding from 150 on
    enc.check_rows(state_bits, bits, values, 3, 160, 128, valid=150)


def test_the_viterbi_sources_compile_with_nvcc(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    text = cuda_trellis_encode.kernel_header()
    for i, (bits, values) in enumerate(((2, 1), (3, 1), (4, 1), (3, 2))):
        code = TrellisCode(16, bits, values)
        for closed in (False, True):
            body = cuda_trellis_encode.source(code, 256 // values, 128 // values, closed)
            text += cuda_source.kernel_source(f"tq_viterbi{i}{int(closed)}", ["y", "closing"],
                                              ["path", "back"], body, [mx.float32, mx.int32],
                                              [mx.int32, mx.uint32], ())
    cuda_source.compile_with_nvcc(text, tmp_path, "viterbi")


# ---------------------------------------------------------------------------- the benchmark


def test_the_benchmark_runs(emulated, monkeypatch, capsys, tmp_path):
    """`benchmarks/kernels.py --trellis` end to end at tiny shapes (each method evaluated
    once instead of timed), so the device step runs the first time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernels as bench

    monkeypatch.setattr(bench, "TRELLIS_SHAPES", [(64, 256)])
    monkeypatch.setattr(bench, "PER_EVAL", 2)
    monkeypatch.setattr(bench, "_time", lambda fn, reps=10: (mx.eval(fn()), 1e-6)[1])
    check = bench.trellis_check
    monkeypatch.setattr(bench, "trellis_check", lambda: check(out_f=16, in_f=256))
    small = bench.bench_trellis_encode
    monkeypatch.setattr(bench, "bench_trellis_encode",
                        lambda: small(rows=2, cols=256, cpu_rows=1, cpu_cols=256, state_bits=10))
    bench.trellis_main(str(tmp_path / "trellis.json"), encode=True)
    out = capsys.readouterr().out
    assert "trellis3_linear" in out and "slice identical" in out
    assert "trellis3v2_V2" in out  # version 2 and V=2 timed beside version 1 at V=1
    import json

    results = json.loads((tmp_path / "trellis.json").read_text())
    assert [r["slice_identical"] for r in results["encode"]] == [True] * 3
    assert results["gemv"][0]["shape"] == "64x256"
    assert all(c["decode_exact"] and c["gemv"] < 1e-5 for c in results["check"].values())
    assert "3 v2" in results["check"] and "trellis3v2_single" in results["gemv"][0]

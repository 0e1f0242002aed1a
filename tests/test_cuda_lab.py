"""tools/cuda_lab.py writes a standalone CUDA program from the kernels' own sources:
it must keep up with their launch signatures (nvcc compiles it here; the GPU runs it)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

LAB = Path(__file__).resolve().parents[1] / "tools" / "cuda_lab.py"


@pytest.fixture
def lab(monkeypatch):
    # building MLX kernel objects needs the CUDA backend: the lab only takes sources
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **_: None)
    spec = importlib.util.spec_from_file_location("cuda_lab", LAB)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cuda_lab", module)
    spec.loader.exec_module(module)
    yield module
    from turboquant.kernels import cuda_gemv, cuda_linear

    cuda_gemv._kernel.cache_clear()  # the lab built them with the stand-in above
    cuda_linear._kernel.cache_clear()


SPECS = [("gemv", 1024, 4096, 3, {"rpw": 4}), ("linear", 512, 14336, 4, {}),
         ("linear", 256, 1024, 2, {"rows_per_warp": 2, "tiles": 2})]


def test_variants_carry_the_launch_their_kernels_need(lab):
    gemv, down, small = lab.build(SPECS, kv_contexts=(), kv_tail_contexts=())
    assert gemv.grid == (1024 // 4 * 32 // 128, 1, 1) and gemv.block == 128
    assert gemv.shared == 2 * 4096  # the staged fp16 row
    names = [n for n, _ in down.args]
    assert names == ["x", "signs", "mix", "codes", "hplane", "scales", "levels", "bias"]
    mix = dict(down.args)["mix"]
    assert mix.count == 28 * 28  # 14336 rotates as 28 segments of 512, as the runtime does
    assert down.shared > 48 * 1024  # asks for more than the default shared memory
    assert "constexpr int TILES = 2;" in small.source
    # weights are what streams: codes, high plane (3-bit only), scales
    assert down.weight_bytes == 512 * 14336 * 4 // 8 + 512 * 14336 // 64 * 2


def test_gemv_candidate_loops_splice_into_the_kernels_source(lab):
    """A candidate main loop (`GEMV_LOOPS`) replaces the GEMV's own: if that loop's text
    changes, building the candidate fails here rather than timing a stale copy."""
    plain, candidate = lab.build([("gemv", 1024, 4096, 3, {"rpw": 4}),
                                  ("gemv", 1024, 4096, 3, {"rpw": 4, "loop": "syncwarp"})],
                                 kv_contexts=(), kv_tail_contexts=())
    assert candidate.family == plain.family and candidate.func == plain.func + "_syncwarp"
    assert "__syncwarp()" in candidate.source and "__syncwarp()" not in plain.source


def test_kv_variants_pass_shapes_and_strides_where_the_kernel_reads_them(lab):
    partial, candidate, mma, waves, mma_waves, merge, merge_split, merge_wide = lab.build(
        [], kv_contexts=(4096,), kv_tail_contexts=())
    from turboquant.kernels import cuda_kv_plan, cuda_kv_sources

    assert merge_split.family == merge.family == merge_wide.family
    assert merge_split.block == cuda_kv_plan.split_per_dim(128) * 128 == 8 * 128
    assert merge_wide.block == 1024 and merge_wide.grid == merge.grid
    # the candidate partial kernels run the same launch and are checked against it
    for other in (candidate, mma):
        assert other.family == partial.family and other.func != partial.func
        assert (other.grid, other.block, other.args) == (partial.grid, partial.block,
                                                        partial.args)
    assert "tq_mma3<EXACT>(" in mma.source and mma_waves.args == partial.args
    assert "constexpr bool EXACT = true;" in mma.source  # the lab's hi + lo reference
    # the wave-filling grid: its own family (other chunk sums), fewer chunks at 32K only
    assert waves.family != partial.family and waves.args == partial.args
    assert waves.grid == partial.grid  # 4K: 32 chunks fill less than a wave either way
    assert [n for n, _ in partial.args] == cuda_kv_sources.PARTIAL_INPUTS
    args = dict(partial.args)
    assert args["k_codes"].shape == (1, 8, 4096, 16) and args["k_codes"].weight  # K4: 16 words
    assert args["v_codes"].shape == (1, 8, 4096, 12)  # V3: 12 words of 128 codes
    assert lab._call_args("k_codes", args["k_codes"], partial.source) == [
        "a_k_codes + (size_t)(c) * 524288", "Shape{1, 8, 4096, 16}",
        "Strides{524288, 65536, 16, 1}"]
    assert partial.grid[1] == 8 and partial.block == cuda_kv_plan.NT
    assert [n for n, _, _ in partial.outputs] == ["part_ml", "part_acc"]
    assert merge.grid == (32, 1, 1) and merge.outputs[0][2] == 32 * 128


def test_fp16_parts_in_bigger_chunks_get_fewer_blocks(lab):
    """The runtime's fp16 part at its longest (4 sink + 188 tail tokens: 2 tiles) in chunks
    of a tile (the runtime's, 128), or in one chunk of 256 (before 2026-11-30): the same
    compressed chunks, one fp16 chunk fewer, FPCH to match."""
    variants = lab.build([], kv_contexts=(), kv_tail_contexts=(1024,), tail_fp_tokens=(256,))
    partial = variants[0]
    fp256 = next(v for v in variants if v.name.startswith("kv_partial_fp256"))
    assert partial.name == "kv_partial_1024_t188_k4v3"
    assert fp256.family != partial.family and fp256.args == partial.args
    assert fp256.grid == (partial.grid[0] - 1, 8, 1)
    assert "constexpr int FPCH = 2;" in partial.source and "constexpr int FPCH = 1;" in fp256.source


def test_runtime_grid_times_both_products_of_the_tensor_core_kernel(lab):
    """On the runtime's grid the lab times `_PARTIAL_MMA` with hi + lo products and with
    fp16 operands (the runtime's default) as one family, so it prints their difference."""
    variants = lab.build([], kv_contexts=(), kv_tail_contexts=(1024,))
    exact = next(v for v in variants if v.name == "kv_partial_mma_waves_fp128_1024_t188_k4v3")
    fast = next(v for v in variants if v.name == exact.name + "_fp16x")
    assert fast.family == exact.family and (fast.grid, fast.args) == (exact.grid, exact.args)
    assert "constexpr bool EXACT = true;" in exact.source
    assert "constexpr bool EXACT = false;" in fast.source


def test_extra_kv_bits_add_the_8_bit_layers_kernels(lab):
    """`--emit` also times the 8-bit K/V kernels (the layers the cache protects by
    default) at the tail contexts, as the runtime lays them out."""
    variants = lab.build([], kv_contexts=(), kv_tail_contexts=(1024,), kv_extra_bits=((8, 8),))
    k8v8 = [v for v in variants if v.name.endswith("_1024_t188_k8v8")]
    assert {"kv_partial_1024_t188_k8v8", "kv_merge_split_1024_t188_k8v8"} <= {v.name for v in k8v8}
    args = dict(k8v8[0].args)
    assert args["k_codes"].shape[-1] == args["v_codes"].shape[-1] == 32  # 128 bytes a head
    assert lab.KV_EXTRA_BITS[0] == (8, 8)


def test_gemv_header_candidates_get_helpers_of_their_own(lab, tmp_path):
    """A candidate decode header (`HEADER_VARIANTS`) replaces the GEMV's helpers under its
    own names, so kernels.cu holds it beside the runtime's header and still compiles."""
    plain, candidate = lab.build([("gemv", 1024, 4096, 3, {"rpw": 4}),
                                  ("gemv", 1024, 4096, 3, {"rpw": 4, "header": "mulhi"})],
                                 kv_contexts=(), kv_tail_contexts=())
    assert candidate.family == plain.family and candidate.func == plain.func + "_mulhi"
    assert "mul.hi.u32" in candidate.source and "mul.hi.u32" not in plain.source
    assert "tqmulhi_block16" in candidate.source and "tq_block16" not in candidate.source
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    (tmp_path / "kernels.cu").write_text(lab.kernels_file([plain, candidate]))
    res = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-o",
                          str(tmp_path / "k.cubin"), str(tmp_path / "kernels.cu")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def test_program_compiles_with_nvcc(lab, tmp_path):
    """kernels.cu builds as a CUBIN (the device also builds it with NVRTC, as MLX does) and
    main.cu, which launches them through the driver API, compiles."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    variants = lab.build(SPECS, kv_contexts=(1024,), kv_tail_contexts=(1024,))
    main = lab.program(variants)
    assert main.count("int main(") == 1 and main.count("rng_state = ") == len(variants) + 1
    assert main.count("lab_function(mod, ") == len(variants)
    _build_with_nvcc(lab, variants, tmp_path)


def _build_with_nvcc(lab, variants, tmp_path) -> None:
    """kernels.cu as a CUBIN and main.cu as an object, as run.sh builds them (both at
    once: one core each)."""
    (tmp_path / "kernels.cu").write_text(lab.kernels_file(variants))
    (tmp_path / "main.cu").write_text(lab.program(variants))
    runs = [subprocess.Popen(["nvcc", "-std=c++17", "-arch=sm_90", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in (["-cubin", str(tmp_path / "kernels.cu"), "-o", str(tmp_path / "k.cubin")],
                         ["-c", str(tmp_path / "main.cu"), "-o", str(tmp_path / "main.o")])]
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]


def test_other_wave_plans_time_the_batched_kernel_as_families_of_their_own(lab):
    """PLAN_CANDIDATES: the batched tensor-core kernel on other resident-block counts, each
    its own family (another chunking: a difference to the runtime's plan means nothing)."""
    variants = lab.build([], kv_contexts=(), kv_tail_contexts=(32768,), kv_extra_bits=((8, 8),))
    by_name = {v.name: v for v in variants}
    for tag, runtime_blocks in (("k4v3", 9), ("k8v8", 6)):
        base = f"kv_partial_mma_waves_fp128_32768_t188_{tag}_fp16x_b8"
        assert base in by_name
        others = [by_name[f"{base}_w{n}"] for n in lab.PLAN_CANDIDATES if n != runtime_blocks]
        assert f"{base}_w{runtime_blocks}" not in by_name  # that one is the runtime's
        assert all(v.family == v.name for v in others)
        assert len({v.grid for v in others} | {by_name[base].grid}) > 1  # plans differ


def test_only_selects_variants_by_name(lab):
    variants = lab.build([], kv_contexts=(), kv_tail_contexts=(1024,), kv_extra_bits=((8, 8),))
    picked = lab.select(variants, "k8v8_fp16x_b8")
    assert picked and all("k8v8_fp16x_b8" in v.name for v in picked)
    assert lab.select(variants, None) == variants and lab.select(variants, "^nothing$") == []


def test_tensor_core_candidate_is_checked_against_its_layout_decoded_code_by_code(lab, tmp_path):
    """`lab_mma`: the mma kernels of a shape share a family whose first variant (the
    reference the lab compares them with) decodes the same layout one code at a time; the
    speed-of-light variants (loads alone, a plain stream) are families of their own."""
    ref, k2, k4xs, loads, stream = lab.build(
        [("mma", 256, 1024, 3, {"ksplit": 0}), ("mma", 256, 1024, 3, {"ksplit": 2}),
         ("mma", 256, 1024, 3, {"ksplit": 4, "xsmem": True}),
         ("mma", 256, 1024, 3, {"ksplit": 2, "null": "loads"}),
         ("mma", 256, 1024, 3, {"ksplit": 1, "null": "stream"})],
        kv_contexts=(), kv_tail_contexts=())
    assert ref.func.startswith("mmaref_") and ref.family == k2.family == k4xs.family
    assert "mma.sync.aligned.m16n8k16" in k2.source
    assert "tq_mma4(" not in ref.source.split("__global__")[1]  # decodes code by code
    assert k2.grid == (256 // 16 * 2 // 4, 1, 1) and k4xs.grid == (256 // 16, 1, 1)
    assert "#define TQ_XSMEM 1" in k4xs.source and "#define TQ_XSMEM 0" in k2.source
    assert loads.family == loads.name and stream.family == stream.name
    # the same operands as the GEMV's (codes, high plane, scales): the weights stream
    assert k2.weight_bytes == 256 * 1024 * 3 // 8 + 256 * 1024 // 64 * 2
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    variants = [ref, k2, k4xs, loads, stream]
    _build_with_nvcc(lab, variants, tmp_path)


def test_fused_kernel_without_its_rotation_times_on_its_own(lab):
    """`rotate=False`: the fused launch with a plain copy of the row where the rotation was
    (what the rotation costs it); a family of its own, since its outputs differ."""
    from turboquant.kernels import cuda_rotate

    plain, bare = lab.build([("linear", 512, 14336, 3, {}),
                             ("linear", 512, 14336, 3, {"rotate": False})],
                            kv_contexts=(), kv_tail_contexts=())
    rotation = cuda_rotate.rotate_row(28)  # 14336 = 28 x 512
    assert rotation in plain.source and rotation not in bare.source
    assert bare.func == plain.func + "_norotate" and bare.family == bare.name != plain.family
    assert bare.grid == plain.grid and bare.shared == plain.shared

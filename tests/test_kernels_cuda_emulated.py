"""The CUDA linear kernels on the CPU: `tests/test_kernels_cuda_linear.py`'s checks at
small shapes, every launch run by `tests/cuda_emulation.py` (the kernel dispatch told it
is on CUDA), so a change to a CUDA kernel's source or its launch plan is tested without
a GPU: the fused rotation + GEMV of a group (2, 3, 4 bits; bf16, fp16, float32 rows),
its norm / SwiGLU / residual extras, the unfused launches, the GEMV alone (ternary as
2-bit codes), the gathered experts and the fused gather, and prefill's tile decode
(`tests/test_kernels_cuda_dequant.py`'s exact check), and the compressed KV cache's
decode attention (`tests/test_kernels_cuda_kv.py`'s cases: the tensor-core partial
kernel, `mma.sync` gathered from the warp's fragments, with fp16 or exact hi + lo
operands, and the plain one). What the emulation does not check
(races, speed, registers) the GPU files and nvcc do. Skipped without a C++20 compiler.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from turboquant.kernels import (cuda, cuda_dequant, cuda_gemv, cuda_kv, cuda_kv_plan, cuda_linear,
                                cuda_memory, cuda_rotate, dispatch)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_emulation  # noqa: E402
import test_kernels_cuda_dequant as dequant  # noqa: E402  (its GPU checks, run here)
import test_kernels_cuda_kv as kv  # noqa: E402
import test_kernels_cuda_linear as gpu  # noqa: E402  (its checks, run here at small shapes)


def _forget_kernels():
    """Built kernels and plans hold the kernel objects: none may outlive the emulation."""
    for built in (cuda_linear._kernel, cuda_gemv._kernel, cuda_rotate._kernel,
                  cuda_dequant._kernel, cuda_kv._kernel):
        built.cache_clear()
    cuda._PREPARED.clear()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return cuda_emulation.folder_or_skip(tmp_path_factory, "cuda_emulated")


@pytest.fixture
def emulated_cuda(monkeypatch, folder):
    with cuda_emulation.emulating(monkeypatch, folder, _forget_kernels):
        monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
        yield


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_fused_group_launch(emulated_cuda, bits):
    gpu.test_group_matches_reference(bits, 992, (64, 40))  # 31 x 32 rotation, padded input


@pytest.mark.parametrize("in_f, outs, kind", [(992, (64, 40), "norm"), (992, (64,), "residual"),
                                              (512, (64,), "gate+residual")])
def test_the_extras_in_the_launch(emulated_cuda, in_f, outs, kind):
    gpu.test_extras_match_reference(in_f, outs, kind)


def test_the_unfused_launches(emulated_cuda, monkeypatch):
    gpu.test_unfused_launches_match_reference(monkeypatch, 992, (64, 40))


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
def test_the_gemv_alone(emulated_cuda, bits):
    gpu.test_matvec_matches_reference(bits, 992, 40)


@pytest.mark.parametrize("bits", [3, "ternary"])
def test_the_gathered_experts(emulated_cuda, bits):
    gpu.test_gathered_experts_match_reference(bits, 992, 40, 2)


def test_the_fused_gather(emulated_cuda, monkeypatch):
    gpu.test_fused_gather_matches_rotation_then_reference(monkeypatch, 2, 992, 256)


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
def test_the_prefill_tile_decode(emulated_cuda, bits):
    dequant.test_kernel_decodes_the_reference_values(bits, 64)  # exact, every out dtype


@pytest.fixture
def tensor_cores(monkeypatch):
    """The device said to be an sm_90 (the KV kernel takes its `mma.sync` path there)."""
    monkeypatch.setattr(cuda_memory, "compute_capability", lambda: (9, 0))


@pytest.mark.parametrize("case, mma, exact", [
    (kv.Case(kv=2, r=4, bits=(4, 3), ctx=197), True, False),  # one block compressed
    (kv.Case(kv=2, r=4, bits=(4, 3), ctx=300), True, True),  # float32's tolerance
    (kv.Case(b=2, kv=2, r=8, dim=64, bits=(4, 4), ctx=300), False, False),  # no mma: D 64
    (kv.Case(kv=2, r=4, bits=(2, 3), ctx=600, sink=0), False, False),  # the plain kernel
], ids=["mma", "mma-exact", "d64", "plain"])
def test_the_kv_decode_attention(emulated_cuda, tensor_cores, monkeypatch, case, mma, exact):
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_MMA", mma)
    monkeypatch.setattr(cuda_kv_plan, "KV_MMA_EXACT", exact)
    checked = kv.check_case(case)
    assert all(("_mma" in line) == mma for line in checked), checked

"""The Metal kernels against the reference.

On macOS with Metal the kernels run for real (marked `metal`). Everywhere else the kernel
source still gets checked: its header and body compile as C++ (a C++ compiler stands in
for the Metal one, one loop stands in for a simdgroup's 32 lanes), and the emulated
kernel must agree with the reference, so the unpacking and indexing are tested on Linux.
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import dispatch, metal, reference, tiles
from turboquant.stages import decode, encode, rotate

WIDTHS = (2, 3, 4, "ternary")
CXX = shutil.which("g++") or shutil.which("clang++")


def _case(bits, n=20, inp=100, gs=32, experts=3):
    mx.random.seed(7)
    qts = [encode(mx.random.normal((n, inp)), bits, gs, seed=3) for _ in range(experts)]
    k = qts[0].spec.padded_in
    x = mx.random.normal((2, inp))
    xr = mx.pad(rotate(x, 3), [(0, 0), (0, k - inp)])
    codes = mx.stack([q.codes for q in qts])
    scales = mx.stack([q.scales for q in qts])
    return qts, x, xr, codes, scales


# ---------------------------------------------------------------------------- on Metal


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs MLX's Metal backend (macOS)")
@pytest.mark.parametrize("bits", WIDTHS)
def test_metal_gemv_and_gather_match_the_reference(bits):
    qts, x, xr, codes, scales = _case(bits)
    k = qts[0].spec.padded_in
    with mx.stream(mx.gpu):
        y = metal.tq_matvec(xr, qts[0].codes, qts[0].scales, bits, 32, 20, k)
        ref = reference.tq_matvec(xr, qts[0].codes, qts[0].scales, bits, 32, 20, k)
        assert mx.allclose(y, ref, atol=1e-4).item()
        assert mx.allclose(y, x @ decode(qts[0]).T, atol=1e-4).item()
        idx = mx.array([[2, 0]], dtype=mx.uint32)
        xg = xr[:1].reshape(1, 1, 1, k)
        y = metal.tq_gather_matmul(xg, codes, scales, idx, bits, 32, 20, k)
        ref = reference.tq_gather_matmul(xg, codes, scales, idx, bits, 32, 20, k)
        assert mx.allclose(y, ref, atol=1e-4).item()
    assert dispatch.describe()["matvec"] == "metal"


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs MLX's Metal backend (macOS)")
@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("per_launch", [3, 1])
def test_metal_prefill_experts_match_the_reference(monkeypatch, bits, per_launch):
    """Prefill's experts on Metal (more pairs than the gathered GEMV takes): the experts in
    use decoded, in one launch or one a launch, then MLX's gather_mm, in each dtype."""
    qts, x, xr, codes, scales = _case(bits, n=64, inp=300)
    k = qts[0].spec.padded_in
    monkeypatch.setattr(tiles, "CHUNK", per_launch * 64 * k)
    with mx.stream(mx.gpu):
        xg = mx.random.normal((40, 1, 1, k))
        idx = (mx.random.uniform(shape=(40, 2)) * 3).astype(mx.uint32)
        want = reference.tq_gather_matmul(xg, codes, scales, idx, bits, 32, 64, k)
        for dtype, tol in ((mx.float32, 1e-4), (mx.float16, 4e-3), (mx.bfloat16, 2e-2)):
            y = metal.tq_gather_matmul(xg, codes, scales, idx, bits, 32, 64, k, out_dtype=dtype)
            err = mx.max(mx.abs(y.astype(mx.float32) - want)).item() / mx.max(mx.abs(want)).item()
            assert y.shape == want.shape and y.dtype == dtype and err < tol, (dtype, err)


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs MLX's Metal backend (macOS)")
@pytest.mark.parametrize("bits", WIDTHS)
def test_metal_prefill_matches_the_reference(bits):
    qts, *_ = _case(bits, n=300, inp=1000, experts=1)
    qt, k = qts[0], qts[0].spec.padded_in
    with mx.stream(mx.gpu):
        want = reference.dequantize(qt.codes, qt.scales, bits, 32, k)
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            w = metal.dequantize(qt.codes, qt.scales, bits, 32, k, dtype)
            assert mx.array_equal(w, want.astype(dtype)).item(), dtype
        x = mx.random.normal((40, k))
        ref = reference.tq_matmul(x, qt.codes, qt.scales, bits, 32, 300, k)
        for dtype, tol in ((mx.float32, 1e-5), (mx.float16, 4e-3), (mx.bfloat16, 2e-2)):
            y = metal.tq_matmul(x.astype(dtype), qt.codes, qt.scales, bits, 32, 300, k,
                                chunk=100 * k)
            err = mx.max(mx.abs(y.astype(mx.float32) - ref)).item() / mx.max(mx.abs(ref)).item()
            assert y.dtype == dtype and err < tol, (dtype, err)
    assert dispatch.describe()["matmul"] == "metal"


# ---------------------------------------------------------------------------- emulated


def _emulate(tmp_path, x, codes, scales, levels, indices, bits, gs, n, k, gather):
    t, m, _ = x.shape
    words, groups = codes.shape[-1], k // gs
    body = metal.SOURCE.replace("acc = simd_sum(acc);\n    if (lane == 0u) {", "{")
    body = body.replace("] = acc;", "] += acc;")  # lanes run one after another and add up
    assert "simd_sum" not in body and body.count("] += acc;") == 1, "update this emulation"
    b = 0 if bits == "ternary" else bits
    program = f"""
#include <cstdint>
#include <cstdio>
#include <vector>
typedef uint32_t uint; typedef float float16_t;
struct uint3 {{ uint x, y, z; }};
{metal.HEADER}
template <int BITS, bool GATHER, int NROWS, int NWORDS, int NGROUPS, int GSIZE, int KDIM, int MROWS>
void kernel_body(const float* x, const uint32_t* codes, const float16_t* scales,
                 const float* levels, const uint32_t* indices, float* y,
                 uint thread_index_in_simdgroup, uint3 threadgroup_position_in_grid,
                 uint3 thread_position_in_grid) {{
{body}
}}
int main() {{
  std::vector<float> x({x.size}), s({scales.size}), lv({levels.size}), y({t * m * n}, 0.f);
  std::vector<uint32_t> c({codes.size}), idx({indices.size});
  for (auto& v : x) scanf("%f", &v);
  for (auto& v : c) scanf("%u", &v);
  for (auto& v : s) scanf("%f", &v);
  for (auto& v : lv) scanf("%f", &v);
  for (auto& v : idx) scanf("%u", &v);
  for (uint t = 0; t < {t}; ++t) for (uint m = 0; m < {m}; ++m)
    for (uint row = 0; row < {n}; ++row) for (uint lane = 0; lane < 32; ++lane)
      kernel_body<{b}, {str(gather).lower()}, {n}, {words}, {groups}, {gs}, {k}, {m}>(
          x.data(), c.data(), s.data(), lv.data(), idx.data(), y.data(),
          lane, uint3{{row, 0, 0}}, uint3{{row * 32 + lane, m, t}});
  for (auto v : y) printf("%.9g\\n", v);
}}
"""
    src, exe = tmp_path / "kernel.cpp", tmp_path / "kernel"
    src.write_text(program)
    subprocess.run([CXX, "-O1", "-std=c++17", "-w", str(src), "-o", str(exe)], check=True)
    arrays = (x, codes, scales.astype(mx.float32), levels, indices)
    data = " ".join(" ".join(map(repr, np.array(a).ravel().tolist())) for a in arrays)
    out = subprocess.run([str(exe)], input=data, capture_output=True, text=True, check=True)
    return np.array(out.stdout.split(), dtype=np.float32).reshape(t, m, n)


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler to emulate the kernel source")
@pytest.mark.parametrize("bits", WIDTHS)
def test_metal_kernel_source_computes_what_the_reference_does(tmp_path, bits):
    qts, x, xr, codes, scales = _case(bits)
    k, levels = qts[0].spec.padded_in, reference.levels(bits)
    one = mx.zeros((1,), dtype=mx.uint32)
    y = _emulate(tmp_path, xr.reshape(1, 2, k), qts[0].codes, qts[0].scales, levels, one,
                 bits, 32, 20, k, gather=False)
    np.testing.assert_allclose(y[0], np.array(x @ decode(qts[0]).T), atol=1e-4)
    idx = mx.array([2, 0, 1], dtype=mx.uint32)
    xg = mx.broadcast_to(xr[:1], (3, 1, k))
    y = _emulate(tmp_path, xg, codes, scales, levels, idx, bits, 32, 20, k, gather=True)
    ref = reference.tq_gather_matmul(xg, codes, scales, idx, bits, 32, 20, k)
    np.testing.assert_allclose(y, np.array(ref), atol=1e-4)


def _emulate_dequant(tmp_path, codes, scales, levels, bits, gs, k):
    """`metal.DEQUANT_SOURCE` compiled as C++ (float for the output type), one call a
    (row, column) thread: the weights it writes."""
    rows, words = codes.shape
    b = 0 if bits == "ternary" else bits
    program = f"""
#include <cstdint>
#include <cstdio>
#include <vector>
typedef uint32_t uint; typedef float float16_t;
struct uint3 {{ uint x, y, z; }};
{metal.HEADER}
template <typename T, int BITS, int NWORDS, int NGROUPS, int GSIZE, int KDIM>
void kernel_body(const uint32_t* codes, const float16_t* scales, const float* levels, T* w,
                 uint3 thread_position_in_grid) {{
{metal.DEQUANT_SOURCE}
}}
int main() {{
  std::vector<float> s({scales.size}), lv({levels.size}), w({rows * k + 8}, -1.f);
  std::vector<uint32_t> c({codes.size});
  for (auto& v : c) scanf("%u", &v);
  for (auto& v : s) scanf("%f", &v);
  for (auto& v : lv) scanf("%f", &v);
  // rows from the last: a thread past its row's end would overwrite the next row's start
  for (uint row = {rows}; row-- > 0;) for (uint col = 0; col < {k + 7}; ++col)
    kernel_body<float, {b}, {words}, {k // gs}, {gs}, {k}>(
        c.data(), s.data(), lv.data(), w.data(), uint3{{col, row, 0}});
  for (auto v : w) printf("%.9g\\n", v);
}}
"""
    src, exe = tmp_path / "dequant.cpp", tmp_path / "dequant"
    src.write_text(program)
    subprocess.run([CXX, "-O1", "-std=c++17", "-w", str(src), "-o", str(exe)], check=True)
    arrays = (codes, scales.astype(mx.float32), levels)
    data = " ".join(" ".join(map(repr, np.array(a).ravel().tolist())) for a in arrays)
    out = subprocess.run([str(exe)], input=data, capture_output=True, text=True, check=True)
    w = np.array(out.stdout.split(), dtype=np.float32)
    assert (w[rows * k:] == -1).all()  # nothing written past the last row
    return w[: rows * k].reshape(rows, k)


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler to emulate the kernel source")
@pytest.mark.parametrize("bits", WIDTHS)
def test_metal_prefill_decode_source_writes_the_reference_weights(tmp_path, bits):
    """Threads past the row's end (a grid rounded up) write nothing; every weight is the
    reference's levels[code] * scale, exactly."""
    qts, *_ = _case(bits, experts=1)
    qt, k = qts[0], qts[0].spec.padded_in
    w = _emulate_dequant(tmp_path, qt.codes, qt.scales, reference.levels(bits), bits, 32, k)
    want = np.array(reference.dequantize(qt.codes, qt.scales, bits, 32, k))
    np.testing.assert_array_equal(w, want)


@pytest.mark.parametrize("per_launch", [2, 1])
def test_metal_prefill_experts_decode_the_experts_in_use_for_gather_mm(monkeypatch, per_launch):
    """A prefill's many pairs: the experts in use decoded by `metal.dequantize` (stood in
    for here by the reference's arithmetic: the wiring runs on any machine) in the
    output's dtype, a run of at most `tiles.CHUNK` weights a launch, then MLX's gather_mm
    (`tiles.gathered_matmul`); the reference's results."""
    decoded = []

    def fake(codes, scales, bits, group_size, padded_in, out_dtype=mx.float16):
        decoded.append((codes.shape[0], out_dtype))
        return reference.dequantize(codes, scales, bits, group_size, padded_in).astype(out_dtype)

    monkeypatch.setattr(metal, "dequantize", fake)
    qts, x, xr, codes, scales = _case(3)
    k = qts[0].spec.padded_in
    monkeypatch.setattr(tiles, "CHUNK", per_launch * 20 * k)
    xg = mx.broadcast_to(xr[:1], (20, 1, k))  # 20 pairs: past the gathered GEMV's 16 rows
    idx = mx.array([0, 2] * 10, dtype=mx.uint32)
    y = metal.tq_gather_matmul(xg, codes, scales, idx, 3, 32, 20, k, out_dtype=mx.float32)
    ref = reference.tq_gather_matmul(xg, codes, scales, idx, 3, 32, 20, k)
    np.testing.assert_allclose(np.array(y), np.array(ref), atol=1e-4)
    # experts 0 and 2: in one launch, or one a launch
    assert decoded == ([(40, mx.float32)] if per_launch == 2 else [(20, mx.float32)] * 2)

"""The Metal trellis GEMV (`kernels/metal_trellis.py`) against `stages.trellis.decode_rows`
and a float64 product.

On macOS with Metal the kernel runs for real (marked `metal`). Everywhere else its header
and body compile as C++ (as `tests/test_kernels_metal.py` does for the scalar kernels: a
loop over the 32 lanes stands in for a simdgroup, each lane's total added to the output),
so the states' bit windows, the tail-biting circle and the byte sums are checked on Linux.
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import metal_trellis
from turboquant.stages import trellis
from turboquant.stages.trellis import TrellisCode

CXX = shutil.which("g++") or shutil.which("clang++")
CASES = [(2, 16, 1, 256), (3, 16, 1, 256), (4, 16, 1, 256), (3, 12, 2, 128), (2, 20, 1, 32)]


def _case(code: TrellisCode, rows: int, padded: int, group_size: int, tokens: int = 2):
    rng = np.random.default_rng(code.bits * 10 + code.values)
    words = rng.integers(0, 2**32, size=(rows, padded * code.bits // 32),
                         dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.01, 0.1, size=(rows, padded // group_size)).astype(np.float16)
    x = rng.standard_normal((tokens, padded)).astype(np.float32)
    return x, words, scales


def _want(code, x, words, scales, group_size, block):
    w = trellis.decode_rows(code, words, scales, group_size, block).astype(np.float64)
    return x.astype(np.float64) @ w.T


def _emulate(tmp_path, code, x, words, scales, group_size, block):
    tokens, k = x.shape
    rows = words.shape[0]
    body = metal_trellis.SOURCE.replace("acc = simd_sum(acc);\n    if (lane == 0u) {", "{")
    body = body.replace("] = T(acc * TQ_INV_STD);", "] += T(acc * TQ_INV_STD);")
    assert "simd_sum" not in body and body.count("] += T(") == 1, "update this emulation"
    args = dict(metal_trellis.template(code, block, group_size, k, rows, mx.float32))
    del args["T"]
    params = ", ".join(f"int {name}" for name in args)
    values = ", ".join(str(v) for v in args.values())
    program = f"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
using std::min;
typedef uint32_t uint; typedef float float16_t;
struct uint3 {{ uint x, y, z; }};
{metal_trellis.header()}
template <typename T, {params}>
void kernel_body(const float* x, const uint32_t* codes, const float16_t* scales, float* y,
                 uint thread_index_in_simdgroup, uint3 threadgroup_position_in_grid,
                 uint3 thread_position_in_grid) {{
{body}
}}
int main() {{
  std::vector<float> x({x.size}), s({scales.size}), y({tokens * rows}, 0.f);
  std::vector<uint32_t> c({words.size});
  for (auto& v : x) scanf("%f", &v);
  for (auto& v : c) scanf("%u", &v);
  for (auto& v : s) scanf("%f", &v);
  for (uint t = 0; t < {tokens}; ++t)
    for (uint row = 0; row < {rows}; ++row) for (uint lane = 0; lane < 32; ++lane)
      kernel_body<float, {values}>(x.data(), c.data(), s.data(), y.data(), lane,
                                  uint3{{row, 0, 0}}, uint3{{row * 32 + lane, t, 0}});
  for (auto v : y) printf("%.9g\\n", v);
}}
"""
    src, exe = tmp_path / "trellis.cpp", tmp_path / "trellis"
    src.write_text(program)
    subprocess.run([CXX, "-O1", "-std=c++17", "-w", str(src), "-o", str(exe)], check=True)
    arrays = (x, words, scales.astype(np.float32))
    data = " ".join(" ".join(map(repr, a.ravel().tolist())) for a in arrays)
    out = subprocess.run([str(exe)], input=data, capture_output=True, text=True, check=True)
    return np.array(out.stdout.split(), dtype=np.float64).reshape(tokens, rows)


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler to emulate the kernel source")
@pytest.mark.parametrize("bits, state_bits, values, block", CASES)
def test_metal_trellis_source_computes_the_reference_product(tmp_path, bits, state_bits, values,
                                                             block):
    code = TrellisCode(state_bits, bits, values)
    x, words, scales = _case(code, 12, 320, 32)  # blocks of `block` and a shorter last one
    y = _emulate(tmp_path, code, x, words, scales, 32, block)
    want = _want(code, x, words, scales, 32, block)
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs MLX's Metal backend (macOS)")
@pytest.mark.parametrize("bits, state_bits, values, block", CASES)
def test_metal_trellis_gemv_matches_the_reference(bits, state_bits, values, block):
    code = TrellisCode(state_bits, bits, values)
    x, words, scales = _case(code, 300, 4160, 64, tokens=3)
    with mx.stream(mx.gpu):
        y = metal_trellis.matvec(mx.array(x), mx.array(words), mx.array(scales), code, block,
                                 64, 300, 4160)
    want = _want(code, x, words, scales, 64, block)
    assert np.abs(np.array(y) - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler to emulate the kernel source")
@pytest.mark.parametrize("bits, state_bits, values, block", [(3, 16, 1, 256), (4, 12, 2, 128)])
def test_metal_trellis_version_2_computes_the_reference_product(tmp_path, bits, state_bits,
                                                                values, block):
    """Trellis version 2 (no shift-xor): the same source, its VERSION argument 2."""
    code = TrellisCode(state_bits, bits, values, version=2)
    x, words, scales = _case(code, 12, 320, 32)
    y = _emulate(tmp_path, code, x, words, scales, 32, block)
    want = _want(code, x, words, scales, 32, block)
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-5
    v1 = _want(TrellisCode(state_bits, bits, values), x, words, scales, 32, block)
    assert np.abs(y - v1).max() / np.abs(v1).max() > 0.1  # another codebook

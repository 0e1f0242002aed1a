"""The Metal KV decode kernel (`kernels/metal_kv.py`) against the reference.

On macOS with Metal it runs for real (marked `metal`). Everywhere else its header and body
compile as C++: 32 threads and a barrier stand in for a simdgroup and its `simd_sum`, so
the unpacking, the strides, the online softmax and the chunk merge are tested on Linux.
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import metal_kv
from turboquant.kernels.kv_reference import KVParts, PackedKV, kv_quantize, tq_attention

CXX = shutil.which("g++") or shutil.which("clang++")


def make_parts(b=1, kv=2, c=300, kd=128, dv=128, bits=(4, 3), sink=4, tail=20, lo=3,
               spare=5, seed=0):
    """(KVParts, buffers): the compressed span a slice [lo, lo + c) of bigger buffers, as the
    cache keeps it; buffers maps each packed array to (its whole buffer in numpy, the
    slice's first element in it) for the emulation."""
    keys = mx.random.split(mx.random.key(seed), 5)
    comp_k = mx.random.normal((b, kv, c, kd), key=keys[0]) * 2.0
    comp_v = mx.random.normal((b, kv, c, dv), key=keys[1])
    kc, kn = kv_quantize(comp_k, bits[0], 99 + seed, True)
    vc, vn = kv_quantize(comp_v, bits[1], 99 + seed, True)
    buffers = {}

    def slab(name, x):
        buf = np.zeros((b, kv, lo + c + spare, *x.shape[3:]), dtype=np.asarray(x).dtype)
        buf[:, :, lo : lo + c] = np.asarray(x)
        buffers[name] = (buf, lo * int(np.prod(buf.shape[3:], dtype=np.int64)))
        return mx.array(buf)[:, :, lo : lo + c]

    packed = PackedKV(slab("k_codes", kc), slab("k_norms", kn), slab("v_codes", vc),
                      slab("v_norms", vn), bits[0], bits[1], 99 + seed, kd, dv)
    fp = [mx.random.normal((b, kv, n, d), key=k).astype(mx.float16)
          for n, d, k in ((sink, kd, keys[2]), (sink, dv, keys[3]), (tail, kd, keys[4]),
                          (tail, dv, keys[2]))]
    parts = KVParts(fp[0] if sink else None, fp[1] if sink else None, packed,
                    fp[2] if tail else None, fp[3] if tail else None)
    return parts, buffers


# ---------------------------------------------------------------------------- on Metal


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs MLX's Metal backend (macOS)")
@pytest.mark.parametrize("bits", [(4, 3), (8, 3), (3, 3), (2, 4)])
def test_metal_decode_matches_the_reference(bits):
    parts, _ = make_parts(bits=bits, c=700)
    q = mx.random.normal((1, 8, 1, 128), key=mx.random.key(5))
    with mx.stream(mx.gpu):
        got = metal_kv.decode_attention(q, parts, 0.1)
        want = tq_attention(q, parts, 0.1)
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


# ---------------------------------------------------------------------------- emulated


def _strides(buf: np.ndarray) -> list[int]:
    return [st // buf.itemsize for st in buf.strides]


def _emulate(tmp_path, q_rot: np.ndarray, packed: PackedKV, buffers: dict, scale: float):
    """The kernel's source compiled as C++ and run over the cache's buffers (each packed
    array its slice's first element and its buffer's strides, as MLX passes a strided
    slice): (part_m, part_s, part_acc)."""
    rows, kd = q_rot.shape
    dv, kv = packed.v_dim, packed.k_codes.shape[1]
    r = rows // (packed.k_codes.shape[0] * kv)
    nch = -(-packed.length // metal_kv.TOKENS)
    names = ["k_codes", "k_norms", "v_codes", "v_norms"]
    bufs = [buffers[n][0] for n in names]
    offsets = [buffers[n][1] for n in names]
    consts = np.asarray(metal_kv.consts(packed.bits_k, packed.bits_v, kd, dv, scale))
    shape = ", ".join(map(str, packed.k_codes.shape))
    strides = ["{" + ", ".join(map(str, _strides(b))) + "}" for b in bufs]
    program = f"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>
typedef uint32_t uint;
struct uint3 {{ uint x, y, z; }};
using std::exp; using std::max; using std::min;
static std::barrier<>* g_bar;
static float g_vals[32];
static thread_local uint t_lane;
float simd_sum(float v) {{  // 32 threads stand in for the simdgroup
  g_vals[t_lane] = v;
  g_bar->arrive_and_wait();
  float s = 0.f;
  for (int i = 0; i < 32; ++i) s += g_vals[i];
  g_bar->arrive_and_wait();
  return s;
}}
{metal_kv.HEADER}
template <int KD, int DV, int BK, int BV, int R, int KV, int TOKENS>
void kernel_body(const float* q_rot, const uint32_t* k_codes, const int* k_codes_shape,
                 const long* k_codes_strides, const float* k_norms, const long* k_norms_strides,
                 const uint32_t* v_codes, const long* v_codes_strides, const float* v_norms,
                 const long* v_norms_strides, const float* consts, float* part_m, float* part_s,
                 float* part_acc, uint thread_index_in_simdgroup,
                 uint3 threadgroup_position_in_grid) {{
{metal_kv.SOURCE}
}}
template <typename T> std::vector<T> read(size_t n) {{
  std::vector<T> v(n);
  for (auto& x : v) {{ double d; if (scanf("%lf", &d) != 1) throw 1; x = T(d); }}
  return v;
}}
int main() {{
  auto q = read<float>({q_rot.size});
  auto kc = read<uint32_t>({bufs[0].size}); auto kn = read<float>({bufs[1].size});
  auto vc = read<uint32_t>({bufs[2].size}); auto vn = read<float>({bufs[3].size});
  auto cs = read<float>({consts.size});
  int kshape[4] = {{{shape}}};
  long ks[4] = {strides[0]}, kns[3] = {strides[1]}, vs[4] = {strides[2]}, vns[3] = {strides[3]};
  std::vector<float> pm({rows * nch}, -7.f), ps({rows * nch}, -7.f), pa({rows * nch * dv}, -7.f);
  std::barrier<> bar(32);
  g_bar = &bar;
  for (uint row = 0; row < {rows // r}; ++row) for (uint ch = 0; ch < {nch}; ++ch) {{
    std::vector<std::thread> lanes;
    for (uint lane = 0; lane < 32; ++lane) lanes.emplace_back([&, lane] {{
      t_lane = lane;
      kernel_body<{kd}, {dv}, {packed.bits_k}, {packed.bits_v}, {r}, {kv}, {metal_kv.TOKENS}>(
          q.data(), kc.data() + {offsets[0]}, kshape, ks, kn.data() + {offsets[1]}, kns,
          vc.data() + {offsets[2]}, vs, vn.data() + {offsets[3]}, vns, cs.data(), pm.data(),
          ps.data(), pa.data(), lane, uint3{{ch, row, 0}});
    }});
    for (auto& t : lanes) t.join();
  }}
  for (auto v : pm) printf("%.9g\\n", v);
  for (auto v : ps) printf("%.9g\\n", v);
  for (auto v : pa) printf("%.9g\\n", v);
}}
"""
    src, exe = tmp_path / "kv.cpp", tmp_path / "kv"
    src.write_text(program)
    subprocess.run([CXX, "-O1", "-std=c++20", "-pthread", "-w", str(src), "-o", str(exe)],
                   check=True)
    data = [q_rot, *bufs, consts]
    text = " ".join(" ".join(map(repr, np.asarray(x, dtype=np.float64).ravel().tolist()))
                    for x in data)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True)
    vals = np.array(out.stdout.split(), dtype=np.float32)
    n = rows * nch
    return (vals[:n].reshape(rows, nch), vals[n : 2 * n].reshape(rows, nch),
            vals[2 * n :].reshape(rows, nch, dv))


def _emulated_piece(tmp_path, buffers: dict):
    """`compressed_piece` with the kernel emulated over `buffers` (the merge is the real one)."""
    calls = []

    def piece(q_rot, packed, scale):
        b, kv, r, _, kd = q_rot.shape
        rows = b * kv * r
        ml, sl, acc = _emulate(tmp_path, np.asarray(q_rot).reshape(rows, kd), packed,
                               buffers, scale)
        calls.append(ml.shape)
        m, s, a = metal_kv.merge_chunks(mx.array(ml), mx.array(sl), mx.array(acc))
        return (m.reshape(b, kv, r, 1, 1), s.reshape(b, kv, r, 1, 1),
                a.reshape(b, kv, r, 1, packed.v_dim))

    piece.calls = calls
    return piece


@pytest.mark.skipif(CXX is None, reason="needs a C++20 compiler to emulate the kernel source")
@pytest.mark.parametrize("case, r", [
    (dict(bits=(4, 3), c=300), 4),  # 3 chunks, the last partial; GQA groups of 4
    (dict(bits=(8, 3), c=128, b=2, kv=1), 8),  # exactly one chunk, two batches, 8 rows
    (dict(bits=(3, 3), c=200, sink=0), 1),  # 3-bit keys: codes straddling words; MHA
    (dict(bits=(2, 4), c=150, kd=64, dv=96, tail=0), 3),  # other head dims (2 and 3 a lane)
])
def test_emulated_kernel_gives_the_reference_attention(tmp_path, case, r):
    parts, buffers = make_parts(**case)
    kd = parts.packed.k_dim
    h = parts.packed.k_codes.shape[1] * r
    q = mx.random.normal((parts.packed.k_codes.shape[0], h, 1, kd), key=mx.random.key(3))
    piece = _emulated_piece(tmp_path, buffers)
    got = tq_attention(q, parts, 0.1, compressed=piece)
    want = tq_attention(q, parts, 0.1)
    assert piece.calls, "the compressed span did not go through the kernel"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)


def test_merge_of_chunks_matches_one_softmax():
    """Chunk pieces (an empty one among them) merge into the whole span's piece."""
    rng = np.random.default_rng(0)
    s = rng.normal(size=(3, 10)).astype(np.float32) * 3
    v = rng.normal(size=(3, 10, 8)).astype(np.float32)
    pieces = []
    for a, e in ((0, 4), (4, 4), (4, 10)):  # the middle chunk is empty
        if e == a:
            pieces.append((np.full(3, -1e30, np.float32), np.zeros(3, np.float32),
                           np.zeros((3, 8), np.float32)))
            continue
        m = s[:, a:e].max(axis=1)
        p = np.exp(s[:, a:e] - m[:, None])
        pieces.append((m, p.sum(axis=1), np.einsum("rt,rtd->rd", p, v[:, a:e])))
    pm, ps, pa = (mx.array(np.stack([x[i] for x in pieces], axis=1)) for i in range(3))
    m, l, acc = metal_kv.merge_chunks(pm, ps, pa)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(acc / l), np.einsum("rt,rtd->rd", p, v) /
                               p.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_decode_attention_leaves_what_it_does_not_take_to_the_reference():
    parts, _ = make_parts(kd=80, dv=80)
    q = mx.zeros((1, 8, 1, 80))
    with pytest.raises(NotImplementedError, match="head dim 80"):
        metal_kv.decode_attention(q, parts, 0.1)
    parts, _ = make_parts()
    with pytest.raises(NotImplementedError, match="one query position"):
        metal_kv.decode_attention(mx.zeros((1, 8, 2, 128)), parts, 0.1)
    with pytest.raises(NotImplementedError, match="16 query heads per KV head"):
        metal_kv.decode_attention(mx.zeros((1, 32, 1, 128)), parts, 0.1)
    with pytest.raises(NotImplementedError, match="masks"):
        metal_kv.decode_attention(mx.zeros((1, 8, 1, 128)), parts, 0.1,
                                  mx.ones((1, parts.length), mx.bool_))


def test_metal_kernel_is_opt_in(monkeypatch):
    from turboquant.runtime import kv_attention

    monkeypatch.delenv("TURBOQUANT_METAL_KV", raising=False)
    assert kv_attention.builtin_kernel("metal") is None
    monkeypatch.setenv("TURBOQUANT_METAL_KV", "1")
    assert kv_attention.builtin_kernel("metal") is metal_kv.decode_attention

"""CUDA prefill (`kernels/cuda_dequant.py`): stored codes decoded to x's dtype tile by tile,
each tile through MLX's GEMM.

Everywhere: the kernel's index arithmetic (`emulate_codes8`, step for step the kernel's
`tq_codes8`) against the reference's unpacking, for every width and any words; `matmul`,
the group prefill and the experts' prefill with the launches replaced by the reference's
arithmetic (so which launches run, in which dtype, and what is done around them are
checked without a GPU); and, where nvcc is installed, the kernel's source compiled for
every width and output dtype.
On the GPU machine (MLX's CUDA build) the kernel's values against the reference's, and
prefill through a model against the reference GEMM.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.kernels import cuda, cuda_dequant, cuda_rotate, group, reference, tiles
from turboquant.stages import encode

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
on_gpu = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
WIDTHS = (2, 3, 4, "ternary")


# ---------------------------------------------------------------------------- everywhere


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(WIDTHS), groups=st.integers(1, 6), data=st.data())
def test_emulated_codes_match_the_reference_unpacking(bits, groups, data):
    padded_in = 32 * groups
    words = reference.words_per_row(padded_in, bits)
    top = 3**20 - 1 if bits == "ternary" else 2**32 - 1
    row = data.draw(st.lists(st.integers(0, top), min_size=words, max_size=words))
    packed = np.array(row, dtype=np.uint32)
    want = np.asarray(reference.unpack(mx.array(packed), bits, padded_in)).tolist()
    got = []
    for col in range(0, padded_in, cuda_dequant.SPAN):
        got += cuda_dequant.emulate_codes8(packed, col, bits)
    assert got == want


def test_constants_name_the_stored_layout():
    c = dict(cuda_dequant.constants(3, 64, 4096, mx.bfloat16))
    assert c == dict(BITS=3, GS=64, PADDED=4096, WORDS=384, NSCALES=64, NLEVELS=8,
                     OutT=mx.bfloat16)
    assert dict(cuda_dequant.constants("ternary", 32, 96, mx.float32))["BITS"] == 5
    assert dict(cuda_dequant.constants("ternary", 32, 96, mx.float32))["NLEVELS"] == 3


@pytest.fixture
def decoded_by_reference(monkeypatch):
    """`cuda_dequant.dequantize` as the kernel would compute it, from the reference: the
    launches it was asked for are recorded (rows, dtype)."""
    launches = []

    def fake(codes, scales, bits, group_size, padded_in, out_dtype=mx.bfloat16):
        launches.append((codes.shape[0], out_dtype))
        return reference.dequantize(codes, scales, bits, group_size, padded_in).astype(out_dtype)

    monkeypatch.setattr(cuda_dequant, "dequantize", fake)
    return launches


@pytest.mark.parametrize("bits", WIDTHS)
def test_matmul_decodes_its_tiles_with_the_kernel(decoded_by_reference, bits):
    """CUDA's "matmul" is `tiles.tiled_matmul` with this module's decode (tests/
    test_kernels_tiles.py checks the tiling): the weight's spec reaches each launch."""
    out_f, in_f = 70, 100
    qt = encode(mx.random.normal((out_f, in_f), key=mx.random.key(1)), bits, 32, seed=5)
    p = qt.spec.padded_in
    x = mx.random.normal((2, 9, p), key=mx.random.key(2)).astype(mx.bfloat16)
    y = cuda_dequant.matmul(x, qt.codes, qt.scales, bits, 32, out_f, p, chunk=20 * p)
    assert y.shape == (2, 9, out_f) and y.dtype == mx.bfloat16
    assert decoded_by_reference == [(18, mx.bfloat16)] * 3 + [(16, mx.bfloat16)]
    want = reference.tq_matmul(x, qt.codes, qt.scales, bits, 32, out_f, p).astype(mx.float32)
    err = mx.max(mx.abs(y.astype(mx.float32) - want)).item() / mx.max(mx.abs(want)).item()
    assert err < 1e-2, err


def test_dequantize_refuses_other_dtypes():
    qt = encode(mx.random.normal((8, 64)), 4, 32, seed=1)
    with pytest.raises(ValueError, match="out_dtype"):  # before anything is launched
        cuda_dequant.dequantize(qt.codes, qt.scales, 4, 32, 64, mx.int32)


def _members(in_f, outs, bits=3, bias=False, seed=0):
    out = []
    for i, o in enumerate(outs):
        w = mx.random.normal((o, in_f), key=mx.random.key(seed + i)) * 0.05
        qt = encode(w, bits, 64, seed=1000 * seed + i + 1)
        b = mx.random.normal((o,), key=mx.random.key(50 + i)) if bias else None
        s = qt.spec
        out.append(group.Member(qt.codes, qt.scales, bits, s.group_size, in_f, o,
                                s.padded_in, s.seed, b))
    return tuple(out)


def _extras(kind, x, members):
    """Extras of this kind, in x's dtype (as a model's norms and activations are)."""
    def normal(shape):
        return mx.random.normal(shape).astype(x.dtype)

    if kind == "norm":
        return group.Extras(norm=normal((x.shape[-1],)), eps=1e-5)
    if kind == "gate":
        return group.Extras(up=normal(x.shape))
    if kind == "residual":
        return group.Extras(residual=normal((*x.shape[:-1], members[0].out_features)))
    return group.NO_EXTRAS


@pytest.fixture
def rotated_by_reference(monkeypatch, decoded_by_reference):
    """`cuda_rotate.rotate` as the kernel would compute it, from the reference rotation:
    each seed's `rotate_padded`, in the requested dtype (its calls recorded)."""
    calls = []

    def fake(x, seeds, width, out_dtype=mx.float16):
        calls.append((tuple(seeds), width, out_dtype))
        return mx.stack([group.rotate_padded(x, s, width) for s in seeds]).astype(out_dtype)

    monkeypatch.setattr(cuda_rotate, "rotate", fake)
    return calls


@pytest.mark.parametrize("kind, outs, bias", [
    ("norm", (96, 32, 32), True),  # q/k/v with biases (qwen2)
    ("plain", (64, 64), False),
    ("gate", (40,), False),  # down: silu(gate) * up in front
    ("residual", (40,), True),  # o_proj / down with the residual added after
])
def test_prefill_group_matches_the_reference_group(rotated_by_reference, kind, outs, bias):
    """More than 8 rows through CUDA's linear_group: one rotation for all members, in the
    dtype the products run in, then each member's tiled product; the reference group's
    results (launches stood in for by the reference's arithmetic)."""
    members = _members(100, outs, bias=bias)
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.random.normal((2, 7, 100), key=mx.random.key(9)).astype(dtype)
        extras = _extras(kind, x, members)
        got = cuda.linear_group(x, members, {}, extras)
        want = group.reference_group(x, members, None, extras)
        assert rotated_by_reference[-1] == (tuple(m.seed for m in members), 128, dtype)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            err = mx.max(mx.abs(g.astype(mx.float32) - w.astype(mx.float32))).item()
            assert err / mx.max(mx.abs(w.astype(mx.float32))).item() < (
                1e-5 if dtype == mx.float32 else 2e-2), (kind, dtype, err)


def test_prefill_group_leaves_mixed_widths_to_the_reference(rotated_by_reference):
    wide = _members(100, (16,))[0]
    narrow = group.Member(wide.codes, wide.scales, 3, 64, 100, 16, 192, wide.seed, None)
    with pytest.raises(NotImplementedError):
        cuda.prefill_group(mx.zeros((9, 100)), (wide, narrow))
    assert rotated_by_reference == []
    few = cuda.linear_group  # at 8 rows or fewer the decode plan runs, not this path
    with pytest.raises(NotImplementedError):
        few(mx.zeros((8, 100)), (wide, narrow))


def _experts(bits=3, experts=4, out_f=48, in_f=100):
    qts = [encode(mx.random.normal((out_f, in_f), key=mx.random.key(20 + e)) * 0.05, bits, 64,
                  seed=3) for e in range(experts)]
    return (mx.stack([q.codes for q in qts]), mx.stack([q.scales for q in qts]),
            qts[0].spec.padded_in)


@pytest.mark.parametrize("bits", [3, "ternary"])
def test_prefill_experts_run_one_tiled_product_per_expert_in_use(decoded_by_reference,
                                                                monkeypatch, bits):
    """Prefill's gathered experts on CUDA (more pairs x rows than the decode kernel takes)
    with TURBOQUANT_CUDA_GATHER_MM=0: the reference's grouping by expert, each expert in
    use one tiled product in the output dtype; the reference's results."""
    monkeypatch.setattr(cuda, "GATHER_MM", False)
    codes, scales, p = _experts(bits)
    x = mx.random.normal((1, 40, 1, 1, p), key=mx.random.key(3))  # (B, L, 1, 1, K) as SwitchGLU
    indices = mx.array([[[0, 2]] * 25 + [[2, 3]] * 15], dtype=mx.uint32)  # (B, L, k): 80 pairs
    for out_dtype in (mx.float32, mx.bfloat16):
        decoded_by_reference.clear()
        y = cuda.gather(x, codes, scales, indices, bits, 64, 48, p, out_dtype=out_dtype)
        want = reference.tq_gather_matmul(x, codes, scales, indices, bits, 64, 48, p)
        assert y.shape == want.shape == (1, 40, 2, 1, 48) and y.dtype == out_dtype
        assert decoded_by_reference == [(48, out_dtype)] * 3  # experts 0, 2 and 3, once each
        err = mx.max(mx.abs(y.astype(mx.float32) - want)).item() / mx.max(mx.abs(want)).item()
        assert err < (1e-5 if out_dtype == mx.float32 else 2e-2), err


# MLX's CUDA gather_mm multiplies float32 in TF32 (errors ~3e-4 on the H200)
GATHER_MM_F32_TOL = 1e-3 if CUDA else 1e-5


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("per_launch", [3, 2, 1])
def test_gather_mm_experts_match_the_reference(decoded_by_reference, monkeypatch, sort,
                                               per_launch):
    """TURBOQUANT_CUDA_GATHER_MM: the experts in use decoded in one launch (their rows
    stacked), then MLX's gather_mm over every pair with the routing renumbered; the
    reference's results, sorted routing (as mlx-lm sorts a long prompt's) included. More
    experts in use than `tiles.CHUNK` weights hold: a run of experts a launch."""
    monkeypatch.setattr(cuda, "GATHER_MM", True)
    codes, scales, p = _experts(3, experts=6)
    monkeypatch.setattr(tiles, "CHUNK", per_launch * 48 * p)
    x = mx.random.normal((1, 40, 1, 1, p), key=mx.random.key(3))
    indices = mx.array([[[5, 1]] * 25 + [[1, 3]] * 15], dtype=mx.uint32)  # experts 1, 3, 5
    if sort:  # as SwitchGLU sorts: one pair a row, in expert order
        flat = indices.flatten()
        order = mx.argsort(flat)
        x = x.reshape(40, 1, p)[order // 2]  # (80, 1, K): each pair's token row
        indices = flat[order]
    # float32: MLX's CPU gather_mm takes nothing else (the GPU test runs bf16)
    y = cuda.gather(x, codes, scales, indices, 3, 64, 48, p, out_dtype=mx.float32,
                    sorted_indices=sort)
    want = reference.tq_gather_matmul(x, codes, scales, indices, 3, 64, 48, p)
    assert y.shape == want.shape == ((80, 1, 48) if sort else (1, 40, 2, 1, 48))
    assert y.dtype == mx.float32
    launches = {3: [3 * 48], 2: [2 * 48, 48], 1: [48] * 3}[per_launch]
    assert decoded_by_reference == [(rows, mx.float32) for rows in launches]
    err = mx.max(mx.abs(y - want)).item() / mx.max(mx.abs(want)).item()
    assert err < GATHER_MM_F32_TOL, err


def test_few_pairs_stay_on_the_decode_kernel(decoded_by_reference, monkeypatch):
    codes, scales, p = _experts()
    calls = []
    monkeypatch.setattr(cuda, "bind_gather", lambda *a, **k: calls.append(a) or (
        lambda x, c, s, i: mx.zeros((1, 4, 2, 1, 48))))
    x = mx.zeros((1, 4, 1, 1, p))
    cuda.gather(x, codes, scales, mx.zeros((1, 4, 2), dtype=mx.uint32), 3, 64, 48, p)
    assert len(calls) == 1 and decoded_by_reference == []  # 8 pairs: a decode step's launch


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_kernel_source_compiles(tmp_path):
    from cuda_source import compile_with_nvcc, kernel_source

    src = ""
    for bits in WIDTHS:
        for dtype in cuda_dequant.OUT_DTYPES:
            consts = cuda_dequant.constants(bits, 64, 4096, dtype)
            name = f"tq_dequant_{cuda_dequant.kernel_bits(bits)}_{dtype}".replace("mlx.core.", "")
            src += kernel_source(name, ["codes", "scales", "levels"], ["out"],
                                 cuda_dequant._SOURCE, [mx.uint32, mx.float16, mx.float32],
                                 [dtype], consts)
    compile_with_nvcc(cuda_dequant.HEADER + src, tmp_path, "dequant")


# ---------------------------------------------------------------------------- on the GPU


@on_gpu
@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_kernel_decodes_the_reference_values(bits, group_size):
    out_f, in_f = 300, 1000
    qt = encode(mx.random.normal((out_f, in_f), key=mx.random.key(3)), bits, group_size, seed=9)
    p = qt.spec.padded_in
    want = reference.dequantize(qt.codes, qt.scales, bits, group_size, p)
    for dtype in cuda_dequant.OUT_DTYPES:
        got = cuda_dequant.dequantize(qt.codes, qt.scales, bits, group_size, p, dtype)
        assert got.shape == (out_f, p) and got.dtype == dtype
        assert mx.array_equal(got, want.astype(dtype)).item(), (bits, group_size, dtype)
    rows = cuda_dequant.dequantize(qt.codes[17:40], qt.scales[17:40], bits, group_size, p,
                                   mx.float32)  # a tile that starts mid-matrix
    assert mx.array_equal(rows, want[17:40]).item()


@on_gpu
@pytest.mark.parametrize("bits", WIDTHS)
def test_matmul_matches_the_reference_on_the_gpu(bits):
    out_f, in_f = 1000, 4096
    qt = encode(mx.random.normal((out_f, in_f), key=mx.random.key(4)) * 0.02, bits, 64, seed=2)
    p = qt.spec.padded_in
    x = mx.random.normal((3, 37, p), key=mx.random.key(5))
    want = reference.tq_matmul(x, qt.codes, qt.scales, bits, 64, out_f, p)
    scale = mx.max(mx.abs(want)).item()
    for dtype, tol in ((mx.float32, 1e-5), (mx.float16, 4e-3), (mx.bfloat16, 2e-2)):
        for chunk in (None, 300 * p):  # one tile; four, the last one short
            y = cuda_dequant.matmul(x.astype(dtype), qt.codes, qt.scales, bits, 64, out_f, p,
                                    chunk=chunk)
            assert y.dtype == dtype
            err = mx.max(mx.abs(y.astype(mx.float32) - want)).item() / scale
            assert err < tol, (bits, dtype, chunk, err)


@on_gpu
@pytest.mark.parametrize("in_f, outs, kind, bias", [
    (4096, (4096, 1024, 1024), "norm", True),  # Llama-3-8B q/k/v (with qwen2's biases)
    (4096, (14336, 14336), "norm", False),  # gate/up
    (14336, (4096,), "gate", False),  # down: a 28 x 512 rotation
    (992, (64,), "residual", True),  # a padded input
])
def test_prefill_group_matches_the_reference_on_the_gpu(in_f, outs, kind, bias):
    members = _members(in_f, outs, bias=bias)
    for dtype, tol in ((mx.float32, 1e-4), (mx.bfloat16, 3e-2)):
        x = mx.random.normal((300, in_f), key=mx.random.key(4)).astype(dtype)
        extras = _extras(kind, x, members)
        got = cuda.linear_group(x, members, {}, extras)
        want = group.reference_group(x, members, None, extras)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            g, w = g.astype(mx.float32), w.astype(mx.float32)
            err = mx.max(mx.abs(g - w)).item() / mx.max(mx.abs(w)).item()
            assert err < tol, (in_f, outs, dtype, err)


@on_gpu
@pytest.mark.parametrize("bits", [3, 4, "ternary"])
@pytest.mark.parametrize("gather_mm", [False, True, "3 experts a launch"])
def test_prefill_experts_match_the_reference_on_the_gpu(monkeypatch, bits, gather_mm):
    """Prefill's experts: a tiled product per expert in use, or (TURBOQUANT_CUDA_GATHER_MM)
    the experts in use decoded in one launch (or runs of three) and MLX's gather_mm."""
    monkeypatch.setattr(cuda, "GATHER_MM", bool(gather_mm))
    codes, scales, p = _experts(bits, experts=8, out_f=768, in_f=2048)
    if isinstance(gather_mm, str):
        monkeypatch.setattr(tiles, "CHUNK", 3 * 768 * p)
    x = mx.random.normal((1, 256, 1, 1, p), key=mx.random.key(8))
    indices = (mx.random.uniform(shape=(1, 256, 4)) * 8).astype(mx.uint32)
    want = reference.tq_gather_matmul(x, codes, scales, indices, bits, 64, 768, p)
    f32_tol = GATHER_MM_F32_TOL if gather_mm else 1e-4
    for out_dtype, tol in ((mx.float32, f32_tol), (mx.bfloat16, 2e-2)):
        y = cuda.gather(x, codes, scales, indices, bits, 64, 768, p, out_dtype=out_dtype)
        assert y.shape == want.shape and y.dtype == out_dtype
        err = mx.max(mx.abs(y.astype(mx.float32) - want)).item() / mx.max(mx.abs(want)).item()
        assert err < tol, (bits, gather_mm, out_dtype, err)


@on_gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_a_model_prefills_through_the_kernels(tmp_path, kind):
    """A loaded TurboQuant model's logits for a 40-token prompt on the GPU (prefill's
    rotation launches and tiled products) against the same weights on the CPU (the
    reference all the way)."""
    from test_runtime_fixtures import make_checkpoint, write_repo

    from turboquant.kernels import dispatch
    from turboquant.runtime import load

    config, weights = make_checkpoint(kind, seed=8)
    write_repo(tmp_path / kind, config, weights, bits=3)
    model, _ = load(tmp_path / kind)
    prompt = mx.array([[(7 * i) % 90 + 1 for i in range(40)]])
    assert dispatch.registered("cuda", "matmul") is cuda_dequant.matmul
    gpu = model(prompt)
    mx.eval(gpu)
    mx.set_default_device(mx.cpu)
    try:
        cpu = model(prompt)
        mx.eval(cpu)
    finally:
        mx.set_default_device(mx.gpu)
    err = float(mx.max(mx.abs(gpu - cpu)) / mx.max(mx.abs(cpu)))
    assert err < 2e-2, err

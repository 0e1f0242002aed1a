"""The CUDA linear path's Python side, on a machine without CUDA.

`kernels/cuda.py` keeps, per group of linears, the operands in the kernels' layout and
the arguments of its launch (the fused rotation + GEMV, or rotation then GEMV when
unfused). Without a GPU the launches cannot run, so `mx.fast.cuda_kernel` is replaced
here by a recorder that returns zeros of the requested shapes: the test checks what the
plan would launch (shapes, template values, grids, which arrays go where) against values
worked out independently below. Where nvcc is installed the kernels' sources are compiled
for every configuration the tests launch. The kernels' results are checked on the GPU
(tests/test_kernels_cuda_linear.py).
"""

from __future__ import annotations

import math
import re
import shutil

import mlx.core as mx
import pytest

from cuda_source import compile_with_nvcc, kernel_source
from hypothesis import given, settings
from hypothesis import strategies as st
from turboquant.kernels import cuda, cuda_dequant, cuda_gemv, cuda_linear, cuda_rotate, group
from turboquant.stages import encode


_DTYPES = {"float": mx.float32, "__half": mx.float16, "__nv_bfloat16": mx.bfloat16}


def source_constants(body: str) -> dict:
    """The constants a kernel's source defines in front (`cuda_gemv.constants_source`)."""
    found = {}
    constexpr = r"^  constexpr (int|bool) (\w+) = (-?\d+|true|false);$"
    for kind, name, value in re.findall(constexpr, body, re.M):
        found[name] = value == "true" if kind == "bool" else int(value)
    for name, ctype in re.findall(r"^  using (\w+) = (\w+);$", body, re.M):
        found[name] = _DTYPES[ctype]
    return found


class Recorder:
    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, template=()):
        """Records the call; `constants`: its template arguments, or the constants its
        kernel's source defines (the builder's argument that is a source)."""
        body = next((a for a in self.name if isinstance(a, str) and "constexpr" in a), "")
        self.calls.append(dict(inputs=inputs, template=dict(template), grid=grid,
                               constants=dict(template) or source_constants(body),
                               threadgroup=threadgroup, shapes=[tuple(s) for s in output_shapes],
                               dtypes=list(output_dtypes)))
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.fixture
def kernels(monkeypatch):
    made = {}

    def fake(module):
        def kernel(*args):
            key = (module.__name__.rsplit(".", 1)[-1], *args)
            return made.setdefault(key, Recorder(key))
        return kernel

    monkeypatch.setattr(cuda_gemv, "_kernel", fake(cuda_gemv))
    monkeypatch.setattr(cuda_rotate, "_kernel", fake(cuda_rotate))
    monkeypatch.setattr(cuda_linear, "_kernel", fake(cuda_linear))
    monkeypatch.setattr(cuda_dequant, "_kernel", fake(cuda_dequant))
    return made


@pytest.fixture
def unfused(monkeypatch):
    monkeypatch.setattr(cuda, "FUSED", False)


def _members(in_f, outs, bits=3, bias=False):
    out = []
    for i, o in enumerate(outs):
        qt = encode(mx.random.normal((o, in_f), key=mx.random.key(i)) * 0.02, bits, 64, seed=i + 1)
        s = qt.spec
        b = mx.ones((o,)) if bias else None
        out.append(group.Member(qt.codes, qt.scales, bits, 64, in_f, o, s.padded_in, s.seed, b))
    return tuple(out)


def _only(kernels, module):
    (rec,) = [r for k, r in kernels.items() if k[0] == module]
    return rec


def _grouped_call(members, prepared, x):
    """Run q/k/v-shaped members (128, 64, 64 rows) on x (1, 1, 256) bf16; check the outputs."""
    ys = cuda.linear_group(x, members, prepared)
    assert [y.shape for y in ys] == [(1, 1, 128), (1, 1, 64), (1, 1, 64)]
    assert [y.dtype for y in ys] == [mx.bfloat16] * 3


def test_a_group_is_one_launch(kernels):
    members = _members(256, (128, 64, 64), bias=True)
    prepared = {}
    x = mx.zeros((1, 1, 256), dtype=mx.bfloat16)
    _grouped_call(members, prepared, x)
    assert {k[0] for k in kernels} == {"cuda_linear"}
    rec = _only(kernels, "cuda_linear")
    # 3 outputs; float row + fp16 row; no extras
    assert rec.name[1:4] == (3, 4 * 256 + 2 * 256, (False, False, False, False))
    call = rec.calls[0]
    x_in, signs, mix, low, high, scales, levels, bias = call["inputs"]
    assert x_in is x  # no reshape, cast or copy before the kernel
    assert signs.shape == (3, 256) and mix.shape == (3, 1, 1)
    assert low.shape[0] == 256 and scales.shape == (256, 4) and bias.shape == (256,)
    assert call["template"] == {}  # the constants are in the source: no template arguments
    t = _constants(prepared)
    # 256 rows want 1 row per warp (cuda_gemv.rows_per_warp_for); blocks of 8 warps = 8 rows
    assert t == dict(InT=mx.bfloat16, OutT=mx.bfloat16, N=256, A=1, PADDED=256, BITS=3, GS=64,
                     OUT=256, ROWS_PER_WARP=1, WARPS=8, TILES=1, SEGS=3, END0=128,
                     END1=192, HAS_BIAS=True, PAIRS=0)
    body = rec.name[4]
    assert "constexpr int END1 = 192;" in body and "using InT = __nv_bfloat16;" in body
    assert call["grid"] == (32 * cuda_linear.THREADS, 1, 1)
    assert call["threadgroup"] == (cuda_linear.THREADS, 1, 1)
    assert call["shapes"] == [(1, 1, 128), (1, 1, 64), (1, 1, 64)]
    cuda.linear_group(mx.zeros((1, 1, 256), dtype=mx.bfloat16), members, prepared)
    assert len(rec.calls) == 2 and len(kernels) == 1  # the plan is reused: no new kernels


def _constants(prepared, index: int = 0) -> dict:
    """The constants of the plan's `index`-th fused launch."""
    return dict(list(prepared["cuda"].launches.values())[index].constants)


def test_a_single_linear_with_a_mixed_rotation(kernels):
    members = _members(992, (40,), bits=4)  # 31 x 32 rotation, padded input, no bias
    x = mx.zeros((3, 992), dtype=mx.float16)
    prepared = {}
    (y,) = cuda.linear_group(x, members, prepared)
    assert y.shape == (3, 40) and y.dtype == mx.float16
    rec = _only(kernels, "cuda_linear")
    call = rec.calls[0]
    t = _constants(prepared)
    assert (t["N"], t["A"], t["PADDED"], t["SEGS"], t["OUT"], t["HAS_BIAS"]) == (
        992, 31, 1024, 1, 40, False)
    assert call["inputs"][2].shape == (1, 31, 31)
    assert call["grid"] == (5 * cuda_linear.THREADS, 3, 1)  # 40 rows in blocks of 8, 3 tokens
    assert rec.name[1:3] == (1, 4 * 992 + 2 * 1024)


def test_extras_are_inputs_of_the_same_launch(kernels):
    """A norm rides on the q/k/v launch (its weight and eps as one float32 input, built
    once); a gate and a residual on down_proj's: still one launch per group."""
    qkv, down = _members(256, (128, 64, 64)), _members(512, (256,))
    prepared_qkv, prepared_down = {}, {}
    x = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    weight = mx.arange(256).astype(mx.bfloat16)
    for _ in range(2):
        cuda.linear_group(x, qkv, prepared_qkv, group.Extras(norm=weight, eps=1e-5))
    gate, up = mx.ones((1, 1, 512), mx.bfloat16), mx.ones((1, 1, 512), mx.bfloat16)
    res = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    (y,) = cuda.linear_group(gate, down, prepared_down, group.Extras(up=up, residual=res))
    assert y.shape == (1, 1, 256)
    by_mode = {k[3]: r for k, r in kernels.items()}
    assert set(by_mode) == {(True, False, False, False), (False, True, True, False)}
    norm_calls = by_mode[(True, False, False, False)].calls
    assert len(norm_calls) == 2
    nw = norm_calls[0]["inputs"][1]
    assert nw is norm_calls[1]["inputs"][1]  # packed once per norm weight
    assert nw.dtype == mx.float32 and nw.shape == (257,)
    assert mx.array_equal(nw[:256], weight.astype(mx.float32)).item()
    assert abs(nw[256].item() - 1e-5) < 1e-12
    (call,) = by_mode[(False, True, True, False)].calls
    assert call["inputs"][0] is gate and call["inputs"][1] is up and call["inputs"][2] is res
    assert cuda_linear.inputs((False, True, True, False)) == ["x", "up", "res", *cuda_linear.WEIGHTS]


def _same_launch(rec, ys) -> None:
    """The recorder's last two calls (an unbound call, then a bound one) launch alike."""
    plain, bound = rec.calls[-2:]
    assert [y.shape for y in ys] == plain["shapes"]
    assert {k: v for k, v in plain.items() if k != "inputs"} == {
        k: v for k, v in bound.items() if k != "inputs"}
    assert len(plain["inputs"]) == len(bound["inputs"])
    assert all(a is b for a, b in zip(plain["inputs"], bound["inputs"]))


def test_a_bound_call_launches_what_the_call_launches(kernels):
    """`bind_linear_group` (what a decode step runs every token): the same kernel, grid,
    shapes and inputs as `linear_group`, for each extras mode (those of a fused block read
    by a closure of their own, the rest through `_extra_inputs`), the weights bound once."""
    qkv, down = _members(256, (128, 64, 64), bias=True), _members(512, (256,))
    o = _members(256, (256,))
    x = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    weight = mx.arange(256).astype(mx.bfloat16)
    norm = group.Extras(norm=weight, eps=1e-5)
    res = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    gate, up = mx.ones((1, 1, 512), mx.bfloat16), mx.full((1, 1, 512), 2.0, mx.bfloat16)
    cases = [(qkv, x, group.NO_EXTRAS), (qkv, x, norm), (o, x, group.Extras(residual=res)),
             (down, gate, group.Extras(up=up, residual=res)),
             (o, x, group.Extras(norm=weight, eps=1e-5, residual=res)),
             (down, gate, group.Extras(up=up))]
    for members, row, extras in cases:
        prepared = {}
        cuda.linear_group(row, members, prepared, extras)
        run = cuda.bind_linear_group(row, members, prepared, extras)
        ys = run(row, extras)
        (rec,) = [r for k, r in kernels.items() if k[3] == extras.mode and k[1] == len(members)]
        _same_launch(rec, ys)
    assert len(kernels) == len(cases)


def test_a_bound_normed_call_follows_the_norm_weight_and_eps(kernels):
    """The bound norm launch keeps the last norm's packed operand: the same weight and eps
    reuse it, another weight or eps is packed (and launched) anew."""
    qkv = _members(256, (128, 64, 64))
    x = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    first, second = mx.arange(256).astype(mx.bfloat16), mx.ones((256,), mx.bfloat16)
    prepared = {}
    run = cuda.bind_linear_group(x, qkv, prepared, group.Extras(norm=first, eps=1e-5))
    for weight, eps in ((first, 1e-5), (first, 1e-5), (second, 1e-5), (second, 1e-6)):
        extras = group.Extras(norm=weight, eps=eps)
        run(x, extras)
        cuda.linear_group(x, qkv, prepared, extras)
        (rec,) = kernels.values()
        bound, plain = rec.calls[-2:]
        assert bound["inputs"][1] is plain["inputs"][1]
        assert mx.array_equal(bound["inputs"][1][:256], weight.astype(mx.float32)).item()
        assert abs(bound["inputs"][1][256].item() - eps) < 1e-12
    operands = [c["inputs"][1] for c in rec.calls[::2]]
    assert operands[0] is operands[1] and operands[1] is not operands[2]
    assert operands[2] is not operands[3]


def test_a_bound_call_declares_the_views_as_its_output_shapes(kernels, monkeypatch):
    """`views` (an attention's heads): the fused launch declares them as its outputs'
    shapes, so the outputs need no reshape; the same launch otherwise. Views that do not
    hold a member's output are refused, naming the widths."""
    qkv = _members(256, (128, 64, 64))
    x = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    views = ((1, 4, 1, 32), (1, 2, 1, 32), (1, 2, 1, 32))
    prepared = {}
    plain = cuda.bind_linear_group(x, qkv, prepared)(x, group.NO_EXTRAS)
    ys = cuda.bind_linear_group(x, qkv, prepared, views=views)(x, group.NO_EXTRAS)
    assert [y.shape for y in ys] == list(views)
    (rec,) = kernels.values()
    first, second = rec.calls
    assert second["shapes"] == list(views) and first["shapes"] == [y.shape for y in plain]
    assert second["grid"] == first["grid"]
    assert all(a is b for a, b in zip(second["inputs"][1:], first["inputs"][1:]))  # weights
    with pytest.raises(ValueError, match=r"widths \[128, 64, 64\]"):
        group.bind_linear_group(x, qkv, {}, views=((1, 4, 1, 32), (1, 2, 1, 32), (1, 2, 16)))
    monkeypatch.setattr(cuda, "FUSED", False)  # the two-launch path reshapes its outputs
    ys = cuda.bind_linear_group(x, qkv, {}, views=views)(x, group.NO_EXTRAS)
    assert [y.shape for y in ys] == list(views)
    # elsewhere (here: the CPU's kernel) the bound call reshapes the same values
    want = group.bind_linear_group(x, qkv, {})(x, group.NO_EXTRAS)
    got = group.bind_linear_group(x, qkv, {}, views=views)(x, group.NO_EXTRAS)
    assert all(mx.array_equal(a.reshape(v), b) for a, b, v in zip(want, got, views))


def test_a_bound_call_reads_x_in_the_shape_it_is_given(kernels, monkeypatch):
    """`given` (o_proj reading an attention's (B, heads, 1, D) output as its row): the
    fused launch takes that array as it is, no reshape, with the launch the row's call
    makes; elsewhere the bound call reshapes first, to the same values."""
    o = _members(256, (256,))
    row = mx.arange(256).astype(mx.bfloat16).reshape(1, 1, 256) / 256
    heads = row.reshape(1, 4, 1, 64)
    res = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    extras = group.Extras(residual=res)
    prepared = {}
    plain = cuda.bind_linear_group(row, o, prepared, extras)(row, extras)
    read = cuda.bind_linear_group(row, o, prepared, extras, given=(1, 4, 1, 64))(heads, extras)
    (rec,) = kernels.values()
    first, second = rec.calls
    assert second["inputs"][0] is heads  # no reshape before the launch
    assert second["shapes"] == first["shapes"] == [(1, 1, 256)]
    assert [y.shape for y in read] == [y.shape for y in plain]
    with pytest.raises(ValueError, match="cannot be read as"):
        group.bind_linear_group(row, o, {}, extras, given=(1, 4, 1, 32))
    monkeypatch.setattr(cuda, "FUSED", False)  # the two-launch path declines: rotate reads x
    with pytest.raises(NotImplementedError):
        cuda.bind_linear_group(row, o, {}, extras, given=(1, 4, 1, 64))
    # elsewhere (here: the CPU's kernel) the bound call reshapes first: the same values
    want = group.bind_linear_group(row, o, {}, extras)(row, extras)
    got = group.bind_linear_group(row, o, {}, extras, given=(1, 4, 1, 64))(heads, extras)
    assert got[0].shape == (1, 1, 256) and mx.array_equal(want[0], got[0]).item()


def test_binding_prefill_or_an_unfusable_group_is_left_to_the_reference(kernels):
    with pytest.raises(NotImplementedError):
        cuda.bind_linear_group(mx.zeros((9, 256)), _members(256, (64,)), {})
    with pytest.raises(NotImplementedError):
        cuda.bind_linear_group(mx.zeros((1, 1000)), _members(1000, (64,)), {})
    assert not kernels


def test_a_residual_needs_a_single_member():
    with pytest.raises(ValueError, match="single member"):
        cuda_linear.launch(n=256, a=1, padded=256, bits=3, group_size=64, ends=(128, 256),
                           lead=(1,), in_dtype=mx.float16, out_dtype=mx.float16,
                           add_bias=False, mode=(False, False, True, False))


def test_fused_rows_per_warp_keep_members_in_whole_blocks():
    # 4 rows per warp (32 per block): 4096 and 5120 are multiples
    assert cuda_linear.rows_per_warp_for((4096, 5120, 6144)) == 4
    assert cuda_linear.rows_per_warp_for((16, 2064, 4112)) == 2  # 16 rows a block at most
    # a member of 8 rows forces blocks of 8 rows
    assert cuda_linear.rows_per_warp_for((8, 32768)) == 1
    assert cuda_linear.rows_per_warp_for((28672,)) == cuda_gemv.rows_per_warp_for(28672) == 4
    assert cuda_gemv.rows_per_warp_for(1024) == 2 and cuda_gemv.rows_per_warp_for(256) == 1


def test_tiles_per_block_only_where_blocks_stay_many(kernels):
    # 28672 rows: 4 tiles of 32 rows still leave 224 blocks; q/k/v (6144 rows) keep 1
    assert cuda_linear.tiles_for((28672,), 4) == 4
    assert cuda_linear.tiles_for((14336, 28672), 4) == 4  # gate/up: the boundary is whole
    assert cuda_linear.tiles_for((14336 + 32, 28704), 4) == 1  # 14368 rows: not in 64s
    assert cuda_linear.tiles_for((4096, 5120, 6144), 4) == 1
    assert cuda_linear.tiles_for((4096,), 4) == 1
    launch = cuda_linear.launch(n=8192, a=1, padded=8192, bits=3, group_size=64,
                                ends=(28672,), lead=(1,), in_dtype=mx.bfloat16,
                                out_dtype=mx.bfloat16, add_bias=False)
    assert dict(launch.constants)["TILES"] == 4
    assert launch.grid == (224 * cuda_linear.THREADS, 1, 1)
    with pytest.raises(ValueError, match="multiples of a block"):
        cuda_linear.launch(n=256, a=1, padded=256, bits=3, group_size=64, ends=(64, 128),
                           lead=(1,), in_dtype=mx.bfloat16, out_dtype=mx.bfloat16,
                           add_bias=False, rows_per_warp=4, tiles=4)


def test_a_wide_row_needs_dynamic_shared_memory_within_the_limit():
    assert cuda_linear.shared_bytes(14336, 14336) == 4 * 14336 + 2 * 14336
    assert cuda_linear.shared_bytes(1001, 1024) == 4 * 1004 + 2 * 1024  # 16-byte aligned
    assert cuda_linear.fits(14336, 14336, 28)
    assert not cuda_linear.fits(65536, 65536, 8)


def test_unfused_a_group_is_one_rotation_and_one_gemv(kernels, unfused):
    members = _members(256, (128, 64, 64), bias=True)
    prepared = {}
    x = mx.zeros((1, 1, 256), dtype=mx.bfloat16)
    _grouped_call(members, prepared, x)
    (rot,), (gemv,) = ([r for k, r in kernels.items() if k[0] == n] for n in ("cuda_rotate", "cuda_gemv"))
    r, g = rot.calls[0], gemv.calls[0]
    assert r["inputs"][0] is x  # no reshape or copy before the kernel
    assert r["template"] == g["template"] == {}  # the constants are in the sources
    assert r["constants"] == dict(InT=mx.bfloat16, N=256, P=256, A=1, OUTW=256,
                                 THREADS=cuda_rotate.THREADS, OutT=mx.float16)
    assert r["grid"] == (cuda_rotate.THREADS, 3, 1) and r["shapes"] == [(3, 1, 256)]
    t = g["constants"]
    assert (t["SEGS"], t["END0"], t["END1"], t["OUT"], t["XROWS"]) == (3, 128, 192, 256, 1)
    assert t["HAS_BIAS"] is True and t["BITS"] == 3 and t["OutT"] == mx.bfloat16
    assert g["grid"][1] == 1 and g["shapes"] == [(1, 1, 128), (1, 1, 64), (1, 1, 64)]
    assert g["inputs"][0] is not x and g["inputs"][0].shape == (3, 1, 256)
    assert g["inputs"][7].shape == (256,)  # the members' biases, stacked
    assert "cuda" in prepared
    cuda.linear_group(mx.zeros((1, 1, 256), dtype=mx.bfloat16), members, prepared)
    assert len(rot.calls) == len(gemv.calls) == 2  # the plan is reused: no new kernels


def test_unfused_a_single_linear_skips_the_seed_axis(kernels, unfused):
    members = _members(992, (40,), bits=4)  # 31 x 32 rotation, padded input, no bias
    x = mx.zeros((3, 992), dtype=mx.float16)
    (y,) = cuda.linear_group(x, members, {})
    assert y.shape == (3, 40)
    rot = next(r for k, r in kernels.items() if k[0] == "cuda_rotate").calls[0]
    gemv = next(r for k, r in kernels.items() if k[0] == "cuda_gemv").calls[0]
    assert rot["shapes"] == [(3, 1024)] and rot["constants"]["OUTW"] == 1024
    assert (rot["constants"]["A"], rot["constants"]["P"]) == (31, 32)
    t = gemv["constants"]
    assert (t["SEGS"], t["OUT"], t["XROWS"], t["HAS_BIAS"], t["PADDED"]) == (1, 40, 0, False, 1024)
    assert gemv["grid"][1] == 3 and gemv["shapes"] == [(3, 40)]
    assert gemv["inputs"][5].tolist() == [0, 0, 0] and gemv["inputs"][6].tolist() == [0, 1, 2]


def test_prefill_is_one_rotation_then_each_members_tiles(kernels):
    """More than 8 rows: one rotation launch for both members, written in x's dtype (what
    the products multiply in), then each member's codes decoded (`cuda_dequant`)."""
    members = _members(256, (64, 32))
    ys = cuda.linear_group(mx.zeros((9, 256), dtype=mx.bfloat16), members, {})
    assert [(y.shape, y.dtype) for y in ys] == [((9, 64), mx.bfloat16), ((9, 32), mx.bfloat16)]
    calls = {name[0]: rec.calls for name, rec in kernels.items()}
    assert set(calls) == {"cuda_rotate", "cuda_dequant"}
    (rotation,) = calls["cuda_rotate"]
    assert rotation["shapes"] == [(2, 9, 256)] and rotation["dtypes"] == [mx.bfloat16]
    assert rotation["constants"]["OutT"] == mx.bfloat16
    assert [(c["shapes"], c["dtypes"]) for c in calls["cuda_dequant"]] == [
        ([(64, 256)], [mx.bfloat16]), ([(32, 256)], [mx.bfloat16])]


def test_unfusable_groups_are_left_to_the_reference(kernels):
    wide = _members(1000, (64,))  # 125 x 8: more segments than the rotation kernel holds
    prepared = {}
    for _ in range(2):  # decided once, kept
        with pytest.raises(NotImplementedError):
            cuda.linear_group(mx.zeros((1, 1000)), wide, prepared)
    assert prepared["cuda"] is cuda._UNFUSABLE
    mixed = _members(256, (64,), bits=3) + _members(256, (64,), bits=4)
    prepared = {}
    with pytest.raises(NotImplementedError):
        cuda.linear_group(mx.zeros((1, 256)), mixed, prepared)
    assert not kernels  # nothing was launched


def test_a_group_plan_and_a_gemv_layout_of_one_weight_are_kept_apart(kernels):
    """A one-member group's plan and the same weight's GEMV layout are cached on the same
    codes array: each under its own kind (a ternary group falls back to the GEMV)."""
    members = _members(256, (64,))
    cuda.linear_group(mx.zeros((1, 256)), members)
    m = members[0]
    y = cuda.matvec(mx.zeros((1, m.padded_in)), m.codes, m.scales, m.bits, m.group_size, 64,
                    m.padded_in)
    assert y.shape == (1, 64)


def test_without_a_cache_the_plan_lives_as_long_as_the_weights(kernels):
    members = _members(256, (64,))
    cuda.linear_group(mx.zeros((1, 256)), members)
    key = ("group", id(members[0].codes))
    assert key in cuda._PREPARED
    del members
    import gc

    gc.collect()
    assert key not in cuda._PREPARED


_NVCC_CASES = [  # (in_features, outs, bits, bias, x dtype, extras mode)
    (4096, (4096, 1024, 1024), 3, False, mx.bfloat16, (False, False, False, False)),
    (4096, (4096, 1024, 1024), 3, True, mx.bfloat16, (True, False, False, False)),
    (4096, (4096, 1024, 1024), 3, True, mx.bfloat16, (True, False, False, True)),  # RoPE
    (4096, (14336, 14336), 4, False, mx.float16, (True, False, False, False)),
    (4096, (4096,), 3, False, mx.bfloat16, (False, False, True, False)),
    (14336, (4096,), 2, True, mx.float32, (False, False, False, False)),
    (14336, (4096,), 3, False, mx.bfloat16, (False, True, True, False)),
    (992, (40,), 3, False, mx.bfloat16, (False, False, False, False)),
]


def _experts(n_experts, out_f, in_f, bits=3, group_size=64):
    """A switch layer's codes (E, out, words) and scales (E, out, groups), and padded_in."""
    qt = encode(mx.random.normal((n_experts * out_f, in_f), key=mx.random.key(3)) * 0.02,
                bits, group_size, seed=5)
    codes = qt.codes.reshape(n_experts, out_f, -1)
    return codes, qt.scales.reshape(n_experts, out_f, -1), qt.spec.padded_in


@pytest.fixture
def broadcast(monkeypatch):
    """The gathered path before the compact one (TURBOQUANT_CUDA_COMPACT_GATHER=0): x
    copied to every pair, int32 routing, float32 out then cast."""
    monkeypatch.setattr(cuda, "COMPACT_GATHER", False)


def test_gathered_experts_are_one_gemv_over_the_pairs(kernels, broadcast):
    codes, scales, padded = _experts(4, 64, 256)
    x = mx.zeros((1, 2, 1, 1, padded))  # mlx-lm's SwitchGLU: (B, L, 1, M=1, K)
    indices = mx.array([[[3, 0, 2], [1, 1, 0]]])  # (B, L, top-k)
    y = cuda.gather(x, codes, scales, indices, 3, 64, 64, padded)
    assert y.shape == (1, 2, 3, 1, 64) and y.dtype == x.dtype
    call = _only(kernels, "cuda_gemv").calls[0]
    pair_expert, pair_row = call["inputs"][5], call["inputs"][6]
    assert pair_expert.tolist() == [3, 0, 2, 1, 1, 0] and pair_row.tolist() == list(range(6))
    assert call["inputs"][0].shape == (6, padded) and call["inputs"][0].dtype == mx.float16
    assert call["inputs"][1].shape[0] == 4 * 64  # every expert's rows, stacked
    assert call["constants"]["OUT"] == 64 and call["grid"][1] == 6
    # two rows per pair: each row of a pair reads the pair's expert
    cuda.gather(mx.zeros((2, 1, 2, padded)), codes, scales, mx.array([[2], [0]]), 3, 64, 64,
                padded)
    again = _only(kernels, "cuda_gemv").calls[1]
    assert again["inputs"][5].tolist() == [2, 2, 0, 0] and again["inputs"][6].tolist() == [0, 1, 2, 3]
    assert again["inputs"][1] is call["inputs"][1]  # the layout is built once per switch layer


def test_gathered_experts_write_the_callers_dtype(kernels, broadcast):
    codes, scales, padded = _experts(4, 64, 256)
    x = mx.zeros((1, 1, 1, 1, padded))
    y = cuda.gather(x, codes, scales, mx.array([[[1, 2]]]), 3, 64, 64, padded,
                    out_dtype=mx.bfloat16)
    assert y.dtype == mx.bfloat16 and y.shape == (1, 1, 2, 1, 64)
    assert _only(kernels, "cuda_gemv").calls[0]["dtypes"] == [mx.float32]  # then cast


@pytest.fixture
def compact(monkeypatch):
    monkeypatch.setattr(cuda, "COMPACT_GATHER", True)


def _emulated_gemv(call, codes, scales, bits, padded):
    """What the GEMV computes from a recorded launch: for each (pair, row) entry p,
    expert pair_expert[p]'s decoded rows times x row pair_row[p]."""
    from turboquant.kernels import reference

    x, experts, rows = call["inputs"][0], call["inputs"][5], call["inputs"][6]
    w = reference.dequantize(codes, scales, bits, 64, padded)  # (E, out, padded)
    picked = w[experts.reshape(-1).astype(mx.int32)]  # (P, out, padded): read row-major
    xs = x.astype(mx.float32)[rows.astype(mx.int32)]  # (P, padded)
    return (picked @ xs[:, :, None])[..., 0]


def test_compact_gather_reads_each_tokens_row_through_pair_row(kernels, compact):
    from turboquant.kernels import reference

    codes, scales, padded = _experts(4, 64, 256)
    x = mx.random.normal((1, 2, 1, 1, padded), key=mx.random.key(7))  # SwitchGLU's gate/up
    indices = mx.array([[[3, 0, 2], [1, 1, 0]]], dtype=mx.uint32)  # as argpartition gives
    y = cuda.gather(x, codes, scales, indices, 3, 64, 64, padded, out_dtype=mx.bfloat16)
    assert y.shape == (1, 2, 3, 1, 64) and y.dtype == mx.bfloat16
    call = _only(kernels, "cuda_gemv").calls[0]
    assert call["inputs"][0].shape == (2, padded)  # x's own rows, not one per pair
    experts = call["inputs"][5]  # the router's indices as they come, read row-major
    assert experts.dtype == mx.uint32 and experts.reshape(-1).tolist() == [3, 0, 2, 1, 1, 0]
    assert call["inputs"][6].tolist() == [0, 0, 0, 1, 1, 1]
    assert call["dtypes"] == [mx.bfloat16]  # the kernel writes the caller's dtype
    want = reference.tq_gather_matmul(x, codes, scales, indices, 3, 64, 64, padded)
    got = _emulated_gemv(call, codes, scales, 3, padded).reshape(want.shape)
    assert mx.allclose(got, want, atol=2e-3, rtol=2e-3).item()


def test_compact_gather_with_rows_per_pair_and_x_per_pair(kernels, compact):
    codes, scales, padded = _experts(4, 64, 256)
    x = mx.random.normal((2, 1, 2, padded), key=mx.random.key(8))  # 2 rows a pair
    cuda.gather(x, codes, scales, mx.array([[2], [0]]), 3, 64, 64, padded)
    call = _only(kernels, "cuda_gemv").calls[0]
    assert call["inputs"][5].tolist() == [2, 2, 0, 0] and call["inputs"][6].tolist() == [0, 1, 2, 3]
    x = mx.zeros((1, 2, 3, 1, padded))  # down_proj: a row per pair already
    cuda.gather(x, codes, scales, mx.array([[[1, 2, 3], [0, 0, 1]]]), 3, 64, 64, padded)
    call = _only(kernels, "cuda_gemv").calls[1]
    assert call["inputs"][0].shape == (6, padded) and call["inputs"][6].tolist() == list(range(6))
    assert call["inputs"][5].dtype == mx.int32


def test_gathered_experts_prefill_through_the_tiled_product(kernels):
    """More pairs x rows than a decode step's launch takes: no GEMV launch, one tile decode
    per expert in use (all pairs here route to expert 0)."""
    codes, scales, padded = _experts(2, 32, 256)
    many = mx.zeros((cuda.GATHER_MAX_PAIR_ROWS + 1, 1, 1, padded))
    y = cuda.gather(many, codes, scales, mx.zeros((many.shape[0], 1), mx.int32), 3, 64, 32,
                    padded, out_dtype=mx.bfloat16)
    assert y.shape == (many.shape[0], 1, 1, 32) and y.dtype == mx.bfloat16
    assert {name[0] for name in kernels} == {"cuda_dequant"}
    (decode,) = [rec.calls for rec in kernels.values()]
    assert [c["shapes"] for c in decode] == [[(32, padded)]]


def test_ternary_runs_as_two_bit_codes(kernels):
    codes, scales, padded = _experts(2, 32, 256, bits="ternary")
    x = mx.zeros((1, 1, 1, padded))
    cuda.gather(x, codes, scales, mx.array([[1]]), "ternary", 64, 32, padded)
    call = _only(kernels, "cuda_gemv").calls[0]
    assert call["constants"]["BITS"] == 2
    levels = call["inputs"][4]
    assert levels.shape == (4,) and levels[3].item() == 0.0  # [-c, 0, c] and a spare
    assert cuda.matvec(x[0, 0], codes[0], scales[0], "ternary", 64, 32, padded).shape == (1, 32)
    assert _only(kernels, "cuda_gemv").calls[-1]["constants"]["BITS"] == 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_sources_compile_with_nvcc(tmp_path, kernels):
    """The fused kernel (and the unfused pair) for the shapes of a Llama layer and a mixed
    rotation, as mx.fast.cuda_kernel would build them."""
    src, seen = cuda_linear.source(3)[0], set()
    for i, (in_f, outs, bits, bias, dtype, mode) in enumerate(_NVCC_CASES):
        members = _members(in_f, outs, bits=bits, bias=bias)
        s = members[0]
        a, _ = cuda_rotate.factors(in_f, s.seed)
        launch = cuda_linear.launch(
            n=in_f, a=a, padded=cuda._padded64(s.padded_in), bits=bits, group_size=64,
            ends=tuple(sum(outs[: j + 1]) for j in range(len(outs))), lead=(1,),
            in_dtype=dtype, out_dtype=dtype, add_bias=bias, mode=mode,
            pairs=128 if mode[3] else 0)
        extra_dtypes = {"up": dtype, "nw": mx.float32, "res": dtype, "rope_pos": mx.int32,
                        "rope_inv": mx.float32}
        names = cuda_linear.inputs(mode)
        in_dtypes = [dtype, *(extra_dtypes[n] for n in names[1:-7]), mx.float32, mx.float32,
                     mx.uint32, mx.uint32, mx.float16, mx.float32, mx.float32]
        src += kernel_source(f"tq_linear_{i}", names, [f"out{j}" for j in range(len(outs))],
                             launch.body, in_dtypes, launch.dtypes, [])
        seen.add((len(outs), mode))
    assert {segs for segs, _ in seen} == {1, 2, 3} and len({m for _, m in seen}) == 5
    # the unfused pair: the GEMV for 1-3 members, the rotation with a static/dynamic row
    gemv_in = [mx.float16, mx.uint32, mx.uint32, mx.float16, mx.float32, mx.int32, mx.int32,
               mx.float32]
    for segs in (1, 2, 3):
        body = cuda_gemv.launch(bits=3, group_size=64, out_features=6144, padded=4096,
                                nscales=64, pairs=1, out_dtype=mx.bfloat16, rows_per_warp=2,
                                ends=(4096, 5120, 6144)[3 - segs:] if segs > 1 else (),
                                x_rows=1 if segs > 1 else 0).body
        src += kernel_source(f"tq_gemv_{segs}", cuda_gemv.INPUTS,
                             [f"out{j}" for j in range(segs)], body,
                             gemv_in, [mx.bfloat16] * segs, [])
    for dynamic, n, a in ((False, 4096, 1), (True, 14336, 28)):
        t = [("InT", mx.bfloat16), ("N", n), ("P", n // a), ("A", a), ("OUTW", n),
             ("THREADS", cuda_rotate.THREADS), ("OutT", mx.float16)]
        src += kernel_source(f"tq_rotate_{n}", ["x", "signs", "mix"], ["out"],
                             cuda_rotate.kernel_source(dynamic, a),
                             [mx.bfloat16, mx.float32, mx.float32], [mx.float16], t)
    compile_with_nvcc(src, tmp_path, "tq_linear")


def _same_gather_launch(plain: dict, bound: dict) -> None:
    """An unbound gather's launch and a bound one's: the same kernel arguments, the same
    layout and constant arrays, rows and routing of the same values and dtypes (the
    bound routing in the router's shape, read row-major), the same output sizes (the
    bound launch declares its output in the caller's shape: no reshape after it)."""
    same = ("inputs", "shapes")
    assert {k: v for k, v in plain.items() if k not in same} == {
        k: v for k, v in bound.items() if k not in same}
    assert [math.prod(s) for s in plain["shapes"]] == [math.prod(s) for s in bound["shapes"]]
    for i, (a, b) in enumerate(zip(plain["inputs"], bound["inputs"], strict=True)):
        if i in (0, 5):  # x's rows and the pairs' experts: built per call
            assert a.dtype == b.dtype and mx.array_equal(a, b.reshape(a.shape)).item(), i
        else:
            assert a is b, i


@pytest.mark.parametrize("x_shape, indices, m", [
    ((1, 1, 1, 1, 256), [[[3, 0, 2]]], 1),  # SwitchGLU's gate/up: x broadcast to the pairs
    ((1, 2, 1, 1, 256), [[[3, 0, 2], [1, 1, 0]]], 1),
    ((1, 1, 3, 1, 256), [[[1, 2, 3]]], 1),  # down_proj: a row per pair already
    ((2, 1, 2, 256), [[2], [0]], 2),  # two rows a pair
])
@pytest.mark.parametrize("dtype", [mx.uint32, mx.int32, mx.int64])
def test_a_bound_gather_launches_what_gather_launches(kernels, compact, x_shape, indices, m,
                                                     dtype):
    """`bind_gather` (what a switch layer runs every decode step): the same launch as
    `gather` for each routing dtype and pair shape, its result in the caller's dtype."""
    codes, scales, padded = _experts(4, 64, 256)
    x = mx.random.normal(x_shape, key=mx.random.key(9))
    idx = mx.array(indices, dtype=dtype)
    want = cuda.gather(x, codes, scales, idx, 3, 64, 64, padded, out_dtype=mx.bfloat16)
    run = cuda.bind_gather(x, codes, scales, idx, 3, 64, 64, padded, out_dtype=mx.bfloat16)
    got = run(x, codes, scales, idx)
    assert got.shape == want.shape and got.dtype == want.dtype == mx.bfloat16
    plain, bound = _only(kernels, "cuda_gemv").calls
    _same_gather_launch(plain, bound)
    assert bound["inputs"][5].size == len(plain["inputs"][6].tolist())
    assert bound["shapes"] == [got.shape]  # declared by the launch


def test_a_bound_gather_pads_rows_and_follows_other_codes(kernels, compact):
    """Rows padded to whole 64-code groups as `gather` pads them; other codes than the last
    call's bring their own layout (expert streaming's slot pools), the same codes again
    the one already built."""
    codes, scales, padded = _experts(4, 64, 280, bits=4, group_size=32)  # 288: 320 here
    others = codes + 1
    x, idx = mx.ones((1, 1, 1, 1, padded)), mx.array([[[0, 3]]], dtype=mx.uint32)
    run = cuda.bind_gather(x, codes, scales, idx, 4, 32, 64, padded)
    for c in (codes, codes, others, codes):
        cuda.gather(x, c, scales, idx, 4, 32, 64, padded)
        run(x, c, scales, idx)
        plain, bound = _only(kernels, "cuda_gemv").calls[-2:]
        _same_gather_launch(plain, bound)
        assert padded == 288 and bound["inputs"][0].shape == (1, 320)
        assert bound["inputs"][1] is cuda.prepared_experts(c, scales, 4, 32, padded)[0]


def test_binding_a_gather_for_prefill_is_left_to_the_reference(kernels, compact):
    codes, scales, padded = _experts(2, 32, 256)
    many = mx.zeros((cuda.GATHER_MAX_PAIR_ROWS + 1, 1, 1, padded))
    with pytest.raises(NotImplementedError):
        cuda.bind_gather(many, codes, scales, mx.zeros((many.shape[0], 1), mx.int32), 3, 64,
                         32, padded)
    assert not kernels


def test_a_bound_broadcast_gather_is_the_broadcast_gather(kernels, broadcast):
    codes, scales, padded = _experts(4, 64, 256)
    x, idx = mx.ones((1, 1, 1, 1, padded)), mx.array([[[1, 2]]])
    cuda.gather(x, codes, scales, idx, 3, 64, 64, padded, out_dtype=mx.bfloat16)
    y = cuda.bind_gather(x, codes, scales, idx, 3, 64, 64, padded, out_dtype=mx.bfloat16)(
        x, codes, scales, idx)
    assert y.dtype == mx.bfloat16
    plain, bound = _only(kernels, "cuda_gemv").calls
    _same_gather_launch(plain, bound)
    assert bound["dtypes"] == [mx.float32]  # then cast, as the broadcast path does


@pytest.fixture
def fused_gather(monkeypatch):
    """A switch layer's projection as one fused launch (TURBOQUANT_CUDA_FUSED_GATHER=1)."""
    monkeypatch.setattr(cuda, "FUSED_GATHER", True)


def test_a_fused_gather_rotates_the_unrotated_x_in_its_one_launch(kernels, fused_gather):
    """`bind_gather_linear`: the fused kernel (rotation + GEMV) over a decode step's pairs,
    each reading its expert's rows of the stacked layout against its token's x row as it
    comes (no rotation ops, cast or pad before the launch)."""
    codes, scales, padded = _experts(4, 64, 256)
    x = mx.random.normal((1, 2, 1, 1, 256), key=mx.random.key(4)).astype(mx.bfloat16)
    idx = mx.array([[[3, 0, 2], [1, 1, 0]]], dtype=mx.uint32)
    run = cuda.bind_gather_linear(x, codes, scales, idx, 3, 64, 64, padded, seed=5,
                                  out_dtype=mx.bfloat16)
    y = run(x, codes, scales, idx)
    assert y.shape == (1, 2, 3, 1, 64) and y.dtype == mx.bfloat16
    assert {k[0] for k in kernels} == {"cuda_linear"}  # no rotation or GEMV launch of its own
    rec = _only(kernels, "cuda_linear")
    assert rec.name[-1] is True  # the gathered kernel
    call = rec.calls[0]
    assert len(call["inputs"]) == len(cuda_linear.inputs(gather=True)) == 10
    x_in, signs, mix, low, high, scales64, levels, bias, pair_expert, pair_row = call["inputs"]
    assert x_in is x
    assert signs.shape == (1, 256) and mix.shape == (1, 1, 1)
    assert low is cuda.prepared_experts(codes, scales, 3, 64, padded)[0]
    # the router's indices as they come: the kernel reads them row-major
    assert pair_expert is idx and pair_expert.dtype == mx.uint32
    assert pair_row.tolist() == [0, 0, 0, 1, 1, 1]  # each pair's token row
    t = call["constants"]
    assert (t["N"], t["PADDED"], t["OUT"], t["SEGS"], t["BITS"], t["HAS_BIAS"]) == (
        256, 256, 64, 1, 3, False)
    assert call["grid"][1] == 6 and call["shapes"] == [(1, 2, 3, 1, 64)]  # the caller's
    body = rec.name[4]
    assert "const int expert = pair_expert[pair];" in body and "pair_row[pair]" in body


def test_a_fused_gather_can_be_turned_off_and_leaves_prefill_to_the_rest(kernels,
                                                                         monkeypatch):
    codes, scales, padded = _experts(2, 32, 256)
    x, idx = mx.zeros((1, 1, 1, 1, 256)), mx.array([[[1]]])
    many = mx.zeros((cuda.GATHER_MAX_PAIR_ROWS + 1, 1, 1, 256))
    with pytest.raises(NotImplementedError):
        cuda.bind_gather_linear(many, codes, scales, mx.zeros((many.shape[0], 1), mx.int32),
                                3, 64, 32, padded, seed=5)
    monkeypatch.setattr(cuda, "FUSED_GATHER", False)  # TURBOQUANT_CUDA_FUSED_GATHER=0
    with pytest.raises(NotImplementedError):
        cuda.bind_gather_linear(x, codes, scales, idx, 3, 64, 32, padded, seed=5)
    assert not kernels


def test_gathered_linear_sources_compile_with_nvcc(tmp_path, kernels):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    src = cuda_linear.source(1)[0]
    for i, (n, bits, dtype) in enumerate(((2048, 3, mx.bfloat16), (768, 4, mx.float16))):
        a, _ = cuda_rotate.factors(n, 5)
        launch = cuda_linear.launch(n=n, a=a, padded=cuda._padded64(n), bits=bits, group_size=64,
                                    ends=(256,), lead=(8,), in_dtype=dtype, out_dtype=dtype,
                                    add_bias=False, gather=True)
        in_dtypes = [dtype, mx.float32, mx.float32, mx.uint32, mx.uint32, mx.float16,
                     mx.float32, mx.float32, mx.uint32, mx.int32]
        src += kernel_source(f"tq_gather_linear_{i}", cuda_linear.inputs(gather=True), ["out0"],
                             launch.body, in_dtypes, launch.dtypes, [])
    compile_with_nvcc(src, tmp_path, "gather_linear")


@settings(max_examples=60, deadline=None)
@given(q_heads=st.integers(1, 6), kv_heads=st.integers(1, 3), half=st.integers(1, 24),
       v_rows=st.integers(0, 40))
def test_pair_order_puts_each_rope_pair_in_two_neighbouring_rows(q_heads, kv_heads, half,
                                                                 v_rows):
    """`cuda.pair_order`: a permutation of the stacked rows in which, in the queries' and
    the keys' members, stacked row 2i + h of each head is the head's row i + h * D / 2
    (the pair the kernel rotates together, as `_PAIRED_STORE` maps it back); other rows
    stay where they are."""
    head = 2 * half
    ends = (q_heads * head, (q_heads + kv_heads) * head, (q_heads + kv_heads) * head + v_rows)
    rows = cuda.pair_order(ends, head)
    assert sorted(rows) == list(range(ends[-1]))
    for start, stop in ((0, ends[0]), (ends[0], ends[1])):
        for first in range(start, stop, head):
            pairs = rows[first:first + head].reshape(-1, 2) - first
            assert pairs[:, 0].tolist() == list(range(half))
            assert (pairs[:, 1] - pairs[:, 0]).tolist() == [half] * half
    assert rows[ends[1]:].tolist() == list(range(ends[1], ends[-1]))


def test_a_q_k_v_plan_told_its_heads_pairs_its_rows_and_rotates_in_its_launch(kernels):
    """A plan built for RoPE over heads of 128 (`prepared["rope_dims"]`, what a fused
    block's q/k/v group tells it) holds the queries' and keys' rows (codes, high bits,
    scales, bias) in `pair_order`, and a RoPE call is its one launch with the position
    and inverse frequencies as inputs and PAIRS set. Without pairs (no rope_dims, or one
    row a warp) the launch declines RoPE (`group.bind_linear_group` then calls the
    module on the viewed outputs)."""
    import mlx.nn as nn

    members = _members(256, (1024, 512, 512), bias=True)  # 4 rows a warp: pairs fit
    plain, paired = cuda._Plan(members), cuda._Plan(members, 128)
    assert (plain.pairs, paired.pairs) == (0, 128)
    rows = mx.array(cuda.pair_order(plain.ends, 128))
    for before, after in ((plain.low, paired.low), (plain.high, paired.high),
                          (plain.scales, paired.scales), (plain.bias, paired.bias)):
        assert mx.array_equal(before[rows], after)
    x = mx.ones((1, 1, 256), dtype=mx.bfloat16)
    rope = group.Rope(nn.RoPE(128), mx.arange(64, dtype=mx.float32), mx.array(5, mx.int32))
    extras = group.Extras(norm=mx.ones((256,), dtype=mx.bfloat16), eps=1e-5, rope=rope)
    views = ((1, 8, 1, 128), (1, 4, 1, 128), (1, 4, 1, 128))
    ys = cuda.bind_linear_group(x, members, {"rope_dims": 128}, extras, views)(x, extras)
    call = _only(kernels, "cuda_linear").calls[-1]
    names = cuda_linear.inputs(extras.mode)
    assert call["constants"]["PAIRS"] == 128 and call["shapes"] == list(views)
    assert call["inputs"][names.index("rope_pos")] is rope.offset
    assert call["inputs"][names.index("rope_inv")] is rope.inverse
    assert [y.shape for y in ys] == [tuple(v) for v in views]
    for prepared, kept, head in (({}, members, 128),
                                 ({"rope_dims": 16}, _members(256, (64, 32, 32)), 16)):
        # 64 + 32 + 32 rows run 1 row a warp: no pairs
        rope = group.Rope(nn.RoPE(head), mx.arange(head // 2, dtype=mx.float32), rope.offset)
        extras = group.Extras(norm=extras.norm, eps=1e-5, rope=rope)
        views = tuple((1, m.out_features // head, 1, head) for m in kept)
        with pytest.raises(NotImplementedError):  # `group.bind_linear_group` rotates then
            cuda.bind_linear_group(x, kept, prepared, extras, views)
        assert prepared["cuda"].pairs == 0


def test_split_kernels_gives_every_part_the_headers_and_each_kernel_once():
    """`cuda_source.split_kernels` (nvcc runs on a core per part): every part starts with
    what precedes the first kernel, each kernel lands in exactly one part, and a source
    with anything but kernels after its first one stays whole."""
    from cuda_source import split_kernels

    header = "#include <x>\n__device__ int helper() { return 1; }\n"
    kernels = [kernel_source(f"k{i}", ["x"], ["out"], f"out[0] = x[0] + {i};", [mx.float32],
                             [mx.float32], []) for i in range(5)]
    parts = split_kernels(header + "".join(kernels), 2)
    assert len(parts) == 2 and all(p.startswith(header) for p in parts)
    assert sorted(k for p in parts for k in kernels if k in p) == sorted(kernels)
    assert sum(p.count("__global__") for p in parts) == 5
    assert split_kernels(header + kernels[0] + "__device__ int late();\n" + kernels[1], 2) == [
        header + kernels[0] + "__device__ int late();\n" + kernels[1]]
    assert split_kernels(header, 4) == [header]

"""The CUDA linear path's Python side, on a machine without CUDA.

`kernels/cuda.py` keeps, per group of linears, the operands in the kernels' layout and
the arguments of its two launches (rotation, GEMV). Without a GPU the launches cannot
run, so `mx.fast.cuda_kernel` is replaced here by a recorder that returns zeros of the
requested shapes: the test checks what the plan would launch (shapes, template values,
grids, which arrays go where) against values worked out independently below. The
kernels' results are checked on the GPU (tests/test_kernels_cuda_linear.py).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from turboquant.kernels import cuda, cuda_gemv, cuda_rotate, group
from turboquant.stages import encode


class Recorder:
    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.calls.append(dict(inputs=inputs, template=dict(template), grid=grid,
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
    return made


def _members(in_f, outs, bits=3, bias=False):
    out = []
    for i, o in enumerate(outs):
        qt = encode(mx.random.normal((o, in_f), key=mx.random.key(i)) * 0.02, bits, 64, seed=i + 1)
        s = qt.spec
        b = mx.ones((o,)) if bias else None
        out.append(group.Member(qt.codes, qt.scales, bits, 64, in_f, o, s.padded_in, s.seed, b))
    return tuple(out)


def test_a_group_is_one_rotation_and_one_gemv(kernels):
    members = _members(256, (128, 64, 64), bias=True)
    prepared = {}
    x = mx.zeros((1, 1, 256), dtype=mx.bfloat16)
    ys = cuda.linear_group(x, members, prepared)
    assert [y.shape for y in ys] == [(1, 1, 128), (1, 1, 64), (1, 1, 64)]
    assert [y.dtype for y in ys] == [mx.bfloat16] * 3
    (rot,), (gemv,) = ([r for k, r in kernels.items() if k[0] == n] for n in ("cuda_rotate", "cuda_gemv"))
    r, g = rot.calls[0], gemv.calls[0]
    assert r["inputs"][0] is x  # no reshape or copy before the kernel
    assert r["template"] == dict(InT=mx.bfloat16, N=256, P=256, A=1, OUTW=256,
                                 THREADS=cuda_rotate.THREADS)
    assert r["grid"] == (cuda_rotate.THREADS, 3, 1) and r["shapes"] == [(3, 1, 256)]
    t = g["template"]
    assert (t["SEGS"], t["END0"], t["END1"], t["OUT"], t["XROWS"]) == (3, 128, 192, 256, 1)
    assert t["HAS_BIAS"] is True and t["BITS"] == 3 and t["OutT"] == mx.bfloat16
    assert g["grid"][1] == 1 and g["shapes"] == [(1, 1, 128), (1, 1, 64), (1, 1, 64)]
    assert g["inputs"][0] is not x and g["inputs"][0].shape == (3, 1, 256)
    assert g["inputs"][7].shape == (256,)  # the members' biases, stacked
    assert "cuda" in prepared
    cuda.linear_group(mx.zeros((1, 1, 256), dtype=mx.bfloat16), members, prepared)
    assert len(rot.calls) == len(gemv.calls) == 2  # the plan is reused: no new kernels


def test_a_single_linear_skips_the_seed_axis(kernels):
    members = _members(992, (40,), bits=4)  # 31 x 32 rotation, padded input, no bias
    x = mx.zeros((3, 992), dtype=mx.float16)
    (y,) = cuda.linear_group(x, members, {})
    assert y.shape == (3, 40)
    rot = next(r for k, r in kernels.items() if k[0] == "cuda_rotate").calls[0]
    gemv = next(r for k, r in kernels.items() if k[0] == "cuda_gemv").calls[0]
    assert rot["shapes"] == [(3, 1024)] and rot["template"]["OUTW"] == 1024
    assert (rot["template"]["A"], rot["template"]["P"]) == (31, 32)
    t = gemv["template"]
    assert (t["SEGS"], t["OUT"], t["XROWS"], t["HAS_BIAS"], t["PADDED"]) == (1, 40, 0, False, 1024)
    assert gemv["grid"][1] == 3 and gemv["shapes"] == [(3, 40)]
    assert gemv["inputs"][5].tolist() == [0, 0, 0] and gemv["inputs"][6].tolist() == [0, 1, 2]


def test_prefill_and_unfusable_groups_are_left_to_the_reference(kernels):
    members = _members(256, (64,))
    with pytest.raises(NotImplementedError):
        cuda.linear_group(mx.zeros((9, 256)), members, {})
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


def test_without_a_cache_the_plan_lives_as_long_as_the_weights(kernels):
    members = _members(256, (64,))
    cuda.linear_group(mx.zeros((1, 256)), members)
    key = (id(members[0].codes),)
    assert key in cuda._PREPARED
    del members
    import gc

    gc.collect()
    assert key not in cuda._PREPARED

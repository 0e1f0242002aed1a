"""Members with in_scales (format 2) through the CUDA group launch, run on the CPU by
`tests/cuda_emulation.py`: t is folded into the norm's weight, the SwiGLU's up operand or
the input on the MLX side (`kernels.group.scaled_input`), the kernel sources unchanged.
Consecutive members sharing t (or having none) keep one fused launch; the others one each.
Skipped without a C++20 compiler."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turboquant import kernels
from turboquant.kernels import dispatch, group, reference
from turboquant.stages import column_scales, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_emulation  # noqa: E402
import test_kernels_cuda_emulated as emulated  # noqa: E402

IN_F = 992  # a 31 x 32 rotation, the input padded to 1024


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return cuda_emulation.folder_or_skip(tmp_path_factory, "cuda_in_scales")


@pytest.fixture
def emulated_cuda(monkeypatch, folder):
    with cuda_emulation.emulating(monkeypatch, folder, emulated._forget_kernels):
        monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
        yield


def _members(outs, shared: bool, plain_first: bool = False):
    rng = np.random.default_rng(3)
    small = rng.choice(IN_F, 24, replace=False)
    out, t0 = [], None
    for i, o in enumerate(outs):
        w = rng.standard_normal((o, IN_F)).astype(np.float32) * 0.02
        w[:, small] *= 0.05 if shared or i == 0 else 0.2
        t = column_scales(w, min_ratio=0.5)
        t = t0 if shared and t0 is not None else t
        t0 = t
        t = None if plain_first and i < 2 else t
        qt = encode(w, 3, 64, seed=i + 1, in_scales=t)
        s = qt.spec
        out.append(group.Member(qt.codes, qt.scales, 3, 64, IN_F, o, s.padded_in, s.seed,
                                in_scales=qt.in_scales))
    return tuple(out)


def _want(row, members):
    """Member by member on the pure-MLX reference: (t * row) rotated, the GEMV."""
    outs = []
    for m in members:
        t = m.in_scales if m.in_scales is not None else mx.ones((IN_F,))
        xs = row.astype(mx.float32) * t.astype(mx.float32)
        outs.append(reference.tq_matvec(group.rotated_input(xs, m), m.codes, m.scales, m.bits,
                                        m.group_size, m.out_features, m.padded_in))
    return outs


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("kind", ["norm", "gate", "plain"])
def test_scaled_members_in_the_group_launch(emulated_cuda, shared, kind):
    members = _members((64, 40) if kind != "gate" else (64,), shared)
    key = iter(mx.random.split(mx.random.key(5), 3))
    x = (mx.random.normal((2, 1, IN_F), key=next(key)) * 3).astype(mx.bfloat16)
    extras = group.Extras(
        norm=(mx.random.uniform(0.5, 1.5, (IN_F,), key=next(key)).astype(mx.bfloat16)
              if kind == "norm" else None),
        eps=1e-5,
        up=mx.random.normal(x.shape, key=next(key)).astype(mx.bfloat16) if kind == "gate"
        else None,
    )
    prepared = {}
    run = kernels.bind_linear_group(x, members, prepared, extras)
    got = run(x, extras)
    parts = prepared["in_scales_parts"]
    assert len(parts) == (1 if shared else len(members))
    assert all(p[3]["cuda"].fused for p in parts)  # each part one launch of the kernel
    for g, w in zip(got, _want(group.input_of(x, extras), members)):
        err = float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w)))
        assert err < 2e-2, err


def test_unscaled_members_share_a_launch(emulated_cuda):
    """q and k without t (ones dropped at load), v with its own: two launches, not three."""
    members = _members((64, 40, 40), False, plain_first=True)
    x = (mx.random.normal((1, 1, IN_F), key=mx.random.key(2)) * 3).astype(mx.bfloat16)
    prepared = {}
    got = kernels.bind_linear_group(x, members, prepared)(x, group.NO_EXTRAS)
    assert [p[0] for p in prepared["in_scales_parts"]] == [(0, 1), (2,)]
    for g, w in zip(got, _want(x, members)):
        assert float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w))) < 2e-2

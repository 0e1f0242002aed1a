"""The compiled CPU GEMV (kernels/cpu_gemv.py) against the pure-MLX reference.

Every width, group sizes 32/64/128, row lengths that pad, several activation rows, and
scales that are zero, subnormal or large; the float16 widening is checked on all 65,536
bit patterns; the gathered variant (MoE experts) for any pairs and index shapes, through
the dispatch (`kernels/cpu.py`) and in a loaded MoE model. Skipped where numba is not
installed (the reference runs there).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.kernels import cpu, cpu_gemv, dispatch, reference
from turboquant.stages import decode, encode

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="numba is not installed")

WIDTHS = [2, 3, 4, "ternary"]


def _gemv(x, qt):
    return cpu_gemv.gemv(np.asarray(x), np.asarray(qt.codes), np.asarray(qt.scales),
                         np.asarray(reference.levels(qt.spec.bits)), qt.spec.bits,
                         qt.spec.group_size)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(WIDTHS),
    group_size=st.sampled_from([32, 64, 128]),
    rows=st.integers(1, 40),
    cols=st.integers(1, 700),
    tokens=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_reference(bits, group_size, rows, cols, tokens, seed):
    key = mx.random.key(seed)
    qt = encode(mx.random.normal((rows, cols), key=key) * 0.05, bits, group_size, seed=seed)
    x = mx.random.normal((tokens, qt.spec.padded_in), key=mx.random.key(seed + 1))
    want = np.asarray(reference.tq_matvec(x, qt.codes, qt.scales, bits, group_size, rows,
                                          qt.spec.padded_in))
    got = _gemv(x, qt)
    assert got.shape == (tokens, rows)
    _assert_close(got, want, x, qt.codes, qt.scales, bits, group_size, qt.spec.padded_in)


def _assert_close(got, want, x, codes, scales, bits, group_size, padded_in):
    """float32 sums in another order: off by at most a few ulps of the terms' magnitudes."""
    w = np.asarray(reference.dequantize(codes, scales, bits, group_size, padded_in))
    bound = np.abs(np.asarray(x)) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= 1e-4 * bound + 1e-30)


@pytest.mark.parametrize("bits", WIDTHS)
def test_extreme_scales(bits):
    qt = encode(mx.random.normal((16, 256)), bits, 64, seed=2)
    scales = np.asarray(qt.scales).copy()
    scales[0] = 0.0
    scales[1] = np.float16(6e-8)  # subnormal
    scales[2] = np.float16(60000.0)
    scales[3] = -scales[3]
    x = mx.random.normal((2, 256))
    want = np.asarray(reference.tq_matvec(x, qt.codes, mx.array(scales), bits, 64, 16, 256))
    got = cpu_gemv.gemv(np.asarray(x), np.asarray(qt.codes), scales,
                        np.asarray(reference.levels(bits)), bits, 64)
    _assert_close(got, want, x, qt.codes, mx.array(scales), bits, 64, 256)
    assert np.all(got[:, 0] == 0.0)


def test_every_float16_widens_exactly():
    cpu_gemv.gemv(np.zeros((1, 32), np.float32), np.zeros((1, 2), np.uint32),
                  np.zeros((1, 1), np.float16), np.zeros(4, np.float32), 2, 32)  # compile
    widen = cpu_gemv._half_to_float  # the compiled function after the first call
    bits = np.arange(65536, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.array([widen(np.uint16(b)) for b in bits], dtype=np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite], want[finite])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])


def test_the_cpu_dispatch_runs_it_and_layers_agree_with_the_decoded_weights():
    assert dispatch.describe()["matvec"] == "cpu"
    qt = encode(mx.random.normal((48, 300)) * 0.05, 3, 64, seed=9)
    from turboquant.runtime.layers import TQLinear

    layer = TQLinear.from_quantized(qt)
    for tokens in (1, 40):  # decode (the CPU kernel), and a prefill (the reference GEMM)
        x = mx.random.normal((2, tokens, 300))
        want = x @ decode(qt).T
        got = layer(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=2e-5 * float(mx.abs(want).max()))


def _experts(bits, group_size, experts, rows, cols, seed):
    qts = [encode(mx.random.normal((rows, cols), key=mx.random.key(seed + e)) * 0.05, bits,
                  group_size, seed=seed) for e in range(experts)]  # one rotation a layer
    return mx.stack([q.codes for q in qts]), mx.stack([q.scales for q in qts]), qts[0].spec


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from(WIDTHS),
    group_size=st.sampled_from([32, 64]),
    experts=st.integers(1, 6),
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    tokens=st.integers(1, 4),
    top_k=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_gathered_experts_match_the_reference(bits, group_size, experts, rows, cols, tokens,
                                              top_k, seed):
    """mlx-lm's SwitchGLU shapes: x (tokens, 1, 1, K) against indices (tokens, top_k)."""
    codes, scales, spec = _experts(bits, group_size, experts, rows, cols, seed)
    x = mx.random.normal((tokens, 1, 1, spec.padded_in), key=mx.random.key(seed + 99))
    idx = mx.random.randint(0, experts, (tokens, top_k), key=mx.random.key(seed + 7))
    want = reference.tq_gather_matmul(x, codes, scales, idx, bits, group_size, rows,
                                      spec.padded_in)
    got = cpu.gather(x, codes, scales, idx, bits, group_size, rows, spec.padded_in)
    assert got.shape == want.shape == (tokens, top_k, 1, rows) and got.dtype == want.dtype
    for t in range(tokens):
        for j in range(top_k):
            e = int(idx[t, j].item())
            _assert_close(np.asarray(got[t, j]), np.asarray(want[t, j]), x[t, 0],
                          codes[e], scales[e], bits, group_size, spec.padded_in)


def test_the_cpu_dispatch_gathers_decode_steps_and_groups_prefill_by_expert(monkeypatch):
    """A decode step's pairs: one gathered GEMV call. A prefill's many: the reference's
    grouping by expert, each expert in use one GEMV call on all the rows routed to it."""
    assert dispatch.describe()["gather_matmul"] == "cpu"
    codes, scales, spec = _experts(3, 64, 4, 24, 128, seed=3)
    gathered, dense = [], []
    real_gather, real_gemv = cpu_gemv.gather_gemv, cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gather_gemv",
                        lambda *a: gathered.append(a[0].shape) or real_gather(*a))
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *a: dense.append(a[0].shape) or real_gemv(*a))
    for tokens in (2, cpu.GATHER_MAX_PAIR_ROWS):  # a decode step; a prefill's many pairs
        x = mx.random.normal((tokens, 1, 1, 128))
        idx = mx.random.randint(0, 4, (tokens, 2))
        got = dispatch.tq_gather(x, codes, scales, idx, 3, 64, 24, 128)
        want = reference.tq_gather_matmul(x, codes, scales, idx, 3, 64, 24, 128)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-5 * float(mx.abs(want).max()))
    assert gathered == [(4, 1, 128)]  # 2 tokens x 2 experts in one call
    used = np.unique(np.asarray(idx)).tolist()
    counts = [int((np.asarray(idx) == e).sum()) for e in used]
    assert dense == [(n, 128) for n in counts]  # one call per expert in use, all its rows


def test_a_loaded_moe_model_decodes_as_with_the_reference(tmp_path):
    from test_runtime_fixtures import make_checkpoint, write_repo

    from turboquant.runtime import load

    config, weights = make_checkpoint("qwen3_moe", seed=4)
    write_repo(tmp_path / "moe", config, weights, bits=3)
    model, _ = load(tmp_path / "moe")
    tokens = mx.array([[1, 5, 70, 33]])
    got = model(tokens[:, :1])  # one token: top-2 of 4 experts per layer, the CPU kernel
    kernel = dispatch.get("gather_matmul")
    dispatch.unregister("cpu", "gather_matmul")
    try:
        want = model(tokens[:, :1])
    finally:
        dispatch.register("cpu", "gather_matmul", kernel.__wrapped__)
    assert kernel.__wrapped__ is cpu.gather
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(mx.abs(want).max()))


def test_a_group_call_matches_the_reference_group():
    """kernels/cpu.py's linear_group: the members' rotated inputs evaluated together, then
    the GEMV of each; with a norm before and a residual after (a single member)."""
    from turboquant.kernels import group

    def members(outs, bias):
        out = []
        for i, o in enumerate(outs):
            qt = encode(mx.random.normal((o, 192), key=mx.random.key(i)) * 0.05, 3, 64, seed=i)
            b = mx.random.normal((o,), key=mx.random.key(50 + i)) if bias else None
            out.append(group.Member(qt.codes, qt.scales, 3, 64, 192, o, qt.spec.padded_in,
                                    qt.spec.seed, b))
        return tuple(out)

    x = mx.random.normal((2, 1, 192), key=mx.random.key(9)).astype(mx.bfloat16)
    cases = [
        (members((64, 32, 32), bias=True), group.Extras(norm=mx.ones((192,)) * 0.5, eps=1e-5)),
        (members((48,), bias=False), group.Extras(residual=mx.ones((2, 1, 48), mx.bfloat16))),
    ]
    for ms, extras in cases:
        got = cpu.linear_group(x, ms, None, extras)
        want = group.reference_group(x, ms, None, extras)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            err = float(mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max())
            assert err <= 1e-2 * float(mx.abs(w.astype(mx.float32)).max())
    with pytest.raises(NotImplementedError):  # prefill: the reference's GEMM
        cpu.linear_group(mx.zeros((1, 20, 192)), cases[1][0])


@pytest.mark.parametrize("kind", ["qwen2", "llama"])  # a TurboQuant lm_head; a tied embedding
def test_prefill_runs_the_kernel_but_leaves_the_heads_logits_lazy(tmp_path, kind):
    """Prefill (more than 8 tokens a linear) runs the numba kernel ("matmul"; the CPU
    wheel's GEMM is reference BLAS). The kernel computes inside the call, so a head's
    product, whose prefill logits mlx-lm never evaluates (it evaluates the cache), stays
    the reference's lazy graph (`dispatch.graph_only`): no head product is computed until
    the logits are evaluated, and then they equal the reference's."""
    from test_runtime_fixtures import VOCAB, make_checkpoint, write_repo

    from turboquant.runtime import load

    config, weights = make_checkpoint(kind, seed=4)
    write_repo(tmp_path / kind, config, weights, bits=3)
    model, _ = load(tmp_path / kind)
    widths = []

    def counting(x_rot, codes, scales, bits, group_size, out_features, padded_in, **kw):
        widths.append(out_features)
        return cpu.linear(x_rot, codes, scales, bits, group_size, out_features, padded_in)

    tokens = mx.array([list(range(1, 21))])
    dispatch.register("cpu", "matmul", counting)
    try:
        logits = model(tokens)  # built, not evaluated: the layers' kernels ran, not the head
        assert widths and VOCAB not in widths
        mx.eval(logits)
        assert VOCAB not in widths
    finally:
        dispatch.register("cpu", "matmul", cpu.linear)
    dispatch.unregister("cpu", "matmul")
    try:
        want = model(tokens)
    finally:
        dispatch.register("cpu", "matmul", cpu.linear)
    np.testing.assert_allclose(np.asarray(logits.astype(mx.float32)),
                               np.asarray(want.astype(mx.float32)), rtol=0,
                               atol=2e-2 * float(mx.abs(want).max()))


@settings(max_examples=20, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    lvt=st.sampled_from([(8, 1, 64), (10, 2, 128), (16, 1, 256), (12, 1, 96)]),
    group_size=st.sampled_from([32, 64]),
    rows=st.integers(1, 20),
    cols=st.integers(1, 400),
    tokens=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    version=st.sampled_from([1, 2]),
)
def test_trellis_gemv_matches_the_reference(bits, lvt, group_size, rows, cols, tokens, seed,
                                            version):
    """Trellis rows (random words: every bit pattern is a stream) through the compiled GEMV
    and through the dispatch, against the reference's decode_words_mx (trellis versions 1
    and 2)."""
    from turboquant.stages.trellis import TrellisBits

    state_bits, values, block = lvt
    tb = TrellisBits(bits, state_bits, values, block, version)
    padded = -(-cols // group_size) * group_size  # blocks of `block`, the last one shorter
    rng = np.random.default_rng(seed)
    words = padded * bits // 32
    codes = mx.array(rng.integers(0, 2**32, size=(rows, words), dtype=np.uint32))
    scales = mx.array(rng.uniform(0, 0.1, size=(rows, padded // group_size)).astype(np.float16))
    x = mx.array(rng.standard_normal((tokens, padded)).astype(np.float32))
    want = reference.tq_matvec(x, codes, scales, tb, group_size, rows, padded)
    got = cpu_gemv.gemv(np.asarray(x), np.asarray(codes), np.asarray(scales), None, tb,
                        group_size)
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-4, atol=2e-4)
    via = dispatch.tq_linear(x, codes, scales, tb, group_size, rows, padded)
    np.testing.assert_allclose(np.asarray(via), np.asarray(want), rtol=2e-4, atol=2e-4)
    assert dispatch.get_for("matvec", tb, "cpu") is dispatch._TRELLIS[("cpu", "matvec")]


def test_get_and_get_for_share_one_prologue():
    """An unknown op, the graph-only rule and the backend's loading are one code path for
    plain and trellis weights alike (dispatch._backend_for)."""
    from turboquant.stages.trellis import TrellisBits

    tb = TrellisBits(3, 12, 1, 256)
    for call in (lambda: dispatch.get("nope", "cpu"), lambda: dispatch.get_for("nope", tb, "cpu"),
                 lambda: dispatch.get_for("nope", 3, "cpu")):
        with pytest.raises(ValueError, match="unknown kernel op 'nope'"):
            call()
    with dispatch.graph_only():  # an eager backend gives way to the reference for both
        assert dispatch.get("matvec", "cpu") is dispatch._REFERENCE["matvec"]
        assert dispatch.get_for("matvec", tb, "cpu") is dispatch._REFERENCE["matvec"]
    assert dispatch._backend_for("matvec", "cpu") == "cpu"
    with dispatch.graph_only():
        assert dispatch._backend_for("matvec", "cpu") is None

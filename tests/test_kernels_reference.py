"""The pure-MLX reference kernels against the codec: decode(qt) @ x, for every width."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.kernels import dispatch, reference
from turboquant.stages import decode, encode, pack_codes, rotate, unpack_codes

WIDTHS = (2, 3, 4, "ternary")
TOL = 1e-5  # relative to the largest output: float32 accumulation order only


def _rotated(x, qt):
    xr = rotate(x, qt.spec.seed)
    pad = qt.spec.padded_in - qt.spec.in_features
    return mx.pad(xr, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else xr


def _close(y, ref, tol=TOL):
    assert y.shape == ref.shape, (y.shape, ref.shape)
    err = (mx.abs(y - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-12)).item()
    assert err < tol, err


@pytest.mark.parametrize("bits", WIDTHS)
@given(data=st.data())
@settings(max_examples=15, deadline=None)
def test_unpack_matches_the_codec(bits, data):
    rows = data.draw(st.integers(1, 4))
    n = data.draw(st.sampled_from([32, 64, 96, 128, 160, 320]))
    hi = 3 if bits == "ternary" else 2**bits
    seed = data.draw(st.integers(0, 2**31))
    codes = mx.random.randint(0, hi, (rows, n), key=mx.random.key(seed)).astype(mx.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == reference.words_per_row(n, bits)
    got = reference.unpack(packed, bits, n)
    assert mx.array_equal(got.astype(mx.uint8), codes).item()
    assert mx.array_equal(got.astype(mx.uint8), unpack_codes(packed, bits, n)).item()


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("out,inp,gs", [(96, 200, 64), (130, 128, 32), (33, 300, 128)])
@pytest.mark.parametrize("tokens", [(1,), (1, 1), (3,), (2, 20)])
def test_gemv_and_gemm_match_decode(bits, out, inp, gs, tokens):
    mx.random.seed(hash((str(bits), out, inp)) % 2**31)
    qt = encode(mx.random.normal((out, inp)), bits, gs, seed=7)
    x = mx.random.normal((*tokens, inp))
    ref = x @ decode(qt).T
    xr = _rotated(x, qt)
    args = (qt.codes, qt.scales, bits, gs, out, qt.spec.padded_in)
    for chunk in (None, 3 * qt.spec.padded_in, 1):  # one chunk, several, a row at a time
        _close(reference.tq_matvec(xr, *args, chunk=chunk), ref)
        _close(reference.tq_matmul(xr, *args, chunk=chunk), ref)
    _close(dispatch.tq_linear(xr, *args), ref)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_output_keeps_the_activation_dtype(dtype):
    qt = encode(mx.random.normal((64, 64)), 4, 64, seed=1)
    x = mx.random.normal((2, 64))
    y = dispatch.tq_linear(_rotated(x, qt).astype(dtype), qt.codes, qt.scales, 4, 64, 64, 64)
    assert y.dtype == dtype
    _close(y.astype(mx.float32), x @ decode(qt).T, tol=2e-2)


def _experts(bits, e=5, out=48, inp=100, gs=32):
    qts = [encode(mx.random.normal((out, inp)), bits, gs, seed=3) for _ in range(e)]
    w = mx.stack([decode(q) for q in qts])
    codes = mx.stack([q.codes for q in qts])
    scales = mx.stack([q.scales for q in qts])
    return qts[0], w, codes, scales


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize(
    "xshape,ishape",
    [
        ((1, 1, 1, 1, 100), (1, 1, 2)),  # SwitchGLU, one token, top-2 (gather path)
        ((2, 7, 1, 1, 100), (2, 7, 3)),  # SwitchGLU, a prefill (grouped path)
        ((30, 1, 100), (30,)),  # after _gather_sort: sorted rows (grouped path)
        ((3, 4, 2, 100), (3, 4)),  # M = 2 rows per pair
    ],
)
def test_gather_matches_gather_mm_and_a_per_expert_loop(bits, xshape, ishape):
    mx.random.seed(len(xshape) * 100 + xshape[0])
    qt, w, codes, scales = _experts(bits)
    x = mx.random.normal(xshape)
    idx = mx.random.randint(0, w.shape[0], ishape).astype(mx.uint32)
    sorted_ = len(ishape) == 1
    if sorted_:
        idx = mx.sort(idx)
    ref = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_)
    # and the same thing one pair at a time
    batch = mx.broadcast_shapes(x.shape[:-2], idx.shape)
    xb = mx.broadcast_to(x, (*batch, *x.shape[-2:])).reshape(-1, *x.shape[-2:])
    experts = mx.broadcast_to(idx, batch).reshape(-1).tolist()
    loop = mx.stack([xb[t] @ w[e].T for t, e in enumerate(experts)])
    _close(loop.reshape(ref.shape), ref)
    xr = _rotated(x, qt)
    args = (codes, scales, idx, bits, 32, 48, qt.spec.padded_in)
    for chunk in (None, 500):
        _close(reference.tq_gather_matmul(xr, *args, sorted_indices=sorted_, chunk=chunk), ref)
    half = reference.tq_gather_matmul(xr, *args, out_dtype=mx.bfloat16)
    assert half.dtype == mx.bfloat16 and xr.dtype == mx.float32
    _close(half.astype(mx.float32), ref, tol=1e-2)


def test_gather_paths_agree():
    qt, w, codes, scales = _experts(4)
    x = mx.random.normal((6, 1, 100))
    idx = mx.array([4, 0, 4, 2, 2, 1], dtype=mx.uint32)
    xr = _rotated(x, qt)
    args = (codes, scales, idx, 4, 32, 48, qt.spec.padded_in)
    limit = reference.GATHER_MAX_ROWS
    try:
        reference.GATHER_MAX_ROWS = 0
        grouped = reference.tq_gather_matmul(xr, *args)
        reference.GATHER_MAX_ROWS = 1 << 30
        gathered = reference.tq_gather_matmul(xr, *args)
    finally:
        reference.GATHER_MAX_ROWS = limit
    _close(grouped, gathered)


def test_embedding_rows_match_decode():
    qt = encode(mx.random.normal((50, 90)), 3, 32, seed=5)
    ids = mx.array([[0, 49, 7], [7, 7, 1]])
    rows = reference.tq_embedding(ids, qt.codes, qt.scales, 3, 32, qt.spec.padded_in)
    from turboquant.stages import unrotate

    _close(unrotate(rows[..., :90], 5), decode(qt)[ids])


@pytest.mark.parametrize("fn,tokens", [(reference.tq_matvec, 1), (reference.tq_matmul, 16)])
def test_peak_memory_is_a_few_chunks_not_the_matrix(fn, tokens):
    out, k, chunk = 4096, 2048, 1 << 16  # dense float32: 32 MiB; a chunk: 256 KiB
    codes = mx.random.randint(0, 2**31, (out, reference.words_per_row(k, 4))).astype(mx.uint32)
    scales = mx.ones((out, k // 64), dtype=mx.float16)
    x = mx.random.normal((tokens, k))
    mx.eval(codes, scales, x)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn(x, codes, scales, 4, 64, out, k, chunk=chunk))
    peak = mx.get_peak_memory() - base
    assert peak < out * k * 4 / 4, f"peak {peak / 2**20:.1f} MiB"


def test_bad_inputs_are_named():
    qt = encode(mx.random.normal((8, 64)), 4, 64, seed=1)
    with pytest.raises(ValueError, match="padded_in"):
        reference.tq_matvec(mx.zeros((1, 60)), qt.codes, qt.scales, 4, 64, 8, 64)
    with pytest.raises(ValueError, match="codes"):
        reference.tq_matvec(mx.zeros((1, 64)), qt.codes, qt.scales, 3, 64, 8, 64)
    with pytest.raises(ValueError, match="bits"):
        reference.tq_matvec(mx.zeros((1, 64)), qt.codes, qt.scales, 5, 64, 8, 64)


def test_dispatch_uses_the_cpu_kernels_on_cpu_and_a_registered_kernel_on_its_gpu():
    from turboquant.kernels import cpu_gemv

    assert dispatch.backend() == "cpu"
    described = dispatch.describe()
    compiled = "cpu" if cpu_gemv.available() else "reference"
    for op in ("matvec", "matmul", "gather_matmul", "linear_group"):
        assert described.pop(op) == compiled
    assert set(described.values()) == {"reference"}  # only the GEMVs have CPU kernels
    # CPU kernels are eager: where a result may never be evaluated, the reference (lazy)
    with dispatch.graph_only():
        assert dispatch.get("matmul") is reference.tq_matmul
        assert dispatch.get("matvec") is reference.tq_matvec
    assert (dispatch.get("matmul") is reference.tq_matmul) == (compiled == "reference")
    cpu_matvec = getattr(dispatch.get("matvec"), "__wrapped__", dispatch.get("matvec"))
    calls = []

    def fake(*args, **kwargs):
        calls.append(args)
        raise NotImplementedError  # falls back to the reference

    assert dispatch.registered("metal", "matvec") is None
    dispatch.register("metal", "matvec", fake)
    try:
        assert dispatch.registered("metal", "matvec") is fake
        got = dispatch.get("matvec")
        assert getattr(got, "__wrapped__", got) is cpu_matvec  # still on the CPU
        fn = dispatch.get("matvec", device_backend="metal")
        qt = encode(mx.random.normal((8, 64)), 4, 64, seed=1)
        x = mx.random.normal((1, 64))
        _close(fn(_rotated(x, qt), qt.codes, qt.scales, 4, 64, 8, 64), x @ decode(qt).T)
        assert len(calls) == 1
    finally:
        dispatch.unregister("metal", "matvec")
    assert dispatch.registered("metal", "matvec") is None
    # what `get` hands out keeps the kernel's attributes (the whole step asks
    # `stores_in_place` of it: lost behind the wrapper until 2026-12-04)
    fake.stores_in_place = True
    dispatch.register("metal", "matvec", fake)
    try:
        fn = dispatch.get("matvec", device_backend="metal")
        assert fn is not fake and fn.__wrapped__ is fake and fn.stores_in_place is True
    finally:
        dispatch.unregister("metal", "matvec")
    with pytest.raises(ValueError):
        dispatch.register("tpu", "matvec", fake)
    with pytest.raises(ValueError):
        dispatch.register("cuda", "conv", fake)


def test_new_ops_get_a_reference_first_then_backends():
    def ref(x):
        return x + 1

    with pytest.raises(ValueError, match="add_op"):
        dispatch.register("cuda", "test_plus_one", ref)
    dispatch.add_op("test_plus_one", ref)
    try:
        assert dispatch.get("test_plus_one") is ref
        dispatch.register("cuda", "test_plus_one", lambda x: x + 2)
        assert dispatch.get("test_plus_one", device_backend="cuda")(mx.array(1)).item() == 3
        assert dispatch.get("test_plus_one") is ref  # this machine is a CPU
        with pytest.raises(ValueError, match="already"):
            dispatch.add_op("test_plus_one", lambda x: x)
    finally:
        dispatch.unregister("cuda", "test_plus_one")
        dispatch._REFERENCE.pop("test_plus_one")

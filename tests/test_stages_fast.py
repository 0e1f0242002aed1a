"""The numba kernels of encode (stages/fast_hadamard.py, fast_quantize.py) against the numpy/MLX
path: the same bytes for every kind of size, width and group size, and the switches around them."""

import importlib
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from turboquant.stages import encode, fast_hadamard

rotate_mod = importlib.import_module("turboquant.stages.rotate")
codec_mod = importlib.import_module("turboquant.stages.codec")

needs_numba = pytest.mark.skipif(not fast_hadamard.AVAILABLE,
                                 reason="numba is not installed (or TURBOQUANT_NO_NUMBA is set)")


def _set_path(monkeypatch, compiled: bool) -> None:
    monkeypatch.setattr(rotate_mod, "_COMPILED", compiled)
    monkeypatch.setattr(codec_mod, "_COMPILED", compiled)


def _bytes(qt) -> tuple[bytes, bytes, bytes]:
    return (np.array(qt.codes).tobytes(), np.array(qt.scales).tobytes(),
            qt.row_sq_error.tobytes())


# power of two, 12/20/28 * 2^k, a dense factor, > 8192 (split), dense with > 8192, a 12-factor
# with > 8192 (no compiled split: MLX), p < group size (padding), rows not a multiple of a tile
SHAPES = [(37, 2048), (16, 768), (21, 1280), (18, 1792), (40, 5632), (3, 2880), (5, 16384),
          (2, 9 * 16384), (2, 12 * 16384), (7, 1000), (5, 100), (33, 64), (1, 4096)]


@needs_numba
@pytest.mark.parametrize("rows,n", SHAPES, ids=[f"{r}x{n}" for r, n in SHAPES])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_compiled_encode_is_bit_identical(monkeypatch, rows, n, group_size):
    rng = np.random.default_rng(n + rows)
    w = (rng.standard_t(4, size=(rows, n)) * 0.02).astype(np.float32)
    w[0, : n // 3] = 0.0  # zero groups (scale 0), and a signed zero
    w[-1, -1] = -0.0
    for bits in (2, 3, 4, "ternary"):
        _set_path(monkeypatch, True)
        fast = encode(w, bits, group_size=group_size, seed=n, refit=bits != 3)
        _set_path(monkeypatch, False)
        host = encode(w, bits, group_size=group_size, seed=n, refit=bits != 3)
        assert _bytes(fast) == _bytes(host), (bits, group_size)


@needs_numba
@pytest.mark.parametrize("n", [1, 3, 12, 24, 100, 1000, 2048, 2880, 5632, 7168, 16384,
                               9 * 16384])
def test_compiled_rotate_np_is_bit_identical(monkeypatch, n):
    x = mx.array(np.random.default_rng(n).standard_normal((19, n), dtype=np.float32))
    _set_path(monkeypatch, True)
    fast = rotate_mod.rotate_np(x, 7)
    _set_path(monkeypatch, False)
    host = rotate_mod.rotate_np(x, 7)
    assert fast.shape == (19, n) and fast.dtype == np.float32
    np.testing.assert_array_equal(fast.view(np.uint32), host.view(np.uint32))


@needs_numba
def test_encode_uses_the_kernels_when_numba_is_installed():
    assert rotate_mod._COMPILED and codec_mod._COMPILED
    encode(np.ones((4, 256), np.float32), 4, seed=1)
    assert fast_hadamard._compiled  # compile_kernels() ran: the numba versions are in place
    assert hasattr(fast_hadamard._rotate_kernel, "py_func")


def _python(code: str, **env) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, **env}).stdout.strip()


def test_import_does_not_load_numba():
    # the CLI's own process and the runtime import the stages but never encode
    assert _python("import sys, turboquant.stages; print('numba' in sys.modules)") == "False"


def test_no_numba_switch_keeps_the_host_path():
    code = ("import sys, numpy as np; from turboquant.stages import encode, fast_hadamard; "
            "encode(np.ones((4, 256), np.float32), 3, seed=1); "
            "print(fast_hadamard.AVAILABLE, 'numba' in sys.modules)")
    assert _python(code, TURBOQUANT_NO_NUMBA="1") == "False False"


@needs_numba
def test_float16_rounding_from_bits_is_numpys():
    """fast_quantize.f16_bits rounds float32 to float16 as numpy's astype does (nearest, ties
    to even, subnormals, overflow to infinity) and f16_value reads every finite float16 back
    exactly. (Every one of the 2^32 float32 patterns was checked once: 0 differences.)"""
    import numba

    from turboquant.stages import fast_quantize as fq

    fast_hadamard.compile_kernels()

    @numba.njit
    def rounded(a, out):
        for i in range(a.size):
            out[i] = fq.f16_bits(a[i])

    @numba.njit
    def widened(h, out):
        for i in range(h.size):
            out[i] = fq.f16_value(h[i])

    rng = np.random.default_rng(11)
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, np.inf, -np.inf,
                      2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14 - 2.0**-25, 1.0,
                      1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -1.5, 1e-30], dtype=np.float32)
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    mids = (halves[np.isfinite(halves)].astype(np.float32).view(np.uint32)
            + np.uint32(1 << 12)).view(np.float32)  # halfway between neighbours: ties
    a = np.concatenate([edges, mids, rng.integers(0, 2**32, 1 << 21, dtype=np.uint64)
                        .astype(np.uint32).view(np.float32)])
    a = a[~np.isnan(a)]
    got = np.empty(a.size, np.uint16)
    rounded(a, got)
    with np.errstate(over="ignore"):
        assert np.array_equal(got, a.astype(np.float16).view(np.uint16))
    finite = halves[np.isfinite(halves)]
    back = np.empty(finite.size, np.float32)
    widened(finite.view(np.uint16), back)
    assert np.array_equal(back.view(np.uint32), finite.astype(np.float32).view(np.uint32))


@needs_numba
@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
def test_codes_at_and_beside_the_thresholds_are_the_hosts(bits):
    """fast_quantize.code_groups against the numpy steps (nearest_codes_np, code_values_np,
    refit_sums_np, pack_groups_np) where the symmetric chain (2/3/4 bits: |u| on the
    positive half, next_up(|u|) for u <= 0) could differ: u exactly at every threshold and
    its mirror, the floats just beside them, signed zeros, a group of scale 0, and tiny
    and huge u."""
    from turboquant.stages import fast_quantize as fq
    from turboquant.stages.pack import pack_groups_np
    from turboquant.stages.quantize import code_tables_np, code_values_np, nearest_codes_np
    from turboquant.stages.scale import refit_sums_np

    mids, levels = code_tables_np(bits)
    t = np.concatenate([mids, -mids]).astype(np.float32)
    beside = np.concatenate([np.nextafter(t, np.float32(np.inf)),
                             np.nextafter(t, np.float32(-np.inf))])
    special = np.array([0.0, -0.0, 1e-38, -1e-38, 1e-45, -1e-45, 1e30, -1e30, 1.0, -1.0],
                       dtype=np.float32)
    u = np.concatenate([t, beside, special,
                        np.random.default_rng(3).standard_normal(600).astype(np.float32)])
    gs, groups = 32, -(-u.size // 32) + 1
    s = np.full(groups, np.float32(1.0))
    s[-1] = 0.0  # a zero scale: u = 0 there
    by_group = np.zeros((groups, gs), np.float32)
    by_group.reshape(-1)[: u.size] = u  # group k holds u[32 k : 32 k + 32]
    by_group[-1] = np.linspace(-1, 1, gs, dtype=np.float32)
    xt = np.ascontiguousarray(by_group.T)
    assert np.isin(t, xt).all()
    got_codes, got_wq, got_qq = fq.code_groups(xt, s, mids, levels, gs, groups, bits)
    un = xt / np.where(s > 0, s, np.float32(1.0))
    un[:, s == 0] = 0.0
    codes = nearest_codes_np(un, bits)
    q = code_values_np(codes, bits)
    want_wq, want_qq = refit_sums_np(xt, q)
    want = codes if bits == "ternary" else pack_groups_np(codes, bits).T  # (words, groups)
    assert np.array_equal(got_codes, want)
    assert np.array_equal(got_wq.view(np.uint32), want_wq.view(np.uint32))
    assert np.array_equal(got_qq.view(np.uint32), want_qq.view(np.uint32))


@needs_numba
def test_compiled_row_errors_are_numpys():
    """fast_quantize.row_errors gives codec._row_errors' float64 sums bit for bit (numpy sums
    a row's groups in order over group-major views), for any number of rows above one (one
    row stays on numpy: its sum there is pairwise), zero groups and zero scales included."""
    from turboquant.stages import fast_quantize as fq

    rng = np.random.default_rng(5)
    for trial in range(400):
        rows, groups = int(rng.integers(2, 130)), int(rng.integers(1, 400))
        size = groups * rows
        energy = (rng.standard_normal(size) ** 2 * rng.uniform(0.1, 10)).astype(np.float32)
        wq = (rng.standard_normal(size) * 3).astype(np.float32)
        qq = (rng.standard_normal(size) ** 2 * 5).astype(np.float32)
        scales = np.abs(rng.standard_normal(size)).astype(np.float16)
        if trial % 5 == 0:  # a zero group, a zero scale
            energy[:rows] = wq[:rows] = qq[:rows] = 0.0
            scales[-rows:] = 0.0
        by_row = scales.reshape(groups, rows).T  # as refit_rows returns them
        want = codec_mod._row_errors(*(codec_mod._rows_first(v, rows, groups)[..., 0]
                                       for v in (energy,)), by_row,
                                     *(codec_mod._rows_first(v, rows, groups)[..., 0]
                                       for v in (wq, qq)))
        got = fq.row_errors(energy, by_row, wq, qq, rows, groups)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), trial

"""kernels/kv_reference.py: the KV codec, and compressed attention against fp attention."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from turboquant.kernels.kv_reference import (
    KV_BITS,
    KVParts,
    PackedKV,
    dense_parts,
    kv_codes,
    kv_dequantize,
    kv_levels,
    kv_mse,
    kv_quantize,
    kv_words,
    pack_kv,
    tq_attention,
    unpack_kv,
)
from turboquant.stages import lloyd_max_levels, nearest_codes


def _normal(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _outlier_keys(shape, seed):
    """Keys like real ones: a few channels far larger than the rest."""
    x = _normal(shape, seed)
    boost = mx.ones((shape[-1],)).at[mx.array([3, 17, 40])].add(mx.array([20.0, -12.0, 8.0]))
    return x * boost


@pytest.mark.parametrize("bits", KV_BITS)
@pytest.mark.parametrize("count_limit", [0, 1 << 30])  # binary search / counting at once
def test_codes_are_the_nearest_level(bits, count_limit, monkeypatch):
    from turboquant.kernels import kv_reference

    monkeypatch.setattr(kv_reference, "COUNT_LIMIT", count_limit)
    u = _normal((4096,), bits) * 1.7
    assert mx.array_equal(kv_codes(u, bits), nearest_codes(u, bits))
    assert kv_levels(bits).tolist() == pytest.approx(lloyd_max_levels(bits).tolist(), rel=1e-6)
    ties = kv_reference._thresholds(bits)  # both ways: the number of thresholds below u
    assert kv_codes(ties, bits).tolist() == list(range(ties.size))


@pytest.mark.parametrize("bits", KV_BITS)
@pytest.mark.parametrize("dim", [64, 80, 96, 128, 70])
def test_pack_round_trip(bits, dim):
    codes = mx.random.randint(0, 2**bits, (2, 3, 5, dim), key=mx.random.key(dim)).astype(mx.uint8)
    words = pack_kv(codes, bits)
    assert words.dtype == mx.uint32 and words.shape == (2, 3, 5, kv_words(dim, bits))
    assert words.nbytes * 8 <= 2 * 3 * 5 * (dim * bits + 96)  # dense: 3 bits cost 3 bits
    assert mx.array_equal(unpack_kv(words, bits, dim), codes)


@pytest.mark.parametrize("bits", KV_BITS)
@pytest.mark.parametrize("make", [_normal, _outlier_keys])
def test_codec_error_is_the_lloyd_max_mse(bits, make):
    # After the rotation a head vector's coordinates look N(0, 1): the relative error is
    # the codebook's MSE, and stays near it for keys with outlier channels.
    x = make((2000, 128), bits)
    codes, norms = kv_quantize(x, bits, seed=11)
    y = kv_dequantize(codes, norms, bits, seed=11, head_dim=128)
    rel = (mx.sum((y - x) ** 2, axis=-1) / mx.sum(x * x, axis=-1)).mean().item()
    if make is _normal:
        assert rel == pytest.approx(kv_mse(bits), rel=0.1)
    else:  # a few dominant channels: rotated coordinates are not quite Gaussian
        assert 0.5 * kv_mse(bits) < rel < 1.15 * kv_mse(bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_norm_correction_makes_norms_exact(bits):
    x = _normal((500, 64), 5) * 3.0
    codes, norms = kv_quantize(x, bits, seed=2, norm_correction=True)
    y = kv_dequantize(codes, norms, bits, seed=2, head_dim=64)
    ratio = mx.linalg.norm(y, axis=-1) / mx.linalg.norm(x, axis=-1)
    assert mx.abs(ratio - 1).max().item() < 1e-3  # fp16 norm rounding only
    plain_codes, plain = kv_quantize(x, bits, seed=2)
    assert mx.array_equal(plain_codes, codes)  # same codes, only the norm differs
    # centroids shrink a vector by sqrt(1 - mse) on average; the correction undoes it
    shrink = (plain.astype(mx.float32) / norms.astype(mx.float32)).mean().item()
    assert shrink == pytest.approx(math.sqrt(1 - kv_mse(bits)), rel=0.01)


def test_zero_vectors_stay_zero():
    codes, norms = kv_quantize(mx.zeros((3, 64)), 4, seed=0)
    assert mx.all(norms == 0).item()
    assert mx.all(kv_dequantize(codes, norms, 4, 0, 64) == 0).item()


# ---------------------------------------------------------------------------- attention


def _parts(n_sink, n_comp, n_tail, kv=2, dim=64, vdim=None, bits=(4, 3), seed=3, key_seed=0):
    vdim = vdim or dim
    k = _outlier_keys((1, kv, n_sink + n_comp + n_tail, dim), key_seed)
    v = _normal((1, kv, n_sink + n_comp + n_tail, vdim), key_seed + 1)
    packed = None
    if n_comp:
        sl = slice(n_sink, n_sink + n_comp)
        kc, kn = kv_quantize(k[:, :, sl], bits[0], seed)
        vc, vn = kv_quantize(v[:, :, sl], bits[1], seed)
        packed = PackedKV(kc, kn, vc, vn, bits[0], bits[1], seed, dim, vdim)
    sink = (k[:, :, :n_sink], v[:, :, :n_sink]) if n_sink else (None, None)
    tail = (k[:, :, n_sink + n_comp :], v[:, :, n_sink + n_comp :]) if n_tail else (None, None)
    return KVParts(*sink, packed, *tail), k, v


def _sdpa(q, k, v, scale, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _rel(a, b):
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.mark.parametrize(
    "layout", [(4, 200, 30), (0, 200, 0), (4, 0, 30), (0, 77, 9), (2, 150, 0), (0, 0, 5)]
)
@pytest.mark.parametrize("heads", [2, 8])  # MHA and GQA (4 query heads per KV head)
def test_decode_matches_attention_over_the_decoded_cache(layout, heads):
    parts, _, _ = _parts(*layout)
    q = _normal((1, heads, 1, 64), 9)
    k, v = dense_parts(parts)
    scale = 64**-0.5
    want = _sdpa(q, k, v, scale)
    assert _rel(tq_attention(q, parts, scale), want) < 1e-5
    assert _rel(tq_attention(q, parts, scale, chunk=3000), want) < 1e-5  # many chunks


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "bool4", "neg_inf"])
def test_prefill_masks(mask_kind):
    parts, _, _ = _parts(4, 100, 40, kv=2)
    L, T, H = 40, 144, 4
    q = _normal((1, H, L, 64), 4)
    k, v = dense_parts(parts)
    causal = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    window = causal & (mx.arange(T - L, T)[:, None] - mx.arange(T)[None] < 64)
    mask = {
        "causal": "causal",
        "bool": window,
        "additive": mx.where(window, 0.0, -1e9),
        "bool4": mx.broadcast_to(window, (1, H, L, T)),
        "neg_inf": mx.where(window, 0.0, -mx.inf),  # whole blocks masked: no NaN
    }[mask_kind]
    want = _sdpa(q, k, v, 0.125, mask=causal if mask_kind == "causal" else mask)
    assert _rel(tq_attention(q, parts, 0.125, mask, chunk=2000), want) < 1e-5


def test_value_head_dim_may_differ():
    parts, _, _ = _parts(2, 60, 5, dim=96, vdim=64)
    q = _normal((1, 4, 1, 96), 1)
    k, v = dense_parts(parts)
    out = tq_attention(q, parts, 0.1)
    assert out.shape == (1, 4, 1, 64)
    assert _rel(out, _sdpa(q, k, v, 0.1)) < 1e-5


def _predicted_error(q, k, v, scale, bits_k, bits_v, kv):
    """First-order E||out - fp_out||^2 from the codec's MSE.

    After the rotation a coded vector's error is isotropic with E||e||^2 = mse * ||x||^2, so
    a score moves by scale * q.e_k (variance scale^2 ||q||^2 mse_k ||k||^2 / d), which moves
    the output by p (v - out); the value error adds p^2 mse_v ||v||^2, token by token.
    """
    b, h, n, d = q.shape
    qg = q.reshape(b, kv, h // kv, n, d)
    p = mx.softmax((qg @ k[:, :, None].swapaxes(-1, -2)) * scale, axis=-1)  # B KV R L T
    o = p @ v[:, :, None]
    dev = mx.sum((v[:, :, None, None] - o[..., None, :]) ** 2, axis=-1)  # B KV R L T
    k2 = mx.sum(k * k, -1)[:, :, None, None]
    var_s = scale**2 * mx.sum(qg * qg, -1, keepdims=True) * kv_mse(bits_k) * k2 / d
    val = kv_mse(bits_v) * mx.sum(v * v, -1)[:, :, None, None]
    return mx.sum(p * p * (var_s * dev + val), axis=-1).mean().item()


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (4, 3), (3, 3), (8, 2)])
@pytest.mark.parametrize("sharp", [1.0, 2.5])
def test_attention_error_is_what_the_codec_predicts(bits, sharp):
    # Output error against fp attention, within a band around the error the codebook MSE
    # predicts: a bug (wrong norm, wrong rotation, a chunk counted twice) lands far outside.
    kv, d, t = 4, 128, 400
    q = _normal((1, 8, 2, d), 21) * sharp
    k, v = _normal((1, kv, t, d), 22), _normal((1, kv, t, d), 23)
    kc, kn = kv_quantize(k, bits[0], 5)
    vc, vn = kv_quantize(v, bits[1], 5)
    parts = KVParts(None, None, PackedKV(kc, kn, vc, vn, *bits, 5, d, d), None, None)
    scale = d**-0.5
    err = mx.sum((tq_attention(q, parts, scale) - _sdpa(q, k, v, scale)) ** 2, -1).mean().item()
    assert 0.6 < err / _predicted_error(q, k, v, scale, *bits, kv) < 1.6


def test_fp_parts_are_exact():
    # Sinks and the window are attended in full precision: with nothing compressed,
    # the result is plain attention.
    parts, k, v = _parts(4, 0, 60)
    q = _normal((1, 2, 3, 64), 8)
    assert _rel(tq_attention(q, parts, 0.2, "causal"), _sdpa(q, k, v, 0.2, mask="causal")) < 1e-5


def test_dtype_follows_the_queries():
    parts, _, _ = _parts(2, 40, 4)
    q = _normal((1, 2, 1, 64), 2).astype(mx.bfloat16)
    assert tq_attention(q, parts, 0.1).dtype == mx.bfloat16


def test_unit_scale_of_the_codes():
    # u = rotate(x) / ||x|| * sqrt(d) has unit variance per coordinate: levels are N(0, 1)'s.
    x = _outlier_keys((300, 64), 1)
    codes, norms = kv_quantize(x, 8, seed=4)
    y = kv_dequantize(codes, norms, 8, 4, 64, rotated=True)
    u = y / (norms.astype(mx.float32)[:, None] / math.sqrt(64))
    assert mx.mean(u * u).item() == pytest.approx(1.0, rel=0.02)

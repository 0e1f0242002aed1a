"""TurboQuantKVCache and its sliding variant: mlx-lm's cache protocol, accounting, save/load."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from turboquant.kernels.kv_reference import dense_parts, kv_dequantize, kv_quantize, kv_words
from turboquant.runtime.kvcache import (
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
    kv_bytes_per_token,
)
from turboquant.runtime.kv_attention import turboquant_attention

KV, D = 2, 64


def _kv(n, seed, dtype=mx.float16):
    k = mx.random.normal((1, KV, n, D), key=mx.random.key(seed)) * 2
    v = mx.random.normal((1, KV, n, D), key=mx.random.key(seed + 1000))
    return k.astype(dtype), v.astype(dtype)


def _feed(cache, steps, seed=0):
    """Feed chunks of the given sizes; return all keys and values fed (fp16)."""
    ks, vs = [], []
    for i, n in enumerate(steps):
        k, v = _kv(n, seed + i)
        cache.update_and_fetch(k, v)
        ks.append(k)
        vs.append(v)
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def _expected_dense(k, v, n_sink, n_comp, cache):
    """What the cache should hold: exact fp16 sinks and tail, the codec's decode in between."""
    sl = slice(n_sink, n_sink + n_comp)
    nc = cache.norm_correction
    bk, bv, seed = cache.bits_k, cache.bits_v, cache.seed
    kd = kv_dequantize(*kv_quantize(k[:, :, sl], bk, seed, nc), bk, seed, D)
    vd = kv_dequantize(*kv_quantize(v[:, :, sl], bv, seed, nc), bv, seed, D)
    f32 = lambda x: x.astype(mx.float32)  # noqa: E731
    ek = mx.concatenate([f32(k[:, :, :n_sink]), kd, f32(k[:, :, n_sink + n_comp :])], axis=2)
    ev = mx.concatenate([f32(v[:, :, :n_sink]), vd, f32(v[:, :, n_sink + n_comp :])], axis=2)
    return ek, ev


def _check_contents(cache, k, v):
    s, c = cache.sink_tokens, cache.compressed_tokens
    got_k, got_v = dense_parts(cache.parts())
    want_k, want_v = _expected_dense(k, v, s, c, cache)
    assert got_k.shape == want_k.shape
    assert mx.allclose(got_k, want_k, atol=1e-5).item()
    assert mx.allclose(got_v, want_v, atol=1e-5).item()


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="KV bits"):
        TurboQuantKVCache(bits_k=5)
    with pytest.raises(ValueError, match="window"):
        TurboQuantKVCache(window=-1)
    with pytest.raises(ValueError, match="keep"):
        TurboQuantRotatingKVCache(max_size=8, keep=8)


def test_tokens_move_sink_tail_compressed():
    c = TurboQuantKVCache(4, 3, sink=4, window=16, block=8, seed=9)
    assert c.empty() and c.nbytes == 0
    k, v = _feed(c, [3, 1, 1, 10])  # 15 tokens: 4 sinks, 11 in the window
    assert (c.offset, c.sink_tokens, c.compressed_tokens, c.fp16_tokens) == (15, 4, 0, 15)
    k2, v2 = _feed(c, [1] * 20, seed=50)  # 35 tokens
    k, v = mx.concatenate([k, k2], axis=2), mx.concatenate([v, v2], axis=2)
    # compressed in blocks of 8 before each step: the window holds 16..23 + the new token
    assert c.offset == 35 and c.sink_tokens == 4
    assert c.compressed_tokens % 8 == 0 and 16 <= c.fp16_tokens - 4 <= 16 + 8
    assert c.compressed_tokens + c.fp16_tokens == 35 == c.size()
    _check_contents(c, k, v)


def test_a_step_sees_its_own_tokens_in_fp16():
    c = TurboQuantKVCache(4, 3, sink=0, window=0, block=1)
    _feed(c, [50])
    assert c.compressed_tokens == 0 and c.fp16_tokens == 50
    _feed(c, [1], seed=9)
    assert c.compressed_tokens == 50 and c.fp16_tokens == 1


def test_start_after_delays_compression():
    c = TurboQuantKVCache(4, 3, sink=2, window=4, block=1, start_after=40)
    _feed(c, [1] * 40)
    assert c.compressed_tokens == 0
    _feed(c, [1], seed=7)
    assert c.compressed_tokens == 40 - 2 - 4


@pytest.mark.parametrize("phase", [0, 5, 15])
def test_compressed_part_ends_on_the_phase_s_block_boundaries(phase):
    """Whatever the steps (prefill chunks, single tokens), the compressed part ends on a
    position sink + phase + k * block: all the whole blocks that have left the window."""
    c = TurboQuantKVCache(4, 3, sink=4, window=32, block=16, phase=phase)
    done = 0
    for n in [7, 100, 1, 1, 33, 1, 1, 1, 200, *[1] * 40]:
        _feed(c, [n], seed=done)
        done += n
        c.state  # noqa: B018  (compresses what the next step would)
        ends = 4 + phase + (done - 32 - 4 - phase) // 16 * 16 if done - 32 >= 4 + phase else 4
        assert c.sink_tokens + c.compressed_tokens == ends, (n, done)
        assert c.size() == done
    with pytest.raises(ValueError, match="phase must be below block"):
        TurboQuantKVCache(4, 3, block=16, phase=16)


@pytest.mark.parametrize("bits", [(8, 3), (4, 3), (4, 4), (3, 3), (2, 2), (8, 8)])
def test_nbytes_is_the_packed_size(bits):
    c = TurboQuantKVCache(*bits, sink=4, window=32, block=16)
    _feed(c, [300], seed=1)
    c.state  # noqa: B018  (reading the state compresses what left the window)
    n_comp, n_fp = c.compressed_tokens, c.fp16_tokens
    assert n_comp == (300 - 4 - 32) // 16 * 16  # whole blocks out of the window
    packed = KV * n_comp * (4 * (kv_words(D, bits[0]) + kv_words(D, bits[1])) + 2 * 2)
    fp16 = KV * n_fp * D * 2 * 2
    assert c.nbytes == packed + fp16
    assert KV * n_comp * kv_bytes_per_token(D, *bits) == packed
    # and it is what the arrays hold: no fp16 shadow copy of the compressed tokens
    arrays = [x for x in c.state.values() if isinstance(x, mx.array)]
    assert sum(x.nbytes for x in arrays) == c.nbytes
    # 4-bit keys + 3-bit values: (64*4 + 64*3) / 8 + 4 bytes = 60 bytes for 256 fp16 bytes
    if bits == (4, 3):
        assert kv_bytes_per_token(D, *bits) == 60
    # what an fp16 cache would hold for the same 300 tokens
    assert c.fp16_nbytes == KV * 300 * D * 2 * 2


def test_summary_line_counts_the_turboquant_layers():
    from mlx_lm.models.cache import CacheList, KVCache

    from turboquant.runtime.kvcache import kv_summary

    a, b = (TurboQuantKVCache(4, 3, sink=4, window=32, block=16) for _ in range(2))
    _feed(a, [300], seed=1)
    _feed(b, [300], seed=2)
    line = kv_summary([a, CacheList(b), KVCache()])  # an fp16 layer is not counted
    held, dense = a.nbytes + b.nbytes, a.fp16_nbytes + b.fp16_nbytes
    assert f"{held / 2**20:.2f} MB for 300 tokens in 2 TurboQuant layers" in line
    assert f"fp16: {dense / 2**20:.2f} MB, {dense / held:.1f}x less" in line
    assert line.endswith("decode attention: the pure-MLX reference")  # on the CPU


def test_trim_then_refeed_is_the_same_cache():
    k, v = _kv(60, 3)
    a = TurboQuantKVCache(4, 3, sink=4, window=8, block=4)
    b = TurboQuantKVCache(4, 3, sink=4, window=8, block=4)
    for i in range(60):
        a.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    for i in range(40):
        b.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert trim_prompt_cache([a], 20) == 20  # reaches into the compressed tokens
    assert a.offset == 40 and a.size() == 40
    ka, va = dense_parts(a.parts())
    kb, vb = dense_parts(b.parts())
    n_fp = b.fp16_tokens - 4
    # the same tokens; where b still has them in fp16, a has them compressed
    assert mx.allclose(ka[:, :, : 40 - n_fp], kb[:, :, : 40 - n_fp]).item()
    assert mx.allclose(va[:, :, : 40 - n_fp], vb[:, :, : 40 - n_fp]).item()
    assert a.trim(100) == 40 and a.size() == 0 and a.sink_tokens == 0
    a.update_and_fetch(k[:, :, :5], v[:, :, :5])
    assert a.sink_tokens == 4 and a.offset == 5


def test_trim_inside_the_window_is_exact():
    k, v = _kv(30, 4)
    a = TurboQuantKVCache(4, 3, sink=2, window=16, block=4)
    a.update_and_fetch(k, v)
    a.trim(5)
    a.update_and_fetch(k[:, :, 25:], v[:, :, 25:])
    b = TurboQuantKVCache(4, 3, sink=2, window=16, block=4)
    b.update_and_fetch(k[:, :, :25], v[:, :, :25])
    b.update_and_fetch(k[:, :, 25:], v[:, :, 25:])
    assert a.compressed_tokens == b.compressed_tokens > 0
    for x, y in zip(dense_parts(a.parts()), dense_parts(b.parts())):
        assert mx.array_equal(x, y)


def test_save_and_load_with_mlx_lm(tmp_path):
    tq = TurboQuantKVCache(8, 3, sink=4, window=16, block=8, seed=2**63 + 5, norm_correction=True)
    rot = TurboQuantRotatingKVCache(max_size=48, keep=2, bits_k=4, bits_v=4, window=8, block=4)
    plain = KVCache()
    caches = [tq, rot, plain]
    for c in caches:
        _feed(c, [40, 1, 1, 30], seed=7)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches, metadata={"model": "tiny"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "tiny"}
    assert [type(c) for c in loaded] == [TurboQuantKVCache, TurboQuantRotatingKVCache, KVCache]
    for a, b in zip(caches[:2], loaded[:2]):
        assert b.offset == a.offset and b.seed == a.seed and b.norm_correction == a.norm_correction
        for name in ("bits_k", "bits_v", "sink", "window", "block"):
            assert getattr(b, name) == getattr(a, name)
        # what mlx-lm's attention reads to route to the hook (plain attributes now)
        assert (b.bits, b.group_size) == (a.bits, a.group_size) == (a.bits_k, D)
        assert b.nbytes == a.nbytes
        # continuing from the loaded cache is continuing from the original
        k, v = _kv(3, 99)
        pa, _ = a.update_and_fetch(k, v)
        pb, _ = b.update_and_fetch(k, v)
        for x, y in zip(dense_parts(pa), dense_parts(pb)):
            assert mx.array_equal(x, y)
    assert loaded[1].max_size == 48 and loaded[1].keep == 2


def test_meta_state_round_trip():
    a = TurboQuantRotatingKVCache(32, keep=1, bits_k=3, bits_v=2, window=4, block=2, seed=77)
    _feed(a, [20, 1, 1])
    b = TurboQuantRotatingKVCache.from_state(a.state, a.meta_state)
    assert (b.max_size, b.keep, b.bits_k, b.bits_v, b.seed, b.offset) == (32, 1, 3, 2, 77, 22)
    assert (b.bits, b.group_size) == (3, D)
    assert (TurboQuantKVCache(8, 3).bits, TurboQuantKVCache(8, 3).group_size) == (8, 0)


@pytest.mark.parametrize("steps", [[1] * 70, [10, 1, 25, 1, 1, 30, 1, 1]])
def test_sliding_window_keeps_what_mlx_lm_keeps(steps):
    # With a window wider than max_size nothing is compressed: the sliding variant must
    # then attend exactly like mlx-lm's RotatingKVCache (keep = 0, as models make it).
    ref = RotatingKVCache(max_size=24)
    ours = TurboQuantRotatingKVCache(max_size=24, bits_k=4, bits_v=3, window=64)
    for i, n in enumerate(steps):
        k, v = _kv(n, i, mx.float32)
        q = mx.random.normal((1, 4, n, D), key=mx.random.key(500 + i))
        mask_ref = ref.make_mask(n, window_size=24)
        mask_ours = ours.make_mask(n, window_size=24)
        rk, rv = ref.update_and_fetch(k, v)
        parts, _ = ours.update_and_fetch(k, v)
        want = mx.fast.scaled_dot_product_attention(q, rk, rv, scale=0.125, mask=mask_ref)
        got = turboquant_attention(q, parts, 0.125, mask_ours)
        assert mx.abs(got - want).max().item() < 1e-5
        assert ours.size() == ref.size() and ours.offset == ref.offset


def test_sliding_window_compresses_the_middle():
    c = TurboQuantRotatingKVCache(max_size=64, keep=4, bits_k=4, bits_v=3, window=16, block=8)
    k, v = _feed(c, [1] * 200)
    assert c.offset == 200 and c.size() <= 64
    assert c.sink_tokens == 4 and c.compressed_tokens > 0
    # the newest 16 are fp16 and exact; the sinks are the first 4 tokens
    kk, _ = dense_parts(c.parts())
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4].astype(mx.float32))
    assert mx.array_equal(kk[:, :, -16:], k[:, :, -16:].astype(mx.float32))
    assert not c.is_trimmable()
    # each query sees the keep tokens and its own window of max_size tokens
    m = c.make_mask(5, window_size=64)
    parts, _ = c.update_and_fetch(*_kv(5, 300))
    assert m.shape == (5, parts.length) == (5, 63 + 5)
    assert mx.all(m[:, :4]).item()  # keep tokens stay visible
    # 63 earlier tokens kept (4 sinks included), as mlx-lm keeps max_size - 1; the last
    # query sees its full window of 64 plus the 4 sinks
    assert m.sum(axis=-1).tolist() == [64, 65, 66, 67, 68]


def test_no_fp16_copy_of_compressed_tokens_stays_alive():
    # After a long prefill step and the next update, the memory the cache holds is its
    # packed size (plus buffer steps of 256 tokens), not the fp16 size of the prefill.
    import gc

    gc.collect()
    before = mx.get_active_memory()
    c = TurboQuantKVCache(4, 3, sink=4, window=32, block=16)
    k, v = _kv(4096, 1)
    c.update_and_fetch(k, v)
    fp16_bytes = k.nbytes + v.nbytes
    del k, v
    parts, _ = c.update_and_fetch(*_kv(1, 2))
    mx.eval(c.state)
    del parts
    gc.collect()
    held = mx.get_active_memory() - before
    assert c.compressed_tokens == (4096 - 4 - 32) // 16 * 16
    slack = 256 * KV * (4 * (kv_words(D, 4) + kv_words(D, 3)) + 4) + 2 * 288 * KV * D * 2
    assert held <= c.nbytes + slack < fp16_bytes / 3


def _same_view(cache):
    """parts().packed holds exactly the cache's compressed rows."""
    pk = cache.parts().packed
    lo, n = cache._c_lo, cache.compressed_tokens
    for got, buf in zip((pk.k_codes, pk.k_norms, pk.v_codes, pk.v_norms), cache._comp):
        assert mx.array_equal(got, buf[:, :, lo : lo + n]).item()
    return pk


@pytest.mark.parametrize("rotating", [0, 200])
def test_decode_steps_reuse_the_compressed_view(rotating):
    # the compressed part changes once per block: its four slices are built once for it
    kw = dict(bits_k=4, bits_v=3, window=16, block=8, seed=3)
    cache = (TurboQuantRotatingKVCache(rotating, keep=2, **kw) if rotating
             else TurboQuantKVCache(sink=2, **kw))
    _feed(cache, [150, 1])
    first = _same_view(cache)
    views = [first]
    for i in range(20):
        _feed(cache, [1], seed=100 + i)
        views.append(_same_view(cache))
    assert views[1] is first  # no flush yet: the same object
    changed = [i for i in range(1, len(views)) if views[i] is not views[i - 1]]
    assert changed and all(views[i].length != views[i - 1].length or rotating for i in changed)
    assert len(changed) <= 3  # once per block (8 tokens), not once per token
    cache.trim(cache._n_tail + 3)  # into the compressed part: a fresh, shorter view
    n0 = _same_view(cache).length
    assert n0 == views[-1].length - 3
    cache.trim(cache._n_tail + 5)  # back to a block boundary, then a block of new tokens
    _feed(cache, [16 + 8, 1], seed=7)  # compressed: other rows, and the view shows them
    assert _same_view(cache).length == n0 - 5 + 8


@pytest.mark.parametrize("bits", [(4, 3), (8, 8), (2, 4)])
def test_compiled_block_compression_is_bit_exact(bits, monkeypatch):
    """COMPILED_FLUSH "1": a decode step's block goes through the mx.compile'd kv_quantize
    (fewer kernels), giving the same codes and norms bit for bit as the plain one; the
    prefill's large pieces stay plain (no trace per shape)."""
    from turboquant.runtime import kvcache

    kw = dict(bits_k=bits[0], bits_v=bits[1], sink=2, window=16, block=8, seed=5)
    states = {}
    for mode in ("0", "1"):
        monkeypatch.setattr(kvcache, "COMPILED_FLUSH", mode)
        kvcache._compiled_kv_quantize.cache_clear()
        cache = TurboQuantKVCache(**kw)
        _feed(cache, [100] + [1] * 40, seed=11)
        pk = cache.parts().packed
        states[mode] = [pk.k_codes, pk.k_norms, pk.v_codes, pk.v_norms]
        # compiled functions were built only for block-sized pieces (per bits, seed, nc)
        assert kvcache._compiled_kv_quantize.cache_info().currsize == (
            0 if mode == "0" else len(set(bits)))
    assert states["0"][0].shape[2] == 100 + 40 - 16 - 2 - (100 + 40 - 16 - 2) % 8
    for plain, compiled in zip(states["0"], states["1"]):
        assert plain.dtype == compiled.dtype and mx.array_equal(plain, compiled).item()


def test_compiled_compression_is_on_for_gpu_backends_only(monkeypatch):
    from turboquant.runtime import kvcache

    monkeypatch.setattr(kvcache, "COMPILED_FLUSH", "auto")
    plain = kvcache._quantizer(4, 0, True, True)
    assert not hasattr(plain, "__wrapped__") and plain.func is kv_quantize  # CPU: plain
    monkeypatch.setattr(kvcache.dispatch, "backend", lambda: "cuda")
    assert kvcache._quantizer(4, 0, True, True) is kvcache._compiled_kv_quantize(4, 0, True)
    assert kvcache._quantizer(4, 0, True, False).func is kv_quantize  # a prefill's piece


@pytest.mark.parametrize("preset", [None, "7"])
def test_importing_the_runtime_raises_mlx_cuda_graph_cache_unless_set(preset):
    """The staggered compressions thrash MLX's 100 cached CUDA graphs (2026-11-30, H200):
    importing turboquant.runtime sets MLX_CUDA_GRAPH_CACHE_SIZE before any model runs,
    and a value the user set wins. A fresh process: MLX reads the variable once."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_GRAPH_CACHE_SIZE"}
    if preset:
        env["MLX_CUDA_GRAPH_CACHE_SIZE"] = preset
    code = ("import os, turboquant.runtime.kvcache; "
            "print(os.environ['MLX_CUDA_GRAPH_CACHE_SIZE'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [preset or "2000"]

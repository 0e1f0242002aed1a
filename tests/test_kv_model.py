"""The TurboQuant KV cache inside real mlx-lm models: routing, generation, hybrids, save/load."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base, llama
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

from turboquant.runtime import kv_attention
from turboquant.runtime.kvcache import (
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
    kv_cache_from_args,
    make_turboquant_cache,
)

VOCAB = 256
DENSE = Path(__file__).resolve().parents[1] / "reference" / "models" / "pystd-dense"


def _llama(layer_types=None, sliding_window=None, layers=4, seed=0):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=layers, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        head_dim=64, layer_types=layer_types, sliding_window=sliding_window,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model():
    return _llama()


def _tokens(n, seed=1):
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed))


def _greedy(model, prompt, cache, n=12):
    out = []
    for tok, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n):
        out.append(int(tok))
    return out


def _logits(model, tokens, cache, step):
    """Feed tokens `step` at a time through the cache; all logits, float32."""
    outs = [model(tokens[None, i : i + step], cache=cache) for i in range(0, tokens.size, step)]
    return mx.concatenate(outs, axis=1).astype(mx.float32)[0]


def test_install_is_one_idempotent_hook():
    kv_attention.install()
    fn = base.quantized_scaled_dot_product_attention
    kv_attention.install()
    assert base.quantized_scaled_dot_product_attention is fn and kv_attention.installed()
    kv_attention.uninstall()
    assert not kv_attention.installed()
    from mlx_lm.models import cache as cache_module

    assert not hasattr(cache_module, "TurboQuantKVCache")
    kv_attention.install()
    assert hasattr(cache_module, "TurboQuantKVCache") and kv_attention.installed()


def test_install_registers_the_cache_classes_it_is_given(monkeypatch):
    # kv_attention imports nothing of kvcache: kvcache hands its classes to install()
    from mlx_lm.models import cache as cache_module

    class OtherCache(TurboQuantKVCache):
        pass

    monkeypatch.setattr(kv_attention, "_CACHE_CLASSES", list(kv_attention._CACHE_CLASSES))
    try:
        kv_attention.install(OtherCache)
        assert cache_module.OtherCache is OtherCache
        assert cache_module.TurboQuantKVCache is TurboQuantKVCache  # given before
        kv_attention.uninstall()
        assert not hasattr(cache_module, "OtherCache")
        assert not hasattr(cache_module, "TurboQuantRotatingKVCache")
        kv_attention.install()  # the classes given before come back
        assert cache_module.OtherCache is OtherCache
    finally:
        kv_attention.install()
        delattr(cache_module, "OtherCache")


def test_mlx_lm_quantized_cache_still_works(model):
    # The hook passes everything that is not a TurboQuant view to mlx-lm's own function.
    tokens = _tokens(70)
    kv_attention.uninstall()
    try:
        want = _logits(model, tokens, [QuantizedKVCache(bits=8) for _ in model.layers], 7)
    finally:
        kv_attention.install()
    got = _logits(model, tokens, [QuantizedKVCache(bits=8) for _ in model.layers], 7)
    assert mx.array_equal(got, want)


def test_wide_window_is_the_fp16_cache(model):
    prompt = _tokens(150)
    want = _greedy(model, prompt, make_prompt_cache(model))
    cache = make_turboquant_cache(model, window=4096, protect_layers=0)
    assert all(isinstance(c, TurboQuantKVCache) for c in cache)
    assert _greedy(model, prompt, cache) == want
    assert all(c.compressed_tokens == 0 for c in cache)
    ref = _logits(model, _tokens(90, 3), make_prompt_cache(model), 9)
    got = _logits(model, _tokens(90, 3), make_turboquant_cache(model, window=4096), 9)
    assert mx.abs(got - ref).max().item() < 1e-4


def _logit_error(got, ref):
    """Mean over positions of the largest logit change, in units of the logits' spread."""
    return (mx.abs(got - ref).max(axis=-1) / ref.std(axis=-1)).mean().item()


@pytest.mark.parametrize("bits, affine_bits", [((8, 8), 8), ((4, 4), 4), ((4, 3), 4)])
def test_compressed_logits_stay_close(model, bits, affine_bits):
    # Error against the fp16 cache, at most that of mlx-lm's affine cache with as many or
    # more bits (group 64, fp16 scale and bias: 8.5 / 4.5 bits per value).
    tokens = _tokens(200, 5)
    ref = _logits(model, tokens, make_prompt_cache(model), 8)
    affine = _logits(model, tokens, [QuantizedKVCache(bits=affine_bits) for _ in model.layers], 8)
    cache = make_turboquant_cache(model, bits_k=bits[0], bits_v=bits[1], sink=4, window=16,
                                  protect_layers=0)
    got = _logits(model, tokens, cache, 8)
    assert all(c.compressed_tokens > 100 for c in cache)
    assert _logit_error(got, ref) < _logit_error(affine, ref)
    assert _logit_error(got, ref) < (0.01 if bits == (8, 8) else 0.15)
    agree = (got[-100:].argmax(-1) == ref[-100:].argmax(-1)).mean().item()
    assert agree > (0.97 if bits == (8, 8) else 0.85)


def test_protected_layers_and_construction(model):
    cache = make_turboquant_cache(model, bits_k=4, bits_v=3, protect_layers=1, protect_bits=8)
    assert [(c.bits_k, c.bits_v) for c in cache] == [(8, 8), (4, 3), (4, 3), (8, 8)]
    assert len({c.seed for c in cache}) == 4  # one rotation seed per layer
    fp = make_turboquant_cache(model, protect_layers=1, protect_bits=None)
    assert [type(c) for c in fp] == [KVCache, TurboQuantKVCache, TurboQuantKVCache, KVCache]
    tokens = _tokens(40)
    _logits(model, tokens, fp, 10)  # mixed lists run
    assert kv_cache_from_args(model) is None
    assert kv_cache_from_args(model, bits_k=16, bits_v=16) is None
    made = kv_cache_from_args(model, bits_k=8, bits_v=3, sink=2, window=32, protect_layers=0)
    assert [(c.bits_k, c.bits_v, c.sink, c.window) for c in made] == [(8, 3, 2, 32)] * 4


def test_layers_compress_on_different_decode_steps(model):
    """Layer i of n compresses at phase i * block // n: after the step that compresses the
    prompt, decoding token by token compresses one layer a step (never all four at once),
    each once per block, and each layer's compressed part ends on its own block boundary."""
    cache = make_turboquant_cache(model, sink=4, window=16, block=8, protect_layers=0)
    assert [c.phase for c in cache] == [0, 2, 4, 6]
    model(_tokens(100, 5)[None], cache=cache)
    flushes = []
    tok = _tokens(1, 6)
    for _ in range(17):  # the first step compresses the prompt, in every layer
        before = [c.compressed_tokens for c in cache]
        tok = mx.argmax(model(tok[None], cache=cache)[:, -1], axis=-1)
        mx.eval(tok)
        flushes.append([i for i, c in enumerate(cache) if c.compressed_tokens != before[i]])
    assert flushes[0] == [0, 1, 2, 3]
    flushes = flushes[1:]
    assert max(len(f) for f in flushes) == 1
    assert sorted(i for f in flushes for i in f) == [0, 0, 1, 1, 2, 2, 3, 3]
    for c in cache:
        assert (c.compressed_tokens - c.phase) % c.block == 0  # sink + comp on its boundary
        assert c.window <= c._n_tail < c.window + c.block + 1


class _Hybrid(nn.Module):
    """A stand-in for hybrid models: linear-attention layers between attention layers."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(2, 2) for _ in range(6)]

    def make_cache(self):
        return [ArraysCache(2), KVCache(), CacheList(KVCache(), ArraysCache(1)),
                ArraysCache(2), RotatingKVCache(max_size=32), KVCache()]


def test_hybrid_models_count_kv_layers_in_order():
    cache = make_turboquant_cache(_Hybrid(), bits_k=4, bits_v=3, protect_layers=1, protect_bits=8)
    assert [type(c) for c in cache] == [ArraysCache, TurboQuantKVCache, CacheList, ArraysCache,
                                        TurboQuantRotatingKVCache, TurboQuantKVCache]
    assert isinstance(cache[2].caches[0], TurboQuantKVCache)
    assert isinstance(cache[2].caches[1], ArraysCache)
    # KV layers are 1, 2, 4, 5: the first and the last are protected
    bits = [cache[1].bits_k, cache[2].caches[0].bits_k, cache[4].bits_k, cache[5].bits_k]
    assert bits == [8, 4, 4, 8]
    assert cache[4].max_size == 32


def test_learned_sinks_are_refused():
    class WithSinks(_Hybrid):
        def __init__(self):
            super().__init__()
            self.sinks = mx.zeros((4,))

    with pytest.raises(ValueError, match="learned attention sinks"):
        make_turboquant_cache(WithSinks())


def test_sliding_window_model():
    types = ["sliding_attention", "full_attention"] * 2
    model = _llama(layer_types=types, sliding_window=32, seed=4)
    tokens = _tokens(120, 8)
    ref = _logits(model, tokens, make_prompt_cache(model), 6)
    cache = make_turboquant_cache(model, window=4096, protect_layers=0)
    assert [type(c) for c in cache] == [TurboQuantRotatingKVCache, TurboQuantKVCache] * 2
    assert mx.abs(_logits(model, tokens, cache, 6) - ref).max().item() < 1e-4
    cache = make_turboquant_cache(model, bits_k=8, bits_v=8, window=8, block=4, protect_layers=0)
    got = _logits(model, tokens, cache, 6)
    assert cache[0].compressed_tokens > 0 and cache[0].size() == 32
    assert _logit_error(got, ref) < 0.01


def test_save_load_mid_generation(model, tmp_path):
    prompt = _tokens(100, 11)
    a = make_turboquant_cache(model, window=16, protect_layers=1, protect_bits=None)
    model(prompt[None], cache=a)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, a)
    b = load_prompt_cache(path)
    assert [c.phase for c in b[1:3]] == [c.phase for c in a[1:3]] == [16, 32]  # 64 * i // 4
    nxt = _tokens(20, 12)
    assert mx.array_equal(_logits(model, nxt, a, 1), _logits(model, nxt, b, 1))


@pytest.mark.skipif(not (DENSE / "config.json").exists(), reason="reference model not trained yet")
def test_reference_model_greedy_agrees():
    from mlx_lm import load

    model, tok = load(str(DENSE))
    text = (Path(__file__).resolve().parents[1] / "reference" / "heldout.txt").read_text()[:3000]
    tokens = mx.array(tok.encode(text)[:400])
    ref = _logits(model, tokens, make_prompt_cache(model), 16)
    cache = make_turboquant_cache(model, bits_k=4, bits_v=3, sink=4, window=32, protect_layers=0)
    got = _logits(model, tokens, cache, 16)
    agree = (got[100:].argmax(-1) == ref[100:].argmax(-1)).mean().item()
    assert agree > 0.9


def test_cli_flags(model):
    import argparse

    from turboquant.runtime.kvcache import add_kv_arguments

    ap = argparse.ArgumentParser()
    add_kv_arguments(ap)
    a = ap.parse_args("--kv-bits-k 8 --kv-bits-v 3 --kv-window 64 --kv-protect-layers 0".split())
    cache = kv_cache_from_args(
        model, a.kv_bits_k, a.kv_bits_v, a.kv_sink, a.kv_window, a.kv_protect_layers
    )
    assert [(c.bits_k, c.bits_v, c.window) for c in cache] == [(8, 3, 64)] * 4
    a = ap.parse_args([])
    assert kv_cache_from_args(model, a.kv_bits_k, a.kv_bits_v, a.kv_sink, a.kv_window) is None
    with pytest.raises(ValueError, match="both be 16"):
        kv_cache_from_args(model, 16, 3)


def test_registered_decode_kernel_is_used_for_one_token(monkeypatch):
    from turboquant.kernels import dispatch
    from turboquant.kernels.kv_reference import KVParts

    k = mx.random.normal((1, 2, 20, 64), key=mx.random.key(0))
    parts = KVParts(None, None, None, k, k)
    calls = []

    def kernel(q, p, scale, mask):
        calls.append(q.shape[2])
        if len(calls) > 1:
            raise NotImplementedError  # a kernel may decline: the reference runs
        return mx.zeros_like(q)

    monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
    kv_attention.register_kernel("cuda", kernel)
    try:
        q1 = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1))
        assert mx.all(kv_attention.turboquant_attention(q1, parts, 0.1) == 0).item()
        ref = mx.fast.scaled_dot_product_attention(q1, k, k, scale=0.1)
        assert mx.allclose(kv_attention.turboquant_attention(q1, parts, 0.1), ref, atol=1e-5).item()
        q4 = mx.random.normal((1, 4, 4, 64), key=mx.random.key(2))
        kv_attention.turboquant_attention(q4, parts, 0.1, "causal")  # prefill: the reference
        assert calls == [1, 1]
    finally:
        kv_attention.unregister_kernel("cuda")

"""benchmarks/decode.py's per-token measure: the gaps between generated tokens, and the
summary --token-times prints (whether a slow run is slow throughout or stalls)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # decode_ncu.py

import decode  # noqa: E402  (the benchmark script)


def test_token_gaps_time_every_generated_token_after_the_first():
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    gaps = decode.token_gaps(llama.Model(args), tokens=6, prompt_len=4)
    assert len(gaps) == 5 and all(g > 0 for g in gaps)
    assert decode.tokens_per_second(gaps) == 5 / sum(gaps)
    assert decode.tokens_per_second([]) == 0.0  # one token: no gap to time


def test_describe_gaps_gives_percentiles_and_counts_the_stalls():
    gaps = [0.004] * 8 + [0.010, 0.012]  # two stalls among 4 ms tokens
    text = decode.describe_gaps(gaps)
    assert "p50 4.00" in text and "max 12.00" in text
    assert "2/10 over 1.25x the median" in text


def test_round_ratios_pair_each_round_with_the_peers_own():
    results = {"affine4": [100.0, 150.0, 120.0], "tq3": [150.0, 165.0, 180.0], "bf16": [90.0]}
    ratios = decode.round_ratios(results)
    assert ratios["tq3"] == [1.5, 1.1, 1.5] and ratios["bf16"] == [0.9]
    assert ratios["affine4"] == [1.0, 1.0, 1.0]
    assert decode.round_ratios({"tq3": [1.0]}) == {}  # no peer measured


def _recording_llama(seen: list):
    """A one-layer Llama whose calls append (input shape, cache offset, cache) to `seen`."""
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=300))
    model = llama.Model(args)
    forward = model.__call__
    model.__class__ = type("Recorded", (llama.Model,), {
        "__call__": lambda self, x, cache=None: seen.append((x.shape, cache[0].offset, cache))
        or forward(x, cache=cache)})
    return model


def test_prefill_tps_times_one_prompt_into_a_fresh_cache():
    """`--prefill N`: prompt tokens per second of an N-token prompt, the median of the
    timed runs after a warm-up; each run starts from an empty cache."""
    seen = []
    tps = decode.prefill_tps(_recording_llama(seen), tokens=20, repeats=3)
    assert tps > 0
    assert [(shape, offset) for shape, offset, _ in seen] == [((1, 20), 0)] * 4  # warm-up + 3


def test_cpu_prefill_evaluates_the_cache_from_empty_each_run():
    """benchmarks/cpu_decode.py `--prefill N`: each run fills a fresh cache, as mlx-lm's
    prefill does, after one that warms up."""
    import cpu_decode

    seen = []
    assert cpu_decode.prefill_tps(_recording_llama(seen), tokens=20, repeats=2) > 0
    assert [(shape, offset) for shape, offset, _ in seen] == [((1, 20), 0)] * 3
    assert all(cache[0].offset == 20 for *_, cache in seen)  # each cache filled


def test_a_process_first_variant_warms_up_as_long_as_it_is_timed(monkeypatch):
    """A process's first round ran 35-45% slow on the H200: the first variant's warm-up
    decodes as many tokens as the timed run, the others' 8; both after the prompt of
    `--context` tokens (the warm-up traces the buffer sizes the timed run meets)."""
    warmups, timed = [], []
    monkeypatch.setattr(decode, "decode_tps",
                        lambda model, tokens, prompt_len: warmups.append((tokens, prompt_len)))
    monkeypatch.setattr(decode, "token_gaps",
                        lambda model, tokens, prompt_len: timed.append(prompt_len) or [0.01] * tokens)

    class Args:
        tokens, profile, context = 256, False, 4096

    assert decode.run_variant(None, Args, first=True) == [0.01] * 256
    decode.run_variant(None, Args)
    assert warmups == [(256, 4096), (8, 4096)] and timed == [4096, 4096]


def test_decode_ncu_profiles_only_the_steady_tokens_it_is_asked_for(monkeypatch):
    """tools/decode_ncu.py: the profiler range opens after WARM steady tokens and
    closes `tokens` later, once each, on the profiled round only."""
    import decode_ncu

    calls = []
    monkeypatch.setattr(decode, "cuda_profiler", lambda start: calls.append(start) or True)
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model, prompt = llama.Model(args), decode_ncu.mx.array([1, 2, 3])
    assert decode_ncu.decode_round(model, prompt, tokens=3, profiled=False) > 0
    assert calls == []
    assert decode_ncu.decode_round(model, prompt, tokens=3, profiled=True) > 0
    assert calls == [True, False]


def test_the_gpt_oss_shape_builds_its_experts_and_biased_layers_as_turboquant_layers(monkeypatch):
    """`--moe gpt-oss`: every expert projection a TQSwitchLinear and every attention
    projection a TQLinear, each keeping its bias, and the model decodes."""
    from turboquant.runtime.layers import TQLinear, TQSwitchLinear

    monkeypatch.setattr(decode, "GPT_OSS_120B", dict(decode.GPT_OSS_120B, **decode.TINY_GPT_OSS))
    model = decode.build("tq3-single", moe="gpt-oss")
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        assert isinstance(proj, TQSwitchLinear) and proj.bias.shape[0] == 8
    for proj in (layer.self_attn.q_proj, layer.self_attn.o_proj):
        assert isinstance(proj, TQLinear) and "bias" in proj
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 512) and mx.all(mx.isfinite(logits)).item()

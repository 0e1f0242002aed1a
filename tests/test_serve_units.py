"""The pieces of `turboquant serve` that need no HTTP: stop strings, request checks, the
chat prompt, model loading (TurboQuant repo, plain folder, Hub repo id) and the context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.runtime.server_api import (
    APIError,
    fallback_chat_prompt,
    parse_chat,
    parse_completion,
)
from turboquant.runtime.server_engine import StopText, is_turboquant, max_context_of

# ---------------------------------------------------------------------------- stop strings

_alphabet = st.sampled_from("ab\n")


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Where the output ends: the start of the occurrence that is complete first (ends
    first; of two ending together, the longer one), found by brute force."""
    hits = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    return min(hits)[1] if hits else None


@settings(max_examples=300, deadline=None)
@given(text=st.text(_alphabet, max_size=30),
       stops=st.lists(st.text(_alphabet, min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_text_cuts_at_the_first_stop_however_the_text_is_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    segments = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher, out, stopped = StopText(tuple(stops)), "", False
    for seg in segments:
        emitted, stopped = matcher.feed(seg)
        out += emitted
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    first = _first_stop(text, stops)
    assert stopped == (first is not None)
    assert out == (text if first is None else text[:first])


def test_stop_text_holds_back_only_a_possible_stop():
    m = StopText(("</end>",))
    assert m.feed("abc</") == ("abc", False)
    assert m.feed("e") == ("", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("y</end>z") == ("y", True)


def test_the_stop_that_completes_first_wins():
    assert StopText(("\n", "a\na")).feed("a\na") == ("a", True)  # "\n" is complete first
    assert StopText(("b", "ab")).feed("ab") == ("", True)  # both end at "b": the longer


# ---------------------------------------------------------------------------- requests


def _bad(fn, body, param):
    with pytest.raises(APIError) as e:
        fn(body, 100)
    assert e.value.status == 400 and e.value.param == param
    return e.value


def test_chat_request_defaults_and_content_parts():
    req = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "hi"}], "max_completion_tokens": 5, "max_tokens": 9,
        "stop": "x", "logit_bias": {"3": -100}, "n": 1, "logprobs": False}, 100)
    assert req.messages == [{"role": "system", "content": "ab"},
                            {"role": "user", "content": "hi"}]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.logit_bias) == (
        5, 1.0, 1.0, ("x",), {3: -100.0})


def test_request_checks_name_the_parameter():
    base = {"model": "m", "prompt": "p"}
    _bad(parse_completion, {**base, "temperature": 2.5}, "temperature")
    _bad(parse_completion, {**base, "temperature": True}, "temperature")
    _bad(parse_completion, {**base, "top_p": -1}, "top_p")
    _bad(parse_completion, {**base, "max_tokens": "8"}, "max_tokens")
    _bad(parse_completion, {**base, "presence_penalty": 3}, "presence_penalty")
    _bad(parse_completion, {**base, "stop": [""]}, "stop")
    _bad(parse_completion, {**base, "logit_bias": {"x": 1}}, "logit_bias")
    _bad(parse_completion, {**base, "logit_bias": {"1": 101}}, "logit_bias")
    _bad(parse_completion, {**base, "best_of": 3}, "best_of")
    _bad(parse_completion, {"prompt": "p"}, "model")
    _bad(parse_completion, {"model": "m"}, "prompt")
    _bad(parse_chat, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {}}]}]}, "messages.[0].content")
    _bad(parse_chat, {"model": "m", "messages": ["hi"]}, "messages.[0]")
    with pytest.raises(APIError):
        parse_chat([], 100)
    assert parse_completion({**base, "prompt": [[1, 2]]}, 100).prompt == [1, 2]
    assert parse_completion({**base, "prompt": ["p"]}, 100).prompt == "p"


def test_fallback_chat_prompt_is_role_prefixed_lines():
    assert fallback_chat_prompt([{"role": "system", "content": "Be terse."},
                                 {"role": "user", "content": "Hi"}]) == (
        "system: Be terse.\nuser: Hi\nassistant:")


def test_chat_without_a_template_uses_the_fallback(tmp_path):
    from test_serve_server import write_tiny_llama

    from turboquant.runtime.server import _load_model, _prompt_tokens

    path = write_tiny_llama(tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    _, tokenizer, _ = _load_model(path)
    assert not tokenizer.has_chat_template
    messages = [{"role": "user", "content": "def f():"}]
    req = parse_chat({"model": "m", "messages": messages}, 8192)
    assert _prompt_tokens(tokenizer, req) == tokenizer.encode(fallback_chat_prompt(messages))


# ---------------------------------------------------------------------------- loading


def test_context_comes_from_the_flag_then_the_config():
    assert max_context_of({"max_position_embeddings": 512}, 100) == 100
    assert max_context_of({"max_position_embeddings": 512}) == 512
    assert max_context_of({"text_config": {"max_position_embeddings": 64}}) == 64
    assert max_context_of({}) == 4096


def test_load_model_uses_the_runtime_for_turboquant_repos_and_mlx_lm_otherwise(tq_repo,
                                                                              tmp_path):
    from test_serve_server import write_tiny_llama

    from turboquant.runtime import TQLinear
    from turboquant.runtime.server import _load_model

    assert is_turboquant(tq_repo)
    model, _, config = _load_model(tq_repo)
    assert any(isinstance(m, TQLinear) for _, m in model.named_modules())
    assert config["quantization_config"]["quant_method"] == "turboquant"

    plain = write_tiny_llama(tmp_path / "plain")
    assert not is_turboquant(plain)
    model, tokenizer, config = _load_model(plain)
    assert not any(isinstance(m, TQLinear) for _, m in model.named_modules())
    assert config["model_type"] == "llama" and tokenizer.eos_token_ids == {0}


@pytest.mark.filterwarnings("ignore:It seems that you are about to commit a data file")
def test_load_model_takes_a_hub_repo_id(tq_repo, hub_server):
    from turboquant.runtime import RepoError, TQLinear
    from turboquant.runtime.server import _load_model

    api = hub_server.api()
    api.create_repo("test-user/tiny-tq")
    api.upload_folder(repo_id="test-user/tiny-tq", folder_path=tq_repo)
    model, _, _ = _load_model("test-user/tiny-tq")
    assert any(isinstance(m, TQLinear) for _, m in model.named_modules())
    with pytest.raises(RepoError, match="test-user/absent"):
        _load_model("test-user/absent")


def test_kv_flags_build_a_turboquant_cache_per_request(tq_repo):
    from turboquant.runtime.kvcache import TurboQuantKVCache
    from turboquant.runtime.server import GenerationOptions, _load_model
    from turboquant.runtime.server_engine import make_prompt_cache

    model, _, _ = _load_model(tq_repo)
    assert make_prompt_cache(model, GenerationOptions()) is None  # mlx-lm's fp16 cache
    opts = GenerationOptions(kv_bits_k=4, kv_bits_v=3, kv_window=8, kv_protect_layers=0)
    a, b = make_prompt_cache(model, opts), make_prompt_cache(model, opts)
    assert all(isinstance(c, TurboQuantKVCache) and c.window == 8 for c in a)
    assert a[0] is not b[0]  # a fresh cache for every request


REFERENCE_MOE = Path(__file__).resolve().parents[1] / "reference" / "models" / "pystd-moe"


@pytest.mark.skipif(not (REFERENCE_MOE / "config.json").is_file(),
                    reason="reference/models/pystd-moe is not placed")
def test_a_plain_bf16_moe_folder_serves_in_float32_on_the_cpu():
    import mlx.core as mx
    from mlx_lm import generate

    from turboquant.runtime.server import _load_model

    model, tokenizer, _ = _load_model(REFERENCE_MOE)
    if mx.default_device().type == mx.cpu:
        assert model.model.layers[0].mlp.switch_mlp.up_proj.weight.dtype == mx.float32
    assert generate(model, tokenizer, "def add(a, b):", max_tokens=4)

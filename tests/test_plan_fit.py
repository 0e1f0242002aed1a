"""Memory planning (pipeline/fit*.py): layer kinds and KV cache from config.json, weights
projected through a recipe (equal to what the conversion plan lays out), a converted repo
read from its headers, and the verdicts."""

from __future__ import annotations

import math

import pytest
from checkpoints import MOE_STYLES, write_llama_checkpoint, write_moe_checkpoint

from turboquant.pipeline import fit
from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.fit import GB, Machine, kv_cache_bytes, project
from turboquant.pipeline.fit_model import model_shape
from turboquant.pipeline.fit_weights import inventory, reproject
from turboquant.pipeline.plan import build_plan
from turboquant.pipeline.sources import LocalSource

CPU_24 = Machine("cpu", 24 * GB, "test")


def _cfg(**kw):
    base = dict(model_type="llama", hidden_size=1024, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=1000,
                intermediate_size=4096)
    base.update(kw)
    return base


# ------------------------------------------------------------------------ config -> shape


def test_full_attention_kv_per_token():
    s = model_shape(_cfg())
    assert s.kinds == ("full",) * 8
    assert s.kv_bytes_per_token(2) == 4 * (64 + 64) * 2
    # mlx-lm's KVCache grows in steps of 256 tokens
    assert kv_cache_bytes(s, 1000, 2, None, 1000) == 8 * 1024 * 4 * 128 * 2
    assert kv_cache_bytes(s, 1024, 2, None, 1024) == kv_cache_bytes(s, 1000, 2, None, 1000)


def test_layer_types_sliding_windows_are_capped():
    # gpt-oss style: alternating sliding / full
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"] * 4, sliding_window=128)
    s = model_shape(cfg)
    assert s.count("sliding") == 4 and s.count("full") == 4
    per = s.kv_bytes_per_token(2)
    long = kv_cache_bytes(s, 100_000, 2, None, 2048)
    assert long == 4 * fit.round_up(100_000, 256) * per + 4 * fit.round_up(128 + 2048, 256) * per


def test_gemma_pattern_and_text_config():
    cfg = {"model_type": "gemma3", "text_config": _cfg(model_type="gemma3_text",
                                                       sliding_window=512,
                                                       sliding_window_pattern=6)}
    s = model_shape(cfg)
    assert s.kinds[:6] == ("sliding",) * 5 + ("full",)
    assert s.hidden == 1024 and s.sliding_window == 512


def test_linear_attention_state_is_constant():
    cfg = _cfg(model_type="qwen3_next", num_hidden_layers=8, full_attention_interval=4,
               linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4)
    s = model_shape(cfg)
    assert s.kinds == ("linear", "linear", "linear", "full") * 2
    conv = 3 * (2 * 16 * 128 + 32 * 128)
    state = 32 * 128 * 128
    assert s.linear_state_bytes(2) == conv * 2 + state * 4
    short = kv_cache_bytes(s, 256, 2, None, 256)
    long = kv_cache_bytes(s, 2560, 2, None, 2048)
    assert long - short == 2 * (2560 - 256) * s.kv_bytes_per_token(2)  # only the full layers


def test_mla_latent_cache():
    v3 = model_shape(_cfg(model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64,
                          qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=256))
    assert v3.kv_bytes_per_token(2) == (512 + 64) * 2
    v2 = model_shape(_cfg(model_type="deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64,
                          qk_nope_head_dim=128, v_head_dim=128))
    assert v2.kv_bytes_per_token(2) == 16 * (192 + 128) * 2


def test_compressed_kv_cache():
    s = model_shape(_cfg())
    n = 100_000
    fp = kv_cache_bytes(s, n, 2, None, 2048)
    kv43 = kv_cache_bytes(s, n, 2, (4, 3), 2048)
    # codes: 4 bits -> 8 words, 3 bits -> 6 words per 64-d head vector, + 2 fp16 norms
    per_head = 4 * (8 + 6) + 4
    hot = 4 + 2048
    cold = fit.round_up(n - hot, 256)
    middle = 4 * (hot * 4 * 128 * 2 + cold * 4 * per_head)
    protected = 4 * (hot * 4 * 128 * 2 + cold * 4 * (4 * (16 + 16) + 4))  # 8 bits
    assert kv43 == middle + protected
    assert kv43 < fp / 2


def test_constants_match_the_runtime():
    from turboquant.kernels import reference
    from turboquant.kernels.kv_reference import kv_words
    from turboquant.runtime.kvcache import DEFAULTS, kv_bytes_per_token

    assert fit.CHUNK == reference.CHUNK
    assert (fit.KV_SINK, fit.KV_WINDOW, fit.KV_PROTECT_LAYERS, fit.KV_PROTECT_BITS) == (
        DEFAULTS["sink"], DEFAULTS["window"], DEFAULTS["protect_layers"], DEFAULTS["protect_bits"])
    for d in (64, 80, 128, 192):
        for b in (2, 3, 4, 8):
            assert fit.kv_words(d, b) == kv_words(d, b)
        assert 4 * (fit.kv_words(d, 4) + fit.kv_words(d, 3)) + 4 == kv_bytes_per_token(d, 4, 3)


# ------------------------------------------------------------------------ weights


def _stored_bytes(plan) -> dict[str, int]:
    return {it.name: sum(s.nbytes for s in it.stored) for it in plan.items}


@pytest.mark.parametrize("style", ["llama", *MOE_STYLES])
@pytest.mark.parametrize("overrides", [{}, {"protect_layers": 0, "expert_bits": 2},
                                       {"protect_layers": 0, "bits": 3,
                                        "expert_bits": "ternary", "group_size": 32}])
def test_projection_equals_the_conversion_plan(tmp_path, style, overrides):
    if style == "llama":
        src = write_llama_checkpoint(tmp_path / "m", layers=3, tie_word_embeddings=True)
    else:
        src = write_moe_checkpoint(tmp_path / "m", style=style, layers=3, hidden=64,
                                   intermediate=64, first_dense_layers=1)
    source = LocalSource(src)
    want = _stored_bytes(build_plan(source, overrides=overrides))
    inv = inventory(source, overrides=overrides)
    assert not inv.problems
    assert {w.name: w.nbytes for w in inv.weights} == want
    experts = {w.name for w in inv.weights if w.is_expert}
    assert experts == {n for n in want if ".experts." in n}


def test_reproject_changes_only_the_recipe(tmp_path):
    src = write_moe_checkpoint(tmp_path / "m", layers=3, hidden=64, intermediate=64)
    inv = inventory(LocalSource(src), overrides={"protect_layers": 0})
    two = reproject(inv, expert_bits=2)
    want = _stored_bytes(build_plan(LocalSource(src), overrides={"protect_layers": 0,
                                                                   "expert_bits": 2}))
    assert {w.name: w.nbytes for w in two.weights} == want
    assert sum(w.nbytes for w in two.weights) < sum(w.nbytes for w in inv.weights)


@pytest.mark.parametrize("style,recipe", [("qwen3_moe", "default"), ("deepseek_v2", None)],
                         ids=["generic", "family"])
def test_reproject_reuses_the_architecture_and_pairing_and_equals_the_plan(
        tmp_path, monkeypatch, style, recipe):
    """`plan`'s suggestions reproject a checkpoint four times: mlx-lm's reading of the
    tensors (derive) and the published pairing are made once (a 1T release spent ~85% of
    its `plan` redoing them), and every reprojection still equals the conversion plan."""
    from turboquant.manifests import architecture
    from turboquant.pipeline import fit_weights

    src = write_moe_checkpoint(tmp_path / "m", style=style, layers=3, hidden=64,
                               intermediate=64, first_dense_layers=1)
    calls = {"derive": 0, "pair": 0}
    derive, pair = architecture.derive, fit_weights.published.pair

    def counted(name, fn):
        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(architecture, "derive", counted("derive", derive))
    monkeypatch.setattr(fit_weights.published, "pair", counted("pair", pair))
    inv = inventory(LocalSource(src), recipe=recipe)
    first = dict(calls)
    options = [{"expert_bits": 2}, {"expert_bits": "ternary"}, {"bits": 3, "expert_bits": 2}]
    again = [reproject(inv, **opt) for opt in options]
    assert calls == first, (first, calls)  # nothing derived or paired again
    monkeypatch.setattr(architecture, "derive", derive)
    monkeypatch.setattr(fit_weights.published, "pair", pair)
    for opt, inv2 in zip(options, again):
        want = _stored_bytes(build_plan(LocalSource(src), recipe=recipe, overrides=opt))
        assert {w.name: w.nbytes for w in inv2.weights} == want, opt


def test_converted_repo_projects_like_its_source(tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", layers=3, hidden=64, intermediate=64)
    out = tmp_path / "out"
    convert(ConvertOptions(str(src), str(out), in_process=True, progress=False,
                           check_disk=False, min_job_bytes=0))
    a = project(inventory(LocalSource(src)), 4096, CPU_24)
    b = project(inventory(LocalSource(out)), 4096, CPU_24)
    assert b.inventory.kind == "repo" and a.inventory.kind == "source"
    assert (a.weights, a.experts, a.kv, a.workspace) == (b.weights, b.experts, b.kv, b.workspace)
    # the repo's files hold the same bytes (plus the safetensors headers)
    on_disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    stored = sum(w.nbytes for w in b.inventory.weights)
    assert stored < on_disk < stored + 64 * 1024


def test_recipe_refusals_are_reported(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", extra_tensors=[("model.mystery.weight", (8, 64))])
    inv = inventory(LocalSource(src))
    assert len(inv.problems) == 1 and "model.mystery.weight" in inv.problems[0]


# ------------------------------------------------------------------------ verdicts


@pytest.fixture(scope="module")
def moe_inventory(tmp_path_factory):
    src = write_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", layers=4, hidden=128,
                               intermediate=128, experts=8, experts_per_tok=2, vocab=512)
    return inventory(LocalSource(src))


def _at(inv, memory, **kw):
    return project(inv, 1024, Machine("cpu", int(memory), "test"), **kw)


def test_verdicts_and_expert_budget(moe_inventory):
    p = _at(moe_inventory, 24 * GB)
    assert p.verdict == "RESIDENT" and p.expert_budget is None
    assert p.need == p.weights + p.kv + p.workspace + p.reserve
    assert p.reserve == fit.RESERVE_FIXED + int(0.05 * 24 * GB)
    # reserve = 1 GB + 5% of memory: solve for memories between "streams" and "resident"
    base = p.nonexpert + p.kv + p.workspace + fit.RESERVE_FIXED
    lo = (base + p.min_expert_budget) / 0.95
    hi = (p.peak + fit.RESERVE_FIXED) / 0.95
    assert lo < hi
    memory = int((lo + hi) / 2)
    q = _at(moe_inventory, memory)
    assert q.verdict == "STREAM"
    assert q.min_expert_budget <= q.expert_budget <= q.experts
    assert q.fixed + q.expert_budget <= memory
    assert _at(moe_inventory, lo - 1000).verdict == "WON'T FIT"
    assert _at(moe_inventory, hi + 1000).verdict == "RESIDENT"
    # one token's worth: the top-2 experts of each of the 4 layers (the first and last
    # layers' experts are bigger: the recipe protects them at 4 bits)
    per_layer = [sum(w.resident(4) for w in moe_inventory.weights
                     if w.layer == i and w.expert == 0) for i in range(4)]
    assert per_layer[0] > per_layer[1]
    assert q.min_expert_budget == 2 * sum(per_layer)
    assert _at(moe_inventory, 0.5 * GB).verdict == "WON'T FIT"


def test_dense_model_is_never_streamed(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", hidden=128, intermediate=256)
    p = _at(inventory(LocalSource(src)), 1.001 * GB)
    assert p.experts == 0 and p.verdict == "WON'T FIT" and p.max_context("STREAM") == 0


def test_activation_dtype_follows_the_runtime(moe_inventory, tmp_path):
    assert _at(moe_inventory, 24 * GB).dtype == "float32"  # MoE on the CPU
    metal = project(moe_inventory, 1024, Machine("metal", 24 * GB, "test"))
    assert metal.dtype == "bfloat16"
    assert metal.weights < _at(moe_inventory, 24 * GB).weights  # norms/router not cast
    assert metal.phases["decode"] == 0  # Metal GEMV kernels decode no tiles
    assert _at(moe_inventory, 24 * GB, dtype="float16").dtype == "float16"


def test_max_context_is_the_edge(moe_inventory):
    p = _at(moe_inventory, 1.2 * GB)
    n = p.max_context("RESIDENT")
    assert n > 1024
    ok = project(moe_inventory, n, p.machine)
    too_long = project(moe_inventory, n + 1, p.machine)
    assert ok.verdict == "RESIDENT" and too_long.verdict != "RESIDENT"


def test_tile_sizes():
    assert fit.tile(1000, 4) == pytest.approx(8150)
    assert fit.tile(1000, 3) == pytest.approx(20100)
    assert fit.tile(10**9, 2) == pytest.approx(4 * (1 << 22) * 8.15)
    assert math.isclose(fit.tile(10, "ternary"), 81.5)

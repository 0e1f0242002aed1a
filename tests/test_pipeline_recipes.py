"""Recipes: bundled files validate, cover their families, and bad files name the bad key."""

from __future__ import annotations

import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint

from turboquant.manifests.recipe import (RECIPES_DIR, RecipeError, list_recipes, load_recipe,
                                         recipe_for_model_type)
from turboquant.pipeline.plan import build_plan
from turboquant.pipeline.sources import LocalSource

FAMILIES = {
    "llama": ["llama", "mistral", "qwen2", "qwen3"],
    "mixtral": ["mixtral"],
    "qwen_moe": ["qwen2_moe", "qwen3_moe"],
    "deepseek_v2": ["deepseek_v2", "deepseek_v3"],
    "gpt_oss": ["gpt_oss"],
    "default": ["*"],  # the generic recipe: any other model_type mlx-lm has
}


def test_bundled_recipes_validate_and_cover_the_families():
    assert sorted(list_recipes()) == sorted(FAMILIES)
    for name, types in FAMILIES.items():
        r = load_recipe(name)
        assert r.model_types == types
        for t in types:
            assert recipe_for_model_type(t).name == name
        assert len(r.hash()) == 64


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_dense_recipe_matches_every_tensor(tmp_path, kind):
    src = write_llama_checkpoint(tmp_path / kind, model_type=kind, layers=4, hidden=64,
                                 intermediate=128, shards=1)
    plan = build_plan(LocalSource(src))
    assert plan.recipe.name == "llama"
    codecs = {it.name: it.codec for it in plan.items}
    assert codecs["model.layers.1.self_attn.q_proj.weight"] == "turboquant"
    assert codecs["model.layers.1.input_layernorm.weight"] == "raw"
    if kind == "qwen2":
        assert codecs["model.layers.1.self_attn.q_proj.bias"] == "raw"


@pytest.mark.parametrize("style", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "gpt_oss"])
def test_moe_recipes_match_every_tensor(tmp_path, style):
    src = write_moe_checkpoint(tmp_path / style, style=style, layers=4, hidden=64,
                               intermediate=64, shards=1, first_dense_layers=1)
    plan = build_plan(LocalSource(src), overrides={"expert_bits": "ternary"})
    experts = [it for it in plan.items if it.expert is not None and it.codec != "raw"]
    assert experts
    # middle layers: ternary experts; protected first/last layers: 4 bits
    mid = [it for it in experts if it.layer in (1, 2)]
    assert mid and all(it.codec == "ternary" for it in mid)
    assert all(it.bits == 4 for it in experts if it.layer in (0, 3))
    routers = [it for it in plan.items if it.name.endswith(("mlp.gate.weight", "router.weight",
                                                            "block_sparse_moe.gate.weight"))]
    assert routers and all(it.codec == "raw" for it in routers)


def test_resolution_rules():
    r = load_recipe("llama").with_overrides(bits=2, down_proj_bits=3)
    mid = r.resolve("model.layers.5.mlp.down_proj.weight", 5, 10)
    assert (mid.action, mid.bits) == ("quantize", 3)
    assert r.resolve("model.layers.5.mlp.up_proj.weight", 5, 10).bits == 2
    assert r.resolve("model.layers.9.mlp.up_proj.weight", 9, 10).bits == 4  # protected
    assert r.resolve("model.layers.0.self_attn.k_proj.weight", 0, 10).bits == 4
    assert r.resolve("model.embed_tokens.weight").bits == 4
    assert r.resolve("model.norm.weight").action == "keep"
    assert r.resolve("model.layers.0.self_attn.rotary_emb.inv_freq").action == "drop"
    assert r.resolve("model.something_else.weight") is None
    raw = load_recipe("llama").with_overrides(embeddings_bits="raw", protect_layers=0)
    assert raw.resolve("model.embed_tokens.weight").action == "keep"
    assert raw.resolve("model.layers.0.mlp.up_proj.weight", 0, 10).bits == 4


def test_hash_follows_overrides():
    base = load_recipe("llama")
    assert base.hash() == load_recipe("llama").hash()
    assert base.hash() != base.with_overrides(bits=3).hash()
    assert base.hash() != base.with_overrides(group_size=128).hash()
    assert base.with_overrides(bits=3).hash() == base.with_overrides(bits=3).hash()


def _write(tmp_path, text):
    p = tmp_path / "r.toml"
    p.write_text(text)
    return p


GOOD = """
name = "t"
model_types = ["llama"]
keep = ['norm\\.weight$']
[quant]
bits = 4
group_size = 64
[[rules]]
match = 'proj\\.weight$'
role = "attention"
"""


@pytest.mark.parametrize(
    "edit, key",
    [
        (("[quant]", "[quant]\nbitz = 3"), "quant.bitz"),
        (("bits = 4", "bits = 5"), "quant.bits"),
        (("group_size = 64", "group_size = 48"), "quant.group_size"),
        (('role = "attention"', 'role = "attn"'), "rules[0].role"),
        (("match = 'proj", "match = '(proj"), "rules[0].match"),
        (('model_types = ["llama"]', "model_types = []"), "model_types"),
        (('name = "t"', 'name = "t"\nflavour = 1'), "flavour"),
        (("[quant]", "[protect]\nbits = 7\n[quant]"), "protect.bits"),
        (("[quant]", "[bits]\nexperts = 3\n[quant]"), "bits.experts"),
    ],
)
def test_bad_recipe_names_file_and_key(tmp_path, edit, key):
    assert load_recipe(_write(tmp_path, GOOD)).name == "t"
    bad = _write(tmp_path, GOOD.replace(*edit, 1))
    with pytest.raises(RecipeError) as e:
        load_recipe(bad)
    assert str(bad) in str(e.value) and key in str(e.value)


def test_missing_quant_table_and_bad_toml(tmp_path):
    with pytest.raises(RecipeError, match=r"missing table \[quant\]"):
        load_recipe(_write(tmp_path, GOOD.replace("[quant]\nbits = 4\ngroup_size = 64\n", "")))
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(_write(tmp_path, "name = ["))
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")


def test_unknown_architecture_names_config_and_model_type():
    with pytest.raises(RecipeError, match=r"config\.json: unknown architecture model_type='bert'"):
        recipe_for_model_type("bert")


def test_bad_override_names_the_option():
    with pytest.raises(RecipeError, match="--expert-bits"):
        load_recipe("mixtral").with_overrides(expert_bits=7)


def test_recipe_files_are_in_the_package():
    assert {p.stem for p in RECIPES_DIR.glob("*.toml")} == set(FAMILIES)


def test_neuron_ratio_reaches_down_proj_only():
    from turboquant.manifests.recipe import RecipeError, load_recipe

    rec = load_recipe("llama")
    down = rec.resolve("model.layers.3.mlp.down_proj.weight", 3, 10)
    up = rec.resolve("model.layers.3.mlp.up_proj.weight", 3, 10)
    assert down.neuron_ratio == 8.0 and up.neuron_ratio is None
    off = rec.with_overrides(column_scales="off")
    assert off.resolve("model.layers.3.mlp.down_proj.weight", 3, 10).neuron_ratio is None
    data = dict(rec.data, quant=dict(rec.data["quant"], neuron_ratio=0.5))
    with pytest.raises(RecipeError, match="neuron_ratio"):
        from turboquant.manifests.recipe import validate
        validate(data, "x.toml")

"""The recipe's codec keys (docs/recipes.md, "Codec: scalar or trellis")."""

from __future__ import annotations

import copy
import tomllib

import pytest

from turboquant.manifests.recipe import (RECIPES_DIR, Recipe, RecipeError, list_recipes,
                                         load_recipe, validate)

Q = "model.layers.3.self_attn.q_proj.weight"
UP = "model.layers.3.mlp.up_proj.weight"
EMB = "model.embed_tokens.weight"


def llama(**quant) -> dict:
    raw = tomllib.loads((RECIPES_DIR / "llama.toml").read_text())
    raw["quant"].update(quant)
    return raw


def recipe(raw) -> Recipe:
    return Recipe(validate(raw, "r.toml"), "r.toml")


def test_recipes_without_codec_keys_keep_their_data_and_hash():
    for name in list_recipes():
        r = load_recipe(name)
        assert "codec" not in r.data["quant"] and "codec" not in r.data
        res = r.resolve(Q, 3, 10) or r.resolve("model.layers.3.mlp.down_proj.weight", 3, 10)
        assert res is None or res.trellis is None
    # the hashes of the recipes the column scales left alone, as before the codec keys
    # (their outputs stay resumable; llama and default changed with column_scales = "auto";
    # deepseek_v2 and gpt_oss changed on 2026-12-05, deliberately: their [[unsupported]]
    # entries for FP8 scales and MXFP4 blocks/scales were dead once pipeline/published.py
    # read those formats, tests/test_published_convert.py shows no tensor can match them)
    before = {"mixtral": "469d2cae2e8d", "qwen_moe": "30706c752d6a",
              "deepseek_v2": "9436237d99a9", "gpt_oss": "d7f0135da7fb"}
    assert {n: load_recipe(n).hash()[:12] for n in before} == before


def test_quant_codec_and_role_and_rule_precedence():
    raw = llama(codec="trellis", trellis_state_bits=12, trellis_block=128)
    raw["codec"] = {"embeddings": "scalar"}
    raw["rules"][2]["codec"] = "scalar"  # attention's rule
    r = recipe(raw)
    assert r.resolve(UP, 3, 10).trellis == (12, 1, 128, 1)
    assert r.resolve(UP, 3, 10).codec == "trellis"
    assert r.resolve(Q, 3, 10).trellis is None and r.resolve(Q, 3, 10).codec == "turboquant"
    assert r.resolve(EMB).trellis is None
    assert r.hash() != load_recipe("llama").hash()


def test_ternary_weights_stay_ternary():
    raw = llama(codec="trellis", bits="ternary")
    res = recipe(raw).resolve(UP, 3, 10)
    assert res.codec == "ternary" and res.trellis is None


@pytest.mark.parametrize("change, match", [
    (dict(codec="lattice"), r"'quant.codec' must be \"scalar\" or \"trellis\""),
    (dict(codec="trellis", refit=False), "refits its scales"),
    (dict(trellis_block=48), "multiple of 32"),
    (dict(trellis_state_bits=24), r"'quant.trellis_state_bits' must be an integer in \[8, 20\]"),
    (dict(trellis_values=3), "quant.trellis_values"),
])
def test_bad_codec_keys_name_the_key(change, match):
    with pytest.raises(RecipeError, match=match):
        recipe(llama(**change))


def test_bad_role_codec_is_refused():
    raw = llama()
    raw["codec"] = {"router": "trellis"}
    with pytest.raises(RecipeError, match="unknown key 'codec.router'"):
        recipe(raw)
    raw = copy.deepcopy(llama())
    raw["codec"] = {"mlp": "vq"}
    with pytest.raises(RecipeError, match="'codec.mlp' must be"):
        recipe(raw)

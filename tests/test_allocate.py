"""`turboquant allocate`: the greedy choice of bits per tensor for a size (a pure function
of errors, bytes and budget), the recipe's `[tensor_bits]` table that carries it, and the
path end to end: convert, allocate, convert with the recipe, load and generate."""

from __future__ import annotations

import json
import tomllib

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.manifests.recipe import RecipeError, list_recipes, load_recipe, validate
from turboquant.pipeline.allocate import (AllocateError, allocate_rows, codes_bytes,
                                          tensor_class, to_toml)
from turboquant.stages import lloyd_max_mse
from turboquant.stages.allocate import (Candidate, choose_bits, gaussian_distortion,
                                        predict_errors, total_bytes)

checkpoints = pytest.importorskip("checkpoints")
convert_mod = pytest.importorskip("turboquant.pipeline.convert")

RATIOS = {2: 0.1132, 3: 0.0326, 4: 0.00888}  # gaussian_distortion at group 64, rounded


def cand(name: str, error3: float, weights: int) -> Candidate:
    """A tensor coded at 3 bits with `error3`, 3 or 4 bits at weights x bits / 8 bytes."""
    return Candidate(name, predict_errors(error3, 3, (3, 4), RATIOS),
                     {3: weights * 3 // 8, 4: weights * 4 // 8})


def steps_left(cands, chosen) -> list[int]:
    """Bytes of each tensor's next step up (none for one at its most bits)."""
    out = []
    for c in cands:
        i = c.bits.index(chosen[c.name])
        if i + 1 < len(c.bits):
            out.append(c.nbytes[c.bits[i + 1]] - c.nbytes[c.bits[i]])
    return out


# ----------------------------------------------------------------------------- the choice

def test_the_tensor_with_the_far_larger_error_gets_the_bits_first():
    cands = [cand("a", 1.0, 1024), cand("big", 100.0, 1024), cand("c", 2.0, 1024)]
    low = total_bytes(cands, {c.name: 3 for c in cands})
    chosen = choose_bits(cands, low + 128)  # one step: 1024 weights x 1 bit
    assert chosen == {"a": 3, "big": 4, "c": 3}
    chosen = choose_bits(cands, low + 256)
    assert chosen == {"a": 3, "big": 4, "c": 4}


def test_error_per_byte_decides_not_error_alone():
    # "big" has 10x the error of "small" at 100x the bytes: small's step buys more per byte
    cands = [cand("big", 10.0, 102400), cand("small", 1.0, 1024)]
    low = total_bytes(cands, {"big": 3, "small": 3})
    assert choose_bits(cands, low + 128) == {"big": 3, "small": 4}
    # a budget too small for big's step still takes small's
    assert choose_bits(cands, low + 12799) == {"big": 3, "small": 4}


def test_the_budget_is_met_and_never_passed():
    cands = [cand(f"t{i}", float(i + 1), 1024 * (1 + i % 3)) for i in range(12)]
    low = total_bytes(cands, {c.name: 3 for c in cands})
    for extra in (0, 100, 128, 700, 1500, 10**6):
        chosen = choose_bits(cands, low + extra)
        used = total_bytes(cands, chosen)
        assert used <= low + extra
        assert all(step > low + extra - used for step in steps_left(cands, chosen))


def test_a_budget_below_the_fewest_bits_is_refused():
    cands = [cand("a", 1.0, 1024)]
    with pytest.raises(ValueError, match="over the budget"):
        choose_bits(cands, 383)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-6, 1e6), st.integers(1, 50_000),
                          st.lists(st.sampled_from([2, 3, 4]), min_size=2, max_size=3,
                                   unique=True)),
                min_size=1, max_size=30),
       st.floats(0.0, 1.0))
def test_the_budget_invariant(specs, share):
    """Any errors, sizes and choices: within budget, short of it by less than every step
    left, and nobody below its fewest bits."""
    cands = []
    for i, (err, weights, choices) in enumerate(specs):
        ratios = {b: RATIOS[b] for b in (2, 3, 4)}
        cands.append(Candidate(f"t{i}", predict_errors(err, 3, choices, ratios),
                               {b: weights * b // 8 + weights // 32 for b in choices}))
    low = total_bytes(cands, {c.name: c.bits[0] for c in cands})
    high = total_bytes(cands, {c.name: c.bits[-1] for c in cands})
    budget = low + int(share * (high - low))
    chosen = choose_bits(cands, budget)
    used = total_bytes(cands, chosen)
    assert low <= used <= budget
    assert all(step > budget - used for step in steps_left(cands, chosen))
    assert all(chosen[c.name] in c.bits for c in cands)
    if share == 1.0:
        assert used == high


def test_the_gaussian_distortion_is_the_codebooks():
    """The codec's error on a rotated Gaussian: the Lloyd-Max MSE, a few % under it (the
    refit), and the ratios the allocation predicts with."""
    for b in (2, 3, 4):
        d = gaussian_distortion(b, 64)
        assert 0.9 * lloyd_max_mse(b) < d <= lloyd_max_mse(b)
        assert d == pytest.approx(RATIOS[b], rel=0.01)


# ----------------------------------------------------------------------------- the recipe

def test_tensor_bits_win_over_roles_and_protected_layers():
    data = load_recipe("llama").data
    data = {**data, "tensor_bits": {"model.layers.0.mlp.down_proj.weight": 2,
                                    "model.layers.5.self_attn.q_proj.weight": 2}}
    r = load_recipe("llama").__class__(validate(data, "t.toml"), "t.toml")
    assert r.data["protect"]["first_layers"] == 1  # layer 0 is protected at 4 bits ...
    res = r.resolve("model.layers.0.mlp.down_proj.weight", 0, 10)
    assert (res.bits, res.neuron_ratio) == (2, 8.0)  # ... and the table wins, rule kept
    assert r.resolve("model.layers.0.mlp.up_proj.weight", 0, 10).bits == 4
    assert r.resolve("model.layers.5.self_attn.q_proj.weight", 5, 10).bits == 2
    assert r.resolve("model.layers.5.self_attn.k_proj.weight", 5, 10).bits == r.bits == 4


def test_tensor_bits_are_validated():
    base = {k: v for k, v in load_recipe("llama").data.items()}
    with pytest.raises(RecipeError, match=r"t.toml: key 'tensor_bits.'x.weight'' must be one "
                                          r"of 2, 3, 4"):
        validate({**base, "tensor_bits": {"x.weight": 5}}, "t.toml")
    with pytest.raises(RecipeError, match="'tensor_bits' must be a table"):
        validate({**base, "tensor_bits": [4]}, "t.toml")
    assert "tensor_bits" not in validate({**base, "tensor_bits": {}}, "t.toml")


def test_a_recipe_without_tensor_bits_keeps_its_hash():
    r = load_recipe("llama")
    assert validate(dict(r.data), "x") == r.data


@pytest.mark.parametrize("name", list_recipes())
def test_every_bundled_recipe_writes_back_as_itself(name, tmp_path):
    data = load_recipe(name).data
    path = tmp_path / "r.toml"
    path.write_text(to_toml({**data, "tensor_bits": {"a.b.weight": 4}}))
    again = load_recipe(path).data
    assert again == {**data, "tensor_bits": {"a.b.weight": 4}}


def test_tensor_class():
    assert tensor_class("model.layers.12.self_attn.q_proj.weight") == "self_attn.q_proj"
    assert tensor_class("model.embed_tokens.weight") == "model.embed_tokens"


def test_a_target_out_of_reach_names_the_floor():
    rows = [{"name": "w", "shape": [64, 256], "codec": "turboquant", "bits": 3,
             "group_size": 64, "padded_in": 256, "byte_start": 0,
             "byte_end": codes_bytes([64, 256], 256, 3) + 64 * 4 * 2, "out_error": 1.0}]
    with pytest.raises(AllocateError, match=r"below what the fewest choice \(3 bits\) takes: "
                                            r"3.250 bits/w"):
        allocate_rows(rows, {}, 3.2, (3, 4))


# ----------------------------------------------------------------------------- end to end

def convert(src, out, **kw):
    opts = convert_mod.ConvertOptions(source=str(src), output=str(out), in_process=True,
                                      progress=False, check_disk=False, **kw)
    return convert_mod.convert(opts)


def manifest(repo):
    return {r["name"]: r for r in pq.read_table(repo / "manifest.parquet").to_pylist()}


def test_convert_allocate_convert_load_generate(tmp_path, capsys):
    from mlx_lm import generate

    from turboquant.allocate import main as allocate_main
    from turboquant.runtime import load

    src = checkpoints.write_llama_checkpoint(tmp_path / "src", layers=3, hidden=128,
                                             intermediate=256, vocab=512, shards=1)
    uniform = convert(src, tmp_path / "tq3", bits=3, embeddings_bits=3, protect_layers=0)
    assert uniform.repo.bits_per_weight < 3.6
    recipe = tmp_path / "r.toml"
    rc = allocate_main([str(tmp_path / "tq3"), "--target-bits", "3.6", "--out", str(recipe)])
    printed = capsys.readouterr().out
    assert rc == 0 and "mlp.down_proj" in printed and "bits/w 3.5" in printed
    chosen = tomllib.loads(recipe.read_text())["tensor_bits"]
    assert set(chosen.values()) == {3, 4}

    mixed = convert(src, tmp_path / "mix", recipe=str(recipe))
    rows = manifest(tmp_path / "mix")
    assert {n: rows[n]["bits"] for n in chosen} == chosen
    # the size the allocation predicted is the repo's, to the byte
    from turboquant.pipeline.allocate import allocate_repo

    a = allocate_repo(tmp_path / "tq3", 3.6)
    assert a.chosen == chosen
    assert mixed.repo.bits_per_weight == pytest.approx(a.bits_per_weight, abs=1e-12)
    assert mixed.repo.bits_per_weight <= 3.6
    # the out_error predicted at 4 bits is what the 4-bit tensors record (same codes as a
    # uniform 4-bit repo: the rotation and scales do not depend on the neighbours' bits)
    for c in a.candidates:
        if chosen[c.name] == 4:
            assert rows[c.name]["out_error"] == pytest.approx(c.errors[4], rel=0.1)

    model, tokenizer = load(tmp_path / "mix")
    text = generate(model, tokenizer, "hello", max_tokens=4, verbose=False)
    assert isinstance(text, str)


def test_a_recipe_for_another_model_is_refused(tmp_path):
    from turboquant.pipeline.errors import PlanError

    src = checkpoints.write_llama_checkpoint(tmp_path / "src", layers=2, shards=1)
    recipe = load_recipe("llama").data
    path = tmp_path / "r.toml"
    path.write_text(to_toml({**recipe, "tensor_bits": {"model.layers.7.mlp.up_proj.weight": 4,
                                                       "model.norm.weight": 4}}))
    with pytest.raises(PlanError, match=r"\[tensor_bits\] names 2 tensor\(s\) this checkpoint "
                                        r"does not code, e.g. 'model.layers.7.mlp.up_proj"):
        convert(src, tmp_path / "out", recipe=str(path))


def test_allocate_help_and_errors(tmp_path, capsys):
    from turboquant.allocate import main as allocate_main

    with pytest.raises(SystemExit):
        allocate_main(["--help"])
    assert "--target-bits B" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        allocate_main([str(tmp_path), "--target-bits", "3.5", "--choices", "3,5",
                       "--out", "r.toml"])
    assert "give two or more of 2, 3, 4" in capsys.readouterr().err
    assert allocate_main([str(tmp_path), "--target-bits", "3.5", "--out", "r.toml"]) == 2
    assert "cannot read its manifest" in capsys.readouterr().err

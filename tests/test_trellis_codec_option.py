"""`turboquant convert --codec trellis --trellis-state-bits L [--trellis-values V]
[--trellis-version N]` (docs/convert.md): the code of every coded role from the command
line, bound into the recipe hash like `--bits`, so a resume with another codec (or another
trellis) is refused instead of mixing codes in one output."""

from __future__ import annotations

import signal

import pytest
from checkpoints import write_llama_checkpoint
from mlx_lm.generate import generate
from test_convert_trust import cli

from turboquant.convert import build_parser
from turboquant.manifests.recipe import Recipe, RecipeError, load_recipe, validate
from turboquant.manifests.schema import read_manifest
from turboquant.runtime import TQLinear, load
from turboquant.stages.trellis import TrellisBits

Q = "model.layers.3.self_attn.q_proj.weight"
UP = "model.layers.3.mlp.up_proj.weight"
EMB = "model.embed_tokens.weight"


def test_codec_override_reaches_every_coded_role():
    base = load_recipe("llama")
    r = base.with_overrides(codec="trellis", trellis_state_bits=12)
    for name in (Q, UP, EMB):
        assert r.resolve(name, 3, 10).trellis == (12, 1, 256, 1), name
    assert base.with_overrides(codec="trellis").resolve(UP, 3, 10).trellis == (16, 1, 256, 1)
    assert r.hash() != base.hash() != base.with_overrides(codec="trellis").hash()


def test_codec_override_beats_the_recipes_roles_and_rules():
    raw = load_recipe("llama").with_overrides(codec="trellis").data
    raw["codec"] = {"embeddings": "scalar"}
    raw["rules"][2]["codec"] = "scalar"  # attention's rule
    from turboquant.manifests.recipe import Recipe, validate

    mixed = Recipe(validate(raw, "r.toml"), "r.toml")
    assert mixed.resolve(Q, 3, 10).trellis is None
    all_trellis = mixed.with_overrides(codec="trellis")
    assert all(all_trellis.resolve(n, 3, 10).trellis for n in (Q, UP, EMB))
    scalar = mixed.with_overrides(codec="scalar")
    assert all(scalar.resolve(n, 3, 10).trellis is None for n in (Q, UP, EMB))
    # scalar everywhere is the recipe that never named a codec: the same hash, so an
    # output converted without the flag resumes with `--codec scalar`
    assert scalar.hash() == load_recipe("llama").hash()


@pytest.mark.parametrize("overrides, match", [
    (dict(trellis_state_bits=12), r"--trellis-state-bits .* codes none: add --codec trellis"),
    (dict(codec="scalar", trellis_state_bits=12), "add --codec trellis"),
    (dict(codec="trellis", trellis_state_bits=24),
     r"'--trellis-state-bits' must be an integer in \[8, 20\], got 24"),
    (dict(codec="lattice"), r"'--codec' must be \"scalar\" or \"trellis\""),
    (dict(trellis_version=2), r"--trellis-version .* codes none: add --codec trellis"),
    (dict(codec="trellis", trellis_version=3),
     r"'--trellis-version' must be an integer in \[1, 2\], got 3"),
    (dict(codec="trellis", trellis_values=3),
     r"'--trellis-values' must be an integer in \[1, 2\], got 3"),
])
def test_bad_codec_overrides_name_the_option(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe("llama").with_overrides(**overrides)


def test_help_names_the_codec_options():
    text = build_parser().format_help()
    assert "--codec {scalar,trellis}" in text and "--trellis-state-bits L" in text
    assert "--trellis-values V" in text and "--trellis-version N" in text


def test_trellis_version_and_values_from_flags_and_recipe_keys():
    base = load_recipe("llama")
    v1 = base.with_overrides(codec="trellis", trellis_state_bits=10)
    v2 = base.with_overrides(codec="trellis", trellis_state_bits=10, trellis_version=2,
                             trellis_values=2)
    assert v2.resolve(UP, 3, 10).trellis == (10, 2, 256, 2)
    assert len({v1.hash(), v2.hash(), base.hash()}) == 3
    # version 1 given is the recipe without the key: the code and the plan hash as before
    assert base.with_overrides(codec="trellis", trellis_version=1).resolve(UP, 3, 10).trellis \
        == base.with_overrides(codec="trellis").resolve(UP, 3, 10).trellis
    raw = base.with_overrides(codec="trellis").data
    raw["quant"].update(trellis_version=2, trellis_values=2, trellis_state_bits=12)
    raw["codec"] = {"attention": "trellis"}
    r = Recipe(validate(raw, "r.toml"), "r.toml")
    assert r.resolve(Q, 3, 10).trellis == (12, 2, 256, 2)
    raw["quant"]["trellis_version"] = 3
    with pytest.raises(RecipeError, match=r"r.toml: key 'quant.trellis_version' must be an "
                                          r"integer in \[1, 2\], got 3"):
        validate(raw, "r.toml")


def test_the_default_version_is_one_entry(monkeypatch):
    """What a GPU run that decides for version 2 changes: TRELLIS_DEFAULTS's version (the
    recipe hash stays, the plan hash, which hashes version 2, refuses a mixed resume)."""
    from turboquant.manifests import recipe

    r = load_recipe("llama").with_overrides(codec="trellis")
    assert r.resolve(UP, 3, 10).trellis[3] == 1
    monkeypatch.setitem(recipe.TRELLIS_DEFAULTS, "trellis_version", 2)
    assert r.resolve(UP, 3, 10).trellis == (16, 1, 256, 2)


def test_a_state_too_small_for_two_values_is_refused_at_planning():
    base = load_recipe("llama").with_overrides(codec="trellis", trellis_values=2)
    r = base.with_overrides(trellis_state_bits=8)
    with pytest.raises(RecipeError, match=r"llama.toml: role mlp at 4 bits with "
                                          r"trellis_values 2 needs trellis_state_bits > 8"):
        r.resolve(UP, 0, 10)  # a protected layer: 4 bits
    assert base.with_overrides(trellis_state_bits=9).resolve(UP, 0, 10).trellis \
        == (9, 2, 256, 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("codec-option")
    return write_llama_checkpoint(base / "src", layers=3, hidden=64, intermediate=128,
                                  vocab=320, shards=2)


def test_convert_with_codec_trellis_loads_and_generates(checkpoint, tmp_path):
    out = tmp_path / "out"
    rc, stdout, stderr = cli(checkpoint, out, "--no-prefect", "--bits", "3",
                             "--codec", "trellis", "--trellis-state-bits", "8")
    assert rc == 0, stderr
    coded = [r for r in read_manifest(out).to_pylist() if r["codec"] != "raw"]
    assert coded and {r["codec"] for r in coded} == {"trellis"}
    assert {r["trellis_state_bits"] for r in coded} == {8}
    model, tokenizer = load(out, dtype="float32")
    up = model.model.layers[1].mlp.up_proj
    assert isinstance(up, TQLinear) and up.bits == TrellisBits(3, 8, 1, 256)
    text = generate(model, tokenizer, "hello", max_tokens=4, verbose=False)
    assert isinstance(text, str)


def test_a_resume_with_another_codec_is_refused_in_one_line(checkpoint, tmp_path):
    out = tmp_path / "out"
    trellis = ("--no-prefect", "--in-process", "--bits", "3", "--codec", "trellis",
               "--trellis-state-bits", "8")
    rc, _, stderr = cli(checkpoint, out, *trellis, crash="unit_committed:3")
    assert rc == -signal.SIGKILL, stderr
    before = sorted(p.name for p in out.iterdir())
    for other in (("--codec", "scalar"), ("--codec", "trellis", "--trellis-state-bits", "9"),
                  ()):
        rc, stdout, stderr = cli(checkpoint, out, "--no-prefect", "--in-process", "--bits",
                                 "3", *other)
        lines = stderr.strip().splitlines()
        assert rc == 1 and len(lines) == 1, stderr
        assert lines[0].startswith("turboquant convert: error:") and str(out) in lines[0]
        assert "quant.codec: 'trellis' -> None" in lines[0] or \
            "quant.trellis_state_bits: 8 -> 9" in lines[0], lines[0]
        assert "different recipes are never mixed" in lines[0]
        assert sorted(p.name for p in out.iterdir()) == before  # refused: nothing written
    rc, _, stderr = cli(checkpoint, out, *trellis)  # the same options resume it
    assert rc == 0, stderr
    assert {r["codec"] for r in read_manifest(out).to_pylist() if r["codec"] != "raw"} \
        == {"trellis"}


@pytest.mark.parametrize("state_bits, values", [(8, 1), (9, 2)])
def test_trellis_version_2_converts_resumes_and_generates(checkpoint, tmp_path, state_bits,
                                                          values):
    """Version 2 (no shift-xor) written end to end: killed and resumed (a resume with the
    default version 1 refused in one line), the same bytes as an uninterrupted run, a
    strict load whose logits are the decoded weights', generate."""
    from test_pipeline_kill import snapshot
    from test_trellis_convert import assert_logits_are_the_decoded_weights

    trellis = ("--no-prefect", "--in-process", "--bits", "3", "--codec", "trellis",
               "--trellis-state-bits", str(state_bits), "--trellis-values", str(values))
    v2 = (*trellis, "--trellis-version", "2")
    out = tmp_path / "out"
    rc, _, stderr = cli(checkpoint, out, *v2, crash="unit_committed:3")
    assert rc == -signal.SIGKILL, stderr
    rc, _, stderr = cli(checkpoint, out, *trellis)  # version 1: the default
    lines = stderr.strip().splitlines()
    assert rc == 1 and len(lines) == 1, stderr
    assert "quant.trellis_version: 2 -> None" in lines[0], lines[0]
    rc, _, stderr = cli(checkpoint, out, *v2)
    assert rc == 0, stderr
    again = tmp_path / "again"
    rc, _, stderr = cli(checkpoint, again, *v2)
    assert rc == 0, stderr
    assert snapshot(again) == snapshot(out)

    coded = [r for r in read_manifest(out).to_pylist() if r["codec"] != "raw"]
    assert coded and {r["codec"] for r in coded} == {"trellis"}
    assert {(r["trellis_state_bits"], r["trellis_values"], r["trellis_version"])
            for r in coded} == {(state_bits, values, 2)}
    from turboquant.pipeline import verify

    # against the source, verify decodes version 2 and finds the rel_mse the job measured
    report = verify.verify_repo(out, source=checkpoint)
    assert report.ok, report.problems
    import json

    config = json.loads((out / "config.json").read_text())
    overrides = config["quantization_config"]["overrides"]
    assert {o["trellis_version"] for o in overrides.values() if o.get("codec") == "trellis"} \
        == {2}
    wanted = f"3-bit trellis (L={state_bits}{', V=2' if values == 2 else ''}, version 2)"
    assert wanted in (out / "README.md").read_text()  # the card names the code
    model, tokenizer = load(out, dtype="float32")
    up = model.model.layers[1].mlp.up_proj
    assert isinstance(up, TQLinear)
    assert up.bits == TrellisBits(3, state_bits, values, 256, version=2)
    assert_logits_are_the_decoded_weights(model, tokenizer, out)

"""`turboquant convert --codec trellis --trellis-state-bits L` (docs/convert.md): the code
of every coded role from the command line, bound into the recipe hash like `--bits`, so a
resume with another codec is refused instead of mixing codes in one output."""

from __future__ import annotations

import signal

import pytest
from checkpoints import write_llama_checkpoint
from mlx_lm.generate import generate
from test_convert_trust import cli

from turboquant.convert import build_parser
from turboquant.manifests.recipe import RecipeError, load_recipe
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
        assert r.resolve(name, 3, 10).trellis == (12, 1, 256), name
    assert base.with_overrides(codec="trellis").resolve(UP, 3, 10).trellis == (16, 1, 256)
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
])
def test_bad_codec_overrides_name_the_option(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe("llama").with_overrides(**overrides)


def test_help_names_the_codec_options():
    text = build_parser().format_help()
    assert "--codec {scalar,trellis}" in text and "--trellis-state-bits L" in text


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

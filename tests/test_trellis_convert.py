"""Trellis-coded weights end to end: a recipe chooses the trellis, the converter codes it
inside its jobs (killed mid-job, it resumes to the same bytes), the repo says format 2, and
the runtime loads it strictly and computes the logits of its decoded weights."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import mlx.core as mx
import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint
from mlx_lm.generate import generate
from test_pipeline_kill import check_resumed, cli, snapshot
from test_runtime_fixtures import model_class

from turboquant.convert import main as convert_main
from turboquant.manifests.recipe import RECIPES_DIR
from turboquant.manifests.schema import read_manifest
from turboquant.pipeline import verify
from turboquant.pipeline.safetensors_io import read_header
from turboquant.runtime import RepoError, TQEmbedding, TQLinear, load
from turboquant.stages import decode
from turboquant.stages.trellis import TrellisBits


def trellis_recipe(folder: Path, state_bits: int = 10, roles: str = "",
                   family: str = "llama") -> Path:
    """A family's recipe with `codec = "trellis"` in [quant] (or only for `roles`)."""
    text = (RECIPES_DIR / f"{family}.toml").read_text()
    if roles:
        text = text.replace("[protect]", f"[codec]\n{roles}\n\n[protect]")
        quant = f"[quant]\ntrellis_state_bits = {state_bits}\n"
    else:
        quant = f'[quant]\ncodec = "trellis"\ntrellis_state_bits = {state_bits}\n'
    path = folder / "trellis.toml"
    path.write_text(text.replace("[quant]\n", quant, 1))
    return path


def decoded_weights(repo: Path) -> dict[str, mx.array]:
    """Every tensor of the repo as float32: raw ones as stored, coded ones decoded."""
    rows = read_manifest(repo).to_pylist()
    out = {}
    for r in rows:
        if r["codec"] == "raw":
            out[r["name"]] = mx.load(str(repo / r["shard"]))[r["name"]].astype(mx.float32)
        else:
            header = read_header(repo / r["shard"], r["shard"])
            out[r["name"]] = decode(verify.load_coded(repo, r, header))
    return out


def decoded_model(repo: Path):
    """mlx-lm's model of the repo's config holding its decoded weights (a strict load)."""
    config = json.loads((repo / "config.json").read_text())
    model_cls, args_cls = model_class(config)
    ref = model_cls(args_cls.from_dict(config))
    ref.load_weights(list(ref.sanitize(decoded_weights(repo)).items()), strict=True)
    return ref


def assert_logits_are_the_decoded_weights(model, tokenizer, repo: Path) -> None:
    """The loaded `model`'s logits (2 tokens, and 24: the GEMM path too) within 1e-4 of
    `decoded_model`'s, and it generates."""
    ref = decoded_model(repo)
    tokens = mx.array([[1, 5, 70, 33, 200, 9, 12, 250] * 3])
    for t in (tokens[:, :2], tokens):
        got, want = model(t), ref(t)
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert err < 1e-4, err
    text = generate(model, tokenizer, "hello", max_tokens=4, verbose=False)
    assert isinstance(text, str)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("trellis")
    src = write_llama_checkpoint(base / "src", layers=3, hidden=64, intermediate=128,
                                 vocab=320, shards=2)
    recipe = trellis_recipe(base)
    out = base / "out"
    assert convert_main([str(src), str(out), "-q", "--no-prefect", "--in-process",
                         "--job-size", "0", "--recipe", str(recipe), "--bits", "3"]) == 0
    return src, recipe, out


def test_the_repo_is_format_2_with_trellis_rows(converted):
    _, _, out = converted
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert qc["format_version"] == 2 and index["metadata"]["format_version"] == 2
    rows = read_manifest(out).to_pylist()
    coded = [r for r in rows if r["codec"] != "raw"]
    assert coded and all(r["codec"] == "trellis" for r in coded)
    for r in coded:
        assert (r["trellis_state_bits"], r["trellis_values"], r["trellis_block"],
                r["trellis_version"]) == (10, 1, 256, 1)
        key = r["name"].removesuffix(".weight")
        assert qc["overrides"][key]["codec"] == "trellis"
        assert qc["overrides"][key]["trellis_state_bits"] == 10
        header = read_header(out / r["shard"], r["shard"])
        assert header.metadata["format_version"] == "2"
    # the same bits per weight as the scalar code: 3.25 at 3 bits, group 64 (4 bits for the
    # recipe's protected layers and embeddings: 4.25), besides the llama recipe's column
    # scales (16 bits an input column: 16 / out a weight)
    assert any(r["in_scales"] for r in coded)
    assert {round(r["bits_per_weight"] - (16 / r["shape"][0] if r["in_scales"] else 0), 2)
            for r in coded} <= {3.25, 4.25}
    assert all(r["rel_mse"] < 0.03 for r in coded if r["bits"] == 3)
    assert verify.verify_repo(out).ok


def test_loaded_strictly_its_logits_are_the_decoded_weights(converted):
    _, _, out = converted
    model, tokenizer = load(out, dtype="float32")
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, TQLinear) and isinstance(q.bits, TrellisBits)
    assert q.bits == TrellisBits(4, 10, 1, 256)  # the first and last layers at 4 bits
    assert model.model.layers[1].mlp.up_proj.bits == TrellisBits(3, 10, 1, 256)
    assert isinstance(model.model.embed_tokens, TQEmbedding)
    assert_logits_are_the_decoded_weights(model, tokenizer, out)


def test_a_converter_reruns_to_the_same_bytes_and_prints_its_speed(converted, tmp_path):
    src, recipe, out = converted
    again = tmp_path / "again"
    rc, text = cli(src, again, "--no-prefect", "--in-process", "--recipe", str(recipe),
                   "--bits", "3", env_extra={"TURBOQUANT_TRELLIS_PROGRESS_SECONDS": "0"})
    assert rc == 0, text
    assert snapshot(again) == snapshot(out)
    assert "trellis encode on the CPU" in text and "weights/s" in text and "left" in text


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid_tensor:2", "unit_committed:5"])
def test_a_trellis_conversion_killed_mid_job_resumes_to_the_same_bytes(
        converted, tmp_path, point):
    src, recipe, out = converted
    args = ("--no-prefect", "--in-process", "--recipe", str(recipe), "--bits", "3")
    reference = snapshot(out)
    killed = tmp_path / "killed"
    rc, text = cli(src, killed, *args, crash=point)
    assert rc == -signal.SIGKILL, text
    assert not (killed / ".turboquant" / "complete").exists()
    rerun = check_resumed(src, killed, reference, extra=args)
    assert "job_resume" in {e["event"] for e in rerun}


def test_codec_per_role(tmp_path):
    """`[codec] mlp = "trellis"`: only the MLP's weights are trellis-coded."""
    src = write_llama_checkpoint(tmp_path / "src", layers=2, hidden=64, intermediate=128,
                                 vocab=320, shards=1)
    recipe = trellis_recipe(tmp_path, roles='mlp = "trellis"')
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "-q", "--no-prefect", "--in-process",
                         "--recipe", str(recipe)]) == 0
    rows = read_manifest(out).to_pylist()
    codecs = {r["name"]: r["codec"] for r in rows}
    assert codecs["model.layers.0.mlp.up_proj.weight"] == "trellis"
    assert codecs["model.layers.0.self_attn.q_proj.weight"] == "turboquant"
    assert codecs["model.embed_tokens.weight"] == "turboquant"


def test_a_reader_refuses_what_it_does_not_know(converted, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    _, _, out = converted
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    table = pq.read_table(copy / "manifest.parquet")
    rows = table.to_pylist()
    name = next(r["name"] for r in rows if r["codec"] == "trellis")
    for r in rows:
        if r["name"] == name:
            r["trellis_version"] = 3
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), copy / "manifest.parquet")
    with pytest.raises(RepoError, match=rf"{name}.*trellis version 3, this runtime reads "
                                         "versions 1, 2"):
        load(copy)
    row = next(r for r in rows if r["name"] == name)
    with pytest.raises(ValueError, match=rf"{name}.*trellis version 3"):
        verify.trellis_spec(row)
    for r in rows:
        if r["name"] == name:
            r["trellis_version"], r["codec"] = 1, "lattice"
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), copy / "manifest.parquet")
    with pytest.raises(RepoError, match=rf"{name}.*codec 'lattice'"):
        load(copy)


def test_moe_experts_gathered_and_streamed(tmp_path):
    """Trellis-coded experts: gathered (the numba GEMV and the reference) and streamed from
    disk give the logits of the decoded weights."""
    src = write_moe_checkpoint(tmp_path / "src", layers=2, hidden=64, intermediate=64,
                               experts=4, shards=1)
    recipe = trellis_recipe(tmp_path, state_bits=9, family="qwen_moe")
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "-q", "--no-prefect", "--in-process",
                         "--recipe", str(recipe), "--expert-bits", "3"]) == 0
    rows = read_manifest(out).to_pylist()
    assert {r["codec"] for r in rows if r["expert"] is not None} == {"trellis"}
    ref = decoded_model(out)
    tokens = mx.array([list(range(3, 123, 3))])
    want = ref(tokens)
    for kwargs in ({}, {"expert_budget": "50%"}):
        model, _ = load(out, dtype="float32", **kwargs)
        for t in (tokens[:, :1], tokens):
            got = model(t)
            w = want if t.shape[1] > 1 else ref(t)
            err = (mx.abs(got - w).max() / mx.abs(w).max()).item()
            assert err < 1e-4, (kwargs, err)

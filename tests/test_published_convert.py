"""Checkpoints as published (FP8 block / channel / tensor scales, MXFP4 experts, int4
pack-quantized) convert to the same bytes as their exact float32 copies, load, generate,
plan with the right counts, and stay in bounded memory."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from checkpoints import write_llama_checkpoint, write_moe_checkpoint
from published_checkpoints import publish, write_tensors

from turboquant.pipeline import job as job_module
from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.errors import PlanError

TINY = dict(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=320)


def run(src, out, **kw):
    kw.setdefault("in_process", True)
    kw.setdefault("progress", False)
    kw.setdefault("check_disk", False)
    return convert(ConvertOptions(str(src), str(out), **kw))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("published-src")
    return write_llama_checkpoint(root / "llama", dtype="float32", shards=2, **TINY)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("published-moe")
    return write_moe_checkpoint(root / "gpt_oss", style="gpt_oss", layers=2, hidden=64,
                                intermediate=64, experts=3, dtype="float32", shards=2)


def assert_same_repo(a: Path, b: Path, dtype: str) -> list[dict]:
    """Shards, index and config equal byte for byte; manifests equal but for source_dtype."""
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert shards == sorted(p.name for p in b.glob("*.safetensors"))
    for name in shards + ["model.safetensors.index.json", "config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ra = pq.read_table(a / "manifest.parquet").to_pylist()
    rb = pq.read_table(b / "manifest.parquet").to_pylist()
    assert len(ra) == len(rb)
    published = [r for r in ra if r["source_dtype"] == dtype]
    assert published, f"no tensor read as {dtype}"
    for x, y in zip(ra, rb):
        if (x["source_dtype"] == dtype and ".down_proj." in x["name"]
                and (x["out_error_from"], y["out_error_from"]) == ("ones", "weights")):
            # no neuron pre-pass reads a published down_proj's gate/up rows, so its
            # out_error's input energies are ones (docs/FORMAT.md, out_error_from)
            x = {**x, "out_error": None, "out_error_from": None}
            y = {**y, "out_error": None, "out_error_from": None}
        assert {**x, "source_dtype": None} == {**y, "source_dtype": None}
    return published


CASES = {
    "fp8-block": dict(fmt="fp8-block", scales_apart=True, dtype="F8_E4M3"),
    "fp8-block-ragged": dict(fmt="fp8-block", block=(32, 48), dtype="F8_E4M3"),
    "fp8-channel-e5m2": dict(fmt="fp8-channel", fp8_dtype="F8_E5M2", dtype="F8_E5M2"),
    "fp8-tensor-e4m3": dict(fmt="fp8-tensor", fp8_dtype="F8_E4M3", scales_apart=True,
                            dtype="F8_E4M3"),
    "int4": dict(fmt="int4", scales_apart=True, dtype="I4"),
    "int4-zero-point": dict(fmt="int4", zero_point=True, config_key="compression_config",
                            dtype="I4"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_published_dense_converts_to_the_bytes_of_its_float32_copy(dense, tmp_path,
                                                                   monkeypatch, case):
    kw = dict(CASES[case])
    dtype = kw.pop("dtype")
    publish(dense, tmp_path / "pub", tmp_path / "copy", **kw)
    # chunks of 7 rows: they cut through 32-row blocks, 8-row zero-point words
    monkeypatch.setattr(job_module, "CHUNK_ELEMENTS", 7 * 64)
    run(tmp_path / "pub", tmp_path / "pub-tq")
    run(tmp_path / "copy", tmp_path / "copy-tq")
    rows = assert_same_repo(tmp_path / "pub-tq", tmp_path / "copy-tq", dtype)
    assert {r["codec"] for r in rows} == {"turboquant"}
    config = json.loads((tmp_path / "pub-tq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "turboquant"
    assert "weight_block_size" not in config["quantization_config"]
    names = {n for n in json.loads((tmp_path / "pub-tq" / "model.safetensors.index.json")
                                   .read_text())["weight_map"]}
    assert not any(n.endswith(("_scale", "_scale_inv", "input_scale", "_shape", "_zero_point",
                               "_packed")) for n in names)


def test_mxfp4_gpt_oss_experts_convert_to_the_bytes_of_their_float32_copy(gpt_oss, tmp_path):
    publish(gpt_oss, tmp_path / "pub", tmp_path / "copy", "mxfp4", scales_apart=True)
    # worker processes, one job per shard: the plan's pairs travel to them pickled, and the
    # job that codes an expert opens the scales' shard too
    run(tmp_path / "pub", tmp_path / "pub-tq", in_process=False, workers=2, min_job_bytes=0)
    run(tmp_path / "copy", tmp_path / "copy-tq", min_job_bytes=0)
    rows = assert_same_repo(tmp_path / "pub-tq", tmp_path / "copy-tq", "MXFP4")
    # 2 layers x 3 experts x gate, up, down
    assert len(rows) == 18 and {r["source_name"] for r in rows} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj",
                                                                         "down_proj")}


def test_published_repos_load_match_mlx_lm_and_generate(dense, gpt_oss, tmp_path):
    """Strict load; logits within 1e-4 of mlx-lm's model on the repo's decoded weights
    (dense; the MXFP4 repo is byte-identical to its float32 copy's, see above)."""
    import mlx.core as mx
    from mlx_lm import generate
    from test_runtime_fixtures import decoded_from_repo, reference_model

    from turboquant.runtime import load

    tokens = mx.array([[1, 5, 70, 33, 200, 9, 12, 250]])
    for name, src, fmt in (("fp8", dense, "fp8-block"), ("fp8-e5m2", dense, "fp8-channel"),
                           ("int4", dense, "int4"), ("mxfp4", gpt_oss, "mxfp4")):
        publish(src, tmp_path / name, tmp_path / f"{name}-copy", fmt)
        out = tmp_path / f"{name}-tq"
        run(tmp_path / name, out)
        model, tokenizer = load(out, dtype="float32")
        if fmt != "mxfp4":  # test_runtime_fixtures' oracle reads no split gpt-oss experts
            want = reference_model(decoded_from_repo(out))(tokens)
            err = (mx.abs(model(tokens) - want).max() / mx.abs(want).max()).item()
            assert err < 1e-4, (name, err)
        assert isinstance(generate(model, tokenizer, "hello", max_tokens=4), str)


def test_kept_published_tensors_are_written_as_float32(dense, tmp_path):
    """A tensor a recipe keeps raw is stored as its dequantized float32 values."""
    from safetensors.numpy import load_file

    publish(dense, tmp_path / "pub", tmp_path / "copy", "fp8-block", block=(32, 48))
    recipe = tmp_path / "keep.toml"
    text = (Path(__file__).resolve().parents[1] / "manifests" / "recipes" / "llama.toml")
    body = text.read_text()
    body = body.replace("keep = [", "keep = ['\\.self_attn\\.v_proj\\.weight$', ", 1)
    recipe.write_text(body)
    run(tmp_path / "pub", tmp_path / "pub-tq", recipe=str(recipe))
    run(tmp_path / "copy", tmp_path / "copy-tq", recipe=str(recipe))
    assert_same_repo(tmp_path / "pub-tq", tmp_path / "copy-tq", "F8_E4M3")
    out = load_file(tmp_path / "pub-tq" / "model.safetensors")
    ref = load_file(tmp_path / "copy" / "model-00001-of-00002.safetensors")
    name = "model.layers.0.self_attn.v_proj.weight"
    assert out[name].dtype == np.float32
    np.testing.assert_array_equal(out[name], ref[name])


def test_plan_counts_parameters_and_bytes(dense, tmp_path, capsys):
    from turboquant.plan import main

    publish(dense, tmp_path / "pub", tmp_path / "copy", "fp8-block", scales_apart=True)
    counts = {}
    for name in ("pub", "copy"):
        assert main([str(tmp_path / name), "--json", "--memory-gb", "64"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["problems"] == []
        counts[name] = d["source"]
    assert counts["pub"]["parameters"] == counts["copy"]["parameters"]
    # every FP8 weight is 1 byte where the copy's is 4; the scales are bytes, not parameters
    from safetensors import safe_open

    fp8, scales = 0, 0
    for f in (tmp_path / "pub").glob("*.safetensors"):
        with safe_open(f, "numpy") as g:
            for k in g.keys():
                a = g.get_tensor(k) if "scale" in k else None
                if k.endswith("weight_scale_inv"):
                    scales += a.nbytes
                elif "_proj.weight" in k:
                    fp8 += int(np.prod(g.get_slice(k).get_shape()))
    assert counts["copy"]["bytes"] - counts["pub"]["bytes"] == 3 * fp8 - scales
    assert main([str(tmp_path / "pub"), "--memory-gb", "64"]) == 0
    assert "parameters in" in capsys.readouterr().out


def test_an_fp8_weight_without_scales_is_refused_in_one_line(dense, tmp_path):
    publish(dense, tmp_path / "pub", tmp_path / "copy", "fp8-block", scales_apart=True)
    (tmp_path / "pub" / "scales.safetensors").unlink()
    index = json.loads((tmp_path / "pub" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if v != "scales.safetensors"}
    (tmp_path / "pub" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError) as e:
        run(tmp_path / "pub", tmp_path / "out")
    msg = str(e.value)
    assert len(e.value.problems) == 14  # 7 projections x 2 layers, each named once
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "F8_E4M3" in msg
    assert "weight_scale_inv" in msg and "incomplete" in msg


def test_an_unsupported_dtype_is_refused_naming_file_tensor_and_dtype(tmp_path):
    from safetensors.numpy import load_file

    src = write_llama_checkpoint(tmp_path / "src", dtype="float32", shards=1, **TINY)
    tensors = list(load_file(src / "model.safetensors").items())
    name = "model.layers.1.mlp.up_proj.weight"
    tensors = [(k, (v * 100).astype(np.int32) if k == name else v) for k, v in tensors]
    write_tensors(src / "model.safetensors", tensors)
    with pytest.raises(PlanError) as e:
        run(src, tmp_path / "out")
    msg = str(e.value)
    assert f"model.safetensors: tensor {name!r}" in msg and "dtype I32 cannot be coded" in msg
    assert "docs/convert.md#published-dtypes" in msg


def test_fp8_conversion_memory_is_one_chunk_not_one_tensor(tmp_path, monkeypatch):
    """Python-side peak while converting FP8 weights of 8 MiB (as float32) each, in chunks
    of 256 KiB: against the same conversion of the float32 copy (the peer)."""
    src = write_llama_checkpoint(tmp_path / "src", layers=1, hidden=1024, intermediate=2048,
                                 heads=4, kv_heads=2, vocab=320, dtype="float32", shards=1)
    publish(src, tmp_path / "pub", tmp_path / "copy", "fp8-block")
    monkeypatch.setattr(job_module, "CHUNK_ELEMENTS", 1 << 16)
    peaks = {}
    for name in ("copy", "pub", "copy"):
        tracemalloc.start()
        try:
            run(tmp_path / name, tmp_path / f"{name}-tq", fresh=True)
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    one_tensor = 2048 * 1024 * 4
    print(f"peak traced: fp8 {peaks['pub'] / 2**20:.2f} MiB, float32 copy "
          f"{peaks['copy'] / 2**20:.2f} MiB, one weight as float32 {one_tensor / 2**20:.0f} MiB")
    # dequantizing a whole weight would add its float32 values (8 MiB) to the peer's peak
    assert peaks["pub"] < peaks["copy"] + (2 << 20)
    assert peaks["pub"] < one_tensor


def test_a_block_scale_without_its_fp8_weight_is_refused(dense, tmp_path):
    """A weight_scale_inv next to a float32 weight (a mixed checkpoint) is named, not
    written and not left to the recipe's rules."""
    publish(dense, tmp_path / "pub", tmp_path / "copy", "fp8-block", scales_apart=True)
    from safetensors.numpy import load_file

    f = tmp_path / "pub" / "scales.safetensors"
    tensors = list(load_file(f).items())
    tensors.append(("model.embed_tokens.weight_scale_inv", np.ones((3, 1), np.float32)))
    write_tensors(f, tensors)
    index = json.loads((tmp_path / "pub" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight_scale_inv"] = f.name
    (tmp_path / "pub" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError) as e:
        run(tmp_path / "pub", tmp_path / "out")
    assert len(e.value.problems) == 1
    assert "'model.embed_tokens.weight_scale_inv'" in str(e.value)
    assert "weight 'model.embed_tokens.weight' is F32" in str(e.value)


# the [[unsupported]] entries deepseek_v2.toml and gpt_oss.toml held until 2026-12-05
REMOVED_UNSUPPORTED = {"deepseek_v2": r"\.weight_scale_inv$",
                       "gpt_oss": r"_blocks$|\.experts\.\w+_scales$"}


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor", "mxfp4", "int4"])
def test_no_tensor_the_plan_sees_can_match_the_removed_unsupported_entries(dense, gpt_oss,
                                                                         tmp_path, fmt):
    """What the recipes' [[unsupported]] patterns were tested against: the tensors the
    pairing yields. Partners and scales are read with their weight (or refused by the
    pairing), codes tensors become their logical names: no name is left to match."""
    import re

    from turboquant.pipeline.published import pair
    from turboquant.pipeline.safetensors_io import read_header

    src = gpt_oss if fmt == "mxfp4" else dense
    publish(src, tmp_path / "pub", tmp_path / "copy", fmt, scales_apart=True)
    for folder in (tmp_path / "pub", tmp_path / "copy"):
        headers = {p.name: read_header(p, p.name) for p in folder.glob("*.safetensors")}
        pairing = pair(headers, json.loads((folder / "config.json").read_text()))
        assert not pairing.problems
        seen = [t.name for f, h in headers.items() for t in pairing.tensors(f, h)]
        assert seen
        for pattern in REMOVED_UNSUPPORTED.values():
            assert not [n for n in seen if re.search(pattern, n)], pattern


@pytest.mark.parametrize("what", ["scales-without-blocks", "blocks-not-mxfp4"])
def test_mxfp4_tensors_the_pairing_cannot_read_are_refused_whatever_the_recipe(
        gpt_oss, tmp_path, what):
    """An orphan MXFP4 `_scales` (its blocks missing) or U8 `_blocks` not shaped (..., 16)
    never reach a recipe: the pairing names the file and tensor, as it does for an orphan
    weight_scale_inv (the gpt_oss recipe once refused them as 'not supported yet')."""
    from safetensors.numpy import load_file

    publish(gpt_oss, tmp_path / "pub", tmp_path / "copy", "mxfp4", scales_apart=True)
    f = tmp_path / "pub" / "scales.safetensors"
    tensors = list(load_file(f).items())
    if what == "scales-without-blocks":
        name = "model.layers.1.mlp.experts.spare_proj_scales"
        tensors.append((name, np.full((3, 8, 2), 127, np.uint8)))
        want = f"tensor {name!r}: MXFP4 scales whose blocks"
    else:
        name = "model.layers.1.mlp.experts.spare_proj_blocks"
        tensors.append((name, np.zeros((3, 32), np.uint8)))
        want = f"tensor {name!r} (U8 [3, 32]): MXFP4 blocks without"
    write_tensors(f, tensors)
    index = json.loads((tmp_path / "pub" / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = f.name
    (tmp_path / "pub" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError) as e:
        run(tmp_path / "pub", tmp_path / "out")
    assert len(e.value.problems) == 1, str(e.value)
    assert want in e.value.problems[0] and "not supported yet" not in str(e.value)


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp4", "int4"])
def test_verify_recomputes_errors_against_the_published_source(dense, gpt_oss, tmp_path, fmt):
    from turboquant.pipeline.verify import verify_repo

    src = gpt_oss if fmt == "mxfp4" else dense
    publish(src, tmp_path / "pub", tmp_path / "copy", fmt, scales_apart=True)
    run(tmp_path / "pub", tmp_path / "pub-tq")
    rep = verify_repo(tmp_path / "pub-tq", source=tmp_path / "pub", full=True)
    assert rep.ok, rep.text()
    assert rep.decoded and all(m is not None for _, _, m in rep.decoded)
    # every tensor's recorded CRC was compared, the published ones' (of their dequantized
    # float32 values) included; a changed code in the source is named
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "pub-tq" / "manifest.parquet").to_pylist()
    assert rep.source_crcs == len(rows)
    pub_rows = [r for r in rows if r["source_dtype"] in ("F8_E4M3", "MXFP4", "I4")]
    assert pub_rows
    target = pub_rows[0]
    shard = tmp_path / "pub" / target["source_shard"]
    from turboquant.pipeline.safetensors_io import read_header

    tensors = read_header(shard).tensors  # the codes: the biggest tensor of the weight
    base = target["source_name"].removesuffix(".weight")
    info = max((t for n, t in tensors.items() if n.startswith(base)), key=lambda t: t.nbytes)
    data = bytearray(shard.read_bytes())
    data[info.start + info.nbytes // 2] ^= 0x11
    shard.write_bytes(bytes(data))
    bad = verify_repo(tmp_path / "pub-tq", source=tmp_path / "pub", full=True)
    assert not bad.ok and any("CRC-32" in p and target["source_name"] in p
                              for p in bad.problems), bad.text()


def test_a_nan_fp8_code_names_the_tensor(dense, tmp_path):
    """E4M3 0x7f is NaN: the job stops naming the weight, as for a NaN in BF16."""
    from turboquant.pipeline.errors import ConversionError
    from turboquant.pipeline.safetensors_io import read_header

    publish(dense, tmp_path / "pub", tmp_path / "copy", "fp8-block")
    f = tmp_path / "pub" / "model-00001-of-00002.safetensors"
    name = "model.layers.0.self_attn.k_proj.weight"
    info = read_header(f).tensors[name]
    data = bytearray(f.read_bytes())
    data[info.start + 5] = 0x7F
    f.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=rf"{name}.*non-finite.*flat index 5"):
        run(tmp_path / "pub", tmp_path / "out")


# ------------------------------------------------------------------ stacked FP8 experts

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), experts=st.integers(1, 4), out_f=st.integers(1, 70),
       in_f=st.integers(1, 70), b0=st.sampled_from([8, 16, 32]), b1=st.sampled_from([8, 16, 32]),
       kind=st.sampled_from(["block", "expert", "channel"]), tag=st.sampled_from(
           ["F8_E4M3", "F8_E5M2"]))
def test_stacked_fp8_experts_read_one_at_a_time_as_ml_dtypes_dequantizes_them(
        tmp_path_factory, seed, experts, out_f, in_f, b0, b1, kind, tag):
    """PublishedReader.expert of (E, out, in) FP8 codes with block, per-expert or
    per-channel scales equals ml_dtypes' values times the scale, computed here."""
    import ml_dtypes

    from turboquant.pipeline.published import PublishedReader, pair
    from turboquant.pipeline.safetensors_io import read_header

    rng = np.random.default_rng(seed)
    ml = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}[tag]
    codes = rng.standard_normal((experts, out_f, in_f)).astype(np.float32).astype(ml)
    grid = {"block": (experts, -(-out_f // b0), -(-in_f // b1)), "expert": (experts, 1, 1),
            "channel": (experts, out_f)}[kind]
    scale = rng.uniform(0.001, 2, size=grid).astype(np.float32)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    path = tmp_path_factory.mktemp("stacked") / "model.safetensors"
    write_tensors(path, [(name, codes), (name + "_scale_inv", scale)])
    headers = {path.name: read_header(path, path.name)}
    qc = {"quant_method": "fp8", "weight_block_size": [b0, b1]}
    pairing = pair(headers, {"quantization_config": qc})
    assert not pairing.problems and name + "_scale_inv" in pairing.partners
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = PublishedReader(lambda f: fd, headers)
        for e in range(experts):
            if kind == "block":
                full = np.kron(scale[e], np.ones((b0, b1), np.float32))[:out_f, :in_f]
            else:
                full = scale[e].reshape(-1, 1)
            want = codes[e].astype(np.float32) * full
            assert np.array_equal(reader.expert(pairing.published[name], e), want,
                                  equal_nan=True)
    finally:
        os.close(fd)


def test_stacked_fp8_experts_convert_to_the_bytes_of_their_float32_copy(tmp_path):
    """Qwen3.5-MoE's experts fused and stacked (E, 2 x I, H) in FP8 with a block grid per
    expert (X_scale_inv): dequantized one expert at a time in the job, split into gate and
    up, coded; the same bytes as converting the float32 copy, and `verify --source`
    recomputes every split row from the FP8 codes."""
    import mlx.core as mx
    from arch_checkpoints import write_arch_checkpoint

    from turboquant.pipeline.verify import verify_repo

    src = tmp_path / "src"
    write_arch_checkpoint(src, "qwen3_5_moe")
    weights = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(src / "model.safetensors"),
                        {k: v.astype(mx.float32) for k, v in weights.items()})
    publish(src, tmp_path / "pub", tmp_path / "copy", "fp8-block", block=(32, 48),
            scales_apart=True)
    run(tmp_path / "pub", tmp_path / "pub-tq", group_size=32)
    run(tmp_path / "copy", tmp_path / "copy-tq", group_size=32)
    rows = assert_same_repo(tmp_path / "pub-tq", tmp_path / "copy-tq", "F8_E4M3")
    stacked = [r for r in rows if r["source_name"].endswith(".experts.gate_up_proj")]
    assert len(stacked) == 2 * 4 * 2  # layers x experts x (gate, up)
    report = verify_repo(tmp_path / "pub-tq", source=tmp_path / "pub", full=True)
    assert report.ok, report.text()


@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "zero-point"])
def test_stacked_int4_experts_convert_to_the_bytes_of_their_float32_copy(tmp_path, zero_point):
    """Qwen3.5-MoE's fused experts stacked (E, 2 x I, H) pack-quantized as int4 (X_packed,
    group scales, zero points packed along rows): dequantized one expert at a time, split
    into gate and up, coded; the same bytes as converting the float32 copy, and `verify
    --source` recomputes every split row from the int4 codes."""
    import mlx.core as mx
    from arch_checkpoints import write_arch_checkpoint

    from turboquant.pipeline.verify import verify_repo

    src = tmp_path / "src"
    write_arch_checkpoint(src, "qwen3_5_moe")
    weights = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(src / "model.safetensors"),
                        {k: v.astype(mx.float32) for k, v in weights.items()})
    publish(src, tmp_path / "pub", tmp_path / "copy", "int4", scales_apart=True,
            zero_point=zero_point)
    run(tmp_path / "pub", tmp_path / "pub-tq", group_size=32)
    run(tmp_path / "copy", tmp_path / "copy-tq", group_size=32)
    rows = assert_same_repo(tmp_path / "pub-tq", tmp_path / "copy-tq", "I4")
    stacked = [r for r in rows if r["source_name"].endswith(".experts.gate_up_proj")]
    assert len(stacked) == 2 * 4 * 2  # layers x experts x (gate, up)
    assert {r["source_name"] for r in rows if r["source_name"].endswith(".experts.down_proj")}
    report = verify_repo(tmp_path / "pub-tq", source=tmp_path / "pub", full=True)
    assert report.ok, report.text()
    assert {n for n, _, m in report.decoded if m is not None} >= {r["name"] for r in stacked}

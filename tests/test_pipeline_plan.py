"""The metadata-only validation pass: jobs, units, layout, and problems that name the file
and the tensor."""

from __future__ import annotations

import json

import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint

from turboquant.manifests.schema import stored_names
from turboquant.pipeline.errors import ConversionError, PlanError
from turboquant.pipeline.plan import build_plan
from turboquant.pipeline.sources import LocalSource


def test_one_job_per_shard_and_layout_matches_header(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", layers=3, shards=3)
    plan = build_plan(LocalSource(src), min_job_bytes=0)
    assert [j.shard for j in plan.jobs] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [j.files[0] for j in plan.jobs] == LocalSource(src).shard_files()
    for job in plan.jobs:
        n = int.from_bytes(job.header[:8], "little")
        header = json.loads(job.header[8 : 8 + n])
        assert header.pop("__metadata__")["format"] == "turboquant"
        pos = len(job.header)
        for unit in job.units:
            for it in unit.items:
                names = stored_names(it.name, it.codec, it.in_scales)  # llama: column scales
                assert [s.name for s in it.stored] == names
                for s in it.stored:
                    assert s.start == pos and header[s.name]["data_offsets"][0] == pos - len(job.header)
                    pos = s.end
        assert pos == job.size


def test_small_shards_are_grouped_and_big_ones_split(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", layers=4, shards=4)
    total = build_plan(LocalSource(src), min_job_bytes=0).read_bytes
    grouped = build_plan(LocalSource(src), min_job_bytes=10 * total)
    assert len(grouped.jobs) == 1 and len(grouped.jobs[0].files) == 4
    assert grouped.jobs[0].shard == "model.safetensors"
    single = write_llama_checkpoint(tmp_path / "one", layers=4, shards=1)
    split = build_plan(LocalSource(single), min_job_bytes=0, max_job_bytes=total // 3)
    assert len(split.jobs) >= 3
    assert all(j.files == ("model.safetensors",) for j in split.jobs)
    names = [it.name for it in split.items]
    assert len(names) == len(set(names))


def test_expert_units_hold_all_projections_consecutively(tmp_path):
    src = write_moe_checkpoint(tmp_path / "m", style="qwen3_moe", layers=2, experts=4,
                               intermediate=64, shards=3)
    plan = build_plan(LocalSource(src), min_job_bytes=0)
    units = [u for j in plan.jobs for u in j.units if ".experts." in u.key]
    assert len(units) == 2 * 4
    for u in units:
        assert [it.name.rsplit(".", 2)[-2] for it in u.items] == ["down_proj", "gate_proj", "up_proj"]
        for a, b in zip(u.items, u.items[1:]):
            assert a.byte_end == b.byte_start  # one contiguous byte range
        seeds = {it.name.rsplit(".", 2)[-2]: it.seed for it in u.items}
        other = next(v for v in units if v.key != u.key and v.key.split(".experts.")[0]
                     == u.key.split(".experts.")[0])
        # experts of one layer and projection share the rotation
        assert seeds == {it.name.rsplit(".", 2)[-2]: it.seed for it in other.items}


def test_gpt_oss_fused_experts_are_split(tmp_path):
    src = write_moe_checkpoint(tmp_path / "m", style="gpt_oss", layers=2, experts=3,
                               hidden=64, intermediate=64, shards=1)
    plan = build_plan(LocalSource(src))
    items = {it.name: it for it in plan.items}
    g = items["model.layers.0.mlp.experts.2.gate_proj.weight"]
    assert g.shape == (64, 64) and g.piece.interleaved and g.piece.transpose
    assert g.piece.tensor == "model.layers.0.mlp.experts.gate_up_proj" and g.piece.expert == 2
    assert items["model.layers.0.mlp.experts.2.up_proj.bias"].shape == (64,)
    assert items["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (64, 64)


def _corrupt_index(src, fn):
    p = src / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx["weight_map"])
    p.write_text(json.dumps(idx))


def test_missing_index_entry_names_tensor_and_file(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", shards=2)
    _corrupt_index(src, lambda wm: wm.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(PlanError) as e:
        build_plan(LocalSource(src))
    msg = str(e.value)
    assert "'model.layers.1.mlp.up_proj.weight'" in msg and "missing from" in msg
    assert "model-00002-of-00002.safetensors" in msg


def test_index_pointing_at_the_wrong_shard_or_a_missing_file(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", shards=2)
    _corrupt_index(src, lambda wm: wm.update({"model.norm.weight": "model-00001-of-00002.safetensors"}))
    with pytest.raises(PlanError, match=r"'model\.norm\.weight' is mapped to model-00001"):
        build_plan(LocalSource(src))
    _corrupt_index(src, lambda wm: wm.update({"model.norm.weight": "model-00009.safetensors"}))
    with pytest.raises(PlanError, match=r"model-00009\.safetensors: is listed in .* but does not exist"):
        build_plan(LocalSource(src))


def test_unmatched_tensor_is_a_validation_error(tmp_path):
    src = write_llama_checkpoint(tmp_path / "m", shards=1,
                                 extra_tensors=[("model.layers.0.mystery.weight", (8, 64))])
    with pytest.raises(PlanError) as e:
        build_plan(LocalSource(src))
    assert "model.safetensors: tensor 'model.layers.0.mystery.weight' matches no rule" in str(e.value)
    assert "llama" in str(e.value)


def test_every_problem_is_listed(tmp_path):
    extra = [(f"model.extra{i}.weight", (4, 64)) for i in range(3)]
    src = write_llama_checkpoint(tmp_path / "m", shards=1, extra_tensors=extra)
    with pytest.raises(PlanError) as e:
        build_plan(LocalSource(src))
    assert len(e.value.problems) == 3


def test_mxfp4_and_unknown_architecture(tmp_path):
    src = write_moe_checkpoint(tmp_path / "m", style="gpt_oss", shards=1,
                               tokenizer=False)
    # a real GPT-OSS checkpoint stores experts as MXFP4 blocks + scales: blocks alone are refused
    from checkpoints import TensorSpec, random_fill, write_safetensors

    write_safetensors(src / "model.safetensors", [
        TensorSpec("model.layers.0.mlp.experts.gate_up_proj_blocks", (4, 64, 2, 16),
                   random_fill(0, "b", 1.0), "float16"),
        TensorSpec("model.norm.weight", (64,), random_fill(0, "n", 1.0)),
    ])
    with pytest.raises(PlanError, match=r"gate_up_proj_blocks.*MXFP4 blocks without.*_scales"):
        build_plan(LocalSource(src))
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "bert"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"config\.json: unknown architecture model_type='bert'"):
        build_plan(LocalSource(src))


def test_plan_is_deterministic(tmp_path):
    src = write_moe_checkpoint(tmp_path / "m", style="mixtral", shards=2)
    a = build_plan(LocalSource(src), min_job_bytes=0)
    b = build_plan(LocalSource(src), min_job_bytes=0)
    assert a.plan_hash() == b.plan_hash()
    c = build_plan(LocalSource(src), overrides={"bits": 3}, min_job_bytes=0)
    assert c.plan_hash() != a.plan_hash()

"""The output folder's rules (pipeline/output.py) and the source fingerprint (sources.py),
as plain functions: what `decide` answers for each kind of folder, how shard identities
compare, and which bytes the fingerprint samples."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.pipeline import output
from turboquant.pipeline.errors import OutputError
from turboquant.pipeline.safetensors_io import SafetensorsHeader, TensorInfo
from turboquant.pipeline.sources import SAMPLE_EDGE, sample_ranges

RECORD = {"recipe": "llama", "recipe_hash": "r1", "plan_hash": "p1", "source": "/src",
          "jobs": 1, "resolved_recipe": {"bits": 4}, "files": ["model.safetensors"],
          "sources": {"model.safetensors": {"file": "model.safetensors", "size": 10,
                                            "header_sha256": "h", "sample_sha256": "s"}}}


def conversion(folder, record=RECORD):
    (folder / ".turboquant").mkdir(parents=True)
    (folder / ".turboquant" / "run.json").write_text(json.dumps(record))
    (folder / ".turboquant" / "run.lock").write_text("")
    for name in ("model.safetensors", "config.json", "README.md"):
        (folder / name).write_text(name)
    return folder


def test_a_new_or_empty_folder_starts(tmp_path):
    assert output.decide(tmp_path / "new", RECORD, fresh=False) == output.Decision(tmp_path / "new")
    assert not output.decide(tmp_path, RECORD, fresh=True).delete


def test_the_same_conversion_resumes_next_to_a_users_file(tmp_path):
    out = conversion(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    assert output.decide(out, RECORD, fresh=False).resume


@pytest.mark.parametrize("change, says", [
    ({"recipe_hash": "r2", "resolved_recipe": {"bits": 3}}, "bits: 4 -> 3"),
    ({"plan_hash": "p2"}, "another source or layout"),
    ({"sources": {"model.safetensors": {**RECORD["sources"]["model.safetensors"],
                                        "sample_sha256": "other"}}},
     "shard model.safetensors of this source is not the one converted (its sampled bytes"),
    ({"sources": {"model.safetensors": {**RECORD["sources"]["model.safetensors"],
                                        "size": 11}}}, "(10 bytes then, 11 now)"),
    ({"sources": {}}, "shard model.safetensors is missing in this source"),
])
def test_another_conversion_is_refused_in_one_line(tmp_path, change, says):
    out = conversion(tmp_path / "out")
    with pytest.raises(OutputError) as e:
        output.decide(out, {**RECORD, **change}, fresh=False)
    assert says in str(e.value) and "\n" not in str(e.value) and "--fresh" in str(e.value)


def test_fresh_lists_only_what_a_conversion_wrote(tmp_path):
    out = conversion(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    (out / "config.json.tmp").write_text("torn")
    (out / ".turboquant" / "jobs").mkdir()
    d = output.decide(out, {**RECORD, "recipe_hash": "other"}, fresh=True)
    names = sorted(str(p.relative_to(out)) for p in d.delete)
    assert names == [".turboquant/jobs", ".turboquant/run.json", "README.md", "config.json",
                     "config.json.tmp", "model.safetensors"]
    output.delete(d)
    assert sorted(p.name for p in out.iterdir()) == [".turboquant", "notes.txt"]
    assert [p.name for p in (out / ".turboquant").iterdir()] == ["run.lock"]


def test_folders_no_conversion_made_are_refused_also_with_fresh(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    for fresh in (False, True):
        with pytest.raises(OutputError, match="is not empty and is not a TurboQuant conversion"):
            output.decide(user, RECORD, fresh=fresh)
    with pytest.raises(OutputError, match="is the source folder"):
        output.decide(user, RECORD, fresh=True, source_folder=user)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        output.decide(tmp_path / "file", RECORD, fresh=False)


def test_a_repo_made_elsewhere_is_replaced_only_with_fresh(tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "turboquant"}}))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00001.safetensors"}}))
    (out / "model-00001-of-00001.safetensors").write_text("x")
    (out / "tokenizer.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="made elsewhere"):
        output.decide(out, RECORD, fresh=False)
    output.delete(output.decide(out, RECORD, fresh=True))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_hub_shards_compare_by_their_lfs_hash():
    a = {"repo": "o/m", "commit": "c1", "file": "f", "size": 5, "sha256": "x",
         "header_sha256": "h"}
    assert output.same_shard(a, {**a, "commit": "c2"})  # a new commit, the same file
    assert not output.same_shard(a, {**a, "sha256": "y"})
    assert not output.same_shard(a, {"file": "f", "size": 5, "header_sha256": "h",
                                     "sample_sha256": "s"})  # not comparable: refused


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=0, max_size=40), st.integers(8, 200))
def test_sampled_ranges_are_sorted_disjoint_and_inside_the_data(sizes, data_start):
    tensors, pos = {}, data_start
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = TensorInfo(f"t{i}", "U8", (n,), pos, pos + n)
        pos += n
    header = SafetensorsHeader("f", pos, data_start, tensors)
    ranges = sample_ranges(header)
    assert all(data_start <= a < b <= pos for a, b in ranges)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))
    covered = lambda x: any(a <= x < b for a, b in ranges)  # noqa: E731
    for t in tensors.values():  # every tensor's first and last bytes are sampled
        if t.end > t.start:
            assert covered(t.start) and covered(t.end - 1)
            assert covered(min(t.end - 1, t.start + SAMPLE_EDGE - 1))

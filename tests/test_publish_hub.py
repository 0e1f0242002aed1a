"""Publishing converted repos to a Hub on loopback, through the real huggingface_hub client:
a batch of three through the Prefect flow, a rerun that uploads nothing, an interrupted
upload resumed, a dry run, clear errors, and the runtime loading a published repo by id."""

from __future__ import annotations

import hashlib
import shutil

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.publish import (card_from_manifest, local_files, publish_many,
                                         publish_repo, summary_table)

ORG = "test-org"
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Three converted repos: two dense (Llama layout), one Mixture-of-Experts."""
    base = tmp_path_factory.mktemp("publish")
    made = []
    for name, kind in (("tiny-llama-tq3", "llama"), ("tiny-llama-tq4", "llama"),
                       ("tiny-moe-tq", "moe")):
        if kind == "llama":
            src = write_llama_checkpoint(base / f"src-{name}", layers=2, hidden=64,
                                         intermediate=128, vocab=320, shards=2)
        else:
            src = write_moe_checkpoint(base / f"src-{name}", style="qwen3_moe", layers=2,
                                       hidden=64, intermediate=32, experts=4, shards=2)
        out = base / name
        convert(ConvertOptions(str(src), str(out), in_process=True, min_job_bytes=0,
                               progress=False, bits=3 if name.endswith("tq3") else None))
        made.append(out)
    return made


def fresh_copies(outputs, tmp_path):
    """Copies of the converted repos (tests may change them)."""
    copies = []
    for o in outputs:
        shutil.copytree(o, tmp_path / o.name)
        copies.append(tmp_path / o.name)
    return copies


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_batch_publish_rerun_uploads_nothing_then_load_by_id(hub_server, outputs, tmp_path):
    from turboquant.pipeline.publish_flow import run_publish_flow

    folders = fresh_copies(outputs, tmp_path)
    ids = [f"{ORG}/{f.name}" for f in folders]
    results = run_publish_flow([str(f) for f in folders], ids, concurrency=2)
    table = summary_table(results)
    assert [r.status for r in results] == ["uploaded"] * 3, table
    for folder, rid, r in zip(folders, ids, results):
        local = {f.path: f for f in local_files(folder)}
        remote = hub_server.list_files(rid)
        assert set(remote) == set(local) | {".gitattributes"}  # no .turboquant/
        for path, f in local.items():
            assert sha(hub_server.read_file(rid, path)) == f.sha256
        shards = [p for p in local if p.endswith(".safetensors")]
        assert hub_server.lfs_uploads[rid] == len(shards) + 1  # shards and the manifest
        assert hub_server.commits[rid] == 1
        assert r.url.endswith(rid) and r.url in table
        card = hub_server.read_file(rid, "README.md").decode()
        assert "library_name: mlx" in card and "Real bits per weight" in card

    hub_server.reset_stats()
    again = run_publish_flow([str(f) for f in folders], ids)
    assert [r.status for r in again] == ["up to date"] * 3, summary_table(again)
    assert all(not r.uploaded and len(r.skipped) == len(results[i].uploaded)
               for i, r in enumerate(again))
    assert sum(hub_server.lfs_uploads.values()) == 0
    assert sum(hub_server.commits.values()) == 0
    assert not any(p.endswith(("/preupload/main", "/commit/main")) for _, p in hub_server.requests)

    # the runtime loads a published repo by its id, through HF_ENDPOINT
    from turboquant.runtime import load

    model, tok = load(ids[0])
    local_model, _ = load(str(folders[0]))
    tokens = mx.array([tok.encode("def f(x):")])
    got, want = model(tokens).astype(mx.float32), local_model(tokens).astype(mx.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.isfinite(np.asarray(got)).all()


def test_only_changed_files_are_uploaded_and_an_interrupted_upload_resumes(hub_server, outputs,
                                                                           tmp_path):
    from huggingface_hub import CommitOperationAdd

    folder = fresh_copies(outputs[:1], tmp_path)[0]
    rid = f"{ORG}/{folder.name}"
    api = hub_server.api()
    api.create_repo(rid)
    # an upload cut short after its LFS objects were sent, before the commit
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    api.preupload_lfs_files(rid, [CommitOperationAdd(s, str(folder / s)) for s in shards])
    assert hub_server.lfs_uploads[rid] == len(shards) and hub_server.commits[rid] == 0
    hub_server.reset_stats()
    r = publish_repo(folder, rid)
    assert r.status == "uploaded" and "manifest.parquet" in r.uploaded
    assert hub_server.lfs_uploads[rid] == 1  # only the manifest: the shards were there
    assert set(hub_server.list_files(rid)) >= set(shards)

    # a changed card: that file alone
    (folder / "README.md").write_text((folder / "README.md").read_text() + "\nNotes.\n")
    hub_server.reset_stats()
    r = publish_repo(folder, rid)
    assert r.uploaded == ["README.md"] and hub_server.lfs_uploads[rid] == 0
    assert hub_server.commits[rid] == 1
    assert hub_server.read_file(rid, "README.md").endswith(b"Notes.\n")

    # a file the folder no longer has (e.g. a shard of an older layout): kept unless --prune
    api.upload_file(path_or_fileobj=b"old", path_in_repo="model-00003-of-00003.safetensors",
                    repo_id=rid)
    assert publish_repo(folder, rid).status == "up to date"
    r = publish_repo(folder, rid, prune=True)
    assert r.deleted == ["model-00003-of-00003.safetensors"] and r.status == "uploaded"
    assert "model-00003-of-00003.safetensors" not in hub_server.list_files(rid)


def test_card_is_rebuilt_from_the_manifest(outputs, tmp_path):
    folder = fresh_copies(outputs[2:], tmp_path)[0]
    written = (folder / "README.md").read_text()
    assert card_from_manifest(folder) == written  # same bytes as the pipeline's card
    card = card_from_manifest(folder, base_model="Qwen/Qwen3-30B-A3B")
    assert "base_model: Qwen/Qwen3-30B-A3B" in card and "ternary" not in card.split("---")[1]


def test_cli_dry_run_then_publish_and_errors(hub_server, outputs, tmp_path, capsys):
    from turboquant.publish import main

    folders = fresh_copies(outputs[:2], tmp_path)
    (folders[1] / "README.md").unlink()  # the card is rebuilt from the manifest
    args = [str(f) for f in folders] + ["--org", ORG, "--no-prefect"]
    assert main([*args, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"{ORG}/{folders[0].name}: would upload model.safetensors.index.json" in text
    assert f"{ORG}/{folders[1].name}: would upload README.md" in text
    assert "dry run" in text and not hub_server.repo_exists(f"{ORG}/{folders[0].name}")
    assert not (folders[1] / "README.md").exists()  # a dry run writes nothing

    assert main([*args, "--private"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 repos ok" in out and (folders[1] / "README.md").exists()
    assert sum(line.endswith("  uploaded") for line in out.splitlines()) == 2
    assert hub_server.api().model_info(f"{ORG}/{folders[0].name}").private

    # an unfinished conversion fails clearly; the other repo is still published
    (folders[0] / ".turboquant" / "complete").unlink()
    (folders[1] / "README.md").write_text("# edited\n")
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "conversion is not finished" in out and "1 of 2 repos ok" in out

    assert main([str(folders[0]), str(folders[1]), "--repo-id", f"{ORG}/x"]) == 2
    assert "--repo-id names one repo" in capsys.readouterr().err


def test_plain_batch_matches_flow_results(hub_server, outputs, tmp_path):
    folders = fresh_copies(outputs, tmp_path)
    ids = [f"test-user/{f.name}" for f in folders]
    results = publish_many([str(f) for f in folders], ids, concurrency=3)
    assert [r.status for r in results] == ["uploaded"] * 3
    assert publish_many([str(f) for f in folders], ids)[0].status == "up to date"

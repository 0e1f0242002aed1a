"""An FP8 release on the (loopback) Hub whose block scales sit in a shard of their own:
the jobs download the scales' shard too, and with --delete-source it is deleted only once
every job that reads it is done. Same bytes as converting the local folder."""

from __future__ import annotations

import hashlib

import pytest
from checkpoints import write_llama_checkpoint
from published_checkpoints import publish

from turboquant.pipeline.convert import ConvertOptions, convert, validate

REPO = "test-user/tiny-fp8"
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes")


def _opts(src, out, **kw):
    return ConvertOptions(str(src), str(out), in_process=True, min_job_bytes=0, progress=False,
                          **kw)


def test_fp8_release_from_the_hub_with_scales_in_another_shard(hub_server, tmp_path):
    src = write_llama_checkpoint(tmp_path / "f32", layers=2, hidden=64, intermediate=160,
                                 heads=4, kv_heads=2, vocab=320, dtype="float32", shards=2)
    publish(src, tmp_path / "pub", tmp_path / "copy", "fp8-block", scales_apart=True)
    api = hub_server.api()
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=str(tmp_path / "pub"))

    out = tmp_path / "hub-out"
    plan = validate(_opts(REPO, out, delete_source=True)).plan
    assert len(plan.jobs) == 2
    assert all("scales.safetensors" in job.files for job in plan.jobs)
    assert plan.readers()["scales.safetensors"] == {"job-00001", "job-00002"}

    convert(_opts(REPO, out, delete_source=True))
    assert not list((out / ".turboquant" / "source").glob("*.safetensors"))
    events = (out / ".turboquant" / "events.jsonl").read_text()
    assert events.count('"source_deleted"') == 3

    local = tmp_path / "local-out"
    convert(_opts(tmp_path / "pub", local))
    for p in sorted(local.glob("*.safetensors")) + [local / "manifest.parquet"]:
        assert hashlib.sha256((out / p.name).read_bytes()).digest() == \
            hashlib.sha256(p.read_bytes()).digest(), p.name

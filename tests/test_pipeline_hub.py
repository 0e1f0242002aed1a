"""A Hub repo as the source, through the real huggingface_hub client and a loopback Hub:
headers first (range requests), shards downloaded one at a time, deleted once converted."""

from __future__ import annotations

import hashlib

import pytest
from checkpoints import write_moe_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert, validate
from turboquant.pipeline.errors import ConversionError
from turboquant.pipeline.verify import verify_repo

REPO = "test-user/tiny-moe"
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes")


def _opts(src, out, **kw):
    return ConvertOptions(str(src), str(out), in_process=True, min_job_bytes=0, progress=False,
                          expert_bits=2, **kw)


def _digest(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_convert_from_a_hub_repo(hub_server, tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", style="qwen3_moe", layers=3, hidden=64,
                               intermediate=64, experts=3, shards=3)
    api = hub_server.api()
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=str(src))

    out = tmp_path / "hub-out"
    prepared = validate(_opts(REPO, out, delete_source=True))  # metadata only
    assert prepared.source.kind == "hub" and len(prepared.plan.jobs) == 3
    assert not list(hub_server.cache_dir.rglob("*.safetensors"))  # no shard downloaded yet
    assert not (out / ".turboquant" / "source").exists()

    summary = convert(_opts(REPO, out, delete_source=True))
    assert summary.jobs_run == 3
    # every downloaded shard was deleted once the jobs reading it were done
    assert not list((out / ".turboquant" / "source").glob("*.safetensors"))
    events = (out / ".turboquant" / "events.jsonl").read_text()
    assert events.count('"source_deleted"') == 3

    local = tmp_path / "local-out"
    convert(_opts(src, local))
    for shard in sorted(local.glob("model-*.safetensors")):
        assert _digest(out / shard.name) == _digest(shard)  # same bytes from either source
    assert _digest(out / "manifest.parquet") == _digest(local / "manifest.parquet")
    assert "base_model: test-user/tiny-moe" in (out / "README.md").read_text()
    assert (out / "tokenizer.json").exists()
    assert verify_repo(out, source=src, full=True).ok

    # rerun from the Hub: nothing to download, everything skipped
    again = convert(_opts(REPO, out, delete_source=True))
    assert again.jobs_skipped == 3


def test_unknown_hub_repo_is_a_clear_error(hub_server, tmp_path):
    with pytest.raises(ConversionError, match="Hub repo 'test-user/nope' not found"):
        validate(_opts("test-user/nope", tmp_path / "out"))

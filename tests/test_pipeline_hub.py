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


def _uploaded(hub_server, tmp_path, repo="test-user/tiny-dense"):
    from checkpoints import write_llama_checkpoint

    src = write_llama_checkpoint(tmp_path / "src", layers=1, hidden=64, intermediate=128,
                                 vocab=128, shards=1)
    api = hub_server.api()
    api.create_repo(repo)
    api.upload_folder(repo_id=repo, folder_path=str(src))
    return repo


@pytest.mark.parametrize("how", ["server-stopped", "HF_HUB_OFFLINE"])
def test_python_api_gives_the_clis_one_line_when_the_hub_is_unreachable(hub_server, tmp_path,
                                                                       how):
    """HubSource (and convert/validate through it) raise HubUnreachable, a ConversionError
    whose message is the CLI's line: the repo, the endpoint and what to do; never the Hub
    client's own exception."""
    from turboquant.pipeline.errors import HubUnreachable
    from turboquant.pipeline.sources import HubSource

    repo = _uploaded(hub_server, tmp_path)
    if how == "server-stopped":
        url = hub_server.url
        hub_server.stop()
        want = (f"cannot reach the Hugging Face Hub at {url} to read Hub repo "
                f"{repo!r} (", "check the network connection (or HF_ENDPOINT), or give a "
                "local folder")
        offline = None
    else:
        want = (f"HF_HUB_OFFLINE is set, so Hub repo {repo!r} cannot be read; ",
                "unset HF_HUB_OFFLINE, or give a local folder")
        offline = hub_server.offline()
        offline.__enter__()
    try:
        for call in (lambda: HubSource(repo), lambda: validate(_opts(repo, tmp_path / "o")),
                     lambda: convert(_opts(repo, tmp_path / "o"))):
            with pytest.raises(HubUnreachable) as e:
                call()
            line = str(e.value)
            assert isinstance(e.value, ConversionError) and "\n" not in line
            assert line.startswith(want[0]) and line.endswith(want[1]), line
            assert e.value.__cause__ is None and e.value.__suppress_context__
    finally:
        if offline is not None:
            offline.__exit__(None, None, None)
    assert not (tmp_path / "o").exists()


def test_a_hub_unreachable_mid_run_is_the_same_line(hub_server, tmp_path):
    """Metadata read, then the server goes away before the shards download: the job's
    error is the same one line (it crosses the worker boundary as a ConversionError)."""
    import pickle

    from turboquant.pipeline.errors import HubUnreachable
    from turboquant.pipeline.sources import HubSource

    repo = _uploaded(hub_server, tmp_path)
    source = HubSource(repo)
    hub_server.stop()
    with pytest.raises(HubUnreachable, match=f"to read Hub repo {repo!r}") as e:
        source.local_path(source.shard_files()[0])
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)


def test_a_cached_hub_repo_converts_with_hf_hub_offline(hub_server, tmp_path):
    """A repo downloaded once converts again with HF_HUB_OFFLINE=1 and the Hub gone, to the
    same bytes, read from the local cache's snapshot (the card still names the repo); one
    that was only partly downloaded is one line saying the cache does not hold it."""
    from huggingface_hub import snapshot_download

    from turboquant.pipeline.errors import HubUnreachable

    repo = _uploaded(hub_server, tmp_path)
    online = tmp_path / "online"
    convert(_opts(repo, online))
    snapshot_download(repo)  # a user's `huggingface-cli download`: every file in the cache
    partial = _uploaded(hub_server, tmp_path / "p", repo="test-user/partial")
    snapshot_download(partial, allow_patterns=["config.json", "*.json"])
    hub_server.stop()
    with hub_server.offline():
        offline = tmp_path / "offline"
        summary = convert(_opts(repo, offline))
        assert summary.jobs_run == 1
        for shard in sorted(online.glob("model-*.safetensors")):
            assert _digest(offline / shard.name) == _digest(shard)
        assert "base_model: test-user/tiny-dense" in (offline / "README.md").read_text()
        with pytest.raises(HubUnreachable, match=r"^HF_HUB_OFFLINE is set.* Hub repo "
                           r"'test-user/partial' .*local Hugging Face cache.*unset HF_HUB_OFFLINE"):
            validate(_opts(partial, tmp_path / "o2"))

"""`turboquant plan` on Hub repos (a loopback Hub through the real huggingface_hub client):
config.json and the index are fetched, every shard is read only through HTTP range
requests for its header, nothing of a shard lands in the cache, and the projection equals
the local folder's."""

from __future__ import annotations

import json

import hub_server as hub_module
import pytest
from checkpoints import write_moe_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.fit import GB, Machine, project
from turboquant.pipeline.fit_weights import inventory
from turboquant.pipeline.sources import LocalSource, open_source

pytestmark = [pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes"),
              pytest.mark.filterwarnings("ignore:It seems that you are about to commit a data")]
MACHINE = Machine("cpu", 24 * GB, "test")


@pytest.fixture
def served(monkeypatch):
    """(path, Range header) of every file the server sends."""
    sent = []
    original = hub_module._Handler._send_file

    def spy(self, file, headers, ctype):
        sent.append((self.path, self.headers.get("Range")))
        return original(self, file, headers, ctype)

    monkeypatch.setattr(hub_module._Handler, "_send_file", spy)
    return sent


def _upload(hub, repo, folder):
    api = hub.api()
    api.create_repo(repo)
    api.upload_folder(repo_id=repo, folder_path=str(folder))


def _numbers(p):
    return (p.weights, p.experts, p.kv, p.workspace, p.min_expert_budget)


def _only_ranges(sent, shards: int):
    reads = [(path, rng) for path, rng in sent if path.split("?")[0].endswith(".safetensors")]
    assert reads, "no shard header was read"
    assert all(rng and rng.startswith("bytes=") for _, rng in reads), reads
    assert len({p for p, _ in reads}) == shards
    assert len(reads) == 2 * shards  # length prefix, then the JSON header


def test_plan_a_source_checkpoint_on_the_hub(hub_server, served, tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", layers=3, hidden=64, intermediate=64,
                               experts=4, shards=3)
    _upload(hub_server, "test-user/moe", src)
    served.clear()
    source = open_source("test-user/moe")
    assert source.kind == "hub"
    remote = project(inventory(source), 2048, MACHINE)
    local = project(inventory(LocalSource(src)), 2048, MACHINE)
    assert _numbers(remote) == _numbers(local)
    assert remote.inventory.source.startswith("test-user/moe@")
    _only_ranges(served, 3)
    assert not list(hub_server.cache_dir.rglob("*.safetensors"))  # no shard downloaded


def test_plan_a_converted_repo_on_the_hub(hub_server, served, tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", layers=3, hidden=64, intermediate=64,
                               experts=4, shards=2)
    out = tmp_path / "out"
    convert(ConvertOptions(str(src), str(out), in_process=True, progress=False,
                           check_disk=False, min_job_bytes=0))
    _upload(hub_server, "test-user/moe-tq", out)
    served.clear()
    remote = project(inventory(open_source("test-user/moe-tq")), 2048, MACHINE)
    assert remote.inventory.kind == "repo"
    assert _numbers(remote) == _numbers(project(inventory(LocalSource(out)), 2048, MACHINE))
    _only_ranges(served, len(list(out.glob("*.safetensors"))))
    assert not list(hub_server.cache_dir.rglob("*.safetensors"))


def test_plan_cli_with_a_repo_id(hub_server, tmp_path, capsys):
    from turboquant.plan import main

    src = write_moe_checkpoint(tmp_path / "src", layers=2, hidden=64, intermediate=64)
    _upload(hub_server, "test-user/cli", src)
    assert main(["test-user/cli", "--memory-gb", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "source" and d["verdict"] == "RESIDENT"
    assert d["commands"][0] == "turboquant convert test-user/cli cli-tq"
    assert main(["test-user/nope"]) == 2
    assert "not found" in capsys.readouterr().err

"""The loopback Hub (tests/hub_server.py) against the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import huggingface_hub
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    create_repo,
    hf_hub_download,
    hf_hub_url,
    list_repo_files,
    model_info,
    snapshot_download,
    upload_folder,
)
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import get_hf_file_metadata
from huggingface_hub.utils import build_hf_headers, get_session

from hub_server import HubServer, hub_client_env

REPO = "test-user/tiny-turboquant"

# huggingface_hub's LFS PUT passes a file object as `data=`, which httpx2 deprecates (client side).
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")


def make_model_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.layers.0.weight": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        "model.layers.0.scales": np.ones(64, dtype=np.float16),
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "turboquant"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    (folder / "README.md").write_text(
        "---\nlicense: apache-2.0\nlibrary_name: mlx\ntags:\n- turboquant\n---\n# Tiny TurboQuant model\n"
    )
    return folder


@pytest.fixture
def published(hub_server, tmp_path):
    """A repo with a safetensors file (LFS), a JSON and a README, published with upload_folder."""
    folder = make_model_folder(tmp_path / "out")
    create_repo(REPO)
    commit = upload_folder(repo_id=REPO, folder_path=folder, commit_message="Publish")
    return folder, commit


def counters(hub: HubServer, repo: str = REPO) -> tuple[int, int, int, int]:
    return hub.lfs_uploads[repo], hub.lfs_bytes[repo], hub.commits[repo], hub.committed_files[repo]


def test_fixture_points_the_client_at_the_server(hub_server):
    from huggingface_hub.hf_api import api
    from huggingface_hub.utils._runtime import is_xet_available

    assert hub_server.url.startswith("http://127.0.0.1:")
    assert constants.ENDPOINT == os.environ["HF_ENDPOINT"] == hub_server.url
    assert api.endpoint == hub_server.url  # the HfApi instance behind huggingface_hub.create_repo & co
    assert hf_hub_url(REPO, "x.json").startswith(hub_server.url + "/")
    assert not is_xet_available()  # uploads take the LFS route
    assert Path(constants.HF_HUB_CACHE) == hub_server.cache_dir
    assert hub_server.cache_dir.is_relative_to(hub_server.hf_home)
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert huggingface_hub.whoami()["name"] == hub_server.user


def test_client_env_is_restored(tmp_path):
    from huggingface_hub.hf_api import api

    before = (constants.ENDPOINT, constants.HF_HUB_CACHE, constants.HF_HUB_DISABLE_XET, api.endpoint)
    env_before = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HOME", "HF_TOKEN", "HF_HUB_DISABLE_XET")}
    with HubServer(tmp_path / "hub") as hub, hub_client_env(hub.url, tmp_path / "home"):
        assert constants.ENDPOINT == hub.url
        assert create_repo("test-user/x").repo_id == "test-user/x"
    assert (constants.ENDPOINT, constants.HF_HUB_CACHE, constants.HF_HUB_DISABLE_XET, api.endpoint) == before
    assert {k: os.environ.get(k) for k in env_before} == env_before
    # The storage outlives the server: a new server on the same folder serves the same repo.
    with HubServer(tmp_path / "hub") as hub, hub_client_env(hub.url, tmp_path / "home2"):
        assert list_repo_files("test-user/x") == [".gitattributes"]


def test_create_repo_exist_ok_private_delete(hub_server):
    api = hub_server.api()
    url = create_repo(REPO)
    assert url.repo_id == REPO and url.endpoint == hub_server.url
    assert create_repo(REPO, exist_ok=True).repo_id == REPO
    with pytest.raises(HfHubHTTPError) as e:
        create_repo(REPO)
    assert e.value.response.status_code == 409
    # Like the real Hub, a new repo has one commit holding a .gitattributes with the LFS patterns.
    assert list_repo_files(REPO) == [".gitattributes"]
    assert "*.safetensors filter=lfs" in hub_server.read_file(REPO, ".gitattributes").decode()
    # No namespace: the repo goes to the token's user.
    assert api.create_repo("bare-name").repo_id == f"{hub_server.user}/bare-name"
    # Private repos are hidden from anonymous requests.
    create_repo("test-org/secret", private=True)
    assert model_info("test-org/secret").private is True
    with pytest.raises(RepositoryNotFoundError):
        model_info("test-org/secret", token=False)
    assert api.repo_exists(REPO)
    api.delete_repo(REPO)
    assert not api.repo_exists(REPO)
    api.delete_repo(REPO, missing_ok=True)
    with pytest.raises(RepositoryNotFoundError):
        model_info(REPO)


def test_upload_folder_goes_through_lfs_and_commit(published, hub_server):
    folder, commit = published
    weights = (folder / "model.safetensors").read_bytes()
    # One LFS object (the safetensors file), one commit with three files.
    assert counters(hub_server) == (1, len(weights), 1, 3)
    assert set(list_repo_files(REPO)) == {".gitattributes", "README.md", "config.json", "model.safetensors"}
    assert commit.oid == hub_server.head(REPO)

    info = model_info(REPO, files_metadata=True)
    assert info.sha == commit.oid
    assert "turboquant" in info.tags and info.card_data.license == "apache-2.0"
    siblings = {s.rfilename: s for s in info.siblings}
    st = siblings["model.safetensors"]
    assert st.size == len(weights)
    assert st.lfs is not None and st.lfs.sha256 == hashlib.sha256(weights).hexdigest()
    assert st.lfs.size == len(weights)
    cfg = siblings["config.json"]
    assert cfg.lfs is None and cfg.size == (folder / "config.json").stat().st_size
    assert cfg.blob_id == hashlib.sha1(b"blob %d\0" % cfg.size + (folder / "config.json").read_bytes()).hexdigest()

    api = hub_server.api()
    tree = {e.path: e for e in api.list_repo_tree(REPO, recursive=True, expand=True)}
    assert tree["model.safetensors"].lfs.sha256 == st.lfs.sha256
    assert tree["model.safetensors"].last_commit.oid == commit.oid
    assert api.file_exists(REPO, "config.json")
    assert not api.file_exists(REPO, "missing.json")
    assert [c.title for c in api.list_repo_commits(REPO)] == ["Publish", "initial commit"]


def test_hf_hub_download_and_snapshot_download(published, hub_server, tmp_path):
    folder, commit = published
    path = Path(hf_hub_download(REPO, "model.safetensors"))
    assert path.read_bytes() == (folder / "model.safetensors").read_bytes()
    assert path.is_relative_to(hub_server.cache_dir) and commit.oid in path.parts
    # Pinned to a commit hash.
    cfg = hf_hub_download(REPO, "config.json", revision=commit.oid)
    assert Path(cfg).read_text() == (folder / "config.json").read_text()

    snap = Path(snapshot_download(REPO, cache_dir=tmp_path / "fresh-cache"))
    assert snap.is_relative_to(tmp_path / "fresh-cache") and snap.name == commit.oid
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (snap / name).read_bytes() == (folder / name).read_bytes()

    local = Path(snapshot_download(REPO, local_dir=tmp_path / "local", allow_patterns=["*.json"]))
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["config.json"]

    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "nope.bin")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("test-user/no-such-repo", "config.json")


def test_range_requests_read_the_safetensors_header(published):
    folder, commit = published
    data = (folder / "model.safetensors").read_bytes()
    url = hf_hub_url(REPO, "model.safetensors")
    session, headers = get_session(), build_hf_headers()

    r = session.get(url, headers={**headers, "Range": "bytes=0-7"})
    assert r.status_code == 206 and r.content == data[:8]
    assert r.headers["Content-Range"] == f"bytes 0-7/{len(data)}"
    (n,) = struct.unpack("<Q", r.content)
    r = session.get(url, headers={**headers, "Range": f"bytes=8-{8 + n - 1}"})
    assert r.status_code == 206
    header = json.loads(r.content)
    assert header["model.layers.0.weight"]["shape"] == [64, 32]
    assert header["__metadata__"] == {"format": "turboquant"}

    assert session.get(url, headers={**headers, "Range": "bytes=-4"}).content == data[-4:]
    assert session.get(url, headers={**headers, "Range": f"bytes={len(data)}-"}).status_code == 416
    full = session.get(url, headers=headers)
    assert full.status_code == 200 and full.content == data

    meta = get_hf_file_metadata(url)
    assert meta.commit_hash == commit.oid
    assert meta.etag == hashlib.sha256(data).hexdigest() and meta.size == len(data)
    # huggingface_hub's own range-request reader works too.
    st = huggingface_hub.get_safetensors_metadata(REPO)
    assert st.files_metadata["model.safetensors"].tensors["model.layers.0.scales"].dtype == "F16"


def test_reupload_of_identical_folder_uploads_nothing(published, hub_server):
    folder, commit = published
    before = counters(hub_server)
    again = upload_folder(repo_id=REPO, folder_path=folder, commit_message="Publish again")
    assert again.oid == commit.oid  # no new commit
    assert counters(hub_server) == before
    assert hub_server.head(REPO) == commit.oid

    # Change only the JSON: a commit with one file, no LFS upload.
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    changed = upload_folder(repo_id=REPO, folder_path=folder)
    assert changed.oid != commit.oid
    lfs, lfs_bytes, commits, files = before
    assert counters(hub_server) == (lfs, lfs_bytes, commits + 1, files + 1)


def test_create_commit_deletions_parent_commit_pr_and_branch(published, hub_server):
    folder, commit = published
    api = hub_server.api()
    ci = api.create_commit(
        REPO,
        operations=[
            CommitOperationAdd("extra/a.txt", b"a"),
            CommitOperationAdd("extra/b.bin", b"\x00\x01binary"),  # binary content: LFS
            CommitOperationDelete("config.json"),
        ],
        commit_message="Edit",
        parent_commit=commit.oid,
    )
    files = hub_server.list_files(REPO)
    assert "config.json" not in files and files["extra/b.bin"]["lfs"] is not None
    assert files["extra/a.txt"]["lfs"] is None
    assert sorted(e.path for e in api.list_repo_tree(REPO, path_in_repo="extra")) == ["extra/a.txt", "extra/b.bin"]
    # A stale parent commit is refused; deleting a missing file is an EntryNotFound.
    with pytest.raises(HfHubHTTPError) as e:
        api.create_commit(REPO, [CommitOperationAdd("c.txt", b"c")], commit_message="x", parent_commit=commit.oid)
    assert e.value.response.status_code == 412
    with pytest.raises(RemoteEntryNotFoundError):
        api.create_commit(REPO, [CommitOperationDelete("gone.txt")], commit_message="x")
    api.create_commit(REPO, [CommitOperationDelete("extra/")], commit_message="Drop folder")
    assert not any(p.startswith("extra/") for p in hub_server.list_files(REPO))

    pr = api.create_commit(REPO, [CommitOperationAdd("pr.txt", b"pr")], commit_message="PR", create_pr=True)
    assert pr.pr_revision == "refs/pr/1"
    assert Path(hf_hub_download(REPO, "pr.txt", revision="refs/pr/1")).read_bytes() == b"pr"
    assert not api.file_exists(REPO, "pr.txt")  # main untouched

    api.create_branch(REPO, branch="dev", revision=ci.oid)
    api.upload_file(path_or_fileobj=b"dev", path_in_repo="dev.txt", repo_id=REPO, revision="dev")
    assert api.file_exists(REPO, "dev.txt", revision="dev") and not api.file_exists(REPO, "dev.txt")
    api.create_tag(REPO, tag="v1", revision="dev")
    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert {b.name for b in refs.branches} == {"main", "dev"}
    assert [t.name for t in refs.tags] == ["v1"] and refs.pull_requests[0].ref == "refs/pr/1"
    assert [p.path for p in api.get_paths_info(REPO, ["dev.txt", "nope"], revision="v1")] == ["dev.txt"]


def test_offline_mode_loads_from_cache(published, hub_server):
    folder, commit = published
    online_file = hf_hub_download(REPO, "model.safetensors")
    online_snap = snapshot_download(REPO)
    n_requests = len(hub_server.requests)
    with hub_server.offline():
        assert huggingface_hub.is_offline_mode()
        assert hf_hub_download(REPO, "model.safetensors") == online_file
        assert snapshot_download(REPO) == online_snap
        with pytest.raises(LocalEntryNotFoundError):
            hf_hub_download(REPO, "never-downloaded.json")
    assert len(hub_server.requests) == n_requests  # nothing reached the server
    assert not huggingface_hub.is_offline_mode()


def test_multipart_upload_and_required_token(tmp_path):
    blob = os.urandom(5000)
    with (
        HubServer(tmp_path / "hub", token="secret", multipart_chunk_size=2048) as hub,
        hub_client_env(hub.url, tmp_path / "home", token="secret"),
    ):
        api = HfApi()
        api.create_repo("test-user/big")
        api.upload_file(path_or_fileobj=blob, path_in_repo="big.bin", repo_id="test-user/big")
        assert hub.lfs_uploads["test-user/big"] == 1
        assert sum(1 for m, p in hub.requests if m == "PUT" and "/part/" in p) == 3
        assert Path(hf_hub_download("test-user/big", "big.bin")).read_bytes() == blob
        with pytest.raises(HfHubHTTPError) as e:
            HfApi(token="wrong").model_info("test-user/big")
        assert e.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError):
            HfApi(token=False).create_repo("test-user/anon")

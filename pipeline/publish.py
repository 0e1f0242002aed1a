"""Publish TurboQuant repos to the Hugging Face Hub, as plain functions.

`publish_repo(folder, repo_id)` checks the folder is a finished conversion, makes sure its
model card is there, creates the Hub repo, compares every local file with the Hub's copy
(sha256 for LFS files, the git blob id for the others) and uploads only what differs, with
`huggingface_hub`'s `upload_folder`. The conversion state (`.turboquant/`) is never
uploaded. A rerun uploads nothing when nothing changed (no commit either), and an upload
cut short resumes: the Hub keeps LFS objects it already received, so only what is missing
is sent again. `publish_many` does a batch in threads; `publish_flow.py` is the same batch
as a Prefect flow with one task per repo.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from turboquant.manifests.schema import (INDEX_FILE, MANIFEST_FILE, QUANT_METHOD,
                                         READ_VERSIONS)

from .errors import ConversionError, network_reason
from .ledger import WORK, atomic_write

# never uploaded: the conversion state, temporary files of an atomic write, git and caches
IGNORE = [f"{WORK}/**", f"{WORK}", "*.tmp", ".git/**", ".cache/**", ".DS_Store"]
HASH_CACHE = "publish-hashes.json"  # in OUTPUT/.turboquant/: skip re-hashing unchanged files
# huggingface_hub warns about any .parquet in a model repo; manifest.parquet belongs there
_DATA_FILE_WARNING = "It seems that you are about to commit a data file"


log = logging.getLogger("turboquant.publish")  # one line per repo: what, then how it went


class PublishError(ConversionError):
    """A folder cannot be published; the message names the folder and what to do."""


@dataclass
class LocalFile:
    path: str  # relative, with "/"
    size: int
    sha256: str
    git_oid: str  # git blob sha1, what the Hub reports for a regular (non-LFS) file


@dataclass
class PublishResult:
    repo_id: str
    folder: str
    url: str = ""
    status: str = ""  # "uploaded", "up to date", "dry run", "failed"
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    bytes: int = 0  # bytes of the files uploaded (or that would be)
    commit: str | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status != "failed"


# ------------------------------------------------------------------------ the folder


def check_folder(folder: Path) -> dict:
    """A finished TurboQuant conversion? Returns its config.json; raises PublishError."""
    if not folder.is_dir():
        raise PublishError(f"{folder}: no such folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PublishError(f"{folder}: cannot read config.json ({e}); publish the output "
                           "folder of `turboquant convert`") from None
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != QUANT_METHOD:
        raise PublishError(f"{folder}: config.json has no TurboQuant quantization_config; "
                           "publish the output folder of `turboquant convert`")
    if q.get("format_version") not in READ_VERSIONS:
        raise PublishError(f"{folder}: format version {q.get('format_version')!r}, this "
                           f"version of turboquant publishes versions "
                           f"{' and '.join(map(str, READ_VERSIONS))}")
    work = folder / WORK
    if work.exists() and not (work / "complete").exists():
        raise PublishError(f"{folder}: the conversion is not finished ({WORK}/complete is "
                           "missing); rerun the same `turboquant convert` command first")
    missing = [f for f in (INDEX_FILE, MANIFEST_FILE) if not (folder / f).exists()]
    if not missing:
        index = json.loads((folder / INDEX_FILE).read_text())
        missing = sorted({s for s in index.get("weight_map", {}).values()
                          if not (folder / s).exists()})
    if missing:
        raise PublishError(f"{folder}: incomplete repo, missing {', '.join(missing[:5])}; "
                           "rerun `turboquant convert` on it")
    return config


def card_from_manifest(folder: Path, base_model: str | None = None) -> str:
    """The model card the pipeline writes (pipeline/card.py), rebuilt from the repo's own
    files: config.json's quantization_config and manifest.parquet (bits, errors)."""
    from turboquant.manifests.schema import read_manifest

    from .card import model_card
    from .repo import RepoSummary

    config = json.loads((folder / "config.json").read_text())
    q = config["quantization_config"]
    rows = read_manifest(folder).to_pylist()
    coded = [r for r in rows if r["codec"] != "raw"]
    shards = sorted({r["shard"] for r in rows})

    def numel(r):
        n = 1
        for d in r["shape"]:
            n *= d
        return n

    summary = RepoSummary(
        tensors=len(rows), coded_tensors=len(coded),
        coded_weights=sum(numel(r) for r in coded),
        coded_bytes=sum(r["byte_end"] - r["byte_start"] for r in coded),
        total_weights=sum(numel(r) for r in rows),
        total_bytes=sum(r["byte_end"] - r["byte_start"] for r in rows),
        files_bytes=sum((folder / s).stat().st_size for s in shards), shards=len(shards))
    source_config = {k: v for k, v in config.items() if k != "quantization_config"}
    recipe = SimpleNamespace(name=q.get("recipe"), bits=q.get("bits"),
                             group_size=q.get("group_size"), model_seed=q.get("model_seed"))
    plan = SimpleNamespace(config=source_config, recipe=recipe,
                           recipe_hash=q.get("recipe_hash", ""),
                           format_version=q.get("format_version"))
    return model_card(plan, rows, summary, base_model)


def _has_card(folder: Path) -> bool:
    try:
        text = (folder / "README.md").read_text()
    except OSError:
        return False
    head = text.split("\n---", 1)[0]
    return text.startswith("---") and "library_name: mlx" in head


def ensure_card(folder: Path, base_model: str | None = None) -> bool:
    """Write README.md from the manifest when it is missing (or when `base_model` is given,
    to name the source model in the card's metadata). True if it was written."""
    if base_model is None and _has_card(folder):
        return False
    atomic_write(folder / "README.md", card_from_manifest(folder, base_model).encode())
    return True


def _ignored(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in IGNORE)


def _hash_file(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, in one pass."""
    size = path.stat().st_size
    sha, git = hashlib.sha256(), hashlib.sha1()
    git.update(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
            git.update(chunk)
    return sha.hexdigest(), git.hexdigest()


def local_files(folder: Path, save_hashes: bool = True) -> list[LocalFile]:
    """Every file to publish with its hashes. Hashes of files unchanged since the last call
    (same size and mtime) are reused from OUTPUT/.turboquant/publish-hashes.json, which is
    updated unless `save_hashes` is False (a dry run writes nothing)."""
    work = folder / WORK
    cache_path = work / HASH_CACHE
    try:
        cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    except ValueError:
        cache = {}
    out, fresh = [], {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if not p.is_file() or _ignored(rel):
            continue
        st = p.stat()
        hit = cache.get(rel)
        if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
            sha, git = hit["sha256"], hit["git_oid"]
        else:
            sha, git = _hash_file(p)
        fresh[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha,
                      "git_oid": git}
        out.append(LocalFile(rel, st.st_size, sha, git))
    if save_hashes and work.is_dir() and fresh != cache:
        atomic_write(cache_path, json.dumps(fresh, indent=1, sort_keys=True).encode())
    return out


# ------------------------------------------------------------------------ the Hub


def _api(api=None):
    if api is not None:
        return api
    from huggingface_hub import HfApi

    return HfApi()  # built at call time: HF_ENDPOINT / HF_TOKEN as they are now


def remote_files(api, repo_id: str, revision: str | None = None) -> dict:
    """{path: RepoFile} of the repo at `revision` ({} for an empty repo or a new branch)."""
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        entries = api.list_repo_tree(repo_id, recursive=True, revision=revision)
        return {e.path: e for e in entries if hasattr(e, "blob_id")}
    except (RevisionNotFoundError, EntryNotFoundError):
        return {}


def same_content(local: LocalFile, remote) -> bool:
    if remote is None or remote.size != local.size:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == local.sha256
    return remote.blob_id == local.git_oid


def _pattern(rel: str) -> str:
    """An fnmatch pattern matching exactly `rel`."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in rel)


def publish_repo(folder: str | os.PathLike, repo_id: str, *, private: bool = False,
                 dry_run: bool = False, base_model: str | None = None, prune: bool = False,
                 revision: str | None = None, commit_message: str | None = None,
                 api=None) -> PublishResult:
    """Publish one output folder to `repo_id`; uploads only files that differ from the Hub.

    `prune` also deletes files of the Hub repo that the folder no longer has (e.g. shards
    of an earlier conversion with another layout). Raises PublishError or the client's
    HTTP errors; a rerun after a failure resumes.
    """
    t0 = time.monotonic()
    warnings.filterwarnings("ignore", message=_DATA_FILE_WARNING, category=UserWarning)
    folder = Path(folder).resolve()
    res = PublishResult(repo_id, str(folder))
    check_folder(folder)
    if not dry_run:
        ensure_card(folder, base_model)
    api = _api(api)
    files = local_files(folder, save_hashes=not dry_run)
    if dry_run and (base_model is not None or not _has_card(folder)):
        card = card_from_manifest(folder, base_model).encode()  # what would be written
        files = [f for f in files if f.path != "README.md"]
        files.append(LocalFile("README.md", len(card), hashlib.sha256(card).hexdigest(),
                               hashlib.sha1(b"blob %d\0" % len(card) + card).hexdigest()))
    endpoint = getattr(api, "endpoint", None) or "https://huggingface.co"
    try:
        exists = api.repo_exists(repo_id)
    except Exception as e:  # noqa: BLE001 - reported as not existing, create_repo says why
        reason = network_reason(e)
        if dry_run and reason is not None:  # nothing else would say the comparison failed
            raise PublishError(f"could not reach the Hugging Face Hub at {endpoint} ({reason}) "
                               "to compare the folder with the repo; nothing was written") from None
        exists = False
    remote = remote_files(api, repo_id, revision) if exists else {}
    for f in files:
        (res.skipped if same_content(f, remote.get(f.path)) else res.uploaded).append(f.path)
    up = set(res.uploaded)
    res.bytes = sum(f.size for f in files if f.path in up)
    if prune:
        local = {f.path for f in files}
        res.deleted = sorted(p for p in remote if p not in local and p != ".gitattributes")
    res.url = f"{endpoint.rstrip('/')}/{repo_id}"
    log.info("%s: %d of %d files to upload (%s)%s", repo_id, len(res.uploaded), len(files),
             _size(res.bytes), f", {len(res.deleted)} to delete" if res.deleted else "")
    if dry_run:
        res.status = "dry run"
        res.seconds = time.monotonic() - t0
        return res
    res.url = str(api.create_repo(repo_id, private=private, exist_ok=True))
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    if not res.uploaded and not res.deleted:
        res.status = "up to date"
        res.seconds = time.monotonic() - t0
        return res
    if not res.uploaded:  # only deletions: nothing to upload, one commit
        from huggingface_hub import CommitOperationDelete

        info = api.create_commit(repo_id, [CommitOperationDelete(p) for p in res.deleted],
                                 commit_message=commit_message or "Remove stale files",
                                 revision=revision)
    else:
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), revision=revision,
            allow_patterns=[_pattern(p) for p in res.uploaded], ignore_patterns=IGNORE,
            delete_patterns=[_pattern(p) for p in res.deleted] or None,
            commit_message=commit_message or f"Upload TurboQuant repo ({len(res.uploaded)} "
                                             "files) with turboquant publish")
    res.commit = getattr(info, "oid", None)
    res.status = "uploaded"
    res.seconds = time.monotonic() - t0
    log.info("%s: uploaded in %.1f s (commit %s)", repo_id, res.seconds, (res.commit or "-")[:12])
    return res


# ------------------------------------------------------------------------ batches


def repo_ids_for(outputs: list[str], repo_id: str | None = None, org: str | None = None
                 ) -> list[str]:
    """`--repo-id` names one repo (one output); `--org` names `ORG/<folder name>` each."""
    if (repo_id is None) == (org is None):
        raise PublishError("give either --repo-id ID (one output) or --org ORG")
    if repo_id is not None:
        if len(outputs) != 1:
            raise PublishError(f"--repo-id names one repo but {len(outputs)} outputs were "
                               "given; use --org ORG to publish each as ORG/<folder name>")
        if repo_id.count("/") != 1:
            raise PublishError(f"--repo-id {repo_id!r}: expected ORG/NAME")
        return [repo_id]
    if "/" in org:
        raise PublishError(f"--org {org!r}: an organisation or user name, without '/'")
    ids = [f"{org}/{Path(o).resolve().name}" for o in outputs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise PublishError(f"two outputs would publish to the same repo ({', '.join(dup)}): "
                           "rename a folder or publish it with --repo-id")
    return ids


def failed(repo_id: str, folder: str, error: BaseException | str) -> PublishResult:
    msg = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return PublishResult(repo_id, str(folder), status="failed", error=msg)


def publish_many(outputs: list[str], repo_ids: list[str], concurrency: int = 4,
                 **options) -> list[PublishResult]:
    """Publish several folders, `concurrency` at a time, without Prefect. A failure is
    reported in its result; the other repos go on."""
    def one(pair):
        out, rid = pair
        try:
            return publish_repo(out, rid, **options)
        except Exception as e:  # noqa: BLE001 - reported per repo
            return failed(rid, out, e)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as ex:
        return list(ex.map(one, zip(outputs, repo_ids)))


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def summary_table(results: list[PublishResult], dry_run: bool = False) -> str:
    """One line per repo: id, files uploaded / skipped, bytes, url, status."""
    head = ("repo", "uploaded", "skipped", "bytes", "url", "status")
    rows = []
    for r in results:
        status = r.status if r.ok else f"failed: {r.error}"
        if r.deleted and r.ok:
            status += f" ({len(r.deleted)} deleted)"
        rows.append((r.repo_id, str(len(r.uploaded)), str(len(r.skipped)), _size(r.bytes),
                     r.url or "-", status))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) if i in (0, 4, 5) else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line(["-" * w for w in widths]), *map(line, rows)]
    ok = sum(r.ok for r in results)
    total = sum(r.bytes for r in results if r.ok)
    planned = dry_run or any(r.status == "dry run" for r in results)
    out.append(f"{ok} of {len(results)} repos ok, {_size(total)} "
               f"{'to upload' if planned else 'uploaded'}")
    return "\n".join(out)

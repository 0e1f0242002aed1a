"""Checkpoint sources: a local Hugging Face folder, or a Hub repo through `huggingface_hub`.

A source answers metadata questions without reading tensor data (config.json, the index,
every shard's safetensors header, a stable identity per shard), and hands out a local path
for one shard when a job needs its bytes. A Hub source reads headers with HTTP range
requests, downloads shards one at a time when a job asks for them, and can delete a
downloaded shard once every job that reads it is done (for disks smaller than the model).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

from .errors import ConversionError, HubUnreachable, SourceError, reaching_hub
from .safetensors_io import SafetensorsHeader, header_length, parse_header, read_header

INDEX_FILE = "model.safetensors.index.json"
# Files copied to the output unchanged (tokenizer, generation defaults, chat templates).
AUX_FILE = re.compile(
    r"^(tokenizer[^/]*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|"
    r"merges\.txt|generation_config\.json|chat_template(\.json|\.jinja)?|[^/]*\.tiktoken|"
    r"tiktoken\.model|preprocessor_config\.json)$"
)


def is_aux_file(name: str) -> bool:
    return bool(AUX_FILE.match(name)) and not name.endswith(".py")


class Source:
    """What the planner and the jobs need from a checkpoint."""

    kind = "abstract"
    description = ""

    def config(self) -> dict:
        raise NotImplementedError

    def index(self) -> dict | None:
        """The parsed model.safetensors.index.json, or None for a single-file checkpoint."""
        raise NotImplementedError

    def shard_files(self) -> list[str]:
        raise NotImplementedError

    def header(self, file: str) -> SafetensorsHeader:
        raise NotImplementedError

    def identity(self, file: str) -> dict:
        """A stable description of one shard (for resume checks and cache keys)."""
        raise NotImplementedError

    def local_path(self, file: str) -> Path:
        """A local path to the shard's bytes (downloads it first for a Hub source)."""
        raise NotImplementedError

    def release(self, file: str) -> bool:
        """Delete a downloaded shard if this source may; True if deleted."""
        return False

    def aux_files(self) -> list[str]:
        raise NotImplementedError

    def aux_path(self, name: str) -> Path:
        raise NotImplementedError

    def base_model(self) -> str | None:
        """A Hub repo id for the model card's `base_model`, when known."""
        return None


def _load_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise SourceError(path.name, f"missing ({what})") from None
    except json.JSONDecodeError as e:
        raise SourceError(path.name, f"is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise SourceError(path.name, "is not a JSON object")
    return obj


def _index_files(index: dict, where: str) -> list[str]:
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise SourceError(where, "has no 'weight_map' object; the index is corrupted")
    return sorted(set(wm.values()))


class LocalSource(Source):
    """A local folder in Hugging Face layout."""

    kind = "local"

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise ConversionError(f"source {folder} is not a folder (nor a Hub repo id)")
        self.description = str(self.folder)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._index = None
        if (self.folder / INDEX_FILE).exists():
            self._index = _load_json(self.folder / INDEX_FILE, "the shard index")
            self._files = _index_files(self._index, INDEX_FILE)
        else:
            self._files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not self._files:
            raise ConversionError(f"{self.folder}: no *.safetensors files (and no {INDEX_FILE})")

    def config(self) -> dict:
        return _load_json(self.folder / "config.json", "every checkpoint needs a config.json")

    def index(self) -> dict | None:
        return self._index

    def shard_files(self) -> list[str]:
        return list(self._files)

    def header(self, file: str) -> SafetensorsHeader:
        if file not in self._headers:
            path = self.folder / file
            if not path.exists():
                raise SourceError(file, f"is listed in {INDEX_FILE} but does not exist in "
                                        f"{self.folder}")
            self._headers[file] = read_header(path, file)
        return self._headers[file]

    def identity(self, file: str) -> dict:
        h = self.header(file)
        return {"file": file, "size": h.file_size, "header_sha256": h.sha256,
                "sample_sha256": sampled_content_sha256(self.folder / file, h)}

    def local_path(self, file: str) -> Path:
        return self.folder / file

    def aux_files(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if p.is_file() and is_aux_file(p.name))

    def aux_path(self, name: str) -> Path:
        return self.folder / name

    def base_model(self) -> str | None:
        # a folder from the HF cache: .../models--org--name/snapshots/<sha>
        for part in self.folder.parts:
            if part.startswith("models--"):
                return part[len("models--"):].replace("--", "/", 1)
        return None


# A shard's contents, sampled: a fine-tune has the same size and header as its base model,
# so its identity needs some of its bytes. These ranges (a few per tensor, and blocks
# spread over the data) cost about 1 MiB of reads per shard and differ between any two
# checkpoints whose weights differ throughout, as those of a fine-tune do.
SAMPLE_EDGE = 64  # bytes at a tensor's start, middle and end
SAMPLE_BLOCKS = 32  # blocks spread evenly over the data section...
SAMPLE_BLOCK = 32 << 10  # ... of this many bytes
SAMPLE_GAP = 4 << 10  # ranges closer than this are read as one


def sample_ranges(header: SafetensorsHeader) -> list[tuple[int, int]]:
    """The byte ranges of a shard that `sampled_content_sha256` reads, sorted, merged."""
    ranges = []
    for t in header.tensors.values():
        if t.end > t.start:
            mid = (t.start + t.end) // 2
            for a in (t.start, mid, t.end - SAMPLE_EDGE):
                a = max(t.start, min(a, t.end))
                ranges.append((a, min(t.end, a + SAMPLE_EDGE)))
    lo, hi = header.data_start, header.file_size
    if hi > lo:
        step = max(1, (hi - lo) // SAMPLE_BLOCKS)
        ranges += [(a, min(hi, a + SAMPLE_BLOCK)) for a in range(lo, hi, step)][:SAMPLE_BLOCKS]
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + SAMPLE_GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def sampled_content_sha256(path: Path, header: SafetensorsHeader) -> str:
    """sha256 over the shard's header and its bytes at `sample_ranges`, with their offsets."""
    h = hashlib.sha256(f"turboquant-sample-1/{header.file_size}/{header.sha256}".encode())
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SourceError(header.file, f"cannot open ({e.strerror})") from None
    try:
        for a, b in sample_ranges(header):
            data = os.pread(fd, b - a, a)
            if len(data) != b - a:
                raise SourceError(header.file, f"file ended at byte {a + len(data)} (wanted "
                                               f"{b}): the file is truncated or changed")
            h.update(f"{a}:{b}:".encode())
            h.update(data)
    finally:
        os.close(fd)
    return h.hexdigest()


class HubSource(Source):
    """A Hub model repo, read through huggingface_hub (HF_ENDPOINT, HF_TOKEN honoured).

    Metadata comes first (repo info, config, index, headers by range requests); shard bytes
    are downloaded by `local_path`, one file at a time, into `download_dir` (or the HF
    cache when it is None). With `delete_after`, `release` deletes a downloaded shard.
    """

    kind = "hub"

    def __init__(self, repo_id: str, revision: str | None = None,
                 download_dir: str | os.PathLike | None = None, delete_after: bool = False,
                 token: str | None = None):
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        self.repo_id = repo_id
        self.api = HfApi(token=token)
        self.token = token
        self.download_dir = Path(download_dir) if download_dir else None
        self.delete_after = delete_after
        if delete_after and self.download_dir is None:
            raise ConversionError("deleting source shards needs a download folder of our own")
        try:
            with reaching_hub(repo_id):
                info = self.api.model_info(repo_id, revision=revision, files_metadata=True)
        except RepositoryNotFoundError:
            raise ConversionError(f"Hub repo {repo_id!r} not found (check the id, HF_TOKEN and "
                                  "HF_ENDPOINT)") from None
        except HfHubHTTPError as e:
            raise ConversionError(f"Hub repo {repo_id!r}: {e}") from None
        self.commit = info.sha
        self.description = f"{repo_id}@{self.commit}"
        self._siblings = {s.rfilename: s for s in (info.siblings or [])}
        self._headers: dict[str, SafetensorsHeader] = {}
        self._lock = threading.Lock()
        self._index = None
        if INDEX_FILE in self._siblings:
            self._index = _load_json(self._small(INDEX_FILE), "the shard index")
            self._files = _index_files(self._index, INDEX_FILE)
        else:
            self._files = sorted(n for n in self._siblings if n.endswith(".safetensors")
                                 and "/" not in n)
        if not self._files:
            raise ConversionError(f"Hub repo {self.description}: no *.safetensors files")

    def _small(self, name: str) -> Path:
        from huggingface_hub import hf_hub_download

        with reaching_hub(self.repo_id):
            return Path(hf_hub_download(self.repo_id, name, revision=self.commit,
                                        token=self.token))

    def config(self) -> dict:
        if "config.json" not in self._siblings:
            raise SourceError("config.json", f"missing from Hub repo {self.description}")
        return _load_json(self._small("config.json"), "config.json")

    def index(self) -> dict | None:
        return self._index

    def shard_files(self) -> list[str]:
        return list(self._files)

    def _size(self, file: str) -> int:
        s = self._siblings.get(file)
        if s is None:
            raise SourceError(file, f"is listed in {INDEX_FILE} but is not in Hub repo "
                                    f"{self.description}")
        if s.lfs is not None and getattr(s.lfs, "size", None):
            return int(s.lfs.size)
        if s.size is None:
            raise SourceError(file, "the Hub did not report its size")
        return int(s.size)

    def _range(self, file: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a repo file through an HTTP range request."""
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.repo_id, file, revision=self.commit)
        headers = build_hf_headers(token=self.token)
        headers["Range"] = f"bytes={start}-{end - 1}"
        with reaching_hub(self.repo_id):
            r = get_session().get(url, headers=headers, follow_redirects=True)
        if r.status_code not in (200, 206):
            raise SourceError(file, f"range request failed with HTTP {r.status_code}")
        data = r.content
        if r.status_code == 200:  # server ignored the range
            data = data[start:end]
        if len(data) != end - start:
            raise SourceError(file, f"range request returned {len(data)} bytes, wanted "
                                    f"{end - start}: the file is truncated")
        return data

    def header(self, file: str) -> SafetensorsHeader:
        with self._lock:
            if file in self._headers:
                return self._headers[file]
        size = self._size(file)
        local = self._downloaded(file)
        if local is not None:
            h = read_header(local, file)
        else:
            n = header_length(self._range(file, 0, min(8, size)), file, size)
            h = parse_header(self._range(file, 8, 8 + n), file, size)
        with self._lock:
            self._headers[file] = h
        return h

    def identity(self, file: str) -> dict:
        s = self._siblings.get(file)
        lfs = getattr(s, "lfs", None) if s else None
        return {"repo": self.repo_id, "commit": self.commit, "file": file,
                "size": self._size(file), "sha256": getattr(lfs, "sha256", None),
                "header_sha256": self.header(file).sha256}

    def _downloaded(self, file: str) -> Path | None:
        if self.download_dir is not None:
            p = self.download_dir / file
            if p.exists() and p.stat().st_size == self._size(file):
                return p
        return None

    def local_path(self, file: str) -> Path:
        from huggingface_hub import hf_hub_download

        kw = {"local_dir": str(self.download_dir)} if self.download_dir else {}
        with reaching_hub(self.repo_id):
            p = Path(hf_hub_download(self.repo_id, file, revision=self.commit, token=self.token,
                                     **kw))
        if p.stat().st_size != self._size(file):
            raise SourceError(file, f"downloaded {p.stat().st_size} bytes, the Hub says "
                                    f"{self._size(file)}: the download is truncated")
        return p

    def release(self, file: str) -> bool:
        if not (self.delete_after and self.download_dir):
            return False
        p = self.download_dir / file
        if p.exists():
            p.unlink()
            return True
        return False

    def aux_files(self) -> list[str]:
        return sorted(n for n in self._siblings if "/" not in n and is_aux_file(n))

    def aux_path(self, name: str) -> Path:
        return self._small(name)

    def base_model(self) -> str | None:
        return self.repo_id


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def open_source(spec: str, *, revision: str | None = None, download_dir=None,
                delete_after: bool = False) -> Source:
    """A local folder if `spec` is one, else a Hub repo id ("org/name")."""
    if os.path.isdir(spec):
        if delete_after:
            raise ConversionError("--delete-source applies to Hub sources only (it never "
                                  "deletes files of a local folder)")
        return LocalSource(spec)
    if os.path.exists(spec):
        raise ConversionError(f"source {spec} is a file; give the checkpoint's folder (the one "
                              "with config.json and the *.safetensors files)")
    why = _local_path_reason(spec)
    if why is not None:
        raise ConversionError(f"source folder {spec} does not exist (read as a local path, not "
                              f"a Hub repo id: {why}); check the path")
    if _REPO_ID.match(spec):
        cached = _cached_snapshot(spec, revision, download_dir)
        if cached is not None:
            return cached
        return HubSource(spec, revision=revision, download_dir=download_dir,
                         delete_after=delete_after)
    raise ConversionError(f"source {spec!r} is neither a local folder nor a Hub repo id "
                          "(org/name)")


def _cached_snapshot(repo_id: str, revision: str | None, download_dir) -> Source | None:
    """With HF_HUB_OFFLINE set, the repo as the local Hugging Face cache (or the download
    folder) holds it: a LocalSource on its snapshot folder, whose path names the repo (the
    model card's base_model) and the commit. None when the Hub may be used. A repo not in the
    cache, or only partly (a run that read only its headers), is one line saying so."""
    from huggingface_hub import constants, snapshot_download

    if not constants.HF_HUB_OFFLINE:
        return None
    kw = {"local_dir": str(download_dir)} if download_dir else {}
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, **kw))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and its kin: not cached
        raise HubUnreachable(f"HF_HUB_OFFLINE is set, so Hub repo {repo_id!r} cannot be read; "
                             f"it is not in the local Hugging Face cache "
                             f"({download_dir or constants.HF_HUB_CACHE}): unset HF_HUB_OFFLINE, "
                             "or give a local folder") from None
    shards = _listed_shards(folder)
    missing = [f for f in ("config.json", *shards) if not (folder / f).is_file()]
    if not shards:
        missing.append("*.safetensors")
    if missing:
        raise HubUnreachable(f"HF_HUB_OFFLINE is set and Hub repo {repo_id!r} is only partly in "
                             f"the local Hugging Face cache ({folder}: {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''} missing); unset "
                             "HF_HUB_OFFLINE to download the rest, or give a local folder")
    return LocalSource(folder)


def _listed_shards(folder: Path) -> list[str]:
    index = folder / INDEX_FILE
    if index.is_file():
        return _index_files(_load_json(index, "the shard index"), INDEX_FILE)
    return sorted(p.name for p in folder.glob("*.safetensors"))


def _local_path_reason(spec: str) -> str | None:
    """Why `spec`, which does not exist, must still be a local path; None if it may be a Hub
    repo id."""
    if spec.startswith(("/", "./", "../", "~")) or spec in (".", ".."):
        return "it starts with '/', '.' or '~'"
    first = spec.split("/", 1)[0]
    if first and os.path.isdir(first):
        return f"{first}/ is a folder here"
    return None

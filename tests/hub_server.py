"""A small Hugging Face Hub server on loopback, for tests.

There is no network where the tests run, yet the project publishes to and downloads from the
Hugging Face Hub. This module serves, on 127.0.0.1, the subset of the Hub's HTTP API that the
real ``huggingface_hub`` client (2.x) uses for publishing and downloading model repos, so that
the client library itself is exercised end to end through ``HF_ENDPOINT``.

Standard library only (``http.server.ThreadingHTTPServer``); repos live in a folder on disk and
survive a restart of the server on the same folder.

Two entry points:

* :class:`HubServer`: the server. ``HubServer(root).start()`` (or ``with HubServer(root) as hub``)
  listens on a free port; ``hub.url`` is the endpoint. It counts what clients uploaded and
  committed per repo (``lfs_uploads``, ``lfs_bytes``, ``committed_files``, ``commits``, and
  the raw ``requests`` log) so a test can assert that nothing was re-uploaded.
* :func:`hub_client_env`: a context manager that points the ``huggingface_hub`` client at a
  server: it sets the environment (``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_TOKEN``,
  ``HF_HUB_DISABLE_XET=1``, ...) *and* patches the values ``huggingface_hub`` already read at
  import time (``constants.ENDPOINT``, the module-level ``HfApi`` instance behind
  ``huggingface_hub.upload_folder`` & co, cache paths, ...), and restores everything on exit.
  So it works whether ``huggingface_hub`` was imported before or after it.

Xet: ``huggingface_hub`` chooses the Xet upload protocol purely on the client side (``hf_xet``
installed and ``HF_HUB_DISABLE_XET`` unset); nothing the server answers can steer an upload away
from Xet, and this server does not implement the Xet CAS protocol. :func:`hub_client_env`
therefore sets ``HF_HUB_DISABLE_XET=1`` and ``constants.HF_HUB_DISABLE_XET = True``; uploads then
take the classic route (preupload -> LFS batch -> PUT -> commit). For downloads the server never
sends ``X-Xet-Hash`` headers nor ``xetHash`` tree fields, so downloads are plain HTTP either way.

Routes (``{type}`` is ``models``/``datasets``/``spaces``/``kernels``; ``{prefix}`` is empty for
models and ``datasets/`` etc. otherwise):

* ``GET  /api/whoami-v2``
* ``POST /api/repos/create``, ``DELETE /api/repos/delete``, ``POST /api/validate-yaml``
* ``GET  /api/{type}`` (list, ``author``/``search``/``limit``)
* ``GET  /api/{type}/{repo}`` and ``/api/{type}/{repo}/revision/{rev}`` (``blobs=1`` adds sizes/LFS)
* ``GET  /api/{type}/{repo}/tree/{rev}[/{path}]`` (``recursive``, ``expand``)
* ``POST /api/{type}/{repo}/paths-info/{rev}``
* ``POST /api/{type}/{repo}/preupload/{rev}`` (uploadMode, shouldIgnore, oid)
* ``POST /api/{type}/{repo}/commit/{rev}`` (NDJSON: header, file, lfsFile, deletedFile,
  deletedFolder; ``parentCommit``; ``create_pr=1``)
* ``GET  /api/{type}/{repo}/refs``, ``GET /api/{type}/{repo}/commits/{rev}``
* ``POST|DELETE /api/{type}/{repo}/branch/{branch}``, ``POST /api/{type}/{repo}/tag/{rev}``,
  ``DELETE /api/{type}/{repo}/tag/{tag}``, ``PUT /api/{type}/{repo}/settings``
* ``POST /{prefix}{repo}.git/info/lfs/objects/batch`` (upload and download; basic transfer, or
  multipart when ``multipart_chunk_size`` is set)
* ``PUT|POST|GET /_lfs/...`` object upload (single PUT, multipart parts + completion), verify,
  download
* ``GET|HEAD /{prefix}{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag``,
  ``X-Linked-Etag``/``X-Linked-Size`` (LFS files), ``Content-Length``, ``Accept-Ranges`` and
  single-range ``Range`` requests (206 / 416)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import mimetypes
import os
import re
import shutil
import socket
import sys
import threading
import uuid
from collections import Counter
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, quote, unquote

__all__ = ["HubServer", "hub_client_env", "hub_offline", "DEFAULT_GITATTRIBUTES"]

# Plural URL segment -> repo type, and repo type -> prefix in non-API URLs.
_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}

# The .gitattributes the real Hub commits when it creates a model repo.
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib",
        "*.lfs.*", "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot",
        "*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors",
        "saved_model/**/*", "*.tar.*", "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip",
        "*.zst", "*tfevents*",
    )
)  # fmt: skip

_ACTIONS = {"revision", "tree", "paths-info", "preupload", "commit", "refs", "commits", "branch", "tag", "settings"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{7,40}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub calls ``blobId``/``oid`` of a regular file)."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _glob_regex(pattern: str) -> tuple[re.Pattern, bool]:
    """gitattributes/gitignore glob -> (regex, anchored). Unanchored patterns match the basename."""
    anchored = "/" in pattern
    pat = pattern.lstrip("/")
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out + r"\Z"), anchored


def _glob_match(pattern: str, path: str) -> bool:
    rx, anchored = _glob_regex(pattern)
    return bool(rx.match(path if anchored else path.rsplit("/", 1)[-1]))


def _lfs_by_attributes(path: str, gitattributes: str) -> bool:
    lfs = False
    for line in gitattributes.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        pattern, attrs = parts[0], parts[1:]
        if not _glob_match(pattern, path):
            continue
        if "filter=lfs" in attrs:
            lfs = True
        elif "-filter" in attrs or "!filter" in attrs:
            lfs = False
    return lfs


def _gitignored(path: str, gitignore: str) -> bool:
    parts = path.split("/")
    parents = ["/".join(parts[:k]) for k in range(1, len(parts))]
    ignored = False
    for raw in gitignore.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:] if negate else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        candidates = parents if dir_only else [path, *parents]
        if any(_glob_match(line, c) for c in candidates):
            ignored = not negate
    return ignored


def _front_matter(text: str) -> dict | None:
    """YAML metadata of a model card, None if absent; raises ValueError if malformed."""
    if not text.startswith("---"):
        return None
    m = re.match(r"^---\s*\n(.*?)\n---\s*(?:\n|$)", text, re.S)
    if m is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError as e:
        raise ValueError(f"Invalid YAML in model card metadata: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("Model card metadata must be a YAML mapping.")
    return data


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class _Repo:
    """A repo on disk: repo.json (refs, settings), commits/<oid>.json (full tree per commit),
    blobs/<git sha1> (regular files), lfs/<sha256> (LFS objects)."""

    def __init__(self, hub: "HubServer", repo_type: str, repo_id: str):
        parts = repo_id.split("/")
        if repo_type not in _URL_PREFIX or len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts):
            raise HubError(404, f"Repository not found: {repo_id!r}", "RepoNotFound")
        self.hub, self.type, self.id = hub, repo_type, repo_id
        self.dir = hub.root / f"{repo_type}s" / repo_id
        self.key = hub.repo_key(repo_id, repo_type)

    # -- metadata ----------------------------------------------------------------------------
    def exists(self) -> bool:
        return (self.dir / "repo.json").is_file()

    def meta(self) -> dict:
        return json.loads((self.dir / "repo.json").read_text())

    def save_meta(self, meta: dict) -> None:
        _atomic_write(self.dir / "repo.json", json.dumps(meta, indent=1).encode())

    def commit(self, oid: str) -> dict:
        cache = self.hub._commit_cache
        ck = (self.type, self.id, oid)
        if ck not in cache:
            cache[ck] = json.loads((self.dir / "commits" / f"{oid}.json").read_text())
        return cache[ck]

    def has_commit(self, oid: str) -> bool:
        return (self.dir / "commits" / f"{oid}.json").is_file()

    def resolve(self, revision: str, meta: dict | None = None) -> str | None:
        """Branch, tag, refs/heads/x, refs/tags/x, refs/pr/N, full or abbreviated commit oid."""
        meta = meta or self.meta()
        rev = revision
        if rev.startswith("refs/heads/"):
            return meta["branches"].get(rev[len("refs/heads/") :])
        if rev.startswith("refs/tags/"):
            return meta["tags"].get(rev[len("refs/tags/") :], {}).get("commit")
        if rev.startswith("refs/pr/"):
            return meta["prs"].get(rev[len("refs/pr/") :])
        if rev in meta["branches"]:
            return meta["branches"][rev]
        if rev in meta["tags"]:
            return meta["tags"][rev]["commit"]
        if _HEX.fullmatch(rev):
            if len(rev) == 40:
                return rev if self.has_commit(rev) else None
            found = [p.stem for p in (self.dir / "commits").glob(f"{rev}*.json")]
            return found[0] if len(found) == 1 else None
        return None

    def write_commit(self, tree: dict, parents: list[str], title: str, message: str) -> str:
        body = {"parents": parents, "title": title, "message": message, "date": _now(), "tree": tree}
        oid = hashlib.sha1(json.dumps(body, sort_keys=True).encode() + uuid.uuid4().bytes).hexdigest()
        commit = {"id": oid, "authors": [self.hub.user], **body}
        _atomic_write(self.dir / "commits" / f"{oid}.json", json.dumps(commit).encode())
        return oid

    # -- content -----------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        oid = git_blob_sha1(data)
        path = self.dir / "blobs" / oid
        if not path.exists():
            _atomic_write(path, data)
        return oid

    def lfs_path(self, sha256: str) -> Path:
        return self.dir / "lfs" / sha256

    def entry_path(self, entry: dict) -> Path:
        return self.lfs_path(entry["lfs"]["oid"]) if entry.get("lfs") else self.dir / "blobs" / entry["oid"]

    def read(self, entry: dict) -> bytes:
        return self.entry_path(entry).read_bytes()

    def gitattributes(self, tree: dict) -> str:
        entry = tree.get(".gitattributes")
        return self.read(entry).decode("utf-8", "replace") if entry else ""


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _tree_dirs(tree: dict) -> set[str]:
    dirs = set()
    for path in tree:
        parts = path.split("/")
        for k in range(1, len(parts)):
            dirs.add("/".join(parts[:k]))
    return dirs


def _dir_oid(tree: dict, directory: str) -> str:
    prefix = directory + "/"
    items = sorted((p, e["oid"]) for p, e in tree.items() if p.startswith(prefix))
    return hashlib.sha1(json.dumps(items).encode()).hexdigest()


class HubServer:
    """The loopback Hub. See the module docstring for the routes.

    Args:
        root: folder where repos are stored (created if missing). Reusing a folder reuses its repos.
        host, port: where to listen; port 0 (default) picks a free port.
        token: if set, requests carrying another token are refused (401), and writes need it;
            if None, any ``Authorization: Bearer ...`` token is accepted. Anonymous requests can
            read public repos only, never write.
        user: name returned by ``whoami`` and namespace of repos created without one.
        orgs: organisations listed by ``whoami``.
        lfs_threshold: files at least this big go to LFS (the real Hub uses 10 MB), on top of
            the repo's ``.gitattributes`` patterns and binary content (a NUL byte in the sample).
        multipart_chunk_size: if set, LFS objects bigger than this are uploaded with the Hub's
            multipart protocol in parts of this size (exercises the client's multipart path).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        user: str = "test-user",
        orgs: tuple[str, ...] = ("test-org",),
        lfs_threshold: int = 10 * 1024 * 1024,
        multipart_chunk_size: int | None = None,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.host, self.port = host, port
        self.token, self.user, self.orgs = token, user, tuple(orgs)
        self.lfs_threshold = lfs_threshold
        self.multipart_chunk_size = multipart_chunk_size
        self.lock = threading.RLock()
        self._commit_cache: dict[tuple[str, str, str], dict] = {}
        # Statistics, keyed by repo key (repo_id for models, "datasets/<repo_id>" etc. otherwise).
        self.lfs_uploads: Counter[str] = Counter()  # LFS objects received (PUT or multipart)
        self.lfs_bytes: Counter[str] = Counter()  # bytes of those objects
        self.committed_files: Counter[str] = Counter()  # files added/changed by commits
        self.commits: Counter[str] = Counter()  # commits made through the commit endpoint
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._secret = uuid.uuid4().hex

    def _sign(self, repo_type: str, repo_id: str, oid: str) -> str:
        return hashlib.sha256(f"{self._secret}:{repo_type}:{repo_id}:{oid}".encode()).hexdigest()[:32]

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("HubServer is not started")
        return f"http://{self.host}:{self._httpd.server_address[1]}"

    def start(self) -> "HubServer":
        if self._httpd is not None:
            return self
        httpd = _Server((self.host, self.port), _Handler)
        httpd.hub = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.close_connections()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers for tests -------------------------------------------------------------------
    @staticmethod
    def repo_key(repo_id: str, repo_type: str | None = "model") -> str:
        repo_type = repo_type or "model"
        return repo_id if repo_type == "model" else f"{_URL_PREFIX[repo_type]}{repo_id}"

    def reset_stats(self) -> None:
        for c in (self.lfs_uploads, self.lfs_bytes, self.committed_files, self.commits):
            c.clear()
        self.requests.clear()

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        return _Repo(self, repo_type, repo_id).exists()

    def head(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> str | None:
        """Commit oid that ``revision`` points to, or None."""
        repo = _Repo(self, repo_type, repo_id)
        with self.lock:
            return repo.resolve(revision) if repo.exists() else None

    def list_files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, dict]:
        """{path: {"size", "oid", "lfs": {"oid", "size", "pointerSize"} | None}} at ``revision``."""
        repo = _Repo(self, repo_type, repo_id)
        with self.lock:
            oid = repo.resolve(revision)
            return dict(repo.commit(oid)["tree"]) if oid else {}

    def read_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        repo = _Repo(self, repo_type, repo_id)
        return repo.read(self.list_files(repo_id, revision, repo_type)[path])

    def history(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[dict]:
        """Commits reachable from ``revision`` (first parents), newest first, without trees."""
        repo = _Repo(self, repo_type, repo_id)
        with self.lock:
            out, oid = [], repo.resolve(revision)
            while oid:
                c = repo.commit(oid)
                out.append({k: v for k, v in c.items() if k != "tree"})
                oid = c["parents"][0] if c["parents"] else None
            return out

    # -- repo creation (used by the route and handy for seeding tests) -----------------------
    def create_repo(self, repo_id: str, repo_type: str = "model", private: bool = False) -> bool:
        """Create a repo with the Hub's initial commit (a .gitattributes). False if it exists."""
        repo = _Repo(self, repo_type, repo_id)
        with self.lock:
            if repo.exists():
                return False
            repo.dir.mkdir(parents=True, exist_ok=True)
            data = DEFAULT_GITATTRIBUTES.encode()
            tree = {".gitattributes": {"size": len(data), "oid": repo.put_blob(data), "lfs": None}}
            oid = repo.write_commit(tree, [], "initial commit", "")
            repo.save_meta(
                {
                    "id": repo_id,
                    "_id": uuid.uuid4().hex[:24],
                    "type": repo_type,
                    "private": bool(private),
                    "gated": False,
                    "createdAt": _now(),
                    "branches": {"main": oid},
                    "tags": {},
                    "prs": {},
                }
            )
            return True

    def upload_mode(self, repo: _Repo, tree: dict, path: str, size: int, sample: bytes) -> str:
        if size >= self.lfs_threshold:
            return "lfs"
        if _lfs_by_attributes(path, repo.gitattributes(tree) if ".gitattributes" in tree else DEFAULT_GITATTRIBUTES):
            return "lfs"
        if b"\x00" in sample:
            return "lfs"
        return "regular"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    hub: HubServer

    def __init__(self, *args, **kwargs):
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Close kept-alive client connections so that their handler threads end."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LoopbackHub/1.0"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: avoid 40 ms stalls
    server: _Server

    # -- plumbing ----------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # silence stderr
        pass

    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def _handle(self, method: str) -> None:
        self._body_done = False  # reading of the request body has started
        self._body_complete = False  # ... and reached its end
        self._body_bytes: bytes | None = None
        raw_path, _, query = self.path.partition("?")
        self.query = parse_qs(query, keep_blank_values=True)
        self.hub.requests.append((method, raw_path))
        try:
            self._route(method, raw_path)
        except HubError as e:
            self._error(e.status, e.message, e.code, e.headers)
        except BrokenPipeError:
            self.close_connection = True
        except Exception as e:  # a bug here should show up in the client's error message
            import traceback

            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            with contextlib.suppress(Exception):
                self._error(500, f"{type(e).__name__}: {e}")
        finally:
            if not self._body_done:  # unread body: drain it so the kept-alive connection stays in sync
                with contextlib.suppress(Exception):
                    for _ in self._iter_body():
                        pass
            if not self._body_complete:
                self.close_connection = True

    def _iter_body(self, bufsize: int = 1 << 20) -> Iterator[bytes]:
        if self._body_done:
            return
        self._body_done = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    self._body_complete = True
                    return
                remaining = size
                while remaining:
                    chunk = self.rfile.read(min(bufsize, remaining))
                    if not chunk:
                        raise HubError(400, "Truncated chunked body")
                    remaining -= len(chunk)
                    yield chunk
                self.rfile.readline()
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining:
                chunk = self.rfile.read(min(bufsize, remaining))
                if not chunk:
                    raise HubError(400, "Truncated body")
                remaining -= len(chunk)
                yield chunk
            self._body_complete = True

    def _body(self) -> bytes:
        if self._body_bytes is None:
            self._body_bytes = b"".join(self._iter_body())
        return self._body_bytes

    def _json_body(self) -> Any:
        data = self._body()
        try:
            return json.loads(data or b"{}")
        except ValueError:
            raise HubError(400, "Invalid JSON body")

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str | None = None):
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers, "application/json; charset=utf-8")

    def _error(self, status: int, message: str, code: str | None = None, headers: dict | None = None) -> None:
        h = {"X-Error-Message": message.encode("ascii", "replace").decode().replace("\n", " ")}
        if code:
            h["X-Error-Code"] = code
        h.update(headers or {})
        self._json({"error": message}, status, h)

    def _q(self, name: str, default: str | None = None) -> str | None:
        vals = self.query.get(name)
        return vals[-1] if vals else default

    def _qbool(self, name: str) -> bool:
        return (self._q(name) or "").lower() in ("1", "true", "yes", "on")

    # -- auth --------------------------------------------------------------------------------
    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip() or None
        return None

    def _check_token(self) -> bool:
        """True if a valid token is present; raise on an invalid one; False if anonymous."""
        token = self._token()
        if token is None:
            return False
        if self.hub.token is not None and token != self.hub.token:
            raise HubError(401, "Invalid credentials in Authorization header")
        return True

    def _require_auth(self) -> None:
        if not self._check_token():
            raise HubError(401, "You must be authenticated to access this resource", "Unauthorized")

    def _repo(self, repo_type: str, repo_id: str, write: bool = False) -> tuple[_Repo, dict]:
        authed = self._check_token()
        repo = _Repo(self.hub, repo_type, repo_id)
        if not repo.exists():
            raise HubError(404, "Repository not found", "RepoNotFound")
        meta = repo.meta()
        if meta.get("private") and not authed:
            raise HubError(401, "Repository not found", "RepoNotFound")
        if write and not authed:
            raise HubError(401, "You must be authenticated to write to this repository", "Unauthorized")
        return repo, meta

    def _rev(self, repo: _Repo, meta: dict, revision: str) -> str:
        oid = repo.resolve(revision, meta)
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return oid

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.hub.url}/{_URL_PREFIX[repo.type]}{repo.id}"

    # -- routing -----------------------------------------------------------------------------
    def _route(self, method: str, raw_path: str) -> None:
        segs = [unquote(s) for s in raw_path.split("/")[1:]]
        if segs and segs[-1] == "" and len(segs) > 1:
            segs = segs[:-1]
        if not segs or segs == [""]:
            return self._json({"hub": "loopback"})
        if segs[0] == "api":
            return self._route_api(method, segs[1:])
        if segs[0] == "_lfs":
            return self._route_lfs_object(method, segs[1:])
        # /{prefix}{repo}.git/info/lfs/objects/batch
        if len(segs) >= 5 and segs[-4:] == ["info", "lfs", "objects", "batch"] and method == "POST":
            repo_type, rest = self._split_type(segs[:-4])
            repo_id = "/".join(rest)
            if not repo_id.endswith(".git"):
                raise HubError(404, "Not found")
            return self._lfs_batch(repo_type, repo_id[: -len(".git")])
        # /{prefix}{repo}/resolve/{rev}/{path}
        repo_type, rest = self._split_type(segs)
        for n in (2, 1):
            if len(rest) >= n + 3 and rest[n] in ("resolve", "raw") and method in ("GET", "HEAD"):
                return self._resolve(repo_type, "/".join(rest[:n]), rest[n + 1], "/".join(rest[n + 2 :]))
        raise HubError(404, f"Not found: {method} {raw_path}")

    @staticmethod
    def _split_type(segs: list[str]) -> tuple[str, list[str]]:
        if segs and segs[0] in ("datasets", "spaces", "kernels"):
            return _TYPES[segs[0]], segs[1:]
        return "model", segs

    def _route_api(self, method: str, segs: list[str]) -> None:
        hub = self.hub
        if segs == ["whoami-v2"] and method == "GET":
            self._require_auth()
            return self._json(
                {
                    "type": "user",
                    "id": "0" * 24,
                    "name": hub.user,
                    "fullname": hub.user,
                    "email": f"{hub.user}@example.invalid",
                    "emailVerified": True,
                    "isPro": False,
                    "orgs": [{"type": "org", "name": o, "fullname": o, "roleInOrg": "admin"} for o in hub.orgs],
                    "auth": {"type": "access_token", "accessToken": {"displayName": "loopback", "role": "write"}},
                }
            )
        if segs == ["repos", "create"] and method == "POST":
            return self._create_repo()
        if segs == ["repos", "delete"] and method == "DELETE":
            return self._delete_repo()
        if segs == ["validate-yaml"] and method == "POST":
            return self._validate_yaml()
        if not segs or segs[0] not in _TYPES:
            raise HubError(404, f"Not found: /api/{'/'.join(segs)}")
        repo_type, rest = _TYPES[segs[0]], segs[1:]
        if not rest:
            if method == "GET":
                return self._list_repos(repo_type)
            raise HubError(405, "Method not allowed")
        # repo id is "ns/name" (preferred) or a legacy single segment "name"
        if len(rest) == 2 or (len(rest) >= 3 and rest[2] in _ACTIONS):
            repo_id, action, args = "/".join(rest[:2]), (rest[2] if len(rest) > 2 else None), rest[3:]
        elif len(rest) == 1 or rest[1] in _ACTIONS:
            repo_id, action, args = rest[0], (rest[1] if len(rest) > 1 else None), rest[2:]
        else:
            raise HubError(404, "Not found")
        if method != "GET":
            self._body()  # read the request body before taking the lock
        with hub.lock:
            if action is None and method == "GET":
                return self._repo_info(repo_type, repo_id, "main")
            if action == "revision" and method == "GET" and args:
                return self._repo_info(repo_type, repo_id, "/".join(args))
            if action == "tree" and method == "GET":
                return self._tree(repo_type, repo_id, args[0] if args else "main", "/".join(args[1:]))
            if action == "paths-info" and method == "POST":
                return self._paths_info(repo_type, repo_id, "/".join(args) or "main")
            if action == "preupload" and method == "POST":
                return self._preupload(repo_type, repo_id, "/".join(args) or "main")
            if action == "commit" and method == "POST":
                return self._commit(repo_type, repo_id, "/".join(args) or "main")
            if action == "refs" and method == "GET":
                return self._refs(repo_type, repo_id)
            if action == "commits" and method == "GET":
                return self._commits(repo_type, repo_id, "/".join(args) or "main")
            if action == "branch" and args and method in ("POST", "DELETE"):
                return self._branch(method, repo_type, repo_id, "/".join(args))
            if action == "tag" and args and method in ("POST", "DELETE"):
                return self._tag(method, repo_type, repo_id, "/".join(args))
            if action == "settings" and method == "PUT":
                return self._settings(repo_type, repo_id)
        raise HubError(404, f"Not found: {method} /api/{'/'.join(segs)}")

    # -- repos -------------------------------------------------------------------------------
    def _create_repo(self) -> None:
        self._require_auth()
        payload = self._json_body()
        name, org = payload.get("name"), payload.get("organization")
        repo_type = payload.get("type") or "model"
        if repo_type not in _URL_PREFIX:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or "--" in name or ".." in name:
            raise HubError(400, f"Invalid repo name {name!r}")
        if org is not None and (not isinstance(org, str) or not _NAME.fullmatch(org)):
            raise HubError(400, f"Invalid namespace {org!r}")
        repo_id = f"{org or self.hub.user}/{name}"
        visibility = payload.get("visibility")
        private = visibility in ("private", "protected") if visibility else bool(payload.get("private"))
        url = f"{self.hub.url}/{_URL_PREFIX[repo_type]}{repo_id}"
        if not self.hub.create_repo(repo_id, repo_type, private=private):
            message = f"You already created this {repo_type} repo"
            return self._json({"error": message, "url": url}, 409, {"X-Error-Message": message})
        meta = _Repo(self.hub, repo_type, repo_id).meta()
        return self._json({"url": url, "name": repo_id, "id": meta["_id"]})

    def _delete_repo(self) -> None:
        self._require_auth()
        payload = self._json_body()
        repo_id = f"{payload.get('organization') or self.hub.user}/{payload.get('name')}"
        repo_type = payload.get("type") or "model"
        repo = _Repo(self.hub, repo_type, repo_id)
        with self.hub.lock:
            if not repo.exists():
                raise HubError(404, "Repository not found", "RepoNotFound")
            shutil.rmtree(repo.dir)
            for k in [k for k in self.hub._commit_cache if k[:2] == (repo_type, repo_id)]:
                del self.hub._commit_cache[k]
        return self._json({})

    def _validate_yaml(self) -> None:
        payload = self._json_body()
        try:
            _front_matter(payload.get("content") or "")
        except ValueError as e:
            return self._json({"errors": [{"message": str(e)}], "warnings": []}, 400)
        return self._json({"errors": [], "warnings": []})

    def _list_repos(self, repo_type: str) -> None:
        authed = self._check_token()
        author, search = self._q("author"), self._q("search")
        limit = int(self._q("limit") or 0) or None
        out = []
        base = self.hub.root / f"{repo_type}s"
        with self.hub.lock:
            for meta_path in sorted(base.glob("*/*/repo.json")) if base.is_dir() else []:
                repo_id = meta_path.parent.relative_to(base).as_posix()
                if author and repo_id.split("/")[0] != author:
                    continue
                if search and search.lower() not in repo_id.lower():
                    continue
                repo = _Repo(self.hub, repo_type, repo_id)
                meta = repo.meta()
                if meta.get("private") and not authed:
                    continue
                out.append(self._info_dict(repo, meta, meta["branches"]["main"], siblings=False))
        return self._json(out[:limit] if limit else out)

    def _info_dict(self, repo: _Repo, meta: dict, oid: str, siblings: bool = True, blobs: bool = False) -> dict:
        commit = repo.commit(oid)
        tree = commit["tree"]
        info: dict[str, Any] = {
            "_id": meta["_id"],
            "id": repo.id,
            "author": repo.id.split("/")[0] if "/" in repo.id else None,
            "sha": oid,
            "lastModified": commit["date"],
            "createdAt": meta["createdAt"],
            "private": bool(meta.get("private")),
            "gated": meta.get("gated") or False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "usedStorage": sum(e["size"] for e in tree.values()),
        }
        if repo.type == "model":
            info["modelId"] = repo.id
        if "README.md" in tree:
            try:
                card = _front_matter(repo.read(tree["README.md"]).decode("utf-8", "replace"))
            except ValueError:
                card = None
            if card:
                info["cardData"] = card
                tags = card.get("tags") or []
                info["tags"] = [str(t) for t in (tags if isinstance(tags, list) else [tags])]
                for key in ("library_name", "pipeline_tag"):
                    if isinstance(card.get(key), str):
                        info[key] = card[key]
        if siblings:
            sib = []
            for path in sorted(tree):
                entry = tree[path]
                s: dict[str, Any] = {"rfilename": path}
                if blobs:
                    s["size"] = entry["size"]
                    s["blobId"] = entry["oid"]
                    if entry.get("lfs"):
                        lfs = entry["lfs"]
                        s["lfs"] = {"size": lfs["size"], "sha256": lfs["oid"], "pointerSize": lfs["pointerSize"]}
                sib.append(s)
            info["siblings"] = sib
            info["spaces"] = []
        return info

    def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo, meta = self._repo(repo_type, repo_id)
        oid = self._rev(repo, meta, revision)
        return self._json(self._info_dict(repo, meta, oid, blobs=self._qbool("blobs")))

    # -- tree --------------------------------------------------------------------------------
    def _last_commit(self, repo: _Repo, oid: str, path: str, is_dir: bool) -> dict:
        def state(tree: dict) -> Any:
            if not is_dir:
                return tree.get(path)
            prefix = path + "/"
            return sorted((p, e["oid"]) for p, e in tree.items() if p.startswith(prefix))

        commit = repo.commit(oid)
        current = state(commit["tree"])
        while commit["parents"]:
            parent = repo.commit(commit["parents"][0])
            if state(parent["tree"]) != current:
                break
            commit = parent
        return {"id": commit["id"], "title": commit["title"], "date": commit["date"]}

    def _entry_json(self, repo: _Repo, tree: dict, oid: str, path: str, expand: bool) -> dict:
        if path in tree:
            e = tree[path]
            out: dict[str, Any] = {"type": "file", "oid": e["oid"], "size": e["size"], "path": path}
            if e.get("lfs"):
                out["lfs"] = dict(e["lfs"])
            if expand:
                out["lastCommit"] = self._last_commit(repo, oid, path, False)
                out["securityFileStatus"] = {"status": "safe", "avScan": None, "pickleImportScan": None}
        else:
            out = {"type": "directory", "oid": _dir_oid(tree, path), "size": 0, "path": path}
            if expand:
                out["lastCommit"] = self._last_commit(repo, oid, path, True)
        return out

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo, meta = self._repo(repo_type, repo_id)
        oid = self._rev(repo, meta, revision)
        tree = repo.commit(oid)["tree"]
        path = path.strip("/")
        dirs = _tree_dirs(tree)
        if path and path not in dirs:
            raise HubError(404, f"{path} does not exist on \"{revision}\"", "EntryNotFound", {"X-Repo-Commit": oid})
        recursive, expand = self._qbool("recursive"), self._qbool("expand")
        prefix = path + "/" if path else ""
        children = set()
        for p in list(tree) + list(dirs):
            if not p.startswith(prefix) or p == path:
                continue
            if recursive or "/" not in p[len(prefix) :]:
                children.add(p)
        ordered = sorted(children, key=lambda p: (p not in dirs, p))
        return self._json([self._entry_json(repo, tree, oid, p, expand) for p in ordered])

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        body = self._body().decode()
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            payload = json.loads(body or "{}")
            paths, expand = payload.get("paths") or [], bool(payload.get("expand"))
        else:
            form = parse_qs(body, keep_blank_values=True)
            paths, expand = form.get("paths", []), (form.get("expand", ["false"])[-1].lower() in ("1", "true"))
        repo, meta = self._repo(repo_type, repo_id)
        oid = self._rev(repo, meta, revision)
        tree = repo.commit(oid)["tree"]
        dirs = _tree_dirs(tree)
        out = []
        for p in paths:
            p = p.strip("/")
            if p in tree or p in dirs:
                out.append(self._entry_json(repo, tree, oid, p, expand))
        return self._json(out)

    # -- upload ------------------------------------------------------------------------------
    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        payload = self._json_body()
        repo, meta = self._repo(repo_type, repo_id, write=True)
        oid = repo.resolve(revision, meta)
        if oid is None:
            if self._qbool("create_pr"):
                oid = self._rev(repo, meta, "main")
            else:
                raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        tree = repo.commit(oid)["tree"]
        gitignore = payload.get("gitIgnore")
        if gitignore is None and ".gitignore" in tree:
            gitignore = repo.read(tree[".gitignore"]).decode("utf-8", "replace")
        files = []
        for f in payload.get("files") or []:
            path = f.get("path")
            if not isinstance(path, str):
                raise HubError(400, "Invalid preupload payload")
            sample = base64.b64decode(f.get("sample") or "")
            mode = self.hub.upload_mode(repo, tree, path, int(f.get("size") or 0), sample)
            existing = tree.get(path)
            remote_oid = None
            if existing is not None:
                remote_oid = existing["lfs"]["oid"] if existing.get("lfs") else existing["oid"]
            files.append(
                {
                    "path": path,
                    "uploadMode": mode,
                    "shouldIgnore": bool(gitignore) and _gitignored(path, gitignore),
                    "oid": remote_oid,
                }
            )
        return self._json({"files": files, "commitOid": oid})

    def _lfs_href(self, repo: _Repo, oid: str, *suffix: str) -> str:
        # Like the Hub's pre-signed storage URLs: the client sends no Authorization header to
        # them, so the URL itself carries the permission.
        parts = [repo.type, quote(repo.id, safe=""), oid, *suffix]
        return f"{self.hub.url}/_lfs/" + "/".join(parts) + f"?sig={self.hub._sign(repo.type, repo.id, oid)}"

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        payload = self._json_body()
        operation = payload.get("operation")
        with self.hub.lock:
            repo, meta = self._repo(repo_type, repo_id, write=(operation == "upload"))
        objects = []
        transfer = "basic"
        chunk = self.hub.multipart_chunk_size
        for obj in payload.get("objects") or []:
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not _SHA256.fullmatch(oid) or not isinstance(size, int):
                error = {"code": 422, "message": "Invalid object"}
                objects.append({"oid": str(oid), "size": int(size or 0), "error": error})
                continue
            path = repo.lfs_path(oid)
            present = path.is_file() and path.stat().st_size == size
            if operation == "download":
                if not present:
                    error = {"code": 404, "message": "Object does not exist"}
                    objects.append({"oid": oid, "size": size, "error": error})
                else:
                    objects.append(
                        {"oid": oid, "size": size, "authenticated": True,
                         "actions": {"download": {"href": self._lfs_href(repo, oid), "header": {}}}}
                    )  # fmt: skip
                continue
            if operation != "upload":
                raise HubError(400, f"Unsupported LFS operation {operation!r}")
            if present:
                objects.append({"oid": oid, "size": size})  # no actions: already stored, nothing to send
                continue
            header: dict[str, str] = {}
            if chunk and size > chunk and "multipart" in (payload.get("transfers") or []):
                transfer = "multipart"
                nparts = -(-size // chunk)
                header = {"chunk_size": str(chunk)}
                header.update({str(i): self._lfs_href(repo, oid, "part", str(i)) for i in range(1, nparts + 1)})
            objects.append(
                {
                    "oid": oid,
                    "size": size,
                    "authenticated": True,
                    "actions": {
                        "upload": {"href": self._lfs_href(repo, oid), "header": header},
                        "verify": {"href": self._lfs_href(repo, oid, "verify"), "header": {}},
                    },
                }
            )
        body = json.dumps({"transfer": transfer, "objects": objects, "hash_algo": "sha256"}).encode()
        return self._send(200, body, content_type="application/vnd.git-lfs+json")

    def _route_lfs_object(self, method: str, segs: list[str]) -> None:
        # /_lfs/{type}/{quoted repo id}/{oid}[/verify | /part/{n}]
        if len(segs) < 3 or segs[0] not in _URL_PREFIX or not _SHA256.fullmatch(segs[2]):
            raise HubError(404, "Not found")
        repo_type, repo_id, oid, rest = segs[0], segs[1], segs[2], segs[3:]
        if rest == ["verify"]:
            with self.hub.lock:
                repo, _ = self._repo(repo_type, repo_id, write=True)
        else:
            if self._q("sig") != self.hub._sign(repo_type, repo_id, oid):
                raise HubError(403, "Invalid or missing signature on storage URL")
            repo = _Repo(self.hub, repo_type, repo_id)
            if not repo.exists():
                raise HubError(404, "Repository not found", "RepoNotFound")
        final = repo.lfs_path(oid)
        if method == "GET" and not rest:
            if not final.is_file():
                raise HubError(404, "Object does not exist", "EntryNotFound")
            return self._send_file(final, {}, None)
        if method == "PUT" and not rest:
            size = self._receive_object(repo, oid, self._iter_body())
            return self._record_upload(repo, size)
        if method == "PUT" and len(rest) == 2 and rest[0] == "part" and rest[1].isdigit():
            part = self.hub.root / ".parts" / f"{repo_type}-{quote(repo.id, safe='')}-{oid}" / rest[1]
            part.parent.mkdir(parents=True, exist_ok=True)
            md5 = hashlib.md5()
            tmp = part.with_name(f".{part.name}.{uuid.uuid4().hex}")
            with open(tmp, "wb") as f:
                for chunk in self._iter_body():
                    md5.update(chunk)
                    f.write(chunk)
            os.replace(tmp, part)
            return self._send(200, headers={"ETag": f'"{md5.hexdigest()}"'})
        if method == "POST" and not rest:  # multipart completion
            payload = self._json_body()
            parts_dir = self.hub.root / ".parts" / f"{repo_type}-{quote(repo.id, safe='')}-{oid}"
            numbers = sorted(int(p["partNumber"]) for p in payload.get("parts") or [])
            if not numbers or numbers != list(range(1, len(numbers) + 1)):
                raise HubError(400, "Invalid multipart completion payload")

            def chunks() -> Iterator[bytes]:
                for n in numbers:
                    with open(parts_dir / str(n), "rb") as f:
                        while block := f.read(1 << 20):
                            yield block

            try:
                size = self._receive_object(repo, oid, chunks())
            except FileNotFoundError:
                raise HubError(400, "Missing part in multipart upload")
            shutil.rmtree(parts_dir, ignore_errors=True)
            return self._record_upload(repo, size)
        if method == "POST" and rest == ["verify"]:
            payload = self._json_body()
            if not final.is_file() or final.stat().st_size != payload.get("size"):
                raise HubError(404, "Object not found or size mismatch", "EntryNotFound")
            return self._json({"success": True})
        raise HubError(404, "Not found")

    def _receive_object(self, repo: _Repo, oid: str, chunks: Iterator[bytes]) -> int:
        final = repo.lfs_path(oid)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{oid}.{uuid.uuid4().hex}.tmp")
        h, size = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    h.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            if h.hexdigest() != oid:
                raise HubError(400, f"sha256 mismatch: expected {oid}, got {h.hexdigest()}")
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return size

    def _record_upload(self, repo: _Repo, size: int) -> None:
        with self.hub.lock:
            self.hub.lfs_uploads[repo.key] += 1
            self.hub.lfs_bytes[repo.key] += size
        return self._send(200)

    # -- commit ------------------------------------------------------------------------------
    def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        body = self._body()
        repo, meta = self._repo(repo_type, repo_id, write=True)
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError:
            raise HubError(400, "Invalid NDJSON commit payload")
        header = next((ln.get("value") or {} for ln in lines if ln.get("key") == "header"), None)
        if header is None:
            raise HubError(400, "Missing commit header")
        create_pr = self._qbool("create_pr")
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/") :]
        if revision in meta["branches"]:
            ref_kind, ref_name = "branches", revision
        elif revision.startswith("refs/pr/") and revision[len("refs/pr/") :] in meta["prs"]:
            ref_kind, ref_name = "prs", revision[len("refs/pr/") :]
        else:
            raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", "RevisionNotFound")
        head = meta[ref_kind][ref_name]
        parent = header.get("parentCommit")
        if parent and not create_pr and not head.startswith(parent.lower()):
            raise HubError(412, f"A commit has happened since {parent}. Please refresh and try again.")
        base = repo.resolve(parent, meta) if (parent and create_pr) else head
        if base is None:
            raise HubError(404, f"Invalid rev id: {parent}", "RevisionNotFound")
        tree = dict(repo.commit(base)["tree"])
        changed = 0
        for line in lines:
            key, value = line.get("key"), line.get("value") or {}
            if key == "header":
                continue
            path = value.get("path")
            if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
                raise HubError(400, f"Invalid path {path!r}")
            if path == ".git" or path.startswith(".git/"):
                raise HubError(400, f"Invalid path {path!r}")
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    data = str(value.get("content") or "").encode()
                else:
                    data = base64.b64decode(value.get("content") or "")
                if data and (len(data) >= self.hub.lfs_threshold or b"\x00" in data[:8000]):
                    raise HubError(
                        400,
                        f"Your push was rejected because it contains binary files or files over "
                        f"{self.hub.lfs_threshold} bytes ({path}). Upload it with LFS.",
                    )
                tree[path] = {"size": len(data), "oid": repo.put_blob(data), "lfs": None}
                changed += 1
            elif key == "lfsFile":
                sha = value.get("oid")
                obj = repo.lfs_path(sha) if isinstance(sha, str) and _SHA256.fullmatch(sha) else None
                if obj is None or not obj.is_file():
                    raise HubError(
                        400,
                        f"Your push was rejected because an LFS pointer pointed to a file that does not exist ({path})",
                    )
                size = obj.stat().st_size
                if value.get("size") is not None and value["size"] != size:
                    raise HubError(400, f"LFS object size mismatch for {path}")
                pointer = lfs_pointer(sha, size)
                tree[path] = {
                    "size": size,
                    "oid": git_blob_sha1(pointer),
                    "lfs": {"oid": sha, "size": size, "pointerSize": len(pointer)},
                }
                changed += 1
            elif key == "deletedFile":
                if path not in tree:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del tree[path]
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                doomed = [p for p in tree if p.startswith(prefix)]
                if not doomed:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in doomed:
                    del tree[p]
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        title = header.get("summary") or "Commit"
        oid = repo.write_commit(tree, [base], title, header.get("description") or "")
        meta = repo.meta()  # re-read under the lock
        pr_url = None
        if create_pr:
            num = str(max([int(n) for n in meta["prs"]] + [0]) + 1)
            meta["prs"][num] = oid
            pr_url = f"{self._repo_url(repo)}/discussions/{num}"
        else:
            meta[ref_kind][ref_name] = oid
        repo.save_meta(meta)
        self.hub.commits[repo.key] += 1
        self.hub.committed_files[repo.key] += changed
        return self._json(
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self._repo_url(repo)}/commit/{oid}",
                "commitMessage": title,
                "hookOutput": "",
                "pullRequestUrl": pr_url,
            }
        )

    # -- refs --------------------------------------------------------------------------------
    def _refs(self, repo_type: str, repo_id: str) -> None:
        repo, meta = self._repo(repo_type, repo_id)
        def ref(name: str, full: str, oid: str) -> dict:
            return {"name": name, "ref": full, "targetCommit": oid}

        branches = [ref(n, f"refs/heads/{n}", o) for n, o in sorted(meta["branches"].items())]
        tags = [ref(n, f"refs/tags/{n}", t["commit"]) for n, t in sorted(meta["tags"].items())]
        prs = [ref(f"refs/pr/{n}", f"refs/pr/{n}", o) for n, o in sorted(meta["prs"].items(), key=lambda x: int(x[0]))]
        return self._json({"branches": branches, "tags": tags, "converts": [], "pullRequests": prs})

    def _commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo, meta = self._repo(repo_type, repo_id)
        oid = self._rev(repo, meta, revision)
        out = []
        while oid:
            c = repo.commit(oid)
            item = {
                "id": c["id"],
                "title": c["title"],
                "message": c["message"],
                "authors": [{"user": a, "avatar": ""} for a in c["authors"]],
                "date": c["date"],
            }
            if "formatted" in (self._q("expand[]") or ""):
                item["formatted"] = {"title": c["title"], "message": c["message"]}
            out.append(item)
            oid = c["parents"][0] if c["parents"] else None
        return self._json(out)

    def _branch(self, method: str, repo_type: str, repo_id: str, branch: str) -> None:
        payload = self._json_body() if method == "POST" else {}
        repo, meta = self._repo(repo_type, repo_id, write=True)
        if method == "DELETE":
            if branch not in meta["branches"]:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            if branch == "main":
                raise HubError(403, "Cannot delete the default branch")
            del meta["branches"][branch]
        else:
            if branch in meta["branches"]:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            meta["branches"][branch] = self._rev(repo, meta, payload.get("startingPoint") or "main")
        repo.save_meta(meta)
        return self._json({})

    def _tag(self, method: str, repo_type: str, repo_id: str, arg: str) -> None:
        payload = self._json_body() if method == "POST" else {}
        repo, meta = self._repo(repo_type, repo_id, write=True)
        if method == "DELETE":
            if arg not in meta["tags"]:
                raise HubError(404, f"Invalid rev id: {arg}", "RevisionNotFound")
            del meta["tags"][arg]
        else:
            tag = payload.get("tag")
            if not isinstance(tag, str) or not tag:
                raise HubError(400, "Missing tag name")
            if tag in meta["tags"]:
                raise HubError(409, f"Tag already exists: {tag}")
            meta["tags"][tag] = {"commit": self._rev(repo, meta, arg), "message": payload.get("message") or ""}
        repo.save_meta(meta)
        return self._json({})

    def _settings(self, repo_type: str, repo_id: str) -> None:
        payload = self._json_body()
        repo, meta = self._repo(repo_type, repo_id, write=True)
        if "private" in payload:
            meta["private"] = bool(payload["private"])
        if payload.get("visibility"):
            meta["private"] = payload["visibility"] in ("private", "protected")
        if "gated" in payload:
            meta["gated"] = payload["gated"]
        repo.save_meta(meta)
        return self._json({})

    # -- download ----------------------------------------------------------------------------
    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        with self.hub.lock:
            repo, meta = self._repo(repo_type, repo_id)
            oid = self._rev(repo, meta, revision)
            entry = repo.commit(oid)["tree"].get(path)
        if entry is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": oid})
        lfs = entry.get("lfs")
        etag = lfs["oid"] if lfs else entry["oid"]
        headers = {"X-Repo-Commit": oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(lfs["size"])
        name = path.rsplit("/", 1)[-1]
        headers["Content-Disposition"] = f"inline; filename*=UTF-8''{quote(name)}; filename=\"{quote(name)}\""
        ctype = "application/octet-stream" if lfs else (mimetypes.guess_type(name)[0] or "text/plain; charset=utf-8")
        return self._send_file(repo.entry_path(entry), headers, ctype)

    def _send_file(self, file: Path, headers: dict, ctype: str | None) -> None:
        size = file.stat().st_size
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", rng)
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                else:  # suffix range: last N bytes
                    start, end = max(size - int(m.group(2)), 0), size - 1
                if start >= size or start > end:
                    h = dict(headers, **{"Content-Range": f"bytes */{size}"})
                    return self._error(416, f"Range Not Satisfiable: {rng}", headers=h)
                status = 206
                headers = dict(headers, **{"Content-Range": f"bytes {start}-{end}/{size}"})
            # anything else (multiple ranges, garbage): ignore the header, serve the whole file
        length = end - start + 1 if size else 0
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD" or length == 0:
            return
        with open(file, "rb") as f:
            f.seek(start)
            remaining = length
            while remaining:
                block = f.read(min(1 << 20, remaining))
                if not block:
                    break
                self.wfile.write(block)
                remaining -= len(block)


# ---------------------------------------------------------------------------------------------
# Client side: point huggingface_hub at a server.
# ---------------------------------------------------------------------------------------------

_UNSET = object()

_ENV_REMOVED = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HUGGING_FACE_HUB_TOKEN",
    "HUGGINGFACE_HUB_CACHE",
    "HUGGINGFACE_ASSETS_CACHE",
    "HUGGINGFACE_CO_STAGING",
    "HF_OIDC_RESOURCE",
    "HF_OIDC_ID_TOKEN",
    "HF_HUB_ENABLE_HF_TRANSFER",
    "HF_XET_HIGH_PERFORMANCE",
)


class _Patcher:
    """Set attributes and environment variables, remember the old values, undo in reverse."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Any, str, Any]] = []

    def setattr(self, obj: Any, name: str, value: Any, only_if_present: bool = True) -> None:
        old = getattr(obj, name, _UNSET)
        if old is _UNSET and only_if_present:
            return
        self._undo.append(("attr", obj, name, old))
        setattr(obj, name, value)

    def setenv(self, name: str, value: str | None) -> None:
        self._undo.append(("env", None, name, os.environ.get(name, _UNSET)))
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def undo(self) -> None:
        while self._undo:
            kind, obj, name, old = self._undo.pop()
            if kind == "attr":
                if old is _UNSET:
                    with contextlib.suppress(AttributeError):
                        delattr(obj, name)
                else:
                    setattr(obj, name, old)
            elif old is _UNSET:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _reset_client_state() -> None:
    """Drop cached HTTP clients and filesystem instances that remember an endpoint."""
    from huggingface_hub.utils import _http

    _http.close_session()
    hf_fs = sys.modules.get("huggingface_hub.hf_file_system")
    if hf_fs is not None:
        with contextlib.suppress(Exception):
            hf_fs.HfFileSystem.clear_instance_cache()


@contextlib.contextmanager
def hub_client_env(
    endpoint: str,
    hf_home: str | os.PathLike,
    token: str | None = "hf_loopback_test_token",
) -> Iterator[Path]:
    """Point ``huggingface_hub`` at ``endpoint`` with a private ``HF_HOME``; restore on exit.

    Sets the environment (for code reading it later, and for subprocesses) and patches what
    ``huggingface_hub`` read at import time: ``constants.ENDPOINT``/``HUGGINGFACE_CO_URL_TEMPLATE``
    (used by ``hf_hub_url``), the module-level ``HfApi`` behind ``huggingface_hub.create_repo``/
    ``upload_folder``/..., cache and token paths, ``HF_HUB_DISABLE_XET`` (uploads use LFS, which
    this server implements), ``HF_HUB_OFFLINE`` (off) and telemetry (off). Yields the hub cache
    folder (``$HF_HOME/hub``).
    """
    import huggingface_hub.constants as C
    import huggingface_hub.hf_api as hf_api
    from huggingface_hub.utils import _http

    endpoint = endpoint.rstrip("/")
    home = Path(hf_home)
    cache = home / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    p = _Patcher()
    try:
        env = {
            "HF_ENDPOINT": endpoint,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(cache),
            "HF_ASSETS_CACHE": str(home / "assets"),
            "HF_XET_CACHE": str(home / "xet"),
            "HF_TOKEN_PATH": str(home / "token"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": None,
            "HF_TOKEN": token,
        }
        for name in _ENV_REMOVED:
            p.setenv(name, None)
        for name, value in env.items():
            p.setenv(name, value)
        for name in ("NO_PROXY", "no_proxy"):
            cur = os.environ.get(name, "")
            p.setenv(name, ",".join(x for x in (cur, "127.0.0.1", "localhost") if x))

        host = endpoint.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].lower()
        consts = {
            "ENDPOINT": endpoint,
            "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_URL_HOSTS": frozenset(getattr(C, "HF_URL_HOSTS", frozenset()) | {host}),
            "_staging_mode": False,
            "HF_HOME": str(home),
            "default_cache_path": str(cache),
            "default_assets_cache_path": str(home / "assets"),
            "HUGGINGFACE_HUB_CACHE": str(cache),
            "HUGGINGFACE_ASSETS_CACHE": str(home / "assets"),
            "HF_HUB_CACHE": str(cache),
            "HF_ASSETS_CACHE": str(home / "assets"),
            "default_xet_cache_path": str(home / "xet"),
            "HF_XET_CACHE": str(home / "xet"),
            "HF_TOKEN_PATH": str(home / "token"),
            "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
            "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
            "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
            "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
            "HF_HUB_OFFLINE": False,
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_DISABLE_XET": True,
            "HF_HUB_DISABLE_UPDATE_CHECK": True,
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
            "HF_XET_HIGH_PERFORMANCE": False,
        }
        for name, value in consts.items():
            p.setattr(C, name, value)
        p.setattr(hf_api.api, "endpoint", endpoint)
        p.setattr(hf_api.api, "_whoami_cache", {})
        if hasattr(_http, "_HUB_ORIGINS") and hasattr(_http, "_url_origin"):  # redirects stay "on the Hub"
            p.setattr(_http, "_HUB_ORIGINS", frozenset(_http._HUB_ORIGINS | {_http._url_origin(endpoint)}))
        for modname, attr in (
            ("huggingface_hub.utils._cache_manager", "HF_HUB_CACHE"),
            ("huggingface_hub.utils._cache_assets", "HF_ASSETS_CACHE"),
        ):
            mod = sys.modules.get(modname)
            if mod is not None:
                p.setattr(mod, attr, consts[attr])
        _reset_client_state()
        yield cache
    finally:
        p.undo()
        _reset_client_state()


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` for the client, in the environment and in ``huggingface_hub.constants``."""
    import huggingface_hub.constants as C

    p = _Patcher()
    try:
        p.setenv("HF_HUB_OFFLINE", "1")
        p.setattr(C, "HF_HUB_OFFLINE", True)
        yield
    finally:
        p.undo()

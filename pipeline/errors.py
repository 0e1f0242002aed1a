"""Errors the pipeline raises on purpose: each one names the file, the tensor and what to do."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
from pathlib import Path


class ConversionError(Exception):
    """A conversion cannot go on; the message says why and what to do."""


class SourceError(ConversionError):
    """A source checkpoint file is unreadable, truncated, or lies about its contents."""

    def __init__(self, file: str, message: str, tensor: str | None = None):
        self.file, self.tensor = file, tensor
        self.detail = message
        where = f"{file}: tensor {tensor!r}: " if tensor else f"{file}: "
        super().__init__(where + message)

    def __reduce__(self):  # picklable across worker processes
        return (SourceError, (self.file, self.detail, self.tensor))


class PlanError(ConversionError):
    """The metadata-only validation pass found problems (listed one per line)."""

    def __init__(self, problems: list[str], limit: int = 25):
        self.problems = problems
        shown = problems[:limit]
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        head = f"validation failed ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"
        super().__init__("\n  ".join([head, *shown]) + more)

    def __reduce__(self):
        return (PlanError, (self.problems,))


class OutputError(ConversionError):
    """The output folder holds something this command must not touch or mix with."""


class LedgerError(ConversionError):
    """The ledger of a job disagrees with the plan or with the bytes on disk."""


# --- one-line messages for what the operating system and the network say ----------------

_WHAT_TO_DO = {
    errno.ENOSPC: "free some space (or choose another output folder) and run the same command "
                  "again: it resumes where it stopped",
    errno.EDQUOT: "raise the quota or free some space, then run the same command again: it "
                  "resumes where it stopped",
    errno.EROFS: "choose a folder on a writable disk",
    errno.EACCES: "choose a folder you can write to (or fix its permissions)",
    errno.EPERM: "choose a folder you can write to (or fix its permissions)",
}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _existing_parent(path: Path) -> Path | None:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return None


def describe_os_error(e: OSError, path: str | os.PathLike | None = None,
                      needed: int | None = None) -> str:
    """One line: the file, what the system said, and what to do (for a full disk: the free
    space, and the file's size when the writer knows it, `needed`)."""
    path = path or e.filename
    what = e.strerror or str(e)
    if path is None:
        return what
    p = Path(path)
    if e.errno == errno.ENOTDIR:
        blocker = _existing_parent(p)
        if blocker is not None and not blocker.is_dir():
            where = f"{p} is" if blocker == p else f"{p}: {blocker} is"
            return (f"{where} a file, not a folder; choose an output path that is a folder or "
                    "does not exist yet")
        return f"{p}: not a folder; choose an output path that is a folder or does not exist yet"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = os.strerror(e.errno)  # pyarrow words it "Error writing bytes to file. Detail: ..."
        where = _existing_parent(p.parent) or p.parent
        try:
            free = f"{human_bytes(shutil.disk_usage(where).free)} free on that disk"
        except OSError:
            free = "free space unknown"
        if needed is not None:
            free = f"it needs {human_bytes(needed)}, {free}"
        return f"{p}: {what.lower()} while writing it ({free}); {_WHAT_TO_DO[e.errno]}"
    if e.errno in _WHAT_TO_DO:
        return f"{p}: {what.lower()}; {_WHAT_TO_DO[e.errno]}"
    return f"{p}: {what}"


class OutputWriteError(OutputError, OSError):
    """Writing into the output failed (a full disk, a read-only file system, ...)."""

    def __init__(self, errno_: int, message: str):
        OSError.__init__(self, errno_, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # picklable across worker processes
        return (OutputWriteError, (self.errno, self.message))


@contextlib.contextmanager
def writing(path: str | os.PathLike, needed: int | None = None):
    """Within: an OSError names `path`, the free space where it matters (and the `needed`
    bytes of the file, when known), and what to do."""
    try:
        yield
    except OutputWriteError:
        raise
    except OSError as e:
        raise OutputWriteError(e.errno, describe_os_error(e, path, needed)) from None


_NETWORK_ERROR_NAMES = {"ConnectError", "ConnectTimeout", "ReadTimeout", "NetworkError",
                        "TransportError", "ProxyError", "OfflineModeIsEnabled", "Timeout",
                        "ConnectionError", "RemoteDisconnected"}


def network_reason(e: BaseException) -> str | None:
    """What failed, if `e` (or what caused it) is a failure to reach a server; else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, socket.gaierror, TimeoutError)) or any(
                c.__name__ in _NETWORK_ERROR_NAMES for c in type(e).__mro__):
            return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        e = e.__cause__ or e.__context__
    return None


_HUB_CLIENT_MODULES = ("httpx", "httpcore", "huggingface_hub", "requests", "urllib3")


def from_hub_client(e: BaseException) -> bool:
    """Whether `e` or what caused it was raised by the Hub client's HTTP stack."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.split(".")[0].rstrip("0123456789") in _HUB_CLIENT_MODULES:
            return True
        e = e.__cause__ or e.__context__
    return False


def hub_unreachable(reason: str, what: str | None = None) -> str:
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    target = f" to read Hub repo {what!r}" if what else ""
    return (f"cannot reach the Hugging Face Hub at {endpoint}{target} ({reason}); check the "
            "network connection (or HF_ENDPOINT), or give a local folder")


class HubUnreachable(ConversionError):
    """The Hub could not be reached (no network, a server down, HF_HUB_OFFLINE set): the
    one line the CLI prints, raised to Python callers too (pipeline/sources.py)."""


@contextlib.contextmanager
def reaching_hub(repo_id: str):
    """Within: a failure to reach the Hub becomes HubUnreachable naming the repo and what to
    do, instead of the Hub client's own exception; anything else passes unchanged."""
    try:
        yield
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 - the Hub client's network errors are many
        reason = network_reason(e)
        if reason is None:
            raise
        if _offline_mode(e):
            raise HubUnreachable(f"HF_HUB_OFFLINE is set, so Hub repo {repo_id!r} cannot be "
                                 "read; unset HF_HUB_OFFLINE, or give a local folder") from None
        raise HubUnreachable(hub_unreachable(reason, repo_id)) from None


def _offline_mode(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(c.__name__ == "OfflineModeIsEnabled" for c in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
    return False


def spawned_worker_hint() -> str:
    """Why worker processes die at once when convert() runs from a script without a
    `__main__` guard; empty when this process is not such a script."""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or "turboquant" in Path(path).parts or Path(path).name == "turboquant":
        return ""
    return (f". If {Path(path).name} calls convert() at its top level: worker processes are "
            "spawned and import the script again, so put the call under "
            "`if __name__ == \"__main__\":` (or pass in_process=True)")

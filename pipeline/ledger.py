"""What is durable: the work folder, each job's ledger and shard writer, completion markers.

The ledger is the source of truth for what is done (Prefect keeps no results or cache):

    OUTPUT/.turboquant/run.json              identity of the conversion (recipe, plan, each
                                             source shard's contents, the files it writes)
    OUTPUT/.turboquant/events.jsonl          one line per thing a run did (start, skip, done)
    OUTPUT/.turboquant/jobs/<job>.partial    the shard being written (header + data so far)
    OUTPUT/.turboquant/jobs/<job>.ledger.jsonl  one line per finished unit, appended after
                                             its bytes are fsync'ed (units are synced
                                             together, every 32 MiB or 2 s)
    OUTPUT/.turboquant/jobs/<job>.done       completion marker, written after the shard's
                                             atomic rename into OUTPUT/
    OUTPUT/.turboquant/complete              the repo files are all written

A job resumes by reading its ledger (a torn last line is dropped), truncating the partial
shard to the end of the last recorded unit, and going on with the next unit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .direct_io import DirectAppender
from .errors import LedgerError, OutputError, writing
from .plan import Job

WORK = ".turboquant"
CRASH_ENV = "TURBOQUANT_CRASH_AT"  # tests: "<point>[:<n>]" SIGKILLs at the n-th such point


def crash_point(name: str) -> None:
    """SIGKILL this process at a named point when TURBOQUANT_CRASH_AT asks (kill tests)."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    count = _CRASH_COUNTS[name] = _CRASH_COUNTS.get(name, 0) + 1
    if count == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


_CRASH_COUNTS: dict[str, int] = {}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, fsync, rename, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, len(data)), _removed_on_failure(tmp), open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    with open(src, "rb") as fi, writing(dst, os.fstat(fi.fileno()).st_size), \
            _removed_on_failure(tmp), open(tmp, "wb") as fo:
        while chunk := fi.read(1 << 22):
            fo.write(chunk)
        fo.flush()
        os.fsync(fo.fileno())
    os.replace(tmp, dst)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path):
    """A temporary file a failed write leaves (a full disk) is removed: it holds space."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@dataclass
class WorkDir:
    output: Path

    @property
    def root(self) -> Path:
        return self.output / WORK

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    @property
    def events_file(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def complete_file(self) -> Path:
        return self.root / "complete"

    @property
    def source_dir(self) -> Path:
        return self.root / "source"

    def partial(self, job: Job) -> Path:
        return self.jobs / f"{job.name}.partial"

    def ledger(self, job: Job) -> Path:
        return self.jobs / f"{job.name}.ledger.jsonl"

    def done(self, job: Job) -> Path:
        return self.jobs / f"{job.name}.done"

    def lock(self, name: str) -> Path:
        return self.root / f"{name}.lock"

    def make(self) -> None:
        self.jobs.mkdir(parents=True, exist_ok=True)

    def event(self, event: str, **fields) -> None:
        """Append one line to events.jsonl (what happened; for people and tests)."""
        line = json.dumps({"t": round(time.time(), 3), "event": event, "pid": os.getpid(),
                           **fields}, sort_keys=True)
        with writing(self.events_file, len(line) + 1), open(self.events_file, "a") as f:
            f.write(line + "\n")

    def events(self) -> list[dict]:
        if not self.events_file.exists():
            return []
        out = []
        for line in self.events_file.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line torn by a kill
        return out

    def read_done(self, job: Job) -> dict | None:
        p = self.done(job)
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            return None  # cannot happen with atomic_write; treat as not done


class FileLock:
    """An exclusive flock on a file, released when the process dies (even by SIGKILL)."""

    def __init__(self, path: Path, what: str):
        self.path, self.what, self.fd = path, what, None

    def acquire(self, wait: float = 0.0) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = None
                    raise OutputError(f"{self.what} is locked by another process (another "
                                      f"conversion of the same output is running: {self.path})")
                time.sleep(0.1)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def free(self) -> bool:
        """Whether no process holds the lock now (asked without creating or writing the
        file; a missing file is free)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # closing drops the shared lock, if taken

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def sync_bytes() -> int:
    """Bytes of finished units a JobWriter lets pile up before it makes them durable
    (TURBOQUANT_SYNC_BYTES; 0 syncs every unit, as the kill tests' crash points expect)."""
    return int(os.environ.get(SYNC_BYTES_ENV, SYNC_BYTES))


SYNC_BYTES_ENV = "TURBOQUANT_SYNC_BYTES"
SYNC_BYTES = 32 << 20  # an fsync pair per 32 MiB of output (not per tensor: 20% of a run)
SYNC_SECONDS = 2.0  # ... or per 2 s, so that the progress bars (read from the ledger) move


class JobWriter:
    """Writes one job's shard at its planned offsets, recording each finished unit.

    Order of durability for units: their bytes are written and fsync'ed, then their ledger
    lines are appended and fsync'ed. Finished units are made durable together, once
    `sync_bytes()` of them or SYNC_SECONDS have piled up, and at the end of the job (an
    fsync costs milliseconds, and a job has hundreds of units); a kill loses at most the
    units not synced yet, which the next run redoes. `finish` renames the complete shard
    into the output folder (atomic), then writes the job's completion marker.
    """

    def __init__(self, work: WorkDir, job: Job):
        self.work, self.job = work, job
        self.partial = work.partial(job)
        self.ledger_path = work.ledger(job)
        self.records: list[dict] = []  # every finished unit, durable or pending
        self.pending: list[dict] = []  # finished units whose ledger lines are not written
        self.sync_bytes = sync_bytes()
        self.synced_at = (0, time.monotonic())  # (shard position, time) of the last sync
        self.f = None
        self.pos = 0

    # --- resume ---------------------------------------------------------------------
    def open(self) -> int:
        """Open (or resume) the partial shard; returns how many units are already done."""
        self.records = self._read_ledger()
        if self.records and not self.partial.exists():
            raise LedgerError(f"{self.ledger_path}: records {len(self.records)} units but the "
                              f"partial shard {self.partial} is gone; rerun with --fresh")
        if not self.records:
            with writing(self.partial), open(self.partial, "wb") as f:
                f.write(self.job.header)
                f.flush()
                os.fsync(f.fileno())
            self.pos = len(self.job.header)
        else:
            end = self.records[-1]["end"]
            size = self.partial.stat().st_size
            if size < end:
                raise LedgerError(f"{self.partial}: {size} bytes but the ledger says units up to "
                                  f"byte {end} are durable; the shard is damaged, rerun with "
                                  "--fresh")
            self._check_header()
            self._verify_records()
            if size > end:
                os.truncate(self.partial, end)  # drop the bytes of the unit that was cut
            self.pos = end
        self.f = DirectAppender(self.partial, self.pos)
        self.synced_at = (self.pos, time.monotonic())
        return len(self.records)

    def _check_header(self) -> None:
        with open(self.partial, "rb") as f:
            if f.read(len(self.job.header)) != self.job.header:
                raise LedgerError(f"{self.partial}: header differs from the plan's; rerun with "
                                  "--fresh")

    def _read_ledger(self) -> list[dict]:
        if not self.ledger_path.exists():
            return []
        data = self.ledger_path.read_bytes()
        lines = data.split(b"\n")
        complete = lines[:-1]  # the part after the last newline is torn (or empty)
        if lines[-1]:
            with open(self.ledger_path, "r+b") as f:  # drop the torn line
                f.truncate(len(data) - len(lines[-1]))
        records = []
        for i, line in enumerate(complete):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise LedgerError(f"{self.ledger_path}: line {i + 1} is not JSON; rerun with "
                                  "--fresh") from None
            unit = self.job.units[i] if i < len(self.job.units) else None
            if unit is None or rec.get("unit") != i or rec.get("key") != unit.key \
                    or rec.get("end") != unit.byte_end:
                raise LedgerError(f"{self.ledger_path}: line {i + 1} does not match unit {i} of "
                                  "the plan; the ledger belongs to another plan, rerun with "
                                  "--fresh")
            records.append(rec)
        return records

    def _verify_records(self) -> None:
        """Re-hash the recorded units' bytes: a ledger line is trusted only if they match."""
        with open(self.partial, "rb") as f:
            for rec in self.records:
                for item in rec["items"]:
                    if _sha256_range(f, item["byte_start"], item["byte_end"]) != item["checksum"]:
                        raise LedgerError(
                            f"{self.partial}: bytes of {item['name']!r} do not match the "
                            "ledger's checksum; the partial shard is damaged, rerun with --fresh")

    # --- writing --------------------------------------------------------------------
    def write(self, data) -> None:
        with writing(self.partial):
            self.f.write(data)
        self.pos += len(memoryview(data).cast("B"))

    def expect(self, offset: int, what: str) -> None:
        if self.pos != offset:
            raise LedgerError(f"{self.job.name}: writing {what!r} at byte {self.pos}, the plan "
                              f"says {offset}")

    def commit(self, index: int, items: list[dict]) -> None:
        """Unit `index` is written: record it, and make the finished units durable if
        enough of them (bytes or time) have piled up since the last sync."""
        unit = self.job.units[index]
        self.expect(unit.byte_end, unit.key)
        rec = {"unit": index, "key": unit.key, "end": unit.byte_end, "items": items}
        self.records.append(rec)
        self.pending.append(rec)
        pos, t = self.synced_at
        if self.pos - pos >= self.sync_bytes or time.monotonic() - t >= SYNC_SECONDS:
            self.sync()

    @contextlib.contextmanager
    def syncing_on_failure(self):
        """Within: a failure (an exception, not a kill) first makes the units finished so
        far durable, so that the next run resumes after them."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.sync()
            with contextlib.suppress(Exception):
                self.close()
            raise

    def sync(self) -> None:
        """Make the pending units durable: fsync their bytes, then append their ledger
        lines and fsync the ledger."""
        if not self.pending:
            return
        with writing(self.partial):
            self.f.sync()
        crash_point("unit_data_durable")
        lines = [(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n").encode()
                 for rec in self.pending]
        data = b"".join(lines)
        with writing(self.ledger_path), open(self.ledger_path, "ab") as lf:
            half = len(data) - len(lines[-1]) // 2  # the torn point: half the last line
            lf.write(data[:half])
            lf.flush()
            crash_point("ledger_torn")
            lf.write(data[half:])
            lf.flush()
            os.fsync(lf.fileno())
        self.pending.clear()
        self.synced_at = (self.pos, time.monotonic())
        crash_point("unit_committed")

    def finish(self, run: int) -> dict:
        """Rename the complete shard into the output folder, then write the done marker."""
        if self.pos != self.job.size:
            raise LedgerError(f"{self.job.name}: shard has {self.pos} bytes, the plan says "
                              f"{self.job.size}")
        self.sync()  # every unit in the ledger before the rename (_adopt_renamed counts them)
        with writing(self.partial):
            self.f.sync()
            self.f.close()
        self.f = None
        crash_point("before_rename")
        final = self.work.output / self.job.shard
        os.replace(self.partial, final)
        fsync_dir(self.work.output)
        crash_point("after_rename")
        return self.mark_done(run)

    def mark_done(self, run: int) -> dict:
        marker = {"job": self.job.name, "shard": self.job.shard, "size": self.job.size,
                  "units": len(self.job.units), "run": run}
        atomic_write(self.work.done(self.job), json.dumps(marker, sort_keys=True).encode())
        crash_point("after_marker")
        return marker

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _sha256_range(f, start: int, end: int) -> str:
    h = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        b = f.read(min(left, 1 << 22))
        if not b:
            break
        h.update(b)
        left -= len(b)
    return h.hexdigest()


def sha256_file_range(path: Path, start: int, end: int) -> str:
    with open(path, "rb") as f:
        return _sha256_range(f, start, end)


def read_ledger_records(work: WorkDir, job: Job) -> list[dict]:
    """The complete records of a job's ledger (read-only; torn last line ignored)."""
    p = work.ledger(job)
    if not p.exists():
        return []
    out = []
    for line in p.read_bytes().split(b"\n")[:-1]:
        out.append(json.loads(line))
    return out

"""One conversion job, as a plain function: stream its units through the codec into its shard.

`run_job` is what a Prefect task (or a worker process, or a test) calls. It reads each
tensor with positioned reads (one chunk of rows at a time for big matrices), codes it with
`turboquant.stages.encode` (which also measures the coding error, without decoding), and
appends the bytes through `JobWriter`, which records every finished unit in the job's
ledger. It resumes from the ledger if the job was cut short, and returns at once if the
job's marker says it is done.

Trellis-coded tensors (docs/FORMAT.md) take a Viterbi search: on a GPU through
`turboquant.kernels.cuda_trellis_encode.encode_rows_gpu` where it may run (the same
bytes as the CPU path), else on the CPU (stages.trellis, numba). A job prints a progress
line per chunk of trellis rows, at most every PROGRESS_SECONDS: weights done, weights/s
and the time left for the job's trellis tensors (stderr).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checksum import crc32
from .errors import LedgerError, SourceError
from .ledger import FileLock, JobWriter, WorkDir, crash_point, sha256_file_range
from .plan import Item, Job, cut_piece
from .published import PublishedReader
from .safetensors_io import FLOAT_DTYPES, SafetensorsHeader, check_finite, read_raw, to_float32
from .sources import sampled_content_sha256

# weights per chunk of rows (1 MiB as float32): with a worker per core, 4 MiB chunks cost
# ~4% more CPU (1.1B and 4.0B, 4 alternating pairs, 2026-12-05: the workers share the L3),
# 512 KiB ~10% more (per-chunk steps); the bytes do not depend on it. Tests lower it to
# cut tensors in more pieces
CHUNK_ELEMENTS = int(os.environ.get("TURBOQUANT_CHUNK_ELEMENTS", 1 << 18))
RAW_CHUNK = 1 << 26  # bytes per read when copying a raw tensor
PROGRESS_SECONDS = float(os.environ.get("TURBOQUANT_TRELLIS_PROGRESS_SECONDS", 10.0))
# trellis rows are coded in smaller chunks (~3 s each on a CPU at L = 16): the progress
# line comes early and often; the bytes do not depend on the chunking
TRELLIS_CHUNK_ELEMENTS = 1 << 16
# a job looks again this often at how many of the run's jobs hold their lock (see _Cores)
CORES_CHECK_SECONDS = 0.5


@dataclass(frozen=True)
class SourceSpec:
    """How a worker finds a source shard's bytes (picklable; no open connections)."""

    kind: str  # "local" or "hub"
    location: str  # folder, or repo id
    revision: str | None = None
    download_dir: str | None = None


def fetch_shard(spec: SourceSpec, file: str) -> Path:
    if spec.kind == "local":
        return Path(spec.location) / file
    from huggingface_hub import hf_hub_download

    kw = {"local_dir": spec.download_dir} if spec.download_dir else {}
    return Path(hf_hub_download(spec.location, file, revision=spec.revision, **kw))


@dataclass
class JobContext:
    """Everything a job needs, picklable so a worker process can run it."""

    output: str
    job: Job
    headers: dict[str, SafetensorsHeader]
    source: SourceSpec
    refit: bool = True
    run: int = 1
    parent_pid: int | None = None  # a worker exits if this process is gone
    lock_wait: float = 120.0
    identities: dict[str, dict] = field(default_factory=dict)  # source file -> identity
    norm_offset: float = 0.0  # 1 where the family's norms scale by 1 + w (input_energy.py)
    tied_head: bool = False  # the embedding is also the head (tie_word_embeddings)


@dataclass
class JobResult:
    job: str
    shard: str
    units: int
    read_bytes: int  # source bytes converted by this call (0 if skipped)
    skipped: bool = False
    resumed_at: int = 0  # units found done in the ledger when this call started
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


_PARENT: int | None = None  # the process that asked for this job (None: run in-process)


def _check_parent() -> None:
    """A worker whose parent was killed stops at once: no writer outlives its run."""
    if _PARENT is not None and os.getppid() != _PARENT:
        os._exit(3)


def _keep_freed_memory() -> None:
    """Reuse freed memory instead of mapping fresh pages for every chunk (glibc only).

    Coding a chunk allocates several MiB-sized numpy and MLX temporaries; by default glibc
    maps and unmaps each one, and the page faults cost about a quarter of a job's CPU time.
    With these settings blocks under 32 MiB come from the heap, and up to 256 MiB of freed
    heap is kept: the RSS grows by the working set of one chunk (tens of MiB), no more.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (fixed: no dynamic threshold)
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: keep its defaults
        pass


def run_job(ctx: JobContext) -> JobResult:
    """Convert one job (or finish / skip it, per its ledger and marker)."""
    global _PARENT
    _PARENT = ctx.parent_pid
    _keep_freed_memory()
    work = WorkDir(Path(ctx.output))
    job = ctx.job
    t0 = time.monotonic()
    lock = FileLock(work.lock(job.name), f"job {job.name} of {ctx.output}")
    lock.acquire(wait=ctx.lock_wait)
    try:
        if work.read_done(job) is not None:
            work.event("job_skip", job=job.name, run=ctx.run)
            return JobResult(job.name, job.shard, len(job.units), 0, skipped=True,
                             resumed_at=len(job.units))
        final = work.output / job.shard
        writer = JobWriter(work, job)
        if not work.partial(job).exists() and final.exists():
            return _adopt_renamed(work, job, writer, ctx, t0)
        done = writer.open()
        work.event("job_start" if done == 0 else "job_resume", job=job.name, run=ctx.run,
                   units_done=done, units=len(job.units))
        trellis = _TrellisProgress(job, done)
        cores = _Cores(work, job.name)
        with _Reader(ctx) as reader, writer.syncing_on_failure():
            ahead: dict[int, Future] = {}
            for i in range(done, len(job.units)):
                _check_parent()
                ready, ahead = ahead, _look_ahead(job, i + 1, reader, cores)
                items = [_write_item(it, reader, writer, ctx.refit, trellis, cores,
                                     ready.get(id(it)))
                         for it in job.units[i].items]
                writer.commit(i, items)
        marker = writer.finish(ctx.run)
        work.event("job_done", job=job.name, run=ctx.run, shard=job.shard,
                   threads=cores.most)
        read = sum(u.read_bytes for u in job.units[done:])
        return JobResult(job.name, job.shard, len(job.units), read, resumed_at=done,
                         seconds=time.monotonic() - t0, extra=marker)
    finally:
        lock.release()


def _adopt_renamed(work: WorkDir, job: Job, writer: JobWriter, ctx, t0) -> JobResult:
    """The shard was renamed into place but the marker is missing (killed in between)."""
    from .ledger import read_ledger_records

    records = read_ledger_records(work, job)
    final = work.output / job.shard
    if len(records) != len(job.units) or final.stat().st_size != job.size:
        raise LedgerError(f"{final} exists but the ledger of {job.name} is incomplete; it was not "
                          "written by this plan: rerun with --fresh")
    for rec in records:
        for it in rec["items"]:
            if sha256_file_range(final, it["byte_start"], it["byte_end"]) != it["checksum"]:
                raise LedgerError(f"{final}: {it['name']!r} does not match its ledger checksum; "
                                  "rerun with --fresh")
    marker = writer.mark_done(ctx.run)
    work.event("job_adopted", job=job.name, run=ctx.run, shard=job.shard)
    return JobResult(job.name, job.shard, len(job.units), 0, resumed_at=len(job.units),
                     seconds=time.monotonic() - t0, extra=marker)


class _Reader:
    """Open source shards of a job; reads pieces of tensors as arrays."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.fds: dict[str, int] = {}
        self.opening = threading.Lock()  # a look-ahead thread may open a file too
        self._cache_key = None
        self._cache = None
        self._published = None
        self._norms: dict[str, np.ndarray | None] = {}
        self._partner_sums: dict[tuple[str, str], Future] = {}
        self._sums_lock = threading.Lock()
        self.partners = _neuron_partners(ctx)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self._cache = None
        self._published = None

    def fd(self, file: str) -> int:
        with self.opening:
            return self._fd(file)

    def _fd(self, file: str) -> int:
        if file not in self.fds:
            path = fetch_shard(self.ctx.source, file)
            try:
                self.fds[file] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise SourceError(file, f"cannot open ({e.strerror})") from None
            size = os.fstat(self.fds[file]).st_size
            if size != self.ctx.headers[file].file_size:
                raise SourceError(file, f"is {size} bytes now but was {self.ctx.headers[file].file_size} "
                                        "when the conversion was planned: the file changed; "
                                        "rerun with --fresh")
            self._check_contents(file, path)
        return self.fds[file]

    def published(self, item: Item) -> PublishedReader | None:
        """The reader of FP8 / MXFP4 / int4 codes, for an item read through them."""
        if item.published is None:
            return None
        if self._published is None:
            self._published = PublishedReader(self.fd, self.ctx.headers)
        return self._published

    def published_piece(self, item: Item) -> np.ndarray:
        """A published item's expert slice, float32, sliced and transposed."""
        return cut_piece(self.published(item).expert(item.published, item.piece.expert),
                         item.piece)

    def _check_contents(self, file: str, path: Path) -> None:
        """The shard this worker reads is the one the run was planned (and run.json bound)
        with: its sampled bytes match (a file replaced since, or another file at the same
        path on a Dask worker's filesystem, is refused)."""
        want = self.ctx.identities.get(file, {}).get("sample_sha256")
        if want and sampled_content_sha256(path, self.ctx.headers[file]) != want:
            raise SourceError(file, "its contents changed since the conversion was planned "
                                    "(sampled bytes differ); rerun the command (add --fresh "
                                    "to start over from the new contents)")

    def partner_sums(self, file: str, info):
        """(ColumnSums, each row's sum of squares) of a gate/up tensor that a down_proj's
        neuron rule reads (`self.partners`): read once for both pre-passes, its own column
        scales and down_proj's neuron sizes, whichever asks first. The first caller reads it
        on its own thread (never through the pool: a pool thread may be waiting for it);
        later ones wait for that read."""
        key = (file, info.name)
        with self._sums_lock:
            first = key not in self._partner_sums
            if first:
                self._partner_sums[key] = Future()
            done = self._partner_sums[key]
        if first:
            try:
                done.set_result(_partner_sums(self, file, info))
            except BaseException as e:
                done.set_exception(e)
                raise
        return done.result()

    def norm(self, name: str) -> np.ndarray | None:
        """A 1-D float tensor of the job's source files (a norm weight), float64, or None;
        read once a job (a layer's q/k/v or gate/up/down each ask for the same one)."""
        if name not in self._norms:
            self._norms[name] = None
            for file, header in self.ctx.headers.items():
                info = header.tensors.get(name)
                if info is not None and len(info.shape) == 1 and info.dtype in FLOAT_DTYPES:
                    raw = read_raw(self.fd(file), info, 0, info.numel, file)
                    self._norms[name] = to_float32(raw, info.dtype).astype(np.float64)
                    break
        return self._norms[name]

    def info(self, item: Item):
        return self.ctx.headers[item.piece.file].tensors[item.piece.tensor]

    def raw_piece(self, item: Item) -> np.ndarray:
        """The item's values as raw bit patterns (uint8/16/32/64), sliced and transposed."""
        p = item.piece
        info = self.info(item)
        key = (p.file, p.tensor, p.expert)
        if key != self._cache_key:
            self._cache = None  # free before reading the next one
            per = info.numel // info.shape[0]
            raw = read_raw(self.fd(p.file), info, p.expert * per, per, p.file)
            view = raw.view({1: np.uint8, 2: "<u2", 4: "<u4", 8: "<u8"}[info.itemsize])
            self._cache_key, self._cache = key, view.reshape(info.shape[1:])
        return cut_piece(self._cache, p)


def _as_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    return to_float32(bits.reshape(-1).view(np.uint8), dtype).reshape(bits.shape)


class _SourceCrc:
    """CRC-32 of the source values an item reads, as raw bytes in the order it reads them
    (for a whole tensor: its byte range in the source file; for an FP8 / MXFP4 / int4
    tensor: its dequantized float32 values, little-endian, row by row). Recorded in the ledger as
    `source_crc32`, so a repo can be checked against a source tensor by tensor; a CRC
    costs about a tenth of the coding, a sha256 would cost a third."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def trellis_encoder():
    """(name, encoder) for trellis rows: the GPU Viterbi of kernels/cuda_trellis_encode.py
    where it says it may run (`available()`: MLX's CUDA backend and TURBOQUANT_TRELLIS_GPU=1,
    off until a GPU run has shown its paths equal the CPU's), else the CPU's (None: the
    default of stages.encode). stages/ may not import kernels/: the pipeline chooses. A code
    the GPU kernel does not take (`supported`) falls back to the CPU's rows, the same bytes."""
    from turboquant.kernels import cuda_trellis_encode as gpu
    from turboquant.stages import trellis

    if not gpu.available():
        return "CPU", None

    def encode_rows(code, x, group_size, block, valid=None):
        if not gpu.supported(code):
            return trellis.encode_rows(code, x, group_size, block, valid=valid)
        return gpu.encode_rows_gpu(code, x, group_size, block, valid=valid)

    return "GPU", encode_rows


class _TrellisProgress:
    """The job's trellis tensors: weights coded, weights/s, time left (one stderr line at
    most every PROGRESS_SECONDS, and after the last chunk)."""

    def __init__(self, job: Job, done_units: int):
        self.job = job.name
        self.total = sum(it.numel for u in job.units[done_units:] for it in u.items
                         if it.codec == "trellis")
        self.coded = 0
        self.seconds = 0.0
        self.last = time.monotonic()
        self.device, self.encoder = trellis_encoder() if self.total else ("CPU", None)
        if self.total:
            print(f"{self.job}: {self.total:,} weights to trellis-code on the {self.device}",
                  file=sys.stderr, flush=True)

    def add(self, weights: int, seconds: float) -> None:
        self.coded += weights
        self.seconds += seconds
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS and self.coded < self.total:
            return
        self.last = now
        rate = self.coded / max(self.seconds, 1e-9)
        left = (self.total - self.coded) / max(rate, 1e-9)
        print(f"{self.job}: trellis encode on the {self.device}: {self.coded:,} of "
              f"{self.total:,} weights, {rate:,.0f} weights/s, {_duration(left)} left",
              file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Cores:
    """How many threads this job codes its rows with: the machine's usable cores shared
    among the run's jobs running now, read between chunks (at most every
    CORES_CHECK_SECONDS). A running job holds its lock (`WorkDir.lock`, an flock the kernel
    drops when the process dies), so the count is derived from the locks held, never kept:
    a killed job leaves nothing to correct. A job alone on 2 cores codes on 2 threads; two
    jobs on 2 cores on one each. TURBOQUANT_ENCODE_THREADS fixes the number (1: no pool).
    The bytes do not depend on it: chunks are coded independently and written in order."""

    def __init__(self, work: WorkDir, job: str, cores: int | None = None):
        from .machine import usable_cores

        self.root = work.root
        self.job = job
        self.cores = cores or usable_cores()
        fixed = os.environ.get("TURBOQUANT_ENCODE_THREADS")
        self.fixed = max(1, int(fixed)) if fixed else None
        self.checked = -math.inf
        self.now = 1
        self.most = 1  # the most threads used (job_done's event)

    def running(self) -> int:
        """Jobs of this run whose lock is held now (this one counted)."""
        others = sum(1 for p in self.root.glob("*.lock")
                     if p.stem not in ("run", self.job) and not FileLock(p, "").free())
        return 1 + others

    def threads(self) -> int:
        if self.fixed is not None:
            n = self.fixed
        else:
            t = time.monotonic()
            if t - self.checked >= CORES_CHECK_SECONDS:
                self.checked = t
                self.now = max(1, self.cores // self.running())
            n = self.now
        self.most = max(self.most, n)
        return n


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool): a forked
# worker makes its own


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's coding threads (numba kernels with nogil, numpy: both free the GIL)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < threads:
        if _POOL is not None and _POOL[0] == os.getpid():
            _POOL[2].shutdown(wait=False)  # its chunks still finish
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="encode"))
    return _POOL[2]


def _look_ahead(job: Job, index: int, reader: _Reader, cores: _Cores) -> dict[int, Future]:
    """With more than one coding thread: the column-scale pre-passes of unit `index`'s
    source tensors, started on the pool now, so that they run while the unit before is
    coded (they read their own rows; a pre-pass on the job's thread leaves the pool idle).
    {id(item): Future of (in_scales, neuron row sums)}; items it cannot take are prepared
    when written."""
    threads = cores.threads()
    if index >= len(job.units) or threads <= 1:
        return {}
    return {id(it): _pool(threads).submit(_source_in_scales, it, reader)
            for it in job.units[index].items
            if it.codec != "raw" and it.in_scales and it.trellis is None
            and it.piece.expert is None and it.published is None}


def _source_in_scales(item: Item, reader: _Reader, threads: int = 1):
    """(in_scales, neuron row sums or None) of a 2-D tensor read from its source file
    (`_in_scales`'s pre-pass, a chunk of rows at a time; `threads` > 1 reads ahead on the
    pool: not from a pool thread)."""
    out_f, in_f = item.shape
    p = item.piece
    info, fd = reader.info(item), reader.fd(p.file)
    rows = max(1, CHUNK_ELEMENTS // in_f)
    spans = [(r0, min(out_f, r0 + rows)) for r0 in range(0, out_f, rows)]

    def prepass(sums) -> None:
        reads = [lambda a=r0, b=r1: read_raw(fd, info, a * in_f, (b - a) * in_f, p.file)
                 for r0, r1 in spans]
        for (r0, r1), raw in zip(spans, _in_order(reads, threads)):
            _check_parent()
            if info.dtype == "BF16":
                sums.add_bf16(raw.view("<u2").reshape(r1 - r0, in_f))
            else:
                sums.add(to_float32(raw, info.dtype).reshape(r1 - r0, in_f))

    sums = _neuron_row_sums(item, reader)
    if _whole(item, info) and (p.file, p.tensor) in reader.partners:  # gate/up: read once
        return _in_scales(item, reader.partner_sums(p.file, info)[0], _neuron_sizes(sums)), sums
    return _in_scales(item, prepass, _neuron_sizes(sums)), sums


def _whole(item: Item, info) -> bool:
    """The item is its source tensor as stored (no expert, part, transpose or dtype cut)."""
    p = item.piece
    return (p.expert is None and p.parts == 1 and not p.transpose and item.published is None
            and tuple(item.shape) == tuple(info.shape))


def _write_item(item: Item, reader: _Reader, writer: JobWriter, refit: bool,
                trellis: _TrellisProgress | None = None, cores: _Cores | None = None,
                ready: Future | None = None) -> dict:
    writer.expect(item.byte_start, item.name)
    sha = hashlib.sha256()
    crc = _SourceCrc()
    rel_mse = sq_error = None
    energy: dict = {}
    if item.codec == "raw":
        _write_raw(item, reader, writer, sha, crc)
    else:
        sq_error, sq_norm, t, sums = _write_coded(item, reader, writer, sha, crc, refit,
                                                  trellis, cores, ready)
        rel_mse = (0.0 if sq_error == 0.0 else math.inf) if sq_norm == 0.0 else sq_error / sq_norm
        energy = _input_energy(item, reader, t, sums)
    writer.expect(item.byte_end, item.name)
    # sq_error: ||E'||^2 of W / t; times in_energy (mean(t^2 a), a from the layer's own
    # tensors) it is the manifest's out_error (repo.py), or weighted by --input-stats
    return {"name": item.name, "byte_start": item.byte_start, "byte_end": item.byte_end,
            "checksum": sha.hexdigest(), "rel_mse": rel_mse, "sq_error": sq_error,
            "source_crc32": crc.hexdigest(), **energy}


def _input_energy(item: Item, reader: _Reader, t: np.ndarray | None, sums) -> dict:
    """The ledger's {"in_energy": mean(t^2 a), "in_energy_from": "norm" | "neurons" |
    "ones"}: a coded item's input energies from its layer's norm weight and, for a
    down_proj, the gate/up row sums its neuron pre-pass read (pipeline/input_energy.py)."""
    from turboquant.pipeline.input_energy import input_energy, partner_names
    from turboquant.stages.proxy import energy_factor

    src = item.piece.tensor
    rows = dict(zip(partner_names(src), sums[:2])) if sums and partner_names(src) else {}
    a, kind = input_energy(src, item.shape[1], reader.norm, rows.get,
                           reader.ctx.norm_offset, reader.ctx.tied_head)
    return {"in_energy": energy_factor(a, t), "in_energy_from": kind}


def _emit(writer: JobWriter, sha, data: bytes | memoryview) -> None:
    sha.update(data)
    writer.write(data)


def _write_raw(item: Item, reader: _Reader, writer: JobWriter, sha, crc: _SourceCrc) -> None:
    p = item.piece
    src = p.file
    if item.published is not None:
        _write_raw_published(item, reader, writer, sha, crc)
        return
    if p.expert is not None:
        bits = reader.raw_piece(item)
        crc.update(np.ascontiguousarray(bits))
        if item.source_dtype in FLOAT_DTYPES:
            check_finite(_as_float32(bits, item.source_dtype), src, p.tensor)
        _emit(writer, sha, memoryview(bits).cast("B"))
        return
    info = reader.info(item)
    fd = reader.fd(src)
    step = max(1, RAW_CHUNK // info.itemsize)
    for start in range(0, info.numel, step):
        n = min(step, info.numel - start)
        _check_parent()
        raw = read_raw(fd, info, start, n, src)
        crc.update(raw)
        if info.dtype in FLOAT_DTYPES:
            check_finite(to_float32(raw, info.dtype), src, info.name, start)
        _emit(writer, sha, memoryview(raw))


def _write_raw_published(item: Item, reader: _Reader, writer: JobWriter, sha,
                         crc: _SourceCrc) -> None:
    """A kept published tensor: its float32 values (the plan stores it as F32); the CRC
    is of those values (_SourceCrc)."""
    p = item.piece
    if p.expert is not None:
        x = reader.published_piece(item)
        check_finite(x, p.file, p.tensor)
        _emit_values(writer, sha, crc, x)
        return
    out_f = item.shape[0]
    width = item.numel // max(out_f, 1)
    rows = max(1, CHUNK_ELEMENTS // max(width, 1))
    for r0 in range(0, out_f, rows):
        _check_parent()
        x = reader.published(item).rows(item.published, r0, min(out_f, r0 + rows))
        check_finite(x, p.file, p.tensor, r0 * width)
        _emit_values(writer, sha, crc, x)


def _emit_values(writer: JobWriter, sha, crc: _SourceCrc, x: np.ndarray) -> None:
    """Float32 values written as they are (a kept published tensor): they are also what
    its CRC covers."""
    data = np.ascontiguousarray(x, dtype="<f4")
    crc.update(data)
    _emit(writer, sha, memoryview(data).cast("B"))


def _write_coded(item: Item, reader: _Reader, writer: JobWriter, sha, crc: _SourceCrc,
                 refit: bool, trellis: _TrellisProgress | None = None,
                 cores: _Cores | None = None,
                 ready: Future | None = None):
    """The item coded and written, a chunk of rows at a time; (||W - W_hat||^2, ||W||^2,
    of W / t with in_scales; t or None; the neuron pre-pass's gate/up row sums or None).
    `ready`: its in_scales computed ahead (`_look_ahead`)."""
    from turboquant.stages.codec import InScales, encode_np
    from turboquant.stages.fast_convert import bf16_to_float32

    out_f, in_f = item.shape
    if item.trellis is None:
        rows = _scalar_chunk_rows(in_f)
    else:
        rows = max(1, min(CHUNK_ELEMENTS, TRELLIS_CHUNK_ELEMENTS) // in_f)
    p = item.piece
    whole = None
    pub = reader.published(item)
    if pub is not None and p.expert is not None:
        whole = reader.published_piece(item)
        crc.update(np.ascontiguousarray(whole, dtype="<f4"))
    elif p.expert is not None:
        bits = np.ascontiguousarray(reader.raw_piece(item))
        crc.update(bits)
        whole = _as_float32(bits, item.source_dtype)
    elif pub is None:
        info, fd = reader.info(item), reader.fd(p.file)
    spans = [(r0, min(out_f, r0 + rows)) for r0 in range(0, out_f, rows)]
    # a pool thread may read a chunk of the source file itself (a positioned read); the
    # published reader and a whole expert stay on this thread
    reads_anywhere = whole is None and pub is None
    threads = 1 if cores is None or item.trellis is not None else cores.threads()

    def raw_rows(r0: int, r1: int) -> np.ndarray:
        return read_raw(fd, info, r0 * in_f, (r1 - r0) * in_f, p.file)

    def load(r0: int, r1: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Rows r0..r1: (the bytes for the CRC, in order: the raw source bytes, a
        published tensor's float32 values, or None when the CRC has them already; the
        float32 values, checked finite)."""
        if whole is not None:
            x = whole[r0:r1]
        elif pub is not None:
            x = np.ascontiguousarray(pub.rows(item.published, r0, r1), dtype=np.float32)
            check_finite(x, p.file, p.tensor, r0 * in_f)
            return x.astype("<f4", copy=False), x
        else:
            raw = raw_rows(r0, r1)
            if info.dtype == "BF16":  # widened and checked in one pass
                x, finite = bf16_to_float32(raw.view("<u2").reshape(r1 - r0, in_f))
                if not finite:
                    check_finite(x, p.file, p.tensor, r0 * in_f)  # names the first
                return raw, x
            x = to_float32(raw, info.dtype).reshape(r1 - r0, in_f)
            check_finite(x, p.file, p.tensor, r0 * in_f)
            return raw, x
        check_finite(x, p.file, p.tensor, r0 * in_f)
        return None, x

    def prepass(sums) -> None:
        """A whole expert's or a published tensor's rows into `sums` (stages.ColumnSums)."""
        for r0, r1 in spans:
            _check_parent()
            sums.add(whole[r0:r1] if whole is not None else pub.rows(item.published, r0, r1))

    t = sums = None
    if ready is not None:
        t, sums = ready.result()
    elif item.in_scales and reads_anywhere:
        t, sums = _source_in_scales(item, reader, threads)
    elif item.in_scales:
        sums = _neuron_row_sums(item, reader)
        t = _in_scales(item, prepass, _neuron_sizes(sums))
    code_t = None  # ones: the same codes, no multiply
    if t is not None and not (t == 1).all():
        try:  # checked once for the tensor's chunks
            code_t = InScales.of(t, in_f)
        except ValueError as e:
            raise SourceError(p.file, f"cannot be coded: {e}", p.tensor) from None
    codes_spec, scales_spec = item.stored[:2]

    if item.trellis is None:
        codec_args = dict(refit=refit)
    else:
        state_bits, values, block, version = item.trellis
        codec_args = dict(codec="trellis", trellis_state_bits=state_bits,
                          trellis_values=values, trellis_block=block, trellis_version=version,
                          trellis_rows=trellis.encoder if trellis else None)

    def code(x: np.ndarray):
        """One chunk of rows coded (in a pool thread or here): (CodedRows, seconds)."""
        t_start = time.monotonic()
        try:
            coded = encode_np(x, item.bits, item.group_size, seed=item.seed, in_scales=code_t,
                              **codec_args)
        except ValueError as e:
            raise SourceError(p.file, f"cannot be coded: {e}", p.tensor) from None
        return coded, time.monotonic() - t_start

    def load_and_code(r0: int, r1: int):
        raw, x = load(r0, r1)
        return raw, code(x)

    scales_parts: list[bytes] = []
    err_rows: list[np.ndarray] = []  # per-row sums: the total does not depend on chunking
    norm_rows: list[np.ndarray] = []

    def write(r0: int, r1: int, done: Future) -> None:
        raw, (coded, seconds) = done.result()
        if raw is not None:
            crc.update(raw)
        if item.trellis is not None and trellis is not None:
            trellis.add(coded.shape[1] * (r1 - r0), seconds)
        codes, scales = coded.codes, coded.scales
        want_c = (r1 - r0, codes_spec.shape[1])
        want_s = (r1 - r0, scales_spec.shape[1])
        if (codes.shape != want_c or scales.shape != want_s
                or coded.spec.padded_in != item.padded_in):
            raise LedgerError(f"{item.name}: the codec returned codes {codes.shape} / scales "
                              f"{scales.shape}, the format says {want_c} / {want_s}")
        _emit(writer, sha, memoryview(np.ascontiguousarray(codes, dtype="<u4")).cast("B"))
        scales_parts.append(np.ascontiguousarray(scales, dtype="<f2").tobytes())
        # ||W - decode(coded)||^2 and ||W||^2 per row, measured by encode (the rotation is
        # orthogonal, so no decode is needed)
        err_rows.append(coded.row_sq_error)
        norm_rows.append(coded.row_sq_norm)
        if r0 == 0 and r1 < out_f:
            crash_point("mid_tensor")

    # chunks are read, widened and coded on up to `threads` pool threads (a thread reads
    # its own rows), their raw bytes go into the CRC here in order, and they are written
    # in order: the same bytes as one thread. Trellis rows run over the cores already
    # (fast_trellis), so they stay on one thread
    pending: deque[tuple[int, int, Future]] = deque()
    for r0, r1 in spans:
        _check_parent()
        if threads > 1 and reads_anywhere:
            done = _pool(threads).submit(load_and_code, r0, r1)
        elif threads > 1:
            raw, x = load(r0, r1)
            done = _pool(threads).submit(lambda raw=raw, x=x: (raw, code(x)))
        else:
            done = Future()
            done.set_result(load_and_code(r0, r1))
        pending.append((r0, r1, done))
        while len(pending) > threads or (pending and pending[0][2].done()):
            write(*pending.popleft())
        if cores is not None and item.trellis is None:
            threads = cores.threads()
    while pending:
        write(*pending.popleft())
    for s in scales_parts:
        _emit(writer, sha, s)
    if t is not None:  # FORMAT.md version 2: after the scales, inside the item's range
        _emit(writer, sha, np.ascontiguousarray(t, dtype="<f2").tobytes())
    err2 = math.fsum(np.concatenate(err_rows))  # exact, so order and chunking do not matter
    norm2 = math.fsum(np.concatenate(norm_rows))
    return err2, norm2, t, sums


def _scalar_chunk_rows(in_f: int) -> int:
    """Rows a chunk of a scalar-coded tensor holds: CHUNK_ELEMENTS' worth, rounded up to
    whole tiles of the compiled rotation (stages.fast_hadamard.TILE rows; a part tile
    costs a whole one: 11008 columns gave 23 rows, 9.6 ns a weight, where 32 give 6.8).
    Rows are coded independently: the bytes do not depend on it."""
    from turboquant.stages.fast_hadamard import TILE

    rows = max(1, CHUNK_ELEMENTS // in_f)
    return -(-rows // TILE) * TILE


def _in_order(reads: list, threads: int):
    """The results of `reads` (callables), in order: with threads > 1 up to `threads` run
    ahead on the pool (positioned reads free the GIL) while the caller uses the earlier
    ones; else each runs when its turn comes."""
    if threads <= 1:
        for read in reads:
            yield read()
        return
    ahead: deque[Future] = deque()
    for read in reads:
        ahead.append(_pool(threads).submit(read))
        if len(ahead) > threads:
            yield ahead.popleft().result()
    while ahead:
        yield ahead.popleft().result()


def _in_scales(item: Item, prepass, sizes: np.ndarray | None = None) -> np.ndarray:
    """The item's in_scales from a pre-pass over its rows (`prepass(sums)` adds them to a
    stages.ColumnSums a chunk at a time: bounded memory; or the ColumnSums already summed):
    each input column's sum of squares, then `stages.column_scales_from_sums` (or, for a
    down projection with a massive neuron in `sizes`, `stages.neuron_column_scales`); ones
    where no column is small (the weight is then coded exactly as without)."""
    from turboquant.stages.scale import (ColumnSums, column_scales_from_sums,
                                         neuron_column_scales)

    out_f, in_f = item.shape
    if isinstance(prepass, ColumnSums):
        sums = prepass
    else:
        sums = ColumnSums(in_f)
        prepass(sums)
    t = None
    if sizes is not None and sizes.shape == (in_f,):
        t = neuron_column_scales(sums.total(), out_f, sizes, item.neuron_ratio)
    if t is None:
        t = column_scales_from_sums(sums.total(), out_f, min_ratio=item.column_min_ratio)
    return np.ones(in_f, dtype=np.float16) if t is None else t


def _neuron_sizes(sums) -> np.ndarray | None:
    """A down projection's MLP neuron sizes from `_neuron_row_sums`
    (`stages.neuron_sizes_from_sums`), or None where it gave none (the column rule then
    decides)."""
    from turboquant.stages.scale import neuron_sizes_from_sums

    return None if sums is None else neuron_sizes_from_sums(*sums)


def _neuron_partner_names(item: Item) -> tuple[str, str] | None:
    """The source names of the gate and up projections whose rows a down projection's
    neuron rule reads (`item.neuron_ratio`), or None: not such a down_proj."""
    src = item.piece.tensor
    if (item.neuron_ratio is None or item.published is not None or item.piece.expert is not None
            or ".down_proj." not in src):
        return None
    return src.replace(".down_proj.", ".gate_proj."), src.replace(".down_proj.", ".up_proj.")


def _partner_source(headers: dict, name: str):
    """(file, TensorInfo) of a 2-D float tensor of the job's source files, or None."""
    for file, header in headers.items():
        info = header.tensors.get(name)
        if info is not None and len(info.shape) == 2 and info.dtype in FLOAT_DTYPES:
            return file, info
    return None


def _neuron_partners(ctx: JobContext) -> set[tuple[str, str]]:
    """(file, tensor) of every gate/up tensor a down_proj of this job reads for its neuron
    sizes: their own pre-pass reads them through `_Reader.partner_sums`, once for both."""
    found = set()
    for unit in ctx.job.units:
        for item in unit.items:
            for name in _neuron_partner_names(item) or ():
                source = _partner_source(ctx.headers, name)
                if source is not None:
                    found.add((source[0], name))
    return found


def _neuron_row_sums(item: Item, reader: _Reader):
    """(gate rows' sums of squares, up rows', their input width) of a down projection's MLP
    (`stages.row_square_sums`, from `_Reader.partner_sums`), or None: not a down_proj with
    the recipe's neuron_ratio, or its partners are not in the job's files."""
    names = _neuron_partner_names(item)
    if names is None:
        return None
    found = [_partner_source(reader.ctx.headers, name) for name in names]
    if None in found:
        return None
    sums = [reader.partner_sums(file, info)[1] for file, info in found]
    if sums[0].shape != sums[1].shape:
        return None
    return sums[0], sums[1], found[0][1].shape[1]


def _partner_sums(reader: _Reader, file: str, info):
    """A gate/up tensor's (ColumnSums, row sums of squares: `stages.row_square_sums`) in one
    pass (`ColumnSums.add_with_row_sums`), a chunk of rows at a time, read on this thread."""
    from turboquant.stages.scale import ColumnSums

    out_f, in_f = info.shape
    step = max(1, CHUNK_ELEMENTS // in_f)
    fd = reader.fd(file)
    bf16 = info.dtype == "BF16"
    columns = ColumnSums(in_f)
    rows = np.empty(out_f, dtype=np.float64)
    for r0 in range(0, out_f, step):
        r1 = min(out_f, r0 + step)
        _check_parent()
        raw = read_raw(fd, info, r0 * in_f, (r1 - r0) * in_f, file)
        chunk = (raw.view("<u2") if bf16 else to_float32(raw, info.dtype)).reshape(r1 - r0, in_f)
        rows[r0:r1] = columns.add_with_row_sums(chunk, bf16=bf16)
    return columns, rows

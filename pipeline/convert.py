"""Conversion as plain functions: validate -> prepare the output -> run jobs -> repo files.

`convert(options)` runs the whole thing without Prefect; `turboquant.pipeline.flow` wraps
the same steps as a Prefect flow with one task per job. Jobs run in worker processes
(`workers` of them; MLX is used from one thread per process) or, with `in_process`, one
after the other in this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from . import output
from .distributed import run_on_dask
from .errors import ConversionError, spawned_worker_hint
from .input_energy import norm_offset
from .job import JobContext, JobResult, SourceSpec, run_job
from .ledger import FileLock, WorkDir, atomic_write
from .machine import worker_context
from .plan import GB, Job, Plan, build_plan
from .progress import Progress
from .repo import RepoSummary, summarize, write_repo_files
from .sources import HubSource, LocalSource, Source, open_source


@dataclass
class ConvertOptions:
    source: str
    output: str
    recipe: str | None = None
    bits: int | str | None = None
    group_size: int | None = None
    expert_bits: int | str | None = None
    down_proj_bits: int | str | None = None
    embeddings_bits: int | str | None = None
    lm_head_bits: int | str | None = None
    protect_layers: int | None = None
    model_seed: int | None = None
    column_scales: str | None = None  # "auto" / "off": the recipe's [quant] column_scales
    codec: str | None = None  # "scalar" / "trellis": every coded role's code
    trellis_state_bits: int | None = None  # L of the trellis-coded weights
    trellis_values: int | None = None  # V: weights a trellis step codes
    trellis_version: int | None = None  # the trellis's codebook (stages/trellis.py VERSIONS)
    revision: str | None = None
    workers: int = 1
    in_process: bool = False
    fresh: bool = False
    delete_source: bool = False
    min_job_bytes: int = 1 * GB
    max_job_bytes: int = 5 * GB
    progress: bool = True
    check_disk: bool = True
    dask_workers: int = 0  # > 0: jobs on a local Dask cluster of this many processes
    dask_address: str | None = None  # jobs on the Dask scheduler at this address
    input_stats: str | None = None  # `turboquant calibrate`'s file: record out_error per tensor

    @property
    def on_dask(self) -> bool:
        return bool(self.dask_workers or self.dask_address)

    def overrides(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "expert_bits": self.expert_bits,
                "down_proj_bits": self.down_proj_bits, "embeddings_bits": self.embeddings_bits,
                "lm_head_bits": self.lm_head_bits, "protect_layers": self.protect_layers,
                "model_seed": self.model_seed, "column_scales": self.column_scales,
                "codec": self.codec, "trellis_state_bits": self.trellis_state_bits,
                "trellis_values": self.trellis_values, "trellis_version": self.trellis_version}


@dataclass
class Prepared:
    options: ConvertOptions
    source: Source
    plan: Plan
    work: WorkDir
    spec: SourceSpec
    run: int = 1
    t0: float = field(default_factory=time.monotonic)


@dataclass
class Summary:
    output: str
    repo: RepoSummary
    read_bytes: int  # source bytes converted in this run
    total_read_bytes: int
    seconds: float
    jobs_run: int
    jobs_skipped: int
    jobs_resumed: int

    @property
    def throughput(self) -> float:
        return self.read_bytes / self.seconds if self.seconds > 0 else 0.0

    def text(self) -> str:
        r = self.repo
        lines = [
            f"converted {r.tensors} tensors ({r.coded_tensors} coded) into {self.output}",
            f"  real bits per weight: {r.coded_bits_per_weight:.3f} coded, "
            f"{r.bits_per_weight:.3f} overall (scales and 16-bit tensors included)",
            f"  size: {_gb(r.files_bytes)} in {r.shards} shard{'s' if r.shards != 1 else ''} "
            f"(source {_gb(self.total_read_bytes)})",
            f"  time: {self.seconds:.1f} s, {_gb(self.read_bytes)} converted this run at "
            f"{self.throughput / 1e6:.1f} MB/s",
        ]
        if self.jobs_skipped or self.jobs_resumed:
            lines.append(f"  resumed: {self.jobs_skipped} finished job(s) skipped, "
                         f"{self.jobs_resumed} resumed mid-way, {self.jobs_run} run")
        return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


# ------------------------------------------------------------------------ validation


def validate(opts: ConvertOptions) -> Prepared:
    """The metadata-only pass: source metadata, headers, recipe, layout, disk. No writes."""
    out = Path(opts.output).resolve()
    work = WorkDir(out)
    download_dir = str(work.source_dir) if opts.delete_source else None
    source = open_source(opts.source, revision=opts.revision, download_dir=download_dir,
                         delete_after=opts.delete_source)
    plan = build_plan(source, opts.recipe, opts.overrides(), opts.min_job_bytes,
                      opts.max_job_bytes)
    if not plan.jobs:
        raise ConversionError(f"{source.description}: the recipe leaves nothing to write")
    if isinstance(source, LocalSource):
        spec = SourceSpec("local", str(source.folder))
    else:
        spec = SourceSpec("hub", source.repo_id, source.commit, download_dir)
    prepared = Prepared(opts, source, plan, work, spec)
    if opts.check_disk:
        check_disk(prepared)
    return prepared


def check_disk(p: Prepared) -> None:
    """Enough free space for what is left to write (and to download, for a Hub source)?"""
    out = p.work.output
    probe = out if out.exists() else next(x for x in out.parents if x.exists())
    free = shutil.disk_usage(probe).free
    need = 0
    for job in p.plan.jobs:
        if p.work.done(job).exists():
            continue
        partial = p.work.partial(job)
        need += job.size - (partial.stat().st_size if partial.exists() else 0)
    if isinstance(p.source, HubSource):
        sizes = {f: p.plan.headers[f].file_size for f in p.plan.headers}
        if p.options.delete_source:
            need += max((sum(sizes[f] for f in j.files) for j in p.plan.jobs), default=0)
        else:
            need += sum(sizes.values())  # worst case: nothing is in the HF cache yet
    need = int(need * 1.01) + (64 << 20)
    if need > free:
        raise ConversionError(
            f"not enough disk space at {probe}: the conversion needs {_gb(need)} more, "
            f"{_gb(free)} is free" + (" (add --delete-source to keep one downloaded shard at a "
                                      "time)" if isinstance(p.source, HubSource) else ""))


# ------------------------------------------------------------------------ the output folder


def _source_folder(p: Prepared) -> Path | None:
    return p.source.folder if isinstance(p.source, LocalSource) else None


def decide_output(p: Prepared) -> output.Decision:
    """What this run may do with its output folder (output.py); refuses before any write."""
    record = output.run_record(p.plan, p.source)
    return output.decide(p.work.output, record, p.options.fresh, _source_folder(p))


def output_lock(p: Prepared) -> FileLock:
    """The output folder's lock (held for the whole run; a second run on it fails fast).
    Every refusal comes first: a refused run writes nothing."""
    decide_output(p)
    p.work.root.mkdir(parents=True, exist_ok=True)
    return FileLock(p.work.lock("run"), f"output folder {p.work.output}")


def prepare_output(p: Prepared) -> int:
    """Under the output's lock: decide again (refusing a folder that is not this
    conversion's), delete a previous conversion's files for --fresh, record this one;
    returns this run's number (1 for a new one)."""
    decision = decide_output(p)
    work = p.work
    output.delete(decision)
    work.output.mkdir(parents=True, exist_ok=True)
    work.make()
    record = output.run_record(p.plan, p.source)
    if not decision.resume:
        atomic_write(work.run_file, json.dumps(record, indent=2, sort_keys=True).encode())
    run = 1 + sum(1 for e in work.events() if e.get("event") == "run_start")
    work.event("run_start", run=run, recipe_hash=record["recipe_hash"], jobs=len(p.plan.jobs))
    return run


# ------------------------------------------------------------------------ jobs


def job_context(p: Prepared, job: Job, parent_pid: int | None = None) -> JobContext:
    headers = {f: p.plan.headers[f] for f in job.files}
    identities = {f: p.plan.identities[f] for f in job.files}
    config = p.plan.config
    return JobContext(str(p.work.output), job, headers, p.spec, p.plan.recipe.refit, p.run,
                      parent_pid, identities=identities,
                      norm_offset=norm_offset(config.get("model_type")),
                      tied_head=bool(config.get("tie_word_embeddings", False)))


def _worker_init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class JobRunner:
    """Runs jobs in a pool of worker processes (spawned), or in this process.

    `start(jobs)` queues jobs on the workers ahead of time (a head start, head_start.py);
    `run(job)` then waits for the one already started instead of starting it again.
    """

    def __init__(self, p: Prepared):
        self.p = p
        self.pool = None
        self.started: dict[str, Future] = {}
        self.parent = os.getpid()  # what a worker checks is alive (job.py)
        if not p.options.in_process:
            ctx, self.parent = worker_context()  # a fork server where there is one (machine.py)
            self.pool = ProcessPoolExecutor(max_workers=max(1, p.options.workers), mp_context=ctx,
                                            initializer=_worker_init)

    def start(self, jobs: list[Job]) -> None:
        """Queue `jobs` on the worker processes now, in this order."""
        if self.pool is None:
            raise ValueError("jobs run in this process (in_process): nothing to start ahead")
        for job in jobs:
            if job.name not in self.started:
                self.started[job.name] = self.pool.submit(
                    run_job, job_context(self.p, job, self.parent))

    def started_ahead(self, job: Job) -> bool:
        return job.name in self.started

    def run(self, job: Job) -> JobResult:
        if self.pool is None:
            return run_job(job_context(self.p, job))
        try:
            future = self.started.get(job.name)
            if future is None:
                future = self.pool.submit(run_job, job_context(self.p, job, self.parent))
            return future.result()
        except BrokenProcessPool:
            raise ConversionError(
                f"a worker process died (killed, or out of memory) while converting {job.name}; "
                "what it finished is in the ledger: run the same command again to resume"
                + spawned_worker_hint()
            ) from None

    def close(self, wait: bool = True) -> None:
        """Stop the worker processes: queued jobs are cancelled and, with `wait`, running
        ones finish and the processes exit before this returns. Without `wait` they exit
        in the background, and a later `close()` waits for them."""
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
            if wait:
                self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def release_sources(p: Prepared) -> None:
    """Delete downloaded source shards that every reading job has finished (--delete-source)."""
    if not p.options.delete_source:
        return
    done = {j.name for j in p.plan.jobs if p.work.done(j).exists()}
    for file, readers in p.plan.readers().items():
        if readers <= done and p.source.release(file):
            p.work.event("source_deleted", file=file, run=p.run)


def finish(p: Prepared, results: list[JobResult]) -> Summary:
    stats = None
    if p.options.input_stats:
        from .calibrate import read_stats

        stats = read_stats(p.options.input_stats)
    repo = write_repo_files(p.plan, p.work, p.source, stats)
    p.work.event("run_done", run=p.run)
    return Summary(
        output=str(p.work.output),
        repo=repo,
        read_bytes=sum(r.read_bytes for r in results),
        total_read_bytes=p.plan.read_bytes,
        seconds=time.monotonic() - p.t0,
        jobs_run=sum(1 for r in results if not r.skipped),
        jobs_skipped=sum(1 for r in results if r.skipped),
        jobs_resumed=sum(1 for r in results if not r.skipped and r.resumed_at > 0),
    )


def finished(opts: ConvertOptions) -> Summary | None:
    """The summary of a finished conversion of this same source, recipe and layout in the
    output folder, found without writing anything (and without Prefect); None when there
    is something to do, or something to report, which the normal run then does."""
    if opts.fresh or opts.delete_source:
        return None
    out = Path(opts.output).resolve()
    work = WorkDir(out)
    if not work.complete_file.exists():
        return None
    try:
        p = validate(dataclasses.replace(opts, check_disk=False))
        decision = decide_output(p)
    except (ConversionError, ValueError, OSError):  # reported by the normal run
        return None
    if not decision.resume or not FileLock(work.lock("run"), "").free():
        return None
    for job in p.plan.jobs:
        shard = out / job.shard
        if work.read_done(job) is None or not shard.is_file() or \
                shard.stat().st_size != job.size:
            return None
    if not all((out / name).is_file() for name in output.REPO_FILES):
        return None
    return Summary(output=str(out), repo=summarize(p.plan), read_bytes=0,
                   total_read_bytes=p.plan.read_bytes, seconds=time.monotonic() - p.t0,
                   jobs_run=0, jobs_skipped=len(p.plan.jobs), jobs_resumed=0)


def convert(opts: ConvertOptions) -> Summary:
    """The whole conversion without Prefect (same steps, same files as the flow)."""
    p = validate(opts)
    with output_lock(p):
        p.run = prepare_output(p)
        progress = Progress(p.plan, p.work, opts.progress, opts.workers)
        progress.start()
        try:
            if opts.on_dask:
                def done(i: int) -> None:
                    progress.job_finished(p.plan.jobs[i])
                    release_sources(p)

                # parent_pid stays None: a Dask worker process is the job's only writer
                contexts = [job_context(p, job) for job in p.plan.jobs]
                results = run_on_dask(opts, contexts, done)
            else:
                with JobRunner(p) as runner:
                    def one(job: Job) -> JobResult:
                        progress.job_started(job)
                        try:
                            return runner.run(job)
                        finally:
                            progress.job_finished(job)
                            release_sources(p)

                    if opts.in_process or opts.workers <= 1:
                        results = [one(j) for j in p.plan.jobs]
                    else:
                        with ThreadPoolExecutor(max_workers=opts.workers) as ex:
                            results = list(ex.map(one, p.plan.jobs))
        finally:
            progress.close()
        return finish(p, results)

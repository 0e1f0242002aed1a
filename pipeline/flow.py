"""The Prefect 3 flow `convert`: validate, one task per job, then the repo files.

Each task wraps a plain function of `turboquant.pipeline.convert` / `.job`. The ledger
decides what is done, not Prefect: no task persists a result and none is cached, so nothing
is ever read back (unpickled) from the output folder, which others may be able to write (a
shared filesystem with Dask workers). A rerun of the same command, or of the same
deployment, runs every job's task again; a finished job's task returns at once (its
completion marker), and a crashed job resumes from its ledger. With `dask_workers` or
`dask_address` the job tasks run on Dask through prefect-dask (pipeline/distributed.py)
instead of this process's worker processes.

The CLI begins a run before it imports Prefect (head_start.py): validation, the output's
lock and its worker processes already converting. `run_convert_flow(opts, head)` hands
that head start to the flow, which takes it over step by step (its tasks wait for the jobs
started for them) and raises its errors where they belong, so the run is recorded alike.

Importing this module first sets Prefect's quiet defaults (warnings only, analytics off;
see flow_env.py) unless Prefect was imported already.
"""

from __future__ import annotations

from .flow_env import configure_prefect_env

configure_prefect_env()

import contextvars  # noqa: E402
import dataclasses  # noqa: E402

from prefect import flow, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402
from prefect.utilities.annotations import quote  # noqa: E402

from .convert import (ConvertOptions, JobRunner, Prepared, Summary, finish,  # noqa: E402
                      job_context, output_lock, prepare_output, release_sources, validate)
from .distributed import check_api_reachable, task_runner  # noqa: E402
from .flow_api import local_api, note_final_state  # noqa: E402
from .head_start import HeadStart  # noqa: E402
from .job import JobContext, JobResult, run_job  # noqa: E402
from .plan import Job  # noqa: E402
from .progress import Progress  # noqa: E402


# The head start (head_start.py) that `run_convert_flow` hands to the flow it runs: set
# for that one call (the flow's parameters are its options; a deployment's run has none)
_HEAD_START: contextvars.ContextVar[HeadStart | None] = contextvars.ContextVar(
    "turboquant_head_start", default=None)


def given_head_start() -> HeadStart | None:
    """The head start handed to this flow run, if any. (The flow calls this rather than
    reading the ContextVar: prefect-dask pickles the flow's function by value, with the
    globals it names, and a ContextVar cannot be pickled.)"""
    return _HEAD_START.get()


# No task persists its result or is cached (the ledger knows what is done): Prefect never
# reads a result file, and writes none into the output folder, not even a failure's
NOTHING_KEPT = {"cache_policy": NO_CACHE, "persist_result": False}

# each task's final state is recorded by the in-process API before it stops (flow_api.py)
RECORDED = {"on_completion": [note_final_state], "on_failure": [note_final_state]}


@task(name="validate", **NOTHING_KEPT, **RECORDED)
def validate_task(options: ConvertOptions, head: HeadStart | None = None) -> Prepared:
    """Metadata only: source headers, recipe coverage, shapes, layout, disk (or the result
    of that same validation, run by the head start before Prefect was up)."""
    return head.validated() if head is not None else validate(options)


@task(name="convert-shard", **NOTHING_KEPT, **RECORDED)
def job_task(job_index: int, prepared, runner, progress) -> JobResult:
    """Convert one job (one output shard) through the plain `run_job`."""
    job = prepared.plan.jobs[job_index]
    progress.job_started(job)
    try:
        return runner.run(job)
    finally:
        progress.job_finished(job)
        release_sources(prepared)


@task(name="convert-shard", **NOTHING_KEPT)
def dask_job_task(ctx: JobContext) -> JobResult:
    """Convert one job on a Dask worker: it gets paths and metadata, never arrays."""
    return run_job(ctx)


@task(name="write-repo-files", **NOTHING_KEPT, **RECORDED)
def finish_task(prepared, results: list[JobResult]) -> Summary:
    return finish(prepared, results)


@flow(name="turboquant-convert", persist_result=False, log_prints=False,
      task_runner=ThreadPoolTaskRunner(max_workers=1))
def convert_flow(
    source: str,
    output: str,
    recipe: str | None = None,
    bits: int | str | None = None,
    group_size: int | None = None,
    expert_bits: int | str | None = None,
    down_proj_bits: int | str | None = None,
    embeddings_bits: int | str | None = None,
    lm_head_bits: int | str | None = None,
    protect_layers: int | None = None,
    model_seed: int | None = None,
    column_scales: str | None = None,
    codec: str | None = None,
    trellis_state_bits: int | None = None,
    trellis_values: int | None = None,
    trellis_version: int | None = None,
    input_stats: str | None = None,
    revision: str | None = None,
    workers: int = 1,
    in_process: bool = False,
    fresh: bool = False,
    delete_source: bool = False,
    min_job_bytes: int = 10**9,
    max_job_bytes: int = 5 * 10**9,
    progress: bool = True,
    check_disk: bool = True,
    dask_workers: int = 0,
    dask_address: str | None = None,
) -> Summary:
    """Convert a Hugging Face checkpoint (folder or Hub repo id) into a TurboQuant repo."""
    opts = ConvertOptions(**{k: v for k, v in locals().items()})
    head = given_head_start()
    p = validate_task(opts, quote(head))
    with head.held() if head is not None else output_lock(p):
        if head is None:
            p.run = prepare_output(p)
        bars = Progress(p.plan, p.work, opts.progress, opts.workers)
        bars.start()
        try:
            if opts.on_dask:  # one task per job on Dask (pipeline/distributed.py)
                results = run_jobs_on_dask(p, bars)
            else:
                with head.jobs() if head is not None else JobRunner(p) as runner:
                    states = []
                    futures = []
                    for job in p.plan.jobs:
                        t = job_task.with_options(name=f"convert-{job.name}")
                        args = (job.index, quote(p), quote(runner), quote(bars))
                        if opts.in_process or opts.workers <= 1:
                            states.append(t(*args, return_state=True))  # in this thread
                        else:
                            futures.append(t.submit(*args))  # bounded by the task runner
                    for f in futures:
                        f.wait()
                        states.append(f.state)
                    results = [state.result() for state in states]  # raises a job's error
        finally:
            bars.close()
        return finish_task(quote(p), results)


def run_jobs_on_dask(p: Prepared, progress) -> list[JobResult]:
    """One Prefect task per job, submitted to Dask through prefect-dask (call inside the
    convert flow)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with get_client(sync_client=True) as client:
        api = str(client.api_url)  # the temporary server's, when none is configured
    check_api_reachable(p.options.dask_address, api)
    # workers report to this flow's API (else each would start a temporary server of its own)
    runner = task_runner(p.options)
    with temporary_settings({PREFECT_API_URL: api}), runner:
        futures = []
        for job in p.plan.jobs:
            # parent_pid stays None: a Dask worker process is the job's only writer
            t = dask_job_task.with_options(name=f"convert-{job.name}")
            futures.append(runner.submit(t, {"ctx": job_context(p, job)}))
        results = []
        for job, fut in zip(p.plan.jobs, futures):
            fut.wait()
            results.append(fut.state.result())  # raises the job's error
            progress.job_finished(job)
            release_sources(p)
        return results


def run_convert_flow(opts: ConvertOptions, head: HeadStart | None = None) -> Summary:
    """Run `convert_flow` with a task runner bounded to `opts.workers` threads, against
    PREFECT_API_URL or, when none is set, Prefect's API served in this process (flow_api.py).
    `head`: what `head_start.begin(opts)` started before Prefect was imported; the flow
    takes it over (and it is closed whatever happens)."""
    runner = ThreadPoolTaskRunner(max_workers=max(1, opts.workers))
    fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    token = _HEAD_START.set(head)
    try:
        with local_api():
            return convert_flow.with_options(task_runner=runner)(**fields)
    finally:
        _HEAD_START.reset(token)
        if head is not None:
            head.close()

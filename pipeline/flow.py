"""The Prefect 3 flow `convert`: validate, one task per job, then the repo files.

Each task wraps a plain function of `turboquant.pipeline.convert` / `.job`. The ledger
decides what is done; Prefect's cache keys are derived from the same identifiers (format
version, recipe hash, plan hash, job, output folder), and a job's cached result is only
trusted while its completion marker exists (`refresh_cache` otherwise). So a rerun of the
same command, or of the same deployment, skips finished jobs, and a crashed job resumes
from its ledger. With `dask_workers` or `dask_address` the job tasks run on Dask through
prefect-dask (pipeline/distributed.py) instead of this process's worker processes.

Importing this module first sets Prefect's quiet defaults (warnings only, analytics off;
see flow_env.py) unless Prefect was imported already.
"""

from __future__ import annotations

from .flow_env import configure_prefect_env

configure_prefect_env()

import dataclasses  # noqa: E402
import hashlib  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402
from prefect.utilities.annotations import quote  # noqa: E402

from turboquant.manifests.schema import FORMAT_VERSION, QUANT_METHOD  # noqa: E402

from .convert import (ConvertOptions, JobRunner, Prepared, Summary, finish,  # noqa: E402
                      output_lock, prepare_output, release_sources, validate)
from .flow_api import local_api  # noqa: E402
from .job import JobContext, JobResult, run_job  # noqa: E402
from .ledger import WORK  # noqa: E402
from .plan import Job  # noqa: E402
from .progress import Progress  # noqa: E402


def job_key(p: Prepared, job: Job) -> str:
    """The Prefect cache key of a job: the same identifiers as its ledger."""
    ident = "|".join([QUANT_METHOD, str(FORMAT_VERSION), p.plan.recipe_hash, p.plan.plan_hash(),
                      job.name, job.shard, str(p.work.output)])
    return "turboquant-job-" + hashlib.sha256(ident.encode()).hexdigest()


def _cache_key(context, parameters) -> str:
    return parameters["key"]


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
def validate_task(options: ConvertOptions) -> Prepared:
    """Metadata only: source headers, recipe coverage, shapes, layout, disk."""
    return validate(options)


@task(name="convert-shard", cache_key_fn=_cache_key, persist_result=True)
def job_task(key: str, job_index: int, prepared, runner, progress) -> JobResult:
    """Convert one job (one output shard) through the plain `run_job`."""
    job = prepared.plan.jobs[job_index]
    progress.job_started(job)
    try:
        return runner.run(job)
    finally:
        progress.job_finished(job)
        release_sources(prepared)


@task(name="convert-shard", cache_key_fn=_cache_key, persist_result=True)
def dask_job_task(key: str, ctx: JobContext) -> JobResult:
    """Convert one job on a Dask worker: it gets paths and metadata, never arrays."""
    return run_job(ctx)


@task(name="write-repo-files", cache_policy=NO_CACHE, persist_result=False)
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
    p = validate_task(opts)
    with output_lock(p):
        p.run = prepare_output(p)
        bars = Progress(p.plan, p.work, opts.progress, opts.workers)
        bars.start()
        try:
            if opts.on_dask:  # one task per job on Dask (pipeline/distributed.py)
                from .distributed import run_jobs_on_dask

                results = run_jobs_on_dask(p, bars)
            else:
                with JobRunner(p) as runner:
                    states = []
                    futures = []
                    for job in p.plan.jobs:
                        t = job_task.with_options(
                            name=f"convert-{job.name}",
                            refresh_cache=not p.work.done(job).exists(),
                        )
                        args = (job_key(p, job), job.index, quote(p), quote(runner), quote(bars))
                        if opts.in_process or opts.workers <= 1:
                            states.append(t(*args, return_state=True))  # in this thread
                        else:
                            futures.append(t.submit(*args))  # bounded by the task runner
                    for f in futures:
                        f.wait()
                        states.append(f.state)
                    results = []
                    for state in states:
                        r = state.result()  # raises the job's error
                        if state.name == "Cached":
                            r = dataclasses.replace(r, skipped=True, read_bytes=0)
                        results.append(r)
        finally:
            bars.close()
        return finish_task(quote(p), results)


def run_convert_flow(opts: ConvertOptions) -> Summary:
    """Run `convert_flow` with a task runner bounded to `opts.workers` threads, against
    PREFECT_API_URL or, when none is set, Prefect's API served in this process (flow_api.py)."""
    runner = ThreadPoolTaskRunner(max_workers=max(1, opts.workers))
    fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    # Prefect's result records (its cache) live with the output they describe
    store = Path(opts.output).resolve() / WORK / "prefect"
    with local_api({PREFECT_LOCAL_STORAGE_PATH: str(store)}):
        return convert_flow.with_options(task_runner=runner)(**fields)

"""Conversion jobs on a Dask cluster: a local one (worker processes on this machine) or an
existing scheduler (`tcp://host:8786`) whose workers share the output folder.

A task gets a `JobContext`: the output folder's path, the job's plan (tensor names, byte
ranges), the source's safetensors headers and where the source lives (a folder path, or a
Hub repo id). Never arrays: each worker reads its own tensors and appends to its own shard
in the shared output folder, so what crosses the network is a few kilobytes per job.

A worker that dies mid-job loses nothing durable: Dask runs the job again on another
worker, which takes the job's lock (free once the dead process is gone), reads the ledger
and resumes after the last recorded unit, into the same bytes. `run_jobs_on_dask` does this
through `prefect-dask`'s task runner (one Prefect task per job, cached like the thread and
process runs); `run_jobs_on_dask_plain` through `distributed` alone (`--no-prefect`).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager

from .convert import Prepared, job_context, release_sources
from .errors import ConversionError
from .job import JobContext, JobResult, run_job


def cluster_kwargs(workers: int) -> dict:
    """A local cluster of `workers` processes with one thread each (MLX is used from one
    thread per process), listening on loopback only, logging warnings only."""
    return {"n_workers": workers, "processes": True, "threads_per_worker": 1,
            "dashboard_address": "127.0.0.1:0", "host": "127.0.0.1",
            "silence_logs": logging.WARNING}


def _quiet() -> None:
    """Dask's scheduler and nannies log every start and stop at INFO; warnings only."""
    for name in ("distributed", "distributed.scheduler", "distributed.nanny",
                 "distributed.core", "distributed.worker", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def task_runner(options):
    """prefect-dask's task runner for `--dask-address` or `--dask-workers`."""
    from prefect_dask import DaskTaskRunner

    _quiet()
    if options.dask_address:
        return DaskTaskRunner(address=options.dask_address)
    return DaskTaskRunner(cluster_kwargs=cluster_kwargs(options.dask_workers))


def _loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    host = urlsplit(url if "://" in url else f"tcp://{url}").hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _contexts(p: Prepared) -> list[JobContext]:
    # parent_pid stays None: a Dask worker process is the job's only writer
    return [job_context(p, job) for job in p.plan.jobs]


def run_jobs_on_dask(p: Prepared, progress) -> list[JobResult]:
    """One Prefect task per job, submitted to Dask (call inside the convert flow)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import (PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH,
                                  temporary_settings)

    from .flow import dask_job_task, job_key

    with get_client(sync_client=True) as client:
        api = str(client.api_url)  # the temporary server's, when none is configured
    address = p.options.dask_address
    if address and _loopback(api) and not _loopback(address):
        raise ConversionError(
            f"the workers of the Dask scheduler at {address} cannot reach this run's Prefect "
            f"API at {api} (loopback): set PREFECT_API_URL to a Prefect server they can "
            "reach, or add --no-prefect")
    # workers report to this flow's API (else each would start a temporary server of its
    # own) and keep the cache records with the output (shared with remote workers)
    settings = {PREFECT_API_URL: api, PREFECT_LOCAL_STORAGE_PATH: str(p.work.prefect_dir)}
    runner = task_runner(p.options)
    with temporary_settings(settings), runner:
        futures = []
        for job, ctx in zip(p.plan.jobs, _contexts(p)):
            t = dask_job_task.with_options(name=f"convert-{job.name}",
                                           refresh_cache=not p.work.done(job).exists())
            futures.append(runner.submit(t, {"key": job_key(p, job), "ctx": ctx}))
        results = []
        for job, fut in zip(p.plan.jobs, futures):
            fut.wait()
            state = fut.state
            r = state.result()  # raises the job's error
            if state.name == "Cached":
                r = dataclasses.replace(r, skipped=True, read_bytes=0)
            results.append(r)
            progress.job_finished(job)
            release_sources(p)
        return results


@contextmanager
def dask_client(options):
    """A `distributed.Client` on the scheduler at `dask_address`, or on a new local cluster."""
    from distributed import Client, LocalCluster

    _quiet()
    if options.dask_address:
        with Client(options.dask_address) as client:
            yield client
        return
    with LocalCluster(**cluster_kwargs(options.dask_workers)) as cluster, Client(cluster) as client:
        yield client


def run_jobs_on_dask_plain(p: Prepared, progress) -> list[JobResult]:
    """The same jobs through `distributed` alone, without Prefect."""
    from distributed import as_completed

    with dask_client(p.options) as client:
        futures = {client.submit(run_job, ctx, pure=False): job
                   for job, ctx in zip(p.plan.jobs, _contexts(p))}
        results = {}
        for fut in as_completed(futures):
            job = futures[fut]
            results[job.name] = fut.result()  # raises the job's error
            progress.job_finished(job)
            release_sources(p)
        return [results[job.name] for job in p.plan.jobs]

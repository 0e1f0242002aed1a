"""Conversion jobs on a Dask cluster: a local one (worker processes on this machine) or an
existing scheduler (`tcp://host:8786`) whose workers share the output folder.

A Dask task gets a `JobContext`: the output folder's path, the job's plan (tensor names,
byte ranges), the source's safetensors headers and where the source lives (a folder path,
or a Hub repo id). Never arrays: each worker reads its own tensors and appends to its own
shard in the shared output folder, so what crosses the network is a few kilobytes per job.

A worker that dies mid-job loses nothing durable: Dask runs the job again on another
worker, which takes the job's lock (free once the dead process is gone), reads the ledger
and resumes after the last recorded unit, into the same bytes.

This module knows jobs (job.py), not conversions: `run_on_dask` runs a list of job
contexts through `distributed` alone (`--no-prefect`, called by convert.py), and
`task_runner` is prefect-dask's runner for the Prefect flow (flow.py), which sits above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager

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


def check_api_reachable(address: str | None, api: str) -> None:
    """The workers of a remote scheduler cannot report to an API on this machine's loopback."""
    if address and _loopback(api) and not _loopback(address):
        raise ConversionError(
            f"the workers of the Dask scheduler at {address} cannot reach this run's Prefect "
            f"API at {api} (loopback): set PREFECT_API_URL to a Prefect server they can "
            "reach, or add --no-prefect")


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


def run_on_dask(options, contexts: list[JobContext],
                on_done: Callable[[int], None]) -> list[JobResult]:
    """Run the jobs of `contexts` through `distributed` alone, without Prefect; calls
    `on_done(i)` as the i-th finishes. Results come back in the order of `contexts`."""
    from distributed import as_completed

    with dask_client(options) as client:
        futures = {client.submit(run_job, ctx, pure=False): i for i, ctx in enumerate(contexts)}
        results: dict[int, JobResult] = {}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()  # raises the job's error
            on_done(i)
        return [results[i] for i in range(len(contexts))]

"""The machine a conversion runs on: how many jobs to run at once, and how workers start.

`default_workers()` is the `--workers` a user gets without asking: one worker process per
usable core (the CPU affinity mask, and a cgroup's CPU quota where one is set), fewer where
the available memory would not hold them (WORKER_BYTES each, beside RESERVE_BYTES for the
command's own process). Jobs are fixed by the plan, not by the machine, so the output bytes
do not depend on it; a run never starts more processes than it has jobs to run.

`worker_context()` is how worker processes start. On Linux, a fork server (multiprocessing's
"forkserver" start method) imports the job's modules and loads encode's compiled kernels
once (pipeline/worker_start.py, about 1.2 s of one core, most of it numba), then forks each
worker from that state in milliseconds; spawned workers would each pay it again. The
server is a single-threaded process that only imports, so forking it is safe. Where the
fork server is not available (macOS, Windows), workers are spawned. The CLI starts the
server first thing (`start_worker_server`), so its loading overlaps the command's own imports
and validation instead of following them. This module imports nothing heavy.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from pathlib import Path

WORKER_BYTES = 512 << 20  # one worker process: ~300 MB peak RSS measured, with room to spare
RESERVE_BYTES = 1 << 30  # the command's own process (Prefect's API) and the page cache
PRELOAD = "turboquant.pipeline.worker_start"


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cgroup_cpu_quota() -> float | None:
    """CPUs allowed by cgroup v2's cpu.max or v1's cfs quota (None: no limit, or unknown)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_memory() -> int | None:
    """Bytes that can be allocated without swapping: MemAvailable, capped by a cgroup limit
    (None where neither is known)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def default_workers(cores: int | None = None, memory: int | None = None) -> int:
    """Worker processes for a run whose `--workers` was not given: one per usable core, as
    many as the available memory holds (at least 1)."""
    cores = usable_cores() if cores is None else cores
    memory = available_memory() if memory is None else memory
    workers = cores
    if memory is not None:
        workers = min(workers, (memory - RESERVE_BYTES) // WORKER_BYTES)
    return max(1, int(workers))


def start_worker_server() -> None:
    """Start the workers' fork server now (where there is one), so that it loads while this
    process imports the pipeline and validates the run; JobRunner then finds it running."""
    worker_context()


def worker_context():
    """(multiprocessing context, pid a worker's parent has) for the job workers: a fork server
    that preloaded the job's modules where available, spawn otherwise. The pid is what a job
    checks its parent against (job.py): the fork server's, which exits when this process
    does, or this process's for spawned workers."""
    if sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods():
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD])
        forkserver.ensure_running()
        pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
        if pid is not None:
            return ctx, pid
    return multiprocessing.get_context("spawn"), os.getpid()

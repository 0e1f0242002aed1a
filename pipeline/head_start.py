"""A conversion's first plain steps, begun before Prefect is imported (issue 3).

Importing Prefect and its server app takes about 2 s of one core, and the in-process API
server starts after that. `begin()` runs what needs no Prefect first: the metadata-only
validation, the output folder's lock, `prepare_output`, and worker processes started on
every job that is not finished yet, so that the jobs convert while Prefect loads.

The flow stays the record and the judge of the run. `convert_flow` takes the head start
over (flow.py): its `validate` task returns the head start's validated plan, it holds the
head start's lock for the rest of the run, and each job's task waits for the job that was
started for it, returns its result (Prefect persists none: the ledger is the record) or
raises its error. After the jobs the idle worker processes exit in the background while
the repo files are written and Prefect's API stops; `close()` (run_convert_flow) waits
for them last. A step of `begin()` that failed is not reported by `begin()`: its
error is kept and raised by the flow at the step it belongs to (the `validate` task, or
the flow itself for the lock and the output checks), so Prefect records the failed run
and the command prints the same one-line error as without a head start.

Only runs whose jobs go to worker processes get a head start: `--in-process` jobs run in
the flow's own thread, and Dask runs ship their jobs from inside the flow.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .convert import ConvertOptions, JobRunner, Prepared, output_lock, prepare_output, validate
from .ledger import FileLock


def applies(opts: ConvertOptions) -> bool:
    """Whether a run with these options can begin before Prefect is up."""
    return not opts.in_process and not opts.on_dask


@dataclass
class HeadStart:
    """What `begin()` did, or the error that stopped it (`error`, at step `failed_at`)."""

    options: ConvertOptions
    prepared: Prepared | None = None
    lock: FileLock | None = None
    runner: JobRunner | None = None
    error: Exception | None = None
    failed_at: str | None = None  # "validate" or "output"

    def validated(self) -> Prepared:
        """The validation's result, or its error (the flow's `validate` task calls this)."""
        if self.failed_at == "validate":
            raise self.error
        return self.prepared

    @contextlib.contextmanager
    def held(self):
        """The output folder, locked and prepared, for the flow's body; raises the error of
        locking or preparing it instead, if that failed. The lock is released on leaving,
        after a failure only once the jobs still running have finished."""
        try:
            if self.failed_at == "output":
                raise self.error
            yield self.prepared
        except BaseException:
            self.close()  # jobs still running finish first
            raise
        self._release_lock()

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @contextlib.contextmanager
    def jobs(self):
        """The worker processes, for the flow's jobs. After a success they are idle and
        exit in the background (about 0.2 s of interpreter teardown, while the repo files
        are written and Prefect's API stops); `close()` then waits for them. After a
        failure, jobs still running finish before this returns."""
        try:
            yield self.runner
        except BaseException:
            self.runner.close()
            raise
        self.runner.close(wait=False)

    def close(self) -> None:
        """Stop the worker processes (queued jobs cancelled, running ones finished) and
        release the lock. Safe to call again."""
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self._release_lock()


def begin(opts: ConvertOptions) -> HeadStart:
    """Validate, lock and prepare the output, and start the unfinished jobs in worker
    processes; a failing step's error is kept in the result, never raised here."""
    head = HeadStart(opts)
    try:
        head.prepared = validate(opts)
    except Exception as e:  # noqa: BLE001 - raised again by the flow's validate task
        head.error, head.failed_at = e, "validate"
        return head
    p = head.prepared
    try:
        lock = output_lock(p)
        lock.acquire()
        head.lock = lock
        p.run = prepare_output(p)
    except Exception as e:  # noqa: BLE001 - raised again by the flow
        head.error, head.failed_at = e, "output"
        head.close()
        return head
    try:
        head.runner = JobRunner(p)
        head.runner.start([job for job in p.plan.jobs if not p.work.done(job).exists()])
    except BaseException:
        head.close()
        raise
    return head

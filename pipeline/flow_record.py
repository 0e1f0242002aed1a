"""A local run's Prefect record, written by a side process: Prefect off the critical path.

With no Prefect API configured (no PREFECT_API_URL in the environment or the active
profile), the flow of a `turboquant convert` run would only report to a server that lives
and dies with the command, and importing and serving Prefect costs ~3.4 s of CPU (issue
40: on 2 cores the whole gap to mlx_lm.convert at 1.1B). So the plain command on a local
machine runs the plain steps (head_start.py: validation, the output's lock, the jobs in
worker processes, the repo files) and a side process records them as the same Prefect
flow run, `turboquant-convert`, with the same task runs (`validate`, `convert-job-NNNNN`,
`write-repo-files`) in the states they ended in, in PREFECT_HOME's database.

The side process starts with the command at the lowest CPU priority (`nice` 19): it imports
Prefect from cycles the jobs leave idle, waits for the run's outcome on its stdin, then
serves Prefect's API (flow_api.local_api) and runs a flow whose tasks restate the steps'
results and errors. The command does not wait for it when it is the process's own command
line (it ends once its summary is printed; the record follows within seconds), and waits
when called from Python (`turboquant.convert.main`), so a caller sees the record at once.
If the command dies before it reports, the record is a failed flow run saying so.

A configured API (a lasting `prefect server`, Prefect Cloud, a deployment's worker), Dask
runs and `--in-process` runs keep the live flow (flow.py); so does `--live-flow`.
Run times in the record are the side process's, not the jobs'; the ledger
(`.turboquant/events.jsonl`) keeps the jobs' own times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NICE = 19  # the side process's CPU priority: the lowest

# the steps of a run, in order; `failed_at` names the one that raised
STEPS = ("validate", "output", "jobs", "finish")


def api_configured(environ=os.environ) -> bool:
    """Whether Prefect would report to a configured API: PREFECT_API_URL in the environment
    or in the active profile of PREFECT_HOME's profiles.toml (read without importing
    Prefect)."""
    if environ.get("PREFECT_API_URL"):
        return True
    home = Path(environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    try:
        import tomllib

        profiles = tomllib.loads((home / "profiles.toml").read_text())
    except (OSError, ValueError):
        return False
    active = environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    return bool(profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL"))


def applies(opts, live_flow: bool = False, environ=os.environ) -> bool:
    """Whether this run's Prefect record is written by a side process (see the docstring)."""
    from .head_start import applies as has_head_start

    return not live_flow and has_head_start(opts) and not api_configured(environ)


class Recorder:
    """The command's end: starts the side process, notes each step's outcome, and sends them
    all at the end (`send`)."""

    def __init__(self, opts, detached: bool = False):
        """`detached`: the command will not wait for the side process, which then holds
        none of its output streams (a caller reading them to their end would wait for it)."""
        self.outcome = {"options": dataclasses.asdict(opts), "failed_at": None, "error": None,
                        "validated": False, "jobs": {}, "summary": None}
        self.sent = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turboquant.pipeline.flow_record"], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if detached else None,
            start_new_session=True)  # a Ctrl-C is recorded, not felt
        self.proc.stdin.write((json.dumps(self.outcome["options"]) + "\n").encode())
        self.proc.stdin.flush()

    def job(self, name: str, result=None, error: BaseException | None = None) -> None:
        self.outcome["jobs"][name] = (
            {"error": _message(error)} if error is not None else dataclasses.asdict(result))

    def failed(self, step: str, error: BaseException) -> None:
        self.outcome["failed_at"], self.outcome["error"] = step, _message(error)

    def send(self, wait: bool) -> None:
        """Hand the outcome over; with `wait`, return once the record is written."""
        if not self.sent:
            self.sent = True
            try:
                self.proc.stdin.write((json.dumps(self.outcome) + "\n").encode())
                self.proc.stdin.close()
            except OSError:  # the side process is gone: no record, the run stands
                pass
        if wait:
            self.proc.wait()


def _message(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C); run the same command again to resume"
    return str(error) or type(error).__name__


def run(head, recorder: Recorder, wait: bool = False):
    """The plain steps of a head-started run (head_start.begin), each outcome noted for the
    record; returns the Summary or raises the failed step's error, as the flow would."""
    from .convert import finish, release_sources
    from .progress import Progress

    opts = head.options
    step = "validate"
    try:
        p = head.validated()
        recorder.outcome["validated"] = True
        step = "output"
        with head.held():
            step = "jobs"
            bars = Progress(p.plan, p.work, opts.progress, opts.workers)
            bars.start()
            try:
                with head.jobs() as runner:
                    def one(job):
                        bars.job_started(job)
                        try:
                            result = runner.run(job)
                        except BaseException as e:
                            recorder.job(job.name, error=e)
                            raise
                        finally:
                            bars.job_finished(job)
                            release_sources(p)
                        recorder.job(job.name, result)
                        return result

                    if opts.workers <= 1:
                        results = [one(job) for job in p.plan.jobs]
                    else:
                        with ThreadPoolExecutor(max_workers=opts.workers) as pool:
                            results = list(pool.map(one, p.plan.jobs))
            finally:
                bars.close()
            step = "finish"
            summary = finish(p, results)
        recorder.outcome["summary"] = summary.text()
        return summary
    except BaseException as e:
        recorder.failed(step, e)
        raise
    finally:
        head.close()
        recorder.send(wait)


# ------------------------------------------------------------------------ the side process


class RecordedError(Exception):
    """A step's error, as the command reported it."""


def record(options: dict, outcome: dict | None) -> None:
    """Record the run as the flow `turboquant-convert` in the Prefect API of this process
    (flow_api.local_api). `outcome` None: the command ended before reporting one."""
    import inspect

    from prefect import flow, task

    from .flow import NOTHING_KEPT, RECORDED, convert_flow
    from .flow_api import local_api

    if outcome is None:
        outcome = {"failed_at": "jobs", "validated": True, "jobs": {}, "error":
                   "the convert command ended before it reported its outcome (killed?); "
                   "run the same command again to resume"}

    @task(name="validate", **NOTHING_KEPT, **RECORDED)
    def validate_step() -> None:
        if not outcome["validated"]:
            raise RecordedError(outcome["error"])

    @task(name="convert-shard", **NOTHING_KEPT, **RECORDED)
    def job_step(entry: dict) -> dict:
        if "error" in entry:
            raise RecordedError(entry["error"])
        return entry

    @task(name="write-repo-files", **NOTHING_KEPT, **RECORDED)
    def finish_step() -> str:
        if outcome["failed_at"] == "finish":
            raise RecordedError(outcome["error"])
        return outcome["summary"]

    def steps(*_args, **_params):
        validate_step()
        if outcome["failed_at"] in ("validate", "output"):
            raise RecordedError(outcome["error"])
        states = [job_step.with_options(name=f"convert-{name}")(entry, return_state=True)
                  for name, entry in outcome["jobs"].items()]
        for state in states:
            state.result()  # raises the first failed job's error
        if outcome["failed_at"] == "jobs":
            raise RecordedError(outcome["error"])
        return finish_step()

    steps.__signature__ = inspect.signature(convert_flow.fn)  # the same parameters
    steps.__doc__ = convert_flow.fn.__doc__
    recorded = flow(name=convert_flow.name, persist_result=False, log_prints=False)(steps)
    with local_api():
        try:
            recorded(**options)
        except RecordedError:
            pass  # recorded as the failed run it was


STARTUP_TIMEOUT = 900  # seconds the side process's API server may take to start


def note_failure(output: str, error: BaseException) -> None:
    """A record that could not be written is said in the run's events.jsonl (the side
    process has no terminal): `prefect_record_failed` with the error."""
    from .ledger import WorkDir

    try:
        WorkDir(Path(output).resolve()).event("prefect_record_failed",
                                              error=f"{type(error).__name__}: {error}")
    except OSError:
        pass


# the cyclic GC's thresholds while Prefect's ~300,000 objects load (as the CLI's own
# `IMPORT_GC_THRESHOLD`, turboquant/convert.py): ~30 young collections instead of ~670
IMPORT_GC_THRESHOLD = (50_000, 20, 100)


def lower_priority(autogroup: Path = Path("/proc/self/autogroup")) -> None:
    """This process at `nice` NICE, and on Linux its autogroup too: the side process starts
    with setsid (a Ctrl-C is recorded, not felt), which gives it an autogroup of its own, and
    where the kernel has them (sched_autogroup_enabled, the default of most distributions)
    the CPU is shared between autogroups first, by their nice values. At the autogroup's
    default, nice 0, the side process took as much CPU as both job workers together (~3 s
    of a 4B run's 26)."""
    try:
        os.nice(NICE)
    except OSError:
        pass
    try:
        autogroup.write_text(str(NICE))
    except OSError:  # not Linux, autogroups disabled, or not allowed: the nice above stands
        pass


def main() -> None:
    """The side process: import Prefect (GC thresholds raised, then what it built frozen
    out of the GC's scans), wait for the outcome, record it, and leave without the
    interpreter's teardown of Prefect's modules (~1 s): by then the API server has
    recorded every task run and stopped, and Prefect's log and event workers are drained."""
    import gc
    import logging

    lower_priority()
    from .flow_env import configure_prefect_env

    # nobody waits for this server: on a loaded machine, at the lowest priority, it may
    # take minutes to start (the command's own limit is 90 s)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
                          str(STARTUP_TIMEOUT))
    configure_prefect_env()
    before = gc.get_threshold()
    gc.set_threshold(*IMPORT_GC_THRESHOLD)
    from .flow_api import import_server_app

    import_server_app()  # while the command runs, from idle cycles
    import prefect  # noqa: F401

    from . import flow  # noqa: F401
    gc.set_threshold(*before)
    gc.freeze()
    options = json.loads(sys.stdin.readline())
    line = sys.stdin.readline()
    status = 0
    try:
        record(options, json.loads(line) if line.strip() else None)
    except BaseException as e:  # noqa: BLE001 - a broken record never touches the run
        import traceback

        traceback.print_exc()
        note_failure(options["output"], e)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    main()

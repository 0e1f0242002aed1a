"""`turboquant convert` as its own process, in the default Prefect mode: once its summary or
its error is out it leaves with os._exit (the interpreter's teardown of Prefect skipped),
with every output, ledger and Prefect record complete and the exit status right. Called in
this process it returns, and leaves the GC as it found it (turboquant/convert.py)."""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.pipeline.verify import verify_repo

# `turboquant ...` as the console script runs it (cli.main() reads sys.argv); the line an
# atexit handler prints shows whether the interpreter's normal exit ran.
LAUNCH = textwrap.dedent("""
    import atexit, sys
    atexit.register(print, "interpreter exit ran")
    from turboquant.cli import main
    sys.exit(main())
""")
SUMMARY = ("converted 21 tensors", "real bits per weight", "size:", "time:")


def no_api_env(**extra) -> dict:
    """This environment without PREFECT_API_URL (the CLI serves Prefect's API itself), and
    with stdout block-buffered into the pipe, as it is unless PYTHONUNBUFFERED is set."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PYTHONUNBUFFERED")}
    return {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


def turboquant(*args, home):
    """Run `turboquant ARGS` in a process of its own, with PREFECT_HOME=home."""
    return subprocess.run([sys.executable, "-c", LAUNCH, *map(str, args)],
                          env=no_api_env(PREFECT_HOME=str(home)), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("cli") / "src", shards=2, layers=2,
                                  hidden=64, intermediate=128, vocab=300)


def prefect_runs(home) -> tuple[list, list]:
    """(flow run states, task run states) recorded in PREFECT_HOME's database."""
    if not (home / "prefect.db").exists():
        return [], []
    with sqlite3.connect(home / "prefect.db") as db:
        flows = [r[0] for r in db.execute("select state_type from flow_run")]
        tasks = [r[0] for r in db.execute("select state_type from task_run")]
    return flows, tasks


def recorded_runs(home, expected: tuple[list, list], timeout: float = 180) -> tuple[list, list]:
    """prefect_runs(home) once it equals `expected`, or as it is after `timeout` seconds:
    a local run's record is written by a side process that may outlive the command
    (pipeline/flow_record.py)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = prefect_runs(home)
        except sqlite3.OperationalError:  # the side process is creating the database
            seen = None
        if seen == expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def test_prefect_mode_leaves_at_once_with_everything_done(source, tmp_path):
    out, home = tmp_path / "out", tmp_path / "prefect"
    run = turboquant("convert", source, out, "-q", "--job-size", "0", "--in-process",
                     home=home)
    assert run.returncode == 0, run.stderr
    assert all(line in run.stdout for line in SUMMARY), run.stdout  # flushed before leaving
    assert "interpreter exit ran" not in run.stdout  # os._exit: no teardown
    assert (out / ".turboquant" / "complete").exists()
    assert verify_repo(out, source).ok
    flows, tasks = prefect_runs(home)  # drained and stopped before leaving
    assert flows == ["COMPLETED"]
    assert tasks == ["COMPLETED"] * 4  # validate, two shards, repo files


def test_prefect_mode_failure_keeps_its_status_and_message(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not a conversion")
    run = turboquant("convert", source, out, "-q", "--in-process", home=tmp_path / "prefect")
    assert run.returncode == 1
    lines = run.stderr.splitlines()
    errors = [x for x in lines if x.startswith("turboquant convert: error:")]
    assert len(errors) == 1 and "is not a TurboQuant conversion" in errors[0], run.stderr
    assert lines == errors, run.stderr  # nothing of Prefect's (its draining workers) around it
    assert "interpreter exit ran" not in run.stdout
    assert (out / "notes.txt").read_text() == "not a conversion"


@pytest.mark.parametrize("mode", ["--no-prefect", "--dry-run"])
def test_modes_without_prefect_exit_normally(source, tmp_path, mode):
    run = turboquant("convert", source, tmp_path / "out", "-q", "--in-process", mode,
                     home=tmp_path / "prefect")
    assert run.returncode == 0, run.stderr
    assert "interpreter exit ran" in run.stdout


def test_in_process_main_returns_and_leaves_the_gc_alone(source, tmp_path, capsys):
    from turboquant.convert import main

    frozen = gc.get_freeze_count()
    assert main([str(source), str(tmp_path / "out"), "-q", "--in-process"]) == 0
    assert "real bits per weight" in capsys.readouterr().out
    assert gc.get_freeze_count() == frozen


def test_own_process_freezes_what_the_prefect_imports_built():
    code = ("import gc, sys\n"
            "from turboquant.convert import _import_flow\n"
            "_import_flow(freeze=True)\n"
            "print(gc.get_freeze_count(), 'prefect.server.api.server' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=no_api_env())
    count, server = run.stdout.split()
    assert int(count) > 100_000 and server == "True"


def job_starts(out) -> list[str]:
    """The jobs whose conversion began (job_start or job_resume events), in order."""
    lines = (out / ".turboquant" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [e["job"] for e in events if e["event"] in ("job_start", "job_resume")]


def test_worker_processes_start_before_prefect_and_are_recorded_as_its_tasks(source, tmp_path):
    """With worker processes the jobs begin before Prefect is imported (the head start,
    pipeline/head_start.py); the flow takes them over: every job ran once, and Prefect
    recorded the same runs as without a head start."""
    out, home = tmp_path / "out", tmp_path / "prefect"
    run = turboquant("convert", source, out, "-q", "--job-size", "0", "--workers", "2",
                     home=home)
    assert run.returncode == 0, run.stderr
    assert all(line in run.stdout for line in SUMMARY), run.stdout
    assert run.stderr == ""  # nothing left behind (e.g. the pool's semaphores) to warn about
    assert sorted(job_starts(out)) == ["job-00001", "job-00002"]  # none started twice
    assert verify_repo(out, source).ok
    # recorded by a side process (pipeline/flow_record.py): the same runs, soon after
    flows, tasks = recorded_runs(home, (["COMPLETED"], ["COMPLETED"] * 4))
    assert flows == ["COMPLETED"]
    assert tasks == ["COMPLETED"] * 4  # validate, two shards, repo files


@pytest.mark.parametrize("damage, message", [
    ("foreign", "is not a TurboQuant conversion"),  # the output step (flow body)
    ("recipe", "recipe"),  # the validation step (validate task)
])
def test_a_head_start_failure_is_one_line_and_a_failed_flow_run(source, tmp_path, damage,
                                                                message):
    """A step of the head start that fails is raised by the flow where it belongs: the
    same one-line error and exit status, and Prefect records the failed run."""
    out, home = tmp_path / "out", tmp_path / "prefect"
    extra = []
    if damage == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("not a conversion")
    else:
        extra = ["--recipe", str(tmp_path / "missing.toml")]
    run = turboquant("convert", source, out, "-q", "--workers", "2", *extra, home=home)
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("turboquant convert: error:"), run.stderr
    assert message in lines[0]
    validate = ["COMPLETED"] if damage == "foreign" else ["FAILED"]
    flows, tasks = recorded_runs(home, (["FAILED"], validate))
    assert flows == ["FAILED"]
    assert tasks == validate  # validate
    if damage == "foreign":
        assert (out / "notes.txt").read_text() == "not a conversion"


def test_own_process_imports_prefect_with_the_gc_thresholds_raised():
    """Prefect's ~300,000 objects would set off hundreds of collections while they load:
    the thresholds are raised for the imports only, then restored."""
    code = ("import gc\n"
            "from turboquant import convert\n"
            "from turboquant.pipeline import flow_api\n"
            "seen = []\n"
            "flow_api.import_server_app = lambda: seen.append(gc.get_threshold())\n"
            "before = gc.get_threshold()\n"
            "convert._import_flow(freeze=False)\n"
            "convert._import_flow(freeze=True)\n"
            "print(seen == [before, convert.IMPORT_GC_THRESHOLD], gc.get_threshold() == before)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=no_api_env())
    assert run.stdout.split() == ["True", "True"]


# `turboquant ...` with a note of when the workers' fork server was asked to start: whether
# the pipeline (and the validation's modules) had been imported by then
WATCH_SERVER = textwrap.dedent("""
    import sys
    from multiprocessing import forkserver
    started = []
    ensure = forkserver.ensure_running
    def watched():
        started.append("turboquant.pipeline.convert" in sys.modules)
        return ensure()
    forkserver.ensure_running = watched
    from turboquant.cli import main
    status = main(sys.argv[1:])
    print("SERVER", started)
    sys.exit(status)
""")


def test_worker_server_starts_before_the_pipeline_loads_and_not_for_a_finished_output(
        source, tmp_path):
    """The fork server's imports (~0.5 s of one core) overlap the command's own from its
    first step (issue 40); a finished output (a no-op rerun) starts no server at all."""
    out = tmp_path / "out"

    def server_calls(*extra):
        run = subprocess.run([sys.executable, "-c", WATCH_SERVER, "convert", str(source),
                              str(out), "-q", "--no-prefect", *extra], env=no_api_env(),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout.split("SERVER ")[-1].strip().replace("False", "false")
                          .replace("True", "true"))

    calls = server_calls("--workers", "2")
    assert calls and calls[0] is False  # asked first, before the pipeline's imports
    assert server_calls("--workers", "2") == []  # finished: nothing to start

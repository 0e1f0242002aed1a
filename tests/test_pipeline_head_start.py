"""The head start (pipeline/head_start.py): a conversion's validation, output lock and worker
processes begin before Prefect is imported, and the Prefect flow takes them over: jobs that
ran (even finished) before Prefect was up are recorded as the flow's task runs, never run
twice, and a failed step is raised by the flow where it belongs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.pipeline.convert import ConvertOptions
from turboquant.pipeline.head_start import HeadStart, applies, begin


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("head") / "src", shards=2, layers=2,
                                  hidden=64, intermediate=128, vocab=300)


def python(code: str, home) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python (Prefect not imported yet), PREFECT_HOME=home, no API."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_HOME=str(home))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def events(out) -> list[dict]:
    lines = (out / ".turboquant" / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_jobs_finished_before_prefect_is_imported_are_the_flows_task_runs(source, tmp_path):
    out, home = tmp_path / "out", tmp_path / "prefect"
    run = python(f"""
        import sys
        from turboquant.pipeline.convert import ConvertOptions
        from turboquant.pipeline.head_start import begin
        opts = ConvertOptions({str(source)!r}, {str(out)!r}, workers=1, progress=False,
                              min_job_bytes=0)
        head = begin(opts)
        for future in head.runner.started.values():
            future.result()  # every job done, and still no Prefect in this process
        print("prefect imported before the flow:", "prefect" in sys.modules)
        from turboquant.pipeline.flow import run_convert_flow
        summary = run_convert_flow(opts, head)
        print("jobs run:", summary.jobs_run, "skipped:", summary.jobs_skipped)
    """, home)
    assert run.returncode == 0, run.stderr
    assert "prefect imported before the flow: False" in run.stdout
    assert "jobs run: 2 skipped: 0" in run.stdout  # the flow's tasks report the jobs' results
    started = [e["job"] for e in events(out) if e["event"] in ("job_start", "job_resume")]
    assert sorted(started) == ["job-00001", "job-00002"]  # each converted once
    with sqlite3.connect(home / "prefect.db") as db:
        tasks = {name.rsplit("-", 1)[0]: state  # names end in "-" and a short hash
                 for name, state in db.execute("select name, state_type from task_run")}
        flows = [r[0] for r in db.execute("select state_type from flow_run")]
    assert flows == ["COMPLETED"]
    assert tasks == {"validate": "COMPLETED", "convert-job-00001": "COMPLETED",
                     "convert-job-00002": "COMPLETED", "write-repo-files": "COMPLETED"}


def test_the_cli_begins_before_importing_prefect(source, tmp_path):
    out = tmp_path / "out"
    run = python(f"""
        import sys
        from turboquant.pipeline import head_start
        begin = head_start.begin
        def watched(opts):
            print("prefect imported at the head start:", "prefect" in sys.modules)
            return begin(opts)
        head_start.begin = watched
        from turboquant.convert import main
        sys.exit(main([{str(source)!r}, {str(out)!r}, "-q", "--workers", "1"]))
    """, tmp_path / "prefect")
    assert run.returncode == 0, run.stderr
    assert "prefect imported at the head start: False" in run.stdout


def test_a_failed_step_is_kept_for_the_flow_and_leaves_nothing_held(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not a conversion")
    head = begin(ConvertOptions(str(source), str(out), workers=1, progress=False))
    assert head.failed_at == "output" and head.lock is None and head.runner is None
    assert head.validated() is head.prepared  # the validation itself passed
    with pytest.raises(type(head.error), match="not a TurboQuant conversion"):
        with head.held():
            pass
    bad = begin(ConvertOptions(str(source), str(tmp_path / "o2"), recipe="no-such-recipe"))
    assert bad.failed_at == "validate"
    with pytest.raises(type(bad.error)):
        bad.validated()
    assert not (tmp_path / "o2").exists()  # nothing written before validation passed


def test_a_head_start_holds_the_output_until_closed(source, tmp_path):
    opts = ConvertOptions(str(source), str(tmp_path / "out"), workers=1, progress=False)
    head = begin(opts)
    try:
        again = begin(opts)  # a second run of the same output
        assert again.failed_at == "output" and "locked" in str(again.error)
    finally:
        head.close()
    head.close()  # twice is fine
    later = begin(opts)
    later.close()
    assert later.error is None


@pytest.mark.parametrize("kw, expected", [
    ({}, True), ({"workers": 2}, True), ({"in_process": True}, False),
    ({"dask_workers": 2}, False), ({"dask_address": "tcp://127.0.0.1:8786"}, False),
])
def test_which_runs_get_a_head_start(kw, expected):
    assert applies(ConvertOptions("src", "out", **kw)) is expected



class _Pool:
    """Stands in for the ProcessPoolExecutor: records how it was shut down."""

    def __init__(self):
        self.shutdowns = []

    def shutdown(self, wait, cancel_futures):
        self.shutdowns.append(wait)


def _head_with(pool) -> HeadStart:
    from turboquant.pipeline.convert import JobRunner

    runner = JobRunner.__new__(JobRunner)
    runner.pool, runner.started = pool, {}
    return HeadStart(ConvertOptions("src", "out"), runner=runner)


def test_idle_workers_exit_in_the_background_and_are_awaited_at_close():
    """After the jobs succeeded the workers' teardown overlaps the rest of the run and
    close() waits for it; after a failure, running jobs finish before jobs() returns."""
    pool = _Pool()
    head = _head_with(pool)
    with head.jobs():
        pass
    assert pool.shutdowns == [False]  # stop, without waiting
    head.close()
    assert pool.shutdowns == [False, True] and head.runner is None
    pool = _Pool()
    with pytest.raises(RuntimeError):
        with _head_with(pool).jobs():
            raise RuntimeError("a job failed")
    assert pool.shutdowns == [True]

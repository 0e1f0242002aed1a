"""A local run's Prefect record, written by a side process (pipeline/flow_record.py): with no
Prefect API configured the command never imports Prefect, and PREFECT_HOME's database gets
the same flow and task runs as the live flow's, failures included."""

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
from turboquant.pipeline.flow_record import Recorder, api_configured, applies


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("rec") / "src", shards=2, layers=2,
                                  hidden=64, intermediate=128, vocab=300)


def env_without_api(home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(home),
            **extra}


def python(code: str, home, **extra) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with PREFECT_HOME=home and no API configured."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=env_without_api(home, **extra), capture_output=True, text=True,
                          timeout=300)


def runs(home) -> tuple[list, list]:
    """([(flow name, state)], sorted [(task name prefix, state)]) in PREFECT_HOME's database."""
    with sqlite3.connect(home / "prefect.db") as db:
        flows = [tuple(r) for r in db.execute("select f.name, r.state_type from flow_run r "
                                              "join flow f on r.flow_id = f.id")]
        tasks = sorted((name.rsplit("-", 1)[0], state)
                       for name, state in db.execute("select name, state_type from task_run"))
    return flows, tasks


def convert_in_python(source, out, home, *args, **env):
    """`turboquant.convert.main` called from Python (it waits for the record), then whether
    Prefect was imported in that process."""
    return python(f"""
        import sys
        from turboquant.convert import main
        if __name__ == "__main__":
            rc = main([{str(source)!r}, {str(out)!r}, "-q", "--job-size", "0", *{list(args)!r}])
            print("status", rc, "prefect imported:", "prefect" in sys.modules)
    """, home, **env)


def test_a_local_run_is_recorded_without_prefect_in_the_command(source, tmp_path):
    out, home = tmp_path / "out", tmp_path / "prefect"
    run = convert_in_python(source, out, home, "--workers", "2")
    assert run.returncode == 0, run.stderr
    assert "status 0 prefect imported: False" in run.stdout
    flows, tasks = runs(home)  # main() returned once the record was written
    assert flows == [("turboquant-convert", "COMPLETED")]
    assert tasks == [("convert-job-00001", "COMPLETED"), ("convert-job-00002", "COMPLETED"),
                     ("validate", "COMPLETED"), ("write-repo-files", "COMPLETED")]


def test_live_flow_runs_prefect_in_the_command(source, tmp_path):
    out, home = tmp_path / "out", tmp_path / "prefect"
    run = convert_in_python(source, out, home, "--workers", "2", "--live-flow")
    assert run.returncode == 0, run.stderr
    assert "status 0 prefect imported: True" in run.stdout
    flows, tasks = runs(home)
    assert flows == [("turboquant-convert", "COMPLETED")]
    assert [state for _, state in tasks] == ["COMPLETED"] * 4


def test_a_failed_job_is_a_failed_task_and_flow(source, tmp_path):
    """A worker killed mid-job: the command reports it in one line, and the record shows
    that job's task failed with the command's message."""
    out, home = tmp_path / "out", tmp_path / "prefect"
    run = convert_in_python(source, out, home, "--workers", "1",
                            TURBOQUANT_CRASH_AT="unit_committed:3", TURBOQUANT_SYNC_BYTES="0")
    assert "status 1" in run.stdout, run.stderr
    assert "a worker process died" in run.stderr
    flows, tasks = runs(home)
    assert flows == [("turboquant-convert", "FAILED")]
    assert ("validate", "COMPLETED") in tasks and ("convert-job-00001", "FAILED") in tasks
    assert ("write-repo-files", "COMPLETED") not in tasks


def test_a_command_that_dies_before_reporting_is_a_failed_flow(source, tmp_path):
    """The side process reads the outcome from its stdin: end of file without one (the
    command was killed) is recorded as a failed run."""
    home = tmp_path / "prefect"
    code = f"""
        from turboquant.pipeline.convert import ConvertOptions
        from turboquant.pipeline.flow_record import Recorder
        rec = Recorder(ConvertOptions({str(source)!r}, {str(tmp_path / 'out')!r}))
        rec.proc.stdin.close()  # as a killed command's pipe ends
        print("side process status", rec.proc.wait())
    """
    run = python(code, home)
    assert "side process status 0" in run.stdout, run.stderr
    flows, tasks = runs(home)
    assert flows == [("turboquant-convert", "FAILED")]
    assert ("validate", "COMPLETED") in tasks


def test_which_runs_are_recorded_by_a_side_process(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {"PREFECT_HOME": str(home)}
    local = ConvertOptions("src", "out", workers=2)
    assert applies(local, environ=env)
    assert not applies(local, live_flow=True, environ=env)
    assert not applies(ConvertOptions("src", "out", in_process=True), environ=env)
    assert not applies(ConvertOptions("src", "out", dask_workers=2), environ=env)
    assert not applies(local, environ={**env, "PREFECT_API_URL": "http://127.0.0.1:4200/api"})
    # a URL in the active profile is a configured API too
    (home / "profiles.toml").write_text('active = "team"\n[profiles.team]\n'
                                        'PREFECT_API_URL = "http://prefect:4200/api"\n'
                                        '[profiles.ephemeral]\n')
    assert api_configured(env) and not applies(local, environ=env)
    assert not api_configured({**env, "PREFECT_PROFILE": "ephemeral"})


def test_the_outcome_sent_is_plain_json(source, tmp_path):
    """What the command hands over: options, each job's result or error, the failed step."""
    rec = Recorder.__new__(Recorder)
    rec.outcome = {"options": {}, "failed_at": None, "error": None, "validated": True,
                   "jobs": {}, "summary": None}
    rec.job("job-00001", error=KeyboardInterrupt())
    rec.failed("jobs", RuntimeError("disk full"))
    text = json.dumps(rec.outcome)
    back = json.loads(text)
    assert back["jobs"]["job-00001"]["error"].startswith("interrupted")
    assert back["failed_at"] == "jobs" and back["error"] == "disk full"


def test_a_record_that_fails_is_said_in_the_runs_events(source, tmp_path):
    """The side process has no terminal: a record it could not write (here its API server
    given no time to start) is a `prefect_record_failed` event of the run."""
    out = tmp_path / "out"
    (out / ".turboquant").mkdir(parents=True)
    code = f"""
        import json
        from turboquant.pipeline.convert import ConvertOptions
        from turboquant.pipeline.flow_record import Recorder
        rec = Recorder(ConvertOptions({str(source)!r}, {str(out)!r}))
        rec.outcome["validated"] = True
        rec.send(wait=True)
        print("side process status", rec.proc.returncode)
    """
    run = python(code, tmp_path / "prefect", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0")
    assert "side process status 1" in run.stdout, run.stderr
    lines = (out / ".turboquant" / "events.jsonl").read_text().splitlines()
    failed = [json.loads(x) for x in lines if "prefect_record_failed" in x]
    assert len(failed) == 1 and "did not start" in failed[0]["error"]


def test_the_side_process_yields_the_cpu_to_the_jobs(source, tmp_path):
    """The side process runs at nice 19, and so does its autogroup (it starts with setsid):
    where the kernel shares the CPU between autogroups first (Linux), its own at nice 0
    took as much CPU as the job workers together."""
    code = f"""
        import os, time
        from pathlib import Path
        from turboquant.pipeline.convert import ConvertOptions
        from turboquant.pipeline.flow_record import Recorder
        rec = Recorder(ConvertOptions({str(source)!r}, {str(tmp_path / 'out')!r}))
        group = Path(f"/proc/{{rec.proc.pid}}/autogroup")
        for _ in range(600):  # its first step lowers its priority
            if os.getpriority(os.PRIO_PROCESS, rec.proc.pid) == 19:
                break
            time.sleep(0.05)
        time.sleep(0.2)
        print("nice", os.getpriority(os.PRIO_PROCESS, rec.proc.pid))
        print("autogroup", group.read_text().split()[-1] if group.exists() else "none")
        rec.proc.kill()  # no record needed here
        rec.proc.wait()
    """
    run = python(code, tmp_path / "prefect")
    assert "nice 19" in run.stdout, run.stderr
    if os.path.exists("/proc/self/autogroup"):
        assert "autogroup 19" in run.stdout, run.stdout

"""`turboquant convert` as its own process, in the default Prefect mode: once its summary or
its error is out it leaves with os._exit (the interpreter's teardown of Prefect skipped),
with every output, ledger and Prefect record complete and the exit status right. Called in
this process it returns, and leaves the GC as it found it (turboquant/convert.py)."""

from __future__ import annotations

import gc
import os
import sqlite3
import subprocess
import sys
import textwrap

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
    with sqlite3.connect(home / "prefect.db") as db:
        flows = [r[0] for r in db.execute("select state_type from flow_run")]
        tasks = [r[0] for r in db.execute("select state_type from task_run")]
    return flows, tasks


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

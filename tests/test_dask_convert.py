"""Conversion jobs on Dask through prefect-dask: a local cluster of 2 worker processes
writes the same bytes as a single process, and a worker SIGKILLed mid-job on a remote-style
scheduler is replaced by another worker that resumes the job from its ledger."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert

pytestmark = pytest.mark.slow


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / ".turboquant" / "events.jsonl").read_text().splitlines()]


def opts(src, out, **kw) -> ConvertOptions:
    return ConvertOptions(str(src), str(out), min_job_bytes=0, progress=False, **kw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("dask")
    src = write_llama_checkpoint(base / "src", layers=4, hidden=128, intermediate=256,
                                 vocab=320, shards=4)
    ref = base / "ref"
    convert(opts(src, ref, in_process=True))  # one process, one job after the other
    return src, snapshot(ref)


def test_local_cluster_of_two_processes_writes_the_same_bytes(checkpoint, tmp_path, monkeypatch):
    from turboquant.pipeline.flow import run_convert_flow

    src, reference = checkpoint
    monkeypatch.setenv("TURBOQUANT_CHUNK_ELEMENTS", "4096")  # longer jobs: both workers busy
    out = tmp_path / "out"
    summary = run_convert_flow(opts(src, out, dask_workers=2))
    assert snapshot(out) == reference
    assert summary.jobs_run == 4
    ev = events(out)
    writers = {e["pid"] for e in ev if e["event"] == "job_done"}
    assert len(writers) == 2 and os.getpid() not in writers  # two Dask worker processes

    again = run_convert_flow(opts(src, out, dask_workers=2))  # Prefect's cache: all skipped
    assert again.jobs_skipped == 4 and snapshot(out) == reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_workers(address: str, n: int, timeout: float = 60) -> None:
    from distributed import Client

    with Client(address, timeout=timeout) as c:
        c.wait_for_workers(n, timeout=timeout)


def test_worker_killed_mid_job_is_resumed_on_another_worker(checkpoint, tmp_path):
    """A scheduler and two workers started apart from the conversion (as on a cluster);
    one is SIGKILLed at its 3rd finished unit. Dask runs its job again on the other worker,
    which resumes from the ledger: same bytes."""
    from turboquant.pipeline.flow import run_convert_flow

    src, reference = checkpoint
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    # every unit synced on its own: "unit_committed:3" is the third unit
    env = dict(os.environ, TURBOQUANT_CHUNK_ELEMENTS="4096", PYTHONUNBUFFERED="1",
               TURBOQUANT_SYNC_BYTES="0")
    env.pop("TURBOQUANT_CRASH_AT", None)
    log = open(tmp_path / "dask.log", "wb")
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
              "--no-nanny", "--host", "127.0.0.1", "--no-dashboard",
              "--local-directory", str(tmp_path / "scratch")]
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler",
                               "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              env=env, stdout=log, stderr=log, start_new_session=True)]
    try:
        procs.append(subprocess.Popen(worker + ["--name", "doomed"], stdout=log, stderr=log,
                                      env=dict(env, TURBOQUANT_CRASH_AT="unit_committed:3"),
                                      start_new_session=True))
        procs.append(subprocess.Popen(worker + ["--name", "steady"], env=env, stdout=log,
                                      stderr=log, start_new_session=True))
        _wait_for_workers(address, 2)
        out = tmp_path / "out"
        run_convert_flow(opts(src, out, dask_address=address))
        assert procs[1].wait(timeout=10) == -signal.SIGKILL  # the doomed worker was killed
        assert snapshot(out) == reference
        ev = events(out)
        resumed = [e for e in ev if e["event"] == "job_resume"]
        assert len(resumed) == 1 and resumed[0]["units_done"] >= 2
        job = resumed[0]["job"]
        starters = {e["pid"] for e in ev if e.get("job") == job and e["event"].startswith("job_")}
        assert len(starters) == 2  # started by one worker, finished by the other
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        log.close()


def test_cli_plain_dask_and_option_errors(checkpoint, tmp_path, capsys):
    from turboquant.convert import main

    src, reference = checkpoint
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--job-size", "0", "--no-prefect",
                 "--dask-workers", "2"]) == 0
    assert snapshot(out) == reference
    assert main([str(src), str(out), "--dask-workers", "2", "--dask-address",
                 "tcp://127.0.0.1:1"]) == 2
    assert "not both" in capsys.readouterr().err


def test_remote_scheduler_needs_a_reachable_prefect_api(checkpoint, tmp_path):
    """With the CLI's temporary Prefect server (loopback), remote workers could not report
    their task runs: refused before anything is submitted, with what to do."""
    from turboquant.pipeline.errors import ConversionError
    from turboquant.pipeline.flow import run_convert_flow

    src, _ = checkpoint
    with pytest.raises(ConversionError, match="set PREFECT_API_URL to a Prefect server"):
        run_convert_flow(opts(src, tmp_path / "out", dask_address="tcp://10.255.255.1:8786"))
    assert not list((tmp_path / "out").glob("*.safetensors"))

"""Kill tests: SIGKILL the real `turboquant convert` command (a subprocess) at exact points
and at random times, rerun it, and check the output is byte-identical to an uninterrupted
run and that the ledger shows finished shards were not redone."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint

pytestmark = pytest.mark.slow

CHUNK = "2048"  # weights per chunk: cuts tensors into pieces, so kills land mid-tensor
MOE_ARGS = ("--no-prefect", "--workers", "2", "--expert-bits", "ternary")
MOE_CHUNK = "65536"


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def cli(src, out, *extra, crash=None, timeout=300, kill_after=None, env_extra=None,
        chunk=CHUNK):
    """Run `python -m turboquant convert` in its own process group; SIGKILL the group
    after `kill_after` seconds if given. Returns (returncode, output)."""
    # TURBOQUANT_SYNC_BYTES=0: every unit synced on its own, so each crash point's n-th
    # occurrence is the n-th unit (test_sigkill_between_batched_syncs sets a batch size)
    env = dict(os.environ, TURBOQUANT_CHUNK_ELEMENTS=chunk, PYTHONUNBUFFERED="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", TURBOQUANT_SYNC_BYTES="0")
    env.pop("TURBOQUANT_CRASH_AT", None)
    if crash:
        env["TURBOQUANT_CRASH_AT"] = crash
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q",
           "--job-size", "0", *extra]
    log = tempfile.TemporaryFile()  # not a pipe: a leftover child could hold it open
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        proc.wait(timeout=kill_after if kill_after else timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if kill_after is None:
            raise
    finally:
        _reap_group(proc.pid)
    log.seek(0)
    return proc.returncode, log.read().decode(errors="replace")


def _reap_group(pgid: int) -> None:
    """Kill what is left of the process group we started (e.g. Prefect's API server)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def done_markers(out: Path) -> dict[str, str]:
    jobs = out / ".turboquant" / "jobs"
    return {p.name: p.read_text() for p in jobs.glob("*.done")} if jobs.exists() else {}


def events(out: Path) -> list[dict]:
    p = out / ".turboquant" / "events.jsonl"
    lines = p.read_text().splitlines() if p.exists() else []
    out_ = []
    for line in lines:
        try:
            out_.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out_


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    base = tmp_path_factory.mktemp("kill")
    src = write_llama_checkpoint(base / "src", layers=4, hidden=128, intermediate=256,
                                 vocab=320, shards=3)
    ref = base / "ref"
    rc, text = cli(src, ref, "--no-prefect", "--in-process")
    assert rc == 0, text
    return src, snapshot(ref)


def check_resumed(src, out, reference, extra=("--no-prefect", "--in-process"), chunk=CHUNK):
    before = done_markers(out)
    runs_before = sum(1 for e in events(out) if e["event"] == "run_start")
    rc, text = cli(src, out, *extra, chunk=chunk)
    assert rc == 0, text
    assert snapshot(out) == reference
    after = done_markers(out)
    for name, content in before.items():  # finished shards were not redone
        assert after[name] == content
    rerun = [e for e in events(out) if e.get("run", 0) > runs_before]
    finished = {n.removesuffix(".done") for n in before}
    redone = {e["job"] for e in rerun if e["event"] in ("job_start", "job_resume")}
    assert not (redone & finished), (redone, finished)
    return rerun


@pytest.mark.parametrize(
    "point",
    [
        "mid_tensor:2",  # codes of a tensor half written
        "unit_data_durable:9",  # bytes fsync'ed, ledger line not yet written
        "ledger_torn:14",  # half a ledger line on disk
        "unit_committed:20",  # right after a ledger line
        "before_rename:2",  # shard complete, not renamed (mid-finalize)
        "after_rename:2",  # renamed, completion marker missing (mid-finalize)
        "after_marker:3",  # last job done, repo files not written
        "repo_manifest:1",  # manifest written, index and config not yet
    ],
)
def test_sigkill_at_a_point_then_resume(tmp_path, dense, point):
    src, reference = dense
    out = tmp_path / "out"
    rc, text = cli(src, out, "--no-prefect", "--in-process", crash=point)
    assert rc == -signal.SIGKILL, text
    assert not (out / ".turboquant" / "complete").exists()
    rerun = check_resumed(src, out, reference)
    kinds = {e["event"] for e in rerun}
    if point.startswith("after_rename"):
        assert "job_adopted" in kinds
    if point.startswith(("mid_tensor", "unit_", "ledger_torn", "before_rename")):
        assert "job_resume" in kinds


@pytest.mark.parametrize("point", ["unit_data_durable:2", "ledger_torn:3", "unit_committed:2"])
def test_sigkill_between_batched_syncs(tmp_path, dense, point):
    """Units made durable a batch at a time (TURBOQUANT_SYNC_BYTES): a kill loses the
    units of the batch not synced yet, and the rerun redoes them to the same bytes."""
    src, reference = dense
    out = tmp_path / "out"
    batched = {"TURBOQUANT_SYNC_BYTES": "20000"}  # several units a sync in this checkpoint
    rc, text = cli(src, out, "--no-prefect", "--in-process", crash=point, env_extra=batched)
    assert rc == -signal.SIGKILL, text
    lines = ledger_lines(out)
    units = sum(1 for e in events(out) if e["event"] in ("job_start", "job_resume"))
    assert lines and units  # killed mid-job, after a sync or within one
    rc, text = cli(src, out, "--no-prefect", "--in-process", env_extra=batched)
    assert rc == 0, text
    assert snapshot(out) == reference
    assert "job_resume" in {e["event"] for e in events(out)}


def test_batched_syncs_fsync_far_less_than_once_a_unit(tmp_path, dense, monkeypatch):
    """In process: with the default batch size this small checkpoint's jobs sync once each
    (at the end), against two fsyncs a unit with TURBOQUANT_SYNC_BYTES=0."""
    from turboquant.pipeline import ledger
    from turboquant.pipeline.convert import ConvertOptions, convert

    src, _ = dense
    counts, snapshots = {}, {}
    real = os.fsync
    for batch in (None, "0"):
        if batch is None:
            monkeypatch.delenv(ledger.SYNC_BYTES_ENV, raising=False)
        else:
            monkeypatch.setenv(ledger.SYNC_BYTES_ENV, batch)
        calls = []
        monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
        out = tmp_path / f"out-{batch}"
        convert(ConvertOptions(str(src), str(out), min_job_bytes=0, in_process=True,
                               progress=False))
        counts[batch] = len(calls)
        snapshots[batch] = snapshot(out)
    assert snapshots[None] == snapshots["0"]  # the same bytes either way
    units = ledger_lines(tmp_path / "out-0")
    assert counts["0"] >= 2 * units
    assert counts[None] < counts["0"] - units


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    """A checkpoint that takes a few seconds and has many units, run by 2 workers."""
    base = tmp_path_factory.mktemp("kill_random")
    src = write_moe_checkpoint(base / "src", style="qwen3_moe", layers=6, hidden=512,
                               intermediate=512, experts=8, vocab=512, shards=4)
    ref = base / "ref"
    rc, text = cli(src, ref, *MOE_ARGS, chunk=MOE_CHUNK)
    assert rc == 0, text
    return src, snapshot(ref), ledger_lines(ref)


def ledger_lines(out: Path) -> int:
    jobs = out / ".turboquant" / "jobs"
    return sum(p.read_bytes().count(b"\n") for p in jobs.glob("*.ledger.jsonl")) \
        if jobs.exists() else 0


def cli_killed_at(src, out, lines: int, jitter: float, timeout: float = 300):
    """Start the CLI; once the ledgers hold `lines` lines, wait `jitter` s and SIGKILL the
    process group (the CLI and its workers). Returns the return code."""
    env = dict(os.environ, TURBOQUANT_CHUNK_ELEMENTS=MOE_CHUNK)
    env.pop("TURBOQUANT_CRASH_AT", None)
    cmd = [sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q",
           "--job-size", "0", *MOE_ARGS]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ledger_lines(out) >= lines:
                time.sleep(jitter)
                break
            time.sleep(0.01)
    finally:
        _reap_group(proc.pid)
        proc.wait()
    return proc.returncode


def test_sigkill_at_random_times_with_worker_processes(tmp_path, bigger):
    """Kill the whole process group (CLI and its workers) at 5 random points of progress,
    each a random moment after a random number of finished units."""
    src, reference, units = bigger
    out = tmp_path / "out"
    rng = random.Random(1234)
    targets = sorted(rng.sample(range(1, units - 1), 5))
    killed = 0
    for target in targets:
        rc = cli_killed_at(src, out, target, rng.uniform(0.0, 0.05))
        if rc == 0:
            break  # it finished within the jitter
        assert rc == -signal.SIGKILL
        killed += 1
        # all units may already be in the ledger: then the kill landed in finalization
        # (shards, index, manifest), which the resume below must handle just as well
        assert ledger_lines(out) <= units
    assert killed >= 3
    check_resumed(src, out, reference, MOE_ARGS, MOE_CHUNK)


def test_killed_parent_leaves_no_second_writer(tmp_path, bigger):
    """SIGKILL only the CLI process: its worker stops by itself (orphan check), and a rerun
    waits for the job lock rather than writing beside it."""
    src, reference, units = bigger
    out = tmp_path / "out"
    env = dict(os.environ, TURBOQUANT_CHUNK_ELEMENTS=MOE_CHUNK)
    cmd = [sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q",
           "--job-size", "0", *MOE_ARGS]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while ledger_lines(out) < units // 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()  # the parent only
    proc.wait()
    try:
        check_resumed(src, out, reference, MOE_ARGS, MOE_CHUNK)
    finally:
        _reap_group(proc.pid)


def test_prefect_flow_resumes_and_a_finished_rerun_writes_nothing(tmp_path, dense):
    """The real Prefect flow: killed mid-job, rerun resumes from the ledger; a third run
    finds the conversion finished before Prefect starts, and writes nothing (not even an
    event)."""
    src, reference = dense
    out = tmp_path / "out"
    home = {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    rc, text = cli(src, out, "--in-process", crash="unit_committed:12", env_extra=home)
    assert rc == -signal.SIGKILL, text
    check_resumed(src, out, reference, ("--in-process",))
    before = events(out)
    rc, text = cli(src, out, "--in-process", env_extra=home)
    assert rc == 0, text
    assert "3 finished job(s) skipped" in text
    assert events(out) == before
    assert snapshot(out) == reference

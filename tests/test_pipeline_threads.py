"""A job codes its rows on more than one thread when cores are idle, with the same bytes.

The count of running jobs is derived from the job locks held (pipeline/job.py `_Cores`),
so a killed job leaves nothing to correct.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

from checkpoints import write_llama_checkpoint

from turboquant.pipeline import job as job_module
from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.ledger import FileLock, WorkDir
from turboquant.pipeline.machine import usable_cores


def _files(out):
    """sha256 of every output shard and of every ledger's items (the ledger's bytes)."""
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
               for f in sorted(out.glob("*.safetensors"))}
    for f in sorted((out / ".turboquant" / "jobs").glob("*.ledger.jsonl")):
        digests[f.name] = [json.loads(line)["items"] for line in f.read_text().splitlines()]
    return digests


def _threads_used(out):
    return [e["threads"] for e in WorkDir(out).events() if e["event"] == "job_done"]


def test_a_job_on_threads_writes_the_same_bytes(tmp_path, monkeypatch):
    src = write_llama_checkpoint(tmp_path / "src", shards=2, layers=2, hidden=256,
                                 intermediate=512, vocab=300)
    monkeypatch.setenv("TURBOQUANT_CHUNK_ELEMENTS", "2048")  # 8 rows a chunk: many chunks
    monkeypatch.setattr(job_module, "CHUNK_ELEMENTS", 2048)
    outs = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("TURBOQUANT_ENCODE_THREADS", threads)
        out = tmp_path / f"out-{threads}"
        convert(ConvertOptions(str(src), str(out), progress=False, min_job_bytes=0,
                               in_process=True))
        outs[threads] = _files(out)
        assert _threads_used(out) == [int(threads)] * 2
    assert len(outs["1"]) == 4 and outs["1"] == outs["3"]
    # a worker alone on the machine takes the cores (told by nothing but the locks)
    monkeypatch.delenv("TURBOQUANT_ENCODE_THREADS")
    out = tmp_path / "out-default"
    convert(ConvertOptions(str(src), str(out), progress=False, min_job_bytes=0, workers=1))
    assert _files(out) == outs["1"]
    assert _threads_used(out) == [usable_cores()] * 2


HOLD = """
import sys, time
from pathlib import Path
from turboquant.pipeline.ledger import FileLock
FileLock(Path(sys.argv[1]), "").acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_idle_cores_are_counted_from_the_locks_held(tmp_path, monkeypatch):
    monkeypatch.delenv("TURBOQUANT_ENCODE_THREADS", raising=False)
    monkeypatch.setattr(job_module, "CORES_CHECK_SECONDS", 0.0)
    work = WorkDir(tmp_path)
    work.make()
    cores = job_module._Cores(work, "job-a", cores=4)
    own = FileLock(work.lock("job-a"), "")
    own.acquire()
    run = FileLock(work.lock("run"), "")  # the head's lock: not a job
    run.acquire()
    assert cores.threads() == 4  # alone: every core
    other = FileLock(work.lock("job-b"), "")
    other.acquire()
    assert cores.threads() == 2
    held = subprocess.Popen([sys.executable, "-c", HOLD, str(work.lock("job-c"))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        assert cores.threads() == 1  # 3 jobs on 4 cores
        os.kill(held.pid, signal.SIGKILL)  # a killed job's lock goes with it
        held.wait()
    finally:
        if held.poll() is None:
            held.kill()
    assert cores.threads() == 2
    other.release()
    assert cores.threads() == 4 and cores.most == 4
    # read between chunks at most every CORES_CHECK_SECONDS
    monkeypatch.setattr(job_module, "CORES_CHECK_SECONDS", 60.0)
    other.acquire()
    assert cores.threads() == 4  # not looked at again within the minute
    other.release()

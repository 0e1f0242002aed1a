"""pipeline/machine.py: the default `--workers` comes from the cores and the memory, and job
workers start from a fork server that loaded the job's modules and the compiled kernels once.
The output bytes do not depend on how many workers ran or how they started."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.convert import build_parser
from turboquant.pipeline import machine
from turboquant.pipeline.convert import ConvertOptions, JobRunner, convert, validate
from turboquant.stages import fast_hadamard

GB = 10**9


def test_default_workers_one_per_core_as_memory_allows():
    assert machine.default_workers(cores=2, memory=16 * GB) == 2
    assert machine.default_workers(cores=64, memory=16 * GB) == (16 * GB - machine.RESERVE_BYTES) \
        // machine.WORKER_BYTES
    assert machine.default_workers(cores=8, memory=machine.RESERVE_BYTES) == 1  # never 0
    assert machine.default_workers(cores=1, memory=64 * GB) == 1


def test_this_machine_is_read():
    cores = machine.usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    memory = machine.available_memory()
    assert memory is None or memory > 0
    assert 1 <= machine.default_workers() <= cores


def test_the_cli_default_is_sized_by_the_machine():
    args = build_parser().parse_args(["src", "out"])
    assert args.workers is None  # filled in by machine.default_workers() when the command runs
    assert build_parser().parse_args(["src", "out", "--workers", "3"]).workers == 3


def _worker_state():
    return {"numba": "numba" in sys.modules, "kernels": fast_hadamard._compiled,
            "ppid": os.getppid()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux")
def test_workers_start_with_the_kernels_loaded(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=1, layers=1, hidden=64,
                                 intermediate=128, vocab=300)
    p = validate(ConvertOptions(str(src), str(tmp_path / "out"), workers=2, progress=False))
    with JobRunner(p) as runner:
        assert runner.pool._mp_context.get_start_method() == "forkserver"
        state = runner.pool.submit(_worker_state).result()
    # the job's modules and kernels came with the fork: no worker imports or loads them
    assert state["numba"] is fast_hadamard.AVAILABLE and state["kernels"] is fast_hadamard.AVAILABLE
    # a job checks that its parent is alive (job.py): the fork server, which ends with us
    assert state["ppid"] == runner.parent != os.getpid()


def _digests(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.glob("*.safetensors"))}


def test_the_bytes_do_not_depend_on_the_workers(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=3, layers=3, hidden=64,
                                 intermediate=128, vocab=300)
    outs = {}
    for opts in (dict(in_process=True), dict(workers=1), dict(workers=3)):
        out = tmp_path / f"out-{len(outs)}"
        convert(ConvertOptions(str(src), str(out), progress=False, min_job_bytes=0, **opts))
        outs[str(opts)] = _digests(out)
    first, *rest = outs.values()
    assert len(first) == 3 and all(d == first for d in rest)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux")
def test_the_fork_server_starts_before_the_pipeline_is_imported():
    # the CLI starts it first thing: machine.py must not pull in the pipeline or numpy
    code = ("import sys, os; from turboquant.pipeline import machine; "
            "machine.start_worker_server(); "
            "from multiprocessing import forkserver; "
            "pid = forkserver._forkserver._forkserver_pid; os.kill(pid, 0); "
            "print(sorted(m for m in ('numpy', 'mlx.core', 'turboquant.pipeline.convert') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"

"""Conversions you can trust (issue 34, items 1-4 and 8): a job is bound to its source's
contents, --fresh decides before it deletes and deletes only a conversion's files, nothing
is unpickled from the output folder, refused runs write nothing, failed runs leave only
what resume needs, and a finished conversion's rerun is found before Prefect is imported.

Each test runs the real `turboquant convert` command in a process of its own."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.pipeline.safetensors_io import read_header

CHUNK = "2048"  # weights per chunk: kills land mid-tensor
SHARD1 = "model-00001-of-00002.safetensors"


def tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: relative path -> (sha256, mtime in ns)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                         p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def repo_files(folder: Path) -> dict[str, str]:
    """The output repo's own files (not the work folder): name -> sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def cli(src, out, *extra, crash=None, home=None, code=None):
    """Run `turboquant convert SRC OUT -q --job-size 0 EXTRA` (or `code`, a Python
    program given the same arguments) in a process group of its own; returns
    (returncode, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "TURBOQUANT_CRASH_AT")}
    env.update(TURBOQUANT_CHUNK_ELEMENTS=CHUNK, TURBOQUANT_SYNC_BYTES="0",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    if crash:
        env["TURBOQUANT_CRASH_AT"] = crash
    args = ["convert", str(src), str(out), "-q", "--job-size", "0", *extra]
    cmd = [sys.executable, *(["-m", "turboquant"] if code is None else ["-c", code]), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (none expected)
        except ProcessLookupError:
            pass
    return proc.returncode, stdout, stderr


def one_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("turboquant convert: error:"), stderr
    return lines[0]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two same-shape checkpoints with other weights (a model and its 'fine-tune'), and
    each one's uninterrupted conversion (repo files)."""
    base = tmp_path_factory.mktemp("trust")
    kw = dict(shards=2, layers=2, hidden=64, intermediate=128, vocab=300)
    a = write_llama_checkpoint(base / "a", seed=0, **kw)
    b = write_llama_checkpoint(base / "b", seed=1, **kw)
    refs = {}
    for name, src in (("a", a), ("b", b)):
        rc, _, err = cli(src, base / f"ref-{name}", "--no-prefect", "--in-process")
        assert rc == 0, err
        refs[name] = repo_files(base / f"ref-{name}")
    # same names, shapes, sizes and headers: only the weights differ
    for f in (SHARD1, "model-00002-of-00002.safetensors"):
        assert (a / f).stat().st_size == (b / f).stat().st_size
        assert read_header(a / f).sha256 == read_header(b / f).sha256
    assert refs["a"] != refs["b"]
    return a, b, refs


# ------------------------------------------------------------------ 1. source identity


def test_a_fine_tune_into_a_finished_output_is_refused_naming_the_shard(sources, tmp_path):
    a, b, refs = sources
    out = tmp_path / "out"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process")
    assert rc == 0, err
    before = tree(out)
    rc, _, err = cli(b, out, "--no-prefect", "--in-process")
    assert rc == 1
    line = one_error(err)
    assert SHARD1 in line and "sampled bytes differ" in line and "--fresh" in line
    assert tree(out) == before  # refused: nothing written, nothing deleted
    rc, _, err = cli(b, out, "--no-prefect", "--in-process", "--fresh")
    assert rc == 0, err
    assert repo_files(out) == refs["b"]


@pytest.mark.parametrize("point", ["unit_committed:3", "after_marker:1"])
def test_a_kill_then_another_source_never_makes_a_mix(sources, tmp_path, point):
    """Killed mid-job (or between jobs) converting A; the rerun points at B: refused, then
    with --fresh B alone. Never a repo with tensors of both."""
    a, b, refs = sources
    out = tmp_path / "out"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process", crash=point)
    assert rc == -signal.SIGKILL, err
    before = tree(out)
    rc, _, err = cli(b, out, "--no-prefect", "--in-process")
    assert rc == 1 and SHARD1 in one_error(err)
    assert tree(out) == before
    rc, _, err = cli(b, out, "--no-prefect", "--in-process", "--fresh")
    assert rc == 0, err
    assert repo_files(out) == refs["b"]


def test_the_same_source_elsewhere_resumes(sources, tmp_path):
    """Identity is the contents, not the path: a copy of A resumes A's conversion."""
    a, _, refs = sources
    out, copy = tmp_path / "out", tmp_path / "copy-of-a"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process", crash="after_marker:1")
    assert rc == -signal.SIGKILL, err
    copy.mkdir()
    for f in a.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    rc, _, err = cli(copy, out, "--no-prefect", "--in-process")
    assert rc == 0, err
    assert repo_files(out) == refs["a"]


def test_a_shard_replaced_after_planning_is_refused_by_its_job(sources, tmp_path):
    """A worker checks the shard it opens against the run's identity (a file replaced
    since the plan, or another file at that path on a Dask worker)."""
    from turboquant.pipeline.convert import (ConvertOptions, job_context, output_lock,
                                             prepare_output, validate)
    from turboquant.pipeline.errors import SourceError
    from turboquant.pipeline.job import run_job

    a, b, _ = sources
    src = tmp_path / "src"
    src.mkdir()
    for f in a.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    p = validate(ConvertOptions(str(src), str(tmp_path / "out"), min_job_bytes=0,
                                in_process=True, progress=False))
    with output_lock(p):
        p.run = prepare_output(p)
        (src / SHARD1).write_bytes((b / SHARD1).read_bytes())
        with pytest.raises(SourceError, match=f"{SHARD1}: its contents changed"):
            run_job(job_context(p, p.plan.jobs[0]))


def test_the_ledger_records_each_tensors_source_crc(sources, tmp_path):
    a, _, _ = sources
    out = tmp_path / "out"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process")
    assert rc == 0, err
    header = read_header(a / SHARD1)
    data = (a / SHARD1).read_bytes()
    ledger = out / ".turboquant" / "jobs" / "job-00001.ledger.jsonl"
    items = [it for line in ledger.read_text().splitlines()
             for it in json.loads(line)["items"]]
    assert items and all(len(it["source_crc32"]) == 8 for it in items)
    for it in items:
        t = header.tensors[it["name"]]  # whole tensors here: the crc of their byte range
        assert it["source_crc32"] == f"{zlib.crc32(data[t.start:t.end]):08x}"


# ------------------------------------------------------------------ 2. --fresh


def test_fresh_keeps_a_users_file_and_converts_next_to_it(sources, tmp_path):
    a, b, refs = sources
    out = tmp_path / "out"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process")
    assert rc == 0, err
    (out / "notes.txt").write_text("mine")
    rc, _, err = cli(a, out, "--no-prefect", "--in-process")  # resume: finished, untouched
    assert rc == 0, err
    rc, _, err = cli(b, out, "--no-prefect", "--in-process", "--fresh")
    assert rc == 0, err
    assert (out / "notes.txt").read_text() == "mine"
    assert {k: v for k, v in repo_files(out).items() if k != "notes.txt"} == refs["b"]
    rc, _, err = cli(b, out, "--no-prefect", "--in-process")  # and it resumes as usual
    assert rc == 0, err


def test_fresh_that_is_refused_deletes_nothing(sources, tmp_path):
    """--fresh decides everything first: a source that fails validation, or a folder no
    conversion made, leaves every file where it was."""
    a, _, _ = sources
    out = tmp_path / "out"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process")
    assert rc == 0, err
    before = tree(out)
    rc, _, err = cli(a, out, "--no-prefect", "--in-process", "--fresh", "--bits", "5")
    assert rc == 2 and tree(out) == before
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in a.iterdir():
        if f.name != SHARD1:
            (broken / f.name).write_bytes(f.read_bytes())
    rc, _, err = cli(broken, out, "--no-prefect", "--in-process", "--fresh")
    assert rc == 1 and SHARD1 in err
    assert tree(out) == before
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    rc, _, err = cli(a, user, "--no-prefect", "--in-process", "--fresh")
    assert rc == 1 and "is not a TurboQuant conversion" in one_error(err)
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------ 3. no unpickling


class _Plant:
    """Unpickling this writes a marker file: what a planted result file could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def _old_cache_keys(src: Path, out: Path) -> list[str]:
    """The names under which the flow used to look for its jobs' cached results."""
    from turboquant.manifests.schema import FORMAT_VERSION, QUANT_METHOD
    from turboquant.pipeline.plan import build_plan
    from turboquant.pipeline.sources import LocalSource

    plan = build_plan(LocalSource(src), min_job_bytes=0)
    keys = []
    for job in plan.jobs:
        ident = "|".join([QUANT_METHOD, str(FORMAT_VERSION), plan.recipe_hash,
                          plan.plan_hash(), job.name, job.shard, str(out.resolve())])
        keys.append("turboquant-job-" + hashlib.sha256(ident.encode()).hexdigest())
    return keys


def test_a_planted_pickle_in_the_output_folder_never_runs(sources, tmp_path):
    """Prefect's result records are (cloud)pickle; the flow persists and reads none, so a
    file planted in the output folder is never loaded on resume."""
    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import PickleSerializer

    a, _, refs = sources
    out, marker = tmp_path / "out", tmp_path / "marker"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process", crash="after_marker:1")
    assert rc == -signal.SIGKILL, err
    store = out / ".turboquant" / "prefect"
    store.mkdir(parents=True)
    for key in _old_cache_keys(a, out):
        record = ResultRecord(result=_Plant(str(marker)), metadata=ResultRecordMetadata(
            storage_key=str(store / key), expiration=None, serializer=PickleSerializer()))
        (store / key).write_bytes(record.serialize())
    pickle.loads(pickle.dumps(_Plant(str(tmp_path / "probe"))))
    assert (tmp_path / "probe").exists()  # loading one would run it
    rc, _, err = cli(a, out, "--in-process", home=tmp_path / "prefect-home")
    assert not marker.exists(), "a planted result file was unpickled"
    assert rc == 0, err
    assert repo_files(out) == refs["a"]


# ------------------------------------------------------------------ 4. what runs leave


def test_refused_runs_write_nothing(sources, tmp_path):
    """Prefect mode, with the head start (--workers 2) and without (--in-process)."""
    a, b, _ = sources
    home = tmp_path / "prefect-home"
    src = tmp_path / "src"  # OUT = SRC
    src.mkdir()
    for f in a.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    done = tmp_path / "done"
    rc, _, err = cli(a, done, "--no-prefect", "--in-process")
    assert rc == 0, err
    for mode in (["--workers", "2"], ["--in-process"]):
        for source, out, says in ((src, src, "is the source folder"),
                                  (a, user, "is not a TurboQuant conversion"),
                                  (b, done, SHARD1)):
            before = tree(out)
            rc, _, err = cli(source, out, *mode, home=home)
            assert tree(out) == before, (mode, out)
            assert rc == 1 and says in one_error(err), (mode, out)


def test_a_failed_run_leaves_only_what_resume_needs(sources, tmp_path):
    """A NaN in the second shard: the first job's shard and the ledgers stay, no Prefect
    result (a pickled exception) is written anywhere in the output folder."""
    a, _, _ = sources
    src = tmp_path / "src"
    src.mkdir()
    for f in a.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    second = src / "model-00002-of-00002.safetensors"
    t = next(t for t in read_header(second).tensors.values() if t.dtype == "BF16")
    with open(second, "r+b") as f:
        f.seek(t.start)
        f.write(b"\xc0\x7f")  # bf16 NaN
    out = tmp_path / "out"
    rc, _, err = cli(src, out, "--in-process", home=tmp_path / "prefect-home")
    assert rc == 1 and "model-00002-of-00002.safetensors" in one_error(err)
    work = {p.split("/")[1] for p in tree(out) if p.startswith(".turboquant/")}
    assert {n for n in work if not n.endswith(".lock")} == {"run.json", "events.jsonl", "jobs"}
    assert not (out / ".turboquant" / "prefect").exists()
    assert [p.name for p in out.iterdir() if p.is_file()] == [SHARD1]


# ------------------------------------------------------------------ 8. no-op rerun

NOOP = """
import sys
from turboquant.convert import main
status = main(sys.argv[2:])
print("prefect imported:", "prefect" in sys.modules)
sys.exit(status)
"""


def test_a_finished_conversion_is_found_before_prefect_is_imported(sources, tmp_path):
    a, _, refs = sources
    out = tmp_path / "out"
    rc, _, err = cli(a, out, "--no-prefect", "--in-process")
    assert rc == 0, err
    before = tree(out)
    rc, stdout, err = cli(a, out, code=NOOP, home=tmp_path / "prefect-home")
    assert rc == 0, err
    assert "prefect imported: False" in stdout
    assert "2 finished job(s) skipped" in stdout and "converted 21 tensors" in stdout
    assert tree(out) == before  # a no-op writes nothing

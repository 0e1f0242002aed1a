"""What goes wrong outside the program ends in one line that names the file and what to do,
never a traceback: an output path that is (or is under) a file, a read-only file system, a
full disk mid-run, no network for a Hub id, `plan ... | head`, a local path typo, and a
deeply nested JSON body to the server.

The read-only and full-disk cases mount a real read-only bind and a small tmpfs; they need
root (and skip without it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from turboquant.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DENSE = ROOT / "reference" / "models" / "pystd-dense"
CONVERT = ["--no-prefect", "-q", "--job-size", "0"]


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def _turboquant(*args, env=None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "turboquant", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, **kw)


@contextlib.contextmanager
def _mounted(target: Path, *how: str):
    target.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    r = subprocess.run(["mount", *how, str(target)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount here: {r.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_output_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("not a folder")
    assert cli_main(["convert", str(DENSE), str(f), *CONVERT]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == (f"turboquant convert: error: {f} is a file, not a folder; choose an output "
                    "path that is a folder or does not exist yet")


def test_output_under_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("not a folder")
    assert cli_main(["convert", str(DENSE), str(f / "out"), *CONVERT]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"turboquant convert: error: {f / 'out'}")
    assert f"{f} is a file, not a folder" in line
    assert f.read_text() == "not a folder"


def test_read_only_file_system(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    with _mounted(tmp_path / "ro", "--bind", str(tmp_path / "src")) as ro:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True)
        if r.returncode:
            pytest.skip("cannot remount read-only here")
        assert cli_main(["convert", str(DENSE), str(ro / "out"), *CONVERT]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == (f"turboquant convert: error: {ro / 'out'}: read-only file system; choose a "
                    "folder on a writable disk")


def test_disk_full_mid_run_names_the_file_and_the_free_space(tmp_path):
    # 3 MB: the plan passes (the disk check is off) and the first shard fills the disk; the
    # job runs in a worker process, so the error crosses a process boundary too
    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=3m", "tmpfs") as small:
        r = _turboquant("convert", str(DENSE), str(small / "out"), *CONVERT, "--no-disk-check")
        assert r.returncode == 1
        line = _one_line(r.stderr)
        # the default runs a worker per core: whichever job filled the disk is named
        partials = sorted((small / "out" / ".turboquant" / "jobs").glob("*.partial"))
    assert any(line.startswith(f"turboquant convert: error: {p}: no space left on device "
                               "while writing it (") for p in partials), line
    assert " free on that disk); free some space" in line and "resumes" in line


@pytest.mark.parametrize("command, status", [("convert", 1), ("plan", 2)])
def test_hub_id_without_network(tmp_path, command, status):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    args = [command, "someorg/somemodel"] + ([str(tmp_path / "out")] if command == "convert"
                                             else [])
    r = _turboquant(*args, env={"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == status
    line = _one_line(r.stderr)
    assert line.startswith(f"turboquant {command}: error: cannot reach the Hugging Face Hub at "
                           f"{endpoint} to read Hub repo 'someorg/somemodel' (")
    assert line.endswith("check the network connection (or HF_ENDPOINT), or give a local folder")


@pytest.mark.parametrize("command, status", [("convert", 1), ("plan", 2)])
def test_hub_id_with_hf_hub_offline(tmp_path, command, status):
    args = [command, "someorg/somemodel"] + ([str(tmp_path / "out")] if command == "convert"
                                             else [])
    r = _turboquant(*args, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == status
    assert _one_line(r.stderr) == (f"turboquant {command}: error: HF_HUB_OFFLINE is set, so Hub "
                                   "repo 'someorg/somemodel' cannot be read; it is not in the "
                                   f"local Hugging Face cache ({tmp_path / 'hf' / 'hub'}): "
                                   "unset HF_HUB_OFFLINE, or give a local folder")


def test_plan_into_a_closed_pipe_is_quiet():
    """`turboquant plan SRC | head -1`: the reader leaves first; no BrokenPipeError."""
    p = subprocess.Popen([sys.executable, "-m", "turboquant", "plan", str(DENSE)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # as `head` does once it has its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert err == ""


@pytest.mark.parametrize("command, status", [("plan", 2), ("convert", 1), ("generate", 1)])
def test_local_path_typo_is_not_a_hub_id(tmp_path, command, status):
    (tmp_path / "out").mkdir()
    args = {"plan": ["plan", "out/nosuch"], "convert": ["convert", "out/nosuch", "converted"],
            "generate": ["generate", "--model", "out/nosuch", "--prompt", "x"]}[command]
    r = subprocess.run([sys.executable, "-m", "turboquant", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    assert r.returncode == status
    line = _one_line(r.stderr)
    what = "model" if command == "generate" else "source"
    assert f"{what} folder out/nosuch does not exist (read as a local path, not a Hub repo " \
           "id: out/ is a folder here); check the path" in line
    assert "Hub at" not in line


def test_deeply_nested_json_body_is_400(tmp_path):
    from test_serve_server import MODEL, write_tiny_llama

    from turboquant.runtime.server import (Engine, ServerConfig, _load_model, create_app,
                                           serve_in_thread)

    model, tokenizer, _ = _load_model(write_tiny_llama(tmp_path / MODEL))
    cfg = ServerConfig(model_id=MODEL, max_context=256, max_body_bytes=1 << 20)
    body = b'{"model": "tiny-llama", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with serve_in_thread(create_app(Engine(model, tokenizer), cfg)) as url:
        r = httpx.post(url + "/v1/chat/completions", content=body, timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"] == ("the request body nests JSON arrays or objects too deeply to "
                                  "parse")
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_full_disk_names_each_small_file_written_too(tmp_path):
    """The index, config and markers go through atomic_write/atomic_copy: same message."""
    from turboquant.pipeline.errors import OutputWriteError
    from turboquant.pipeline.ledger import atomic_copy, atomic_write

    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as small:
        with open(small / "filler", "wb") as f:  # fill the disk up
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        with pytest.raises(OutputWriteError) as e:
            atomic_write(small / "config.json", b"{}" * 100_000)
        assert str(e.value).startswith(f"{small / 'config.json'}: no space left on device "
                                       "while writing it (")
        with pytest.raises(OutputWriteError, match="tokenizer.json: no space left"):
            atomic_copy(DENSE / "tokenizer.json", small / "tokenizer.json")


def test_which_errors_become_one_line():
    """A network failure outside the Hub client is not blamed on the Hub; a bug keeps its
    traceback (one_line_error gives None and the dispatcher re-raises)."""
    from turboquant.cli import one_line_error

    dask = TimeoutError("Timed out trying to connect to tcp://10.0.0.1:8786 after 30 s")
    assert one_line_error(dask) == ("cannot connect: Timed out trying to connect to "
                                    "tcp://10.0.0.1:8786 after 30 s")
    assert one_line_error(ValueError("a bug")) is None
    assert one_line_error(KeyError("x")) is None


def _fill(folder: Path) -> None:
    """Fill the disk up to its last byte (unbuffered: nothing is left to flush at close)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while f.write(b"\0" * size):
                    pass


def test_a_full_disk_at_the_manifest_names_it_its_size_and_the_free_space(tmp_path):
    """The repo files the run writes at the end, manifest.parquet first (pyarrow's own error
    names no file): the file, the bytes it needs, the free space, what to do; no temporary
    file left holding space; and after space is freed the finish writes the same bytes."""
    from turboquant.cli import one_line_error
    from turboquant.manifests.schema import MANIFEST_FILE
    from turboquant.pipeline.convert import ConvertOptions, convert, validate
    from turboquant.pipeline.errors import OutputWriteError
    from turboquant.pipeline.repo import write_repo_files

    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=16m", "tmpfs") as small:
        opts = ConvertOptions(str(DENSE), str(small / "out"), in_process=True, progress=False,
                              check_disk=False, min_job_bytes=0)
        convert(opts)
        out = small / "out"
        manifest = (out / MANIFEST_FILE).read_bytes()
        (out / MANIFEST_FILE).unlink()
        _fill(small)
        p = validate(opts)
        with pytest.raises(OutputWriteError) as e:
            write_repo_files(p.plan, p.work, p.source)
        line = one_line_error(e.value)
        assert line == str(e.value) and "\n" not in line
        assert line.startswith(f"{out / MANIFEST_FILE}: no space left on device while "
                               f"writing it (it needs {len(manifest) / 1000:.2f} KB, ")
        assert " free on that disk); free some space" in line and "resumes" in line
        assert not (out / (MANIFEST_FILE + ".tmp")).exists()
        (small / "filler").unlink()
        write_repo_files(p.plan, p.work, p.source)
        assert (out / MANIFEST_FILE).read_bytes() == manifest


def test_a_full_disk_at_the_last_event_names_events_jsonl(tmp_path):
    """The run's last line in .turboquant/events.jsonl (`run_done`) on a full disk: named,
    like every other file the run writes (a write() error carries no file name of its own)."""
    from turboquant.pipeline.errors import OutputWriteError
    from turboquant.pipeline.ledger import WorkDir

    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as small:
        work = WorkDir(small / "out")
        work.make()
        work.events_file.write_bytes(b" " * 4095 + b"\n")  # a full page: the next needs one more
        _fill(small)
        with pytest.raises(OutputWriteError) as e:
            work.event("run_done", run=1)
        assert str(e.value).startswith(f"{work.events_file}: no space left on device while "
                                       "writing it (it needs ")

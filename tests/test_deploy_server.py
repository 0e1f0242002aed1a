"""Deployments against a real Prefect server on loopback, run by a real process worker.

`prefect server start` (a subprocess with its own PREFECT_HOME), `turboquant deploy` (the
pool, one deployment per family, the resume automations), `prefect worker start`. A run of
the llama deployment is interrupted by SIGKILLing the worker and everything it started
(the flow-run process and its job process), mid-conversion. A new worker is started, the
run is marked Crashed (what the heartbeat automation does after 3 missed heartbeats, at
least 90 s; done here at once to keep the test short), the resume automation puts it back
in the queue, the new worker reruns it, and the output is byte-identical to an
uninterrupted conversion.

With TURBOQUANT_TEST_HEARTBEATS=1 a second variant (about 2 minutes) leaves the crash to
Prefect too: flow runs send a heartbeat every 30 s, the stalled automation marks the run
Crashed 45 s after the last one, and the resume automation does the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

POOL = "turboquant"  # the pool prefect.yaml names
REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def ledger_lines(out: Path) -> int:
    jobs = out / ".turboquant" / "jobs"
    return sum(p.read_bytes().count(b"\n") for p in jobs.glob("*.ledger.jsonl")) \
        if jobs.exists() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every process it started (the flow run runs in a session of
    its own, so a process group is not enough)."""
    import psutil

    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    for p in [proc, *victims]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    psutil.wait_procs(victims, timeout=10)


class Services:
    """The subprocesses of a test, all killed at the end whatever happens."""

    def __init__(self, base: Path, env: dict):
        self.base, self.env, self.procs = base, env, []

    def start(self, name: str, cmd: list[str], env_extra: dict | None = None):
        log = open(self.base / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, env={**self.env, **(env_extra or {})}, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, cwd=self.base)
        p.log_name = name
        self.procs.append(p)
        return p

    def run(self, cmd: list[str], timeout: float = 120, cwd=None) -> str:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout,
                           cwd=cwd or self.base)
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def logs(self) -> str:
        out = []
        for f in sorted(self.base.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p)


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false",
               PREFECT_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1",
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1")
    for k in ("TURBOQUANT_CRASH_AT", "TURBOQUANT_CHUNK_ELEMENTS"):
        env.pop(k, None)
    services = Services(tmp_path, env)
    try:
        services.start("server", [*PREFECT, "server", "start", "--host", "127.0.0.1",
                                  "--port", str(port), "--no-ui", "--analytics-off"])

        def healthy():
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for("the Prefect server", healthy, 90, 0.5)
        services.url = url
        yield services
    except BaseException:
        print(services.logs())
        raise
    finally:
        services.close()


def deployment_fields(url: str, name: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as c:
        d = c.read_deployment_by_name(name)
    return {"entrypoint": d.entrypoint, "parameters": d.parameters, "tags": sorted(d.tags),
            "pool": d.work_pool_name, "description": d.description}


def flow_run(url: str, run_id):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as c:
        return c.read_flow_run(run_id)


@pytest.mark.parametrize("crash", [
    "marked",
    pytest.param("heartbeats", marks=pytest.mark.skipif(
        not os.environ.get("TURBOQUANT_TEST_HEARTBEATS"),
        reason="about 2 minutes; set TURBOQUANT_TEST_HEARTBEATS=1")),
])
def test_deployment_resumes_after_its_worker_is_killed(prefect_server, tmp_path, crash):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    svc = prefect_server
    src = write_llama_checkpoint(tmp_path / "src", layers=8, hidden=256, intermediate=512,
                                 vocab=512, shards=4)
    ref = tmp_path / "ref"
    convert(ConvertOptions(str(src), str(ref), recipe="llama", min_job_bytes=0,
                           in_process=True, progress=False))
    reference = snapshot(ref)

    beats = ["--stalled-after", "45"] if crash == "heartbeats" else []
    out = svc.run([sys.executable, "-m", "turboquant.deploy", "--pool", POOL,
                   "--family", "llama", "--family", "qwen_moe", *beats])
    assert "deployed turboquant-convert/llama" in out and "qwen_moe" in out
    # prefect.yaml declares the same deployment as `turboquant deploy`
    made = deployment_fields(svc.url, "turboquant-convert/qwen_moe")
    svc.run([*PREFECT, "--no-prompt", "deploy", "--name", "qwen_moe"], cwd=REPO)
    assert deployment_fields(svc.url, "turboquant-convert/qwen_moe") == made

    worker_cmd = [*PREFECT, "worker", "start", "--pool", POOL, "--type", "process"]
    # a conversion of several seconds, every unit synced on its own (the kill below waits
    # for units of the next job in the ledger)
    slow = {"TURBOQUANT_CHUNK_ELEMENTS": "512", "TURBOQUANT_SYNC_BYTES": "0"}
    if crash == "heartbeats":
        slow["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
    worker = svc.start("worker-1", worker_cmd, slow)

    output = tmp_path / "out"
    with temporary_settings({PREFECT_API_URL: svc.url}), get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name("turboquant-convert/llama")
        assert dep.parameters["recipe"] == "llama" and dep.work_pool_name == POOL
        assert "turboquant" in dep.tags
        run = c.create_flow_run_from_deployment(dep.id, parameters={
            "source": str(src), "output": str(output), "min_job_bytes": 0,
            "progress": False})

    # SIGKILL the worker and what it started: one job finished, the next one half-way
    jobs = output / ".turboquant" / "jobs"
    wait_for("a first finished job", lambda: list(jobs.glob("*.done")), 90, 0.05)
    after_first = ledger_lines(output)
    wait_for("units of the next job", lambda: ledger_lines(output) >= after_first + 3, 60, 0.02)
    assert not (output / ".turboquant" / "complete").exists()
    kill_tree(worker)
    lines_at_kill = ledger_lines(output)
    finished_before = {p.name.removesuffix(".done") for p in jobs.glob("*.done")}
    time.sleep(1)
    assert flow_run(svc.url, run.id).state.is_running()  # nobody told the server
    assert ledger_lines(output) == lines_at_kill  # nothing writes any more

    svc.start("worker-2", worker_cmd, slow)
    if crash == "marked":  # what the stalled automation does after 3 missed heartbeats
        with temporary_settings({PREFECT_API_URL: svc.url}), get_client(sync_client=True) as c:
            c.set_flow_run_state(run.id, Crashed(message="worker lost (test)"), force=True)

    def finished():
        fr = flow_run(svc.url, run.id)
        assert not fr.state.is_failed(), fr.state
        return fr if fr.state.is_completed() else None

    fr = wait_for("the resumed run to complete", finished, 180, 0.5)
    assert fr.run_count == 2  # the same flow run, run again
    with temporary_settings({PREFECT_API_URL: svc.url}), get_client(sync_client=True) as c:
        history = [(st.name, st.message or "") for st in c.read_flow_run_states(run.id)]
    names = [n for n, _ in history]
    assert names.index("Crashed") < names.index("AwaitingRetry"), history
    assert any(n == "AwaitingRetry" and m.startswith("resuming after a crash")
               for n, m in history)  # rescheduled by the resume automation
    if crash == "heartbeats":
        assert any(n == "Crashed" and m.startswith("no heartbeat") for n, m in history)
    assert snapshot(output) == reference
    events = [json.loads(x) for x in
              (output / ".turboquant" / "events.jsonl").read_text().splitlines()]
    second = [e for e in events if e.get("run") == 2]
    assert any(e["event"] == "job_resume" for e in second)  # the cut job went on
    redone = {e["job"] for e in second if e["event"] in ("job_start", "job_resume")}
    assert finished_before and not (redone & finished_before)  # finished jobs were kept

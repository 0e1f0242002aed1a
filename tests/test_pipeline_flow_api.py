"""The Prefect API of a conversion (pipeline/flow_api.py): Prefect's server app served from this
process when PREFECT_API_URL is not set (no server subprocess), a set PREFECT_API_URL used as
it is."""

import socket
import threading

import psutil
import pytest

from turboquant.pipeline.flow_env import configure_prefect_env

configure_prefect_env()

from prefect import flow  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.settings import (PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY,  # noqa: E402
                              PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED,
                              temporary_settings)

from turboquant.pipeline import flow_api  # noqa: E402
from turboquant.pipeline.flow_api import local_api  # noqa: E402

no_api_configured = pytest.mark.skipif(bool(PREFECT_API_URL.value()),
                                       reason="PREFECT_API_URL is set here")


@flow(name="turboquant-flow-api-test")
def answer() -> int:
    return 42


def _api_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "prefect-api")


def _server_processes() -> int:
    def is_server(p):
        try:
            return "uvicorn" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    return sum(1 for p in psutil.Process().children(recursive=True) if is_server(p))


@no_api_configured
def test_local_api_serves_prefect_from_this_process():
    servers = _server_processes()
    with local_api():
        url = PREFECT_API_URL.value()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/api")
        assert _api_threads() == 1
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None  # nobody would watch them
        state = answer(return_state=True)
        assert state.is_completed() and state.result() == 42
        with get_client(sync_client=True) as client:  # the run is recorded by that API
            run = client.read_flow_run(state.state_details.flow_run_id)
        assert run.state.is_completed()
        assert _server_processes() == servers  # Prefect started no server subprocess
    assert _api_threads() == 0  # stopped with the run
    assert not PREFECT_API_URL.value()


def test_a_configured_api_is_used_as_it_is():
    url = "http://127.0.0.1:9/api"
    heartbeats = PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value()
    with temporary_settings({PREFECT_API_URL: url}):
        with local_api():
            assert PREFECT_API_URL.value() == url
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == heartbeats
            assert _api_threads() == 0


def _record_servers(monkeypatch) -> list:
    servers = []

    class Recorded(flow_api._Server):
        def __init__(self):
            super().__init__()
            servers.append(self)

    monkeypatch.setattr(flow_api, "_Server", Recorded)
    return servers


@no_api_configured
def test_local_api_answers_without_nagle_delays(monkeypatch):
    """Its connections have TCP_NODELAY (asyncio sets it only on sockets made with
    IPPROTO_TCP): without it every request on a kept-alive connection waited ~40 ms for
    the client's delayed ACK, about 0.3 s of a conversion's start (issue 3)."""
    servers = _record_servers(monkeypatch)
    with local_api():
        with get_client(sync_client=True) as client:
            client.hello()
            client.hello()  # the same connection, kept alive
            connections = list(servers[0].server.server_state.connections)
            nodelay = [c.transport.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in connections]
    assert nodelay and all(nodelay)


@no_api_configured
def test_local_api_applies_the_callers_and_its_own_settings(tmp_path):
    """The caller's settings hold inside (one temporary_settings for all); the served app
    also runs without a lasting server's extras: automations (triggers and their actions)
    and block type registration at its start (0.4 s and 0.25 s of this process's time)."""
    store = str(tmp_path / "results")
    triggers = PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED.value()
    with local_api({PREFECT_LOCAL_STORAGE_PATH: store}):
        assert str(PREFECT_LOCAL_STORAGE_PATH.value()) == store
        with get_client(sync_client=True) as client:
            served = client.request("GET", "/admin/settings").json()["server"]
    assert served["services"]["triggers"]["enabled"] is False
    assert served["register_blocks_on_start"] is False
    assert served["memoize_block_auto_registration"] is False
    assert str(PREFECT_LOCAL_STORAGE_PATH.value()) != store  # restored
    assert PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED.value() == triggers


def test_a_configured_api_gets_the_callers_settings_and_a_drain(tmp_path, monkeypatch):
    """Against a configured server too, Prefect's log and event workers are drained before
    local_api() returns: the CLI then leaves with os._exit, and Prefect's own drain at
    interpreter exit would not run."""
    drains = []
    monkeypatch.setattr(flow_api, "_drain_prefect_workers", lambda: drains.append(1))
    store = str(tmp_path / "results")
    triggers = PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED.value()
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with local_api({PREFECT_LOCAL_STORAGE_PATH: store}):
            assert str(PREFECT_LOCAL_STORAGE_PATH.value()) == store
            assert PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED.value() == triggers  # not ours
            assert drains == []
    assert drains == [1]


SLOW_RECORDER = """
import asyncio, sqlite3, sys
from turboquant.pipeline.flow_env import configure_prefect_env
configure_prefect_env()
from prefect import flow, task
from prefect.server.services import task_run_recorder
from turboquant.pipeline import flow_api

record = task_run_recorder.record_bulk_task_run_events

async def slowly(events):  # a server busy elsewhere: 0.2 s per task run event
    await asyncio.sleep(0.2)
    await record(events)

task_run_recorder.record_bulk_task_run_events = slowly
hooks = {"on_completion": [flow_api.note_final_state], "on_failure": [flow_api.note_final_state]}

@task(**hooks)
def step(i):
    return i

@flow
def steps():
    return [step(i) for i in range(3)]

with flow_api.local_api():
    steps()
with sqlite3.connect(sys.argv[1]) as db:
    print(sorted(r[0] for r in db.execute("select state_type from task_run")))
"""


@no_api_configured
def test_the_served_api_records_every_ended_task_run_before_it_stops(tmp_path):
    """Task runs reach the server as events, recorded asynchronously; stopping the server
    drops what it has not recorded yet. local_api() waits for the task runs that ended
    (note_final_state, a state hook) to be recorded in their final states first."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    run = subprocess.run([sys.executable, "-c", SLOW_RECORDER, str(tmp_path / "prefect.db")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == str(["COMPLETED"] * 3), run.stdout + run.stderr


def test_waiting_for_records_never_raises_when_the_api_is_gone():
    from uuid import uuid4

    from prefect.client.schemas.objects import StateType

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert flow_api.wait_until_recorded({uuid4(): StateType.COMPLETED}, timeout=1) is False
    assert flow_api.wait_until_recorded({}, timeout=1) is True

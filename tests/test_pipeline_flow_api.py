"""The Prefect API of a conversion (pipeline/flow_api.py): Prefect's server app served from this
process when PREFECT_API_URL is not set (no server subprocess), a set PREFECT_API_URL used as
it is."""

import threading

import psutil
import pytest

from turboquant.pipeline.flow_env import configure_prefect_env

configure_prefect_env()

from prefect import flow  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.settings import (PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY,  # noqa: E402
                              temporary_settings)

from turboquant.pipeline.flow_api import local_api  # noqa: E402


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


@pytest.mark.skipif(bool(PREFECT_API_URL.value()), reason="PREFECT_API_URL is set here")
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

"""The Prefect API a conversion reports to: PREFECT_API_URL when it is set, else Prefect's own
server app, run inside this process for the length of the run.

With no API configured, Prefect 3 starts a temporary server in a subprocess
(`SubprocessASGIServer`): a second Python that imports Prefect's server again, about 3 s
before the first flow run can start, plus 1.3 s here to import the module that starts it
and up to a second to stop it. `local_api()` serves the same app (`create_app(ephemeral=True)`:
the same routes, state handling and SQLite database under PREFECT_HOME) from a uvicorn
thread of this process on a free loopback port, points PREFECT_API_URL at it, and at the end
drains Prefect's log and event workers into it and stops it, as `prefect_test_harness` does
with its server. Runs served by it send no flow-run heartbeats: they let a lasting server see
that a run's process died, and this server lives and dies with the run.

A set PREFECT_API_URL (a real `prefect server`, Prefect Cloud, a deployment's worker) is used
as it is, heartbeats included.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class _Server:
    """Prefect's API app served by uvicorn from a thread of this process."""

    def __init__(self):
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app(ephemeral=True, ignore_cache=True)  # a fresh lifespan per run
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.api_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/api"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="prefect-api", daemon=True)

    def start(self, timeout: float) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("Prefect's API server did not start in this process; set "
                                   "PREFECT_API_URL to a running `prefect server`, or add "
                                   "--no-prefect")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def _drain_prefect_workers() -> None:
    """Send the logs and events Prefect still holds to the API before it goes away."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10, at_exit=False)


@contextlib.contextmanager
def local_api():
    """Within: PREFECT_API_URL set (to a server of this process unless it was set already)."""
    from prefect.settings import (PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
                                  PREFECT_SERVER_EPHEMERAL_ENABLED,
                                  PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                                  temporary_settings)

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        yield  # a configured server (or none allowed: Prefect says so itself)
        return
    server = _Server().start(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    try:
        settings = {PREFECT_API_URL: server.api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
        with temporary_settings(settings):
            try:
                yield
            finally:
                _drain_prefect_workers()
    finally:
        server.stop()

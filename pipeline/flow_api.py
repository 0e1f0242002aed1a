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

Its socket is made with IPPROTO_TCP, so that asyncio turns Nagle's algorithm off on its
connections: each API call then takes 1-3 ms instead of ~44 ms (a delayed ACK per call on a
kept-alive connection; about 0.3 s of a conversion's start).

That server also skips two things of a lasting one (`server_settings()`; measured on a 2-core
machine, issue 3): registering Prefect's block types at its start (the check whether they
changed imports every installed Prefect collection, prefect-dask's dask and distributed
among them: 0.25 s), and the automation services (triggers and their actions: 0.4 s of
this process's time, a server built a second time among it). Runs are recorded as before
(flow and task runs, states, events, logs); automations are for a lasting server: set
PREFECT_API_URL to one.

Task runs reach that server as events, which it records asynchronously (its task run
recorder), and stopping it drops what it has not recorded yet. So before it stops,
`local_api()` waits (up to 10 s) until the API shows every task run that
`note_final_state`, a Prefect state hook on each of the conversion's tasks, saw end, in the
state it ended in.

A set PREFECT_API_URL (a real `prefect server`, Prefect Cloud, a deployment's worker) is used
as it is, heartbeats included. Either way Prefect's log and event workers are drained before
`local_api()` returns, so nothing is left for the interpreter's exit to send.
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import threading
import time

RECORD_TIMEOUT = 10.0  # seconds to wait for the server to record the run's task runs

# {task run id: final state type} of the task runs that ended within local_api()
_FINAL_STATES: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "turboquant_final_states", default=None)


class _Server:
    """Prefect's API app served by uvicorn from a thread of this process."""

    def __init__(self):
        # IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections of such a socket; without
        # it each request on a kept-alive connection waits ~40 ms for a delayed ACK
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.api_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/api"
        self.server = None
        self.thread = None

    def start(self, timeout: float) -> _Server:
        """Build the app and serve it; both see the Prefect settings in force here (the
        thread runs in a copy of this context)."""
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app(ephemeral=True, ignore_cache=True)  # a fresh lifespan per run
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        run_here = contextvars.copy_context().run
        self.thread = threading.Thread(target=run_here, args=(self.server.run,),
                                       kwargs={"sockets": [self.sock]}, name="prefect-api",
                                       daemon=True)
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
        if self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
        self.sock.close()


def serves_here() -> bool:
    """Whether `local_api()` will serve Prefect's API from this process."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


def import_server_app() -> None:
    """Import Prefect's server app now if `local_api()` will serve it (about 1.3 s of
    imports), e.g. so that a caller's `gc.freeze()` covers it."""
    if serves_here():
        import prefect.server.api.server  # noqa: F401


def _drain_prefect_workers() -> None:
    """Send the logs and events Prefect still holds to the API before it goes away."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10, at_exit=False)


def note_final_state(task, task_run, state) -> None:
    """A Prefect state hook (`on_completion`, `on_failure`): remember the final state of a
    task run that ended within `local_api()`, so that its server records it before it
    stops. Elsewhere (e.g. on a Dask worker) it does nothing."""
    final = _FINAL_STATES.get()
    if final is not None:
        final[task_run.id] = state.type


def wait_until_recorded(final: dict, timeout: float) -> bool:
    """Poll the API until it shows each task run of `final` ({id: state type}) in that
    state; False if it did not within `timeout` seconds, or could not be asked (this runs
    while a run's own error may be on its way out: it never raises one of its own)."""
    if not final:
        return True
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId

    runs = TaskRunFilter(id=TaskRunFilterId(any_=list(final)))
    deadline = time.monotonic() + timeout
    try:
        with get_client(sync_client=True) as client:
            while True:
                seen = {r.id: r.state_type for r in client.read_task_runs(task_run_filter=runs)}
                if all(seen.get(run) == state for run, state in final.items()):
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
    except Exception:  # noqa: BLE001 - the API is gone: nothing more can be recorded
        return False


def server_settings() -> dict:
    """The in-process server's own Prefect settings, on top of the caller's."""
    from prefect.settings import (PREFECT_API_BLOCKS_REGISTER_ON_START,
                                  PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION,
                                  PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED)

    return {PREFECT_API_BLOCKS_REGISTER_ON_START: False,
            PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION: False,
            PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED: False}  # triggers and their actions


@contextlib.contextmanager
def local_api(settings: dict | None = None):
    """Within: PREFECT_API_URL set (to a server of this process unless it was set already)
    and the given Prefect `settings` ({Setting: value}), in one `temporary_settings`."""
    from prefect.settings import (PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
                                  PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                                  temporary_settings)

    settings = dict(settings or {})
    if not serves_here():  # a configured server (or none allowed: Prefect says so itself)
        with temporary_settings(settings):
            try:
                yield
            finally:
                _drain_prefect_workers()
        return
    server = _Server()
    settings.update(server_settings())
    settings.update({PREFECT_API_URL: server.api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
    final: dict = {}
    token = _FINAL_STATES.set(final)
    with temporary_settings(settings):
        try:
            server.start(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
            try:
                yield
            finally:
                _drain_prefect_workers()
                wait_until_recorded(final, RECORD_TIMEOUT)
        finally:
            server.stop()
            _FINAL_STATES.reset(token)

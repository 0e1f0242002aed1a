"""Prefect's environment, set before Prefect is imported: quiet logs, analytics off.

Prefect reads most settings once, at import; the CLI calls `configure_prefect_env` first.
Task and flow run failures are reported by the CLI as one clear line, so Prefect's own
run loggers only speak at CRITICAL unless `verbose`. Its background workers' progress
notes while they drain at the end ("EventsWorker - Still processing items: 3 items
remaining...") are silenced the same way: the CLI drains them itself (flow_api).
"""

from __future__ import annotations

import logging
import os

QUIET = {
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL": "CRITICAL",
    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",  # the client side: no first-run analytics notice on a terminal
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}

# Prefect's queue services log through loggers named after their class
DRAINING_WORKERS = ("EventsWorker", "APILogWorker")


def configure_prefect_env(verbose: bool = False) -> None:
    """Set quiet defaults (an explicit environment variable always wins)."""
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)
    for name in DRAINING_WORKERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    if verbose:
        for k in ("PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL",
                  "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL"):
            os.environ[k] = "INFO"

"""`turboquant` command line: a thin dispatcher that imports a subcommand only when it runs.

Each subcommand is a module with ``main(argv: list[str] | None) -> int``. Listing them here,
with a one-line summary, keeps ``turboquant --help`` instant: it imports neither MLX model
code nor Prefect.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("turboquant.demo", "run the bundled demo (no network, no server)"),
    "convert": ("turboquant.convert", "convert a Hugging Face checkpoint into a TurboQuant repo"),
    "calibrate": ("turboquant.calibrate", "measure input statistics on a small text (optional; for convert --input-stats)"),
    "allocate": ("turboquant.allocate", "choose bits per tensor for a bits-per-weight target (a recipe for convert)"),
    "verify": ("turboquant.verify", "re-read a TurboQuant repo and check checksums and errors"),
    "generate": ("turboquant.generate", "generate text from a TurboQuant repo"),
    "serve": ("turboquant.serve", "serve a TurboQuant repo over an OpenAI-compatible HTTP API"),
    "plan": ("turboquant.plan", "project a model's memory here: RESIDENT, STREAM or WON'T FIT"),
    "doctor": ("turboquant.doctor", "check a TurboQuant repo folder and this machine (read-only)"),
    "publish": ("turboquant.publish", "publish converted repos to the Hugging Face Hub (uploads only what changed)"),
    "deploy": ("turboquant.deploy", "create Prefect deployments of the convert flow, one per model family"),
}


# Commands that decode on the local GPU, and the MLX settings they start with unless the
# environment says otherwise. CUDA graphs off: on the H200 an 8B-shaped TurboQuant 3-bit
# model decoded at 97.6 tok/s with MLX_USE_CUDA_GRAPHS=0, against 69.2 with graphs on one
# change earlier (MLX 0.32.4; benchmarks/results/decode-h200.txt; mlx-lm's affine-4 lost
# 181 -> 155 tok/s the same way). Ignored by MLX on Metal and the CPU.
DECODE_COMMANDS = ("generate", "serve")
DECODE_ENV = {"MLX_USE_CUDA_GRAPHS": "0"}


# Commands whose main() takes own_process=True when they run as this process's command line
# (`turboquant ...`, `python -m turboquant ...`): they may then use process-wide shortcuts
# (convert: gc.freeze after importing Prefect, os._exit after the summary; issue 3).
OWN_PROCESS_COMMANDS = ("convert",)


def apply_decode_env(command: str, environ=os.environ) -> None:
    """Set DECODE_ENV's defaults for a decoding command (a value already set wins)."""
    if command in DECODE_COMMANDS:
        for key, value in DECODE_ENV.items():
            environ.setdefault(key, value)


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: turboquant <command> [options]",
        "",
        "TurboQuant: data-free LLM compression and a minimal MLX runtime.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Run `turboquant <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from turboquant import __version__

        print(f"turboquant {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"turboquant: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    apply_decode_env(name)  # before MLX touches the GPU
    try:
        module = importlib.import_module(COMMANDS[name][0])
        if argv is None and name in OWN_PROCESS_COMMANDS:  # this process's own command line
            return int(module.main(rest, own_process=True) or 0)
        return int(module.main(rest) or 0)
    except BrokenPipeError:  # `turboquant plan ... | head`: the reader has what it wanted
        _quiet_stdout()
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    except Exception as e:  # noqa: BLE001 - one_line_error re-raises what it does not know
        message = one_line_error(e)
        if message is None:
            raise
        print(f"turboquant {name}: error: {message}", file=sys.stderr)
        return ERROR_STATUS.get(name, 1)


# Exit status of an error that reaches the dispatcher, where a command's docs say other than 1.
ERROR_STATUS = {"plan": 2, "doctor": 2}


def one_line_error(e: BaseException) -> str | None:
    """The one-line message for an error no command caught (a full disk, a file in the way,
    no network), or None for a bug, which keeps its traceback."""
    from turboquant.pipeline.errors import (describe_os_error, from_hub_client, hub_unreachable,
                                            network_reason)

    reason = network_reason(e)
    if reason is not None:
        return hub_unreachable(reason) if from_hub_client(e) else f"cannot connect: {reason}"
    if isinstance(e, OSError) and e.errno is not None and (e.filename or e.strerror):
        return describe_os_error(e)
    return None


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())

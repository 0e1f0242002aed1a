"""The `turboquant` dispatcher: instant help, every listed command importable."""

import importlib
import subprocess
import sys

from turboquant.cli import COMMANDS


def test_help_imports_neither_mlx_nor_prefect():
    code = (
        "import sys, io, contextlib\n"
        "from turboquant.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'prefect')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_command_has_a_main():
    for name, (module, summary) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), name
        assert summary


def test_unknown_command_exits_2(capsys):
    from turboquant.cli import main

    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_decoding_commands_start_without_cuda_graphs_unless_told():
    from turboquant import cli

    env = {}
    cli.apply_decode_env("generate", env)
    assert env == {"MLX_USE_CUDA_GRAPHS": "0"}
    env = {"MLX_USE_CUDA_GRAPHS": "1"}
    cli.apply_decode_env("serve", env)
    assert env == {"MLX_USE_CUDA_GRAPHS": "1"}  # the user's choice wins
    env = {}
    cli.apply_decode_env("convert", env)
    assert env == {}


def test_convert_runs_as_its_own_process_only_from_the_command_line(monkeypatch):
    """Only `turboquant convert ...` itself (cli.main() reading sys.argv) may take the
    process-wide shortcuts (gc.freeze, os._exit); a caller passing argv goes on after it."""
    from turboquant import cli
    from turboquant import convert

    calls = []
    monkeypatch.setattr(convert, "main", lambda argv, **kw: calls.append((argv, kw)) or 0)
    assert cli.main(["convert", "src", "out"]) == 0
    monkeypatch.setattr(sys, "argv", ["turboquant", "convert", "src", "out"])
    assert cli.main() == 0
    assert calls == [(["src", "out"], {}), (["src", "out"], {"own_process": True})]

"""benchmarks/convert.py on a tiny checkpoint: the default `turboquant convert` (no tuned
flags) and `mlx_lm.convert` run alternately, and the table prints the ratio per shape, its
spread, the CPU seconds and peak RSS of both, and the command to reproduce."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import convert as bench  # noqa: E402  (the benchmark script)


def test_the_commands_are_the_plain_ones(tmp_path):
    cmds = bench.commands(tmp_path / "src", tmp_path / "tq", tmp_path / "mlx", [])
    assert cmds["turboquant"][3:] == ["convert", str(tmp_path / "src"), str(tmp_path / "tq"),
                                      "--bits", "4", "--group-size", "64"]
    assert cmds["mlx_lm"][3:] == ["convert", "--hf-path", str(tmp_path / "src"), "-q",
                                  "--q-bits", "4", "--q-group-size", "64", "--mlx-path",
                                  str(tmp_path / "mlx")]


def test_a_tiny_run_alternates_and_reports(tmp_path, capsys):
    assert bench.main(["--shapes", "tiny", "--rounds", "2", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny round 1 (turboquant then mlx_lm)" in out
    assert "tiny round 2 (mlx_lm then turboquant)" in out
    row = next(line for line in out.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5].endswith(")") and "x (" in cells[5]  # median ratio (min-max)
    assert " / " in cells[6] and "MiB" in cells[7]
    assert "python benchmarks/convert.py --shapes tiny --rounds 2" in out
    assert not (tmp_path / "tiny").exists()  # checkpoints go unless --keep


def test_what_outlives_the_command_is_awaited_and_counted():
    """A side process that outlives the command (turboquant's Prefect record) ends before
    the next run starts, and its CPU seconds count; the command's own are reported apart."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    # the command lives a little after starting it (as turboquant's does): processes are
    # found by sampling the command's tree every 50 ms
    spawn = ("import subprocess, sys, time\n"
             f"subprocess.Popen([sys.executable, '-c', {busy!r}], start_new_session=True)\n"
             "time.sleep(0.5)")
    m = bench.measure([sys.executable, "-c", spawn])
    assert m["after"] >= 0.3  # waited for the side process
    assert m["cpu"] >= 0.5 > m["cpu_command"]  # sampled every 50 ms: the last ones may be missed


def test_encode_chunks_compares_a_tree_with_itself(tmp_path, capsys):
    """benchmarks/encode_chunks.py: this tree against a peer tree (here itself) on a small
    width, a row per width with the job's rows a chunk (whole 16-row tiles) and a ratio."""
    import encode_chunks

    root = Path(__file__).resolve().parents[1]
    assert encode_chunks.main(["--widths", "256", "--rounds", "2", "--old-tree", str(root)]) == 0
    out = capsys.readouterr().out
    assert "round 2 this tree" in out and "round 2 old tree" in out
    row = next(line for line in out.splitlines() if line.startswith("| 256 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1024 / 1024"  # 256K weights: 1024 rows, whole tiles
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4].endswith("x")

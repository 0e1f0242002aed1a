"""benchmarks/kernels.py's timing: the pipelined measure (--pipelined, and beside the serial
one in --loop) builds, submits and evaluates every batch it times, each once."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernels  # noqa: E402  (the benchmark script)


def _counting_batches(per_batch: int):
    built = []

    def batch():
        outs = [mx.arange(4) * (len(built) * per_batch + i) for i in range(per_batch)]
        built.append(outs)
        return outs

    return batch, built


def test_pipelined_time_builds_and_evaluates_every_batch_once():
    batch, built = _counting_batches(3)
    seconds = kernels._time_pipelined(batch, reps=4, windows=2, per_batch=3)
    assert seconds > 0
    assert len(built) == 1 + 4 * 2  # a warm-up batch, then reps per window
    for k, outs in enumerate(built):
        for i, out in enumerate(outs):  # every output evaluated, to its own value
            assert out.tolist() == [j * (k * 3 + i) for j in range(4)]


def test_time_switches_to_the_pipelined_measure(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "_time_pipelined", lambda fn, reps: calls.append(reps) or 1.0)
    monkeypatch.setattr(kernels, "PIPELINED", True)
    assert kernels._time(lambda: [], reps=5) == 1.0 and calls == [5]


def test_loop_prints_serial_and_pipelined_figures(capsys):
    kernels._time_loop("probe", lambda i: mx.arange(8) + i, per_eval=4, evals=3)
    line = capsys.readouterr().out
    assert "probe, 4 per eval:" in line and "graph building per call" in line
    assert "pipelined" in line and "us per GEMV" in line

"""benchmarks/prefill.py on the CPU (a smoke run of its small shapes): every method is
timed for every width asked, the TurboQuant weights it makes have the stored layout, and
the table prints the ratios against the peers measured in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prefill  # noqa: E402  (the benchmark script)

from turboquant.kernels.reference import words_per_row  # noqa: E402


def test_weights_have_the_stored_layout():
    (codes, scales), = prefill.tq_weights(24, 128, "ternary", 1)
    assert codes.shape == (24, words_per_row(128, "ternary")) and codes.dtype == mx.uint32
    assert scales.shape == (24, 2) and scales.dtype == mx.float16
    assert mx.all(codes < 3**20).item()  # every word a valid base-3 number


def test_a_small_run_times_every_method(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["prefill.py", "--small", "--tokens", "12", "--bits", "3",
                                      "ternary"])
    prefill.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("M=")]
    assert len(rows) == 2  # one per shape
    for row in rows:
        for method in ("bf16", "affine3", "affine4", "tq3", "tqternary", "tq3-ref"):
            assert f" {method} " in row, (method, row)
        assert "x of affine4" in row and "x of bf16" in row
    assert "reproduce: python benchmarks/prefill.py --tokens 12" in out

"""benchmarks/host_ops.py's exact host measure: calls made while building a step's graph."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_ops  # noqa: E402  (the benchmark script)


def _leaf() -> int:
    return 1


def _step() -> mx.array:
    return mx.array(_leaf() + len([1, 2]))


def test_call_events_count_python_functions_and_builtins():
    # the step itself and _leaf; len is the one builtin (MLX's nanobind ops are not counted)
    assert host_ops._call_events(_step) == dict(py_calls=2, c_calls=1)


def test_call_events_leave_out_the_stand_ins_own_calls():
    x = mx.zeros((2, 3))
    ev = host_ops._call_events(lambda: host_ops._stand_in([x], [(2, 3)], [mx.float32])[0])
    assert ev == dict(py_calls=1, c_calls=0)  # only the lambda: _stand_in is the script's

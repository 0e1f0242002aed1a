"""The CUDA emulation itself (`tests/cuda_emulation.py`): a block's threads run as fibers in
turn from barrier to barrier, so a missing `__syncthreads` shows every run, and a barrier
some threads never reach stops the run with a message instead of hanging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_emulation  # noqa: E402

# each thread stores its input in shared memory and outputs its neighbour's
NEIGHBOUR = """
  __shared__ float slots[64];
  const int t = threadIdx.x;
  slots[t] = x[t];
  {barrier}
  out[t] = slots[(t + 1) % 64];
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return cuda_emulation.folder_or_skip(tmp_path_factory, "emulation")


def _run(folder, name, source, x):
    kernel = cuda_emulation.EmulatedKernel(folder, name, "", source, ["x"], [mx.float32],
                                           ["out"], [mx.float32], [])
    outs, _ = kernel([x], [x.shape], (64, 1, 1), (64, 1, 1))
    return outs[0]


def test_a_barrier_between_write_and_read_gives_the_neighbours(folder):
    x = np.arange(1, 65, dtype=np.float32)
    got = _run(folder, "with_barrier", NEIGHBOUR.format(barrier="__syncthreads();"), x)
    np.testing.assert_array_equal(got, np.roll(x, -1))


def test_a_missing_barrier_reads_what_later_threads_have_not_written(folder):
    """Thread t runs to its end before thread t + 1 starts: every read but the last
    thread's finds its neighbour's slot unwritten (zero: a static's)."""
    x = np.arange(1, 65, dtype=np.float32)
    got = _run(folder, "without_barrier", NEIGHBOUR.format(barrier=""), x)
    assert not np.array_equal(got, np.roll(x, -1))
    np.testing.assert_array_equal(got[:63], 0)


def test_a_barrier_that_some_threads_never_reach_stops_the_run(folder, capfd):
    source = """
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = x[threadIdx.x];
"""
    with pytest.raises(subprocess.CalledProcessError) as stopped:
        _run(folder, "early_return", source, np.ones(64, np.float32))
    assert stopped.value.returncode == 3
    assert "every live thread waits at a barrier" in capfd.readouterr().err

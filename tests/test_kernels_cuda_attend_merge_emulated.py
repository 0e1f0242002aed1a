"""CUDA "buffer_attention" (`kernels/cuda_attend.py`) run on the CPU over many chunks: the
merge of 64 and 141 chunks' partials, both merges. The emulation and the other cases:
`tests/test_kernels_cuda_attend_emulated.py`, whose fixtures and helpers this file uses (a
file apart, so that two test processes share the emulation's minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import cuda_attend

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_kernels_cuda_attend_emulated import (  # noqa: E402, F401  (fixtures, found by name)
    attention, emulated, emulation_folder, softmax_attention)


@pytest.mark.parametrize("merge", ["block", "launch"])
@pytest.mark.parametrize("heads, kv, dim", [(4, 1, 128), (2, 2, 32)], ids=["R4-D128", "R1-D32"])
@pytest.mark.parametrize("size, position", [(512, 500), (1128, 1127)])
def test_the_emulated_merge_of_many_chunks(emulated, monkeypatch, merge, heads, kv, dim,
                                           size, position):
    """The merge over 63 and 141 chunks (of 8 rows here, so the emulation walks 8 times
    fewer rows than 64-row chunks would: the 9000-row case took 123 s on a slow 2-core
    machine): eight chunks' loads a step and the tail, a thread an output float4 (R4-D128,
    the 8B shape's group; one KV head, as the emulation's time goes with its blocks) or the
    chunks split over 16 threads an output (R1-D32, two KV heads: each group's own
    partials and counter)."""
    monkeypatch.setattr(cuda_attend, "CHUNK_TOKENS", 8)
    assert cuda_attend.plan(size, kv)[1] in (64, 141)
    mx.random.seed(position)
    q = (3 * mx.random.normal((1, heads, 1, dim))).astype(mx.bfloat16)
    k = mx.random.normal((1, kv, size, dim)).astype(mx.bfloat16)
    v = mx.random.normal((1, kv, size, dim)).astype(mx.bfloat16)
    got = attention(q, k, v, position, merge, monkeypatch)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               softmax_attention(q, k, v, position), atol=1e-2, rtol=1e-2)

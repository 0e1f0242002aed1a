"""What the fork server of the job workers loads once, before it forks them (machine.py).

Importing this module imports the job's modules (numpy, MLX, the codec) and loads encode's
compiled kernels from numba's disk cache for every width (compiling them the first time),
through numpy-only calls: no MLX array is evaluated and no thread is started here, so the
server stays a single-threaded process that can be forked safely.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from turboquant.pipeline import job  # noqa: E402,F401
from turboquant.stages import codec, fast_convert, fast_hadamard, fast_quantize  # noqa: E402,F401
from turboquant.stages.quantize import code_tables_np  # noqa: E402


def load_kernels() -> None:
    """Run each compiled kernel once on a tiny input (one specialisation per width)."""
    if not fast_hadamard.AVAILABLE:
        return
    x = np.ones((1, 64), np.float32)
    signs = np.ones(64, np.float32)
    fast_hadamard.rotate_groups(x, signs, None, 64, 64, (1.0, 0.125, 1.0), 32, 1, True)
    for bits in codec.SUPPORTED_BITS:
        mids, levels = code_tables_np(bits)
        xt = np.zeros((32, 1), np.float32)
        fast_quantize.code_groups(xt, np.ones(1, np.float32), mids, levels, 32, 1, bits)
    fast_convert.bf16_to_float32(np.zeros((1, 4), np.uint16))


load_kernels()

"""The trellis Viterbi compiled with numba: the same float32 operations as trellis.viterbi.

One row at a time: for each step, the best predecessor of every group of 2^kV states that
share a successor set (first minimum, as np.argmin), then each state's squared distance
(0.0, then + diff_j^2 for j = 0, 1, ...) plus its predecessor's cost. No fast-math, so the
costs, hence the paths, are bit-identical to the numpy path (tests/test_stages_trellis.py).
`AVAILABLE` as in fast_hadamard (numba installed, not disabled by TURBOQUANT_NO_NUMBA=1).
"""

from __future__ import annotations

import numpy as np

from .fast_hadamard import AVAILABLE, _jit, compile_kernels

__all__ = ["AVAILABLE", "viterbi"]


@_jit
def _viterbi_kernel(y, table, kv, closing, path, back, cost, new, best):
    steps, nv = y.shape
    n = table.shape[0]
    fan = 1 << kv
    m = n >> kv
    low = m - 1
    inf = np.float32(np.inf)
    zero = np.float32(0.0)
    for s in range(n):
        d = zero
        for j in range(nv):
            diff = y[0, j] - table[s, j]
            d += diff * diff
        cost[s] = d if closing < 0 or (s & low) == closing else inf
    for t in range(1, steps):
        for p in range(m):
            b = cost[p * fan]
            h = 0
            for i in range(1, fan):
                c = cost[p * fan + i]
                if c < b:
                    b = c
                    h = i
            best[p] = b
            back[t, p] = h
        for hi in range(fan):
            for p in range(m):
                s = hi * m + p
                d = zero
                for j in range(nv):
                    diff = y[t, j] - table[s, j]
                    d += diff * diff
                new[s] = d + best[p]
        for s in range(n):
            cost[s] = new[s]
    last = -1
    lb = inf
    for s in range(n):
        if closing >= 0 and (s >> kv) != closing:
            continue
        if last < 0 or cost[s] < lb:
            lb = cost[s]
            last = s
    path[steps - 1] = last
    for t in range(steps - 1, 0, -1):
        s = path[t]
        path[t - 1] = ((s & low) << kv) | back[t, s & low]
    return lb


def viterbi(code, y: np.ndarray, table: np.ndarray, closing=None):
    """trellis.viterbi's result (states (rows, steps) int64, cost (rows,) float64), compiled."""
    compile_kernels()
    rows, steps, _ = y.shape
    n, kv = 1 << code.state_bits, code.step_bits
    y = np.ascontiguousarray(y, dtype=np.float32)
    table = np.ascontiguousarray(table, dtype=np.float32)
    path = np.empty((rows, steps), dtype=np.int64)
    total = np.empty(rows, dtype=np.float64)
    back = np.empty((steps, n >> kv), dtype=np.uint8)
    cost, new = np.empty(n, np.float32), np.empty(n, np.float32)
    best = np.empty(n >> kv, np.float32)
    for r in range(rows):
        c = -1 if closing is None else int(closing[r])
        total[r] = _viterbi_kernel(y[r], table, kv, c, path[r], back, cost, new, best)
    return path, total

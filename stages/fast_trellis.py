"""The trellis Viterbi compiled with numba: the same float32 operations as trellis.viterbi.

A step of the Viterbi is two passes of 2^L operations each: (a) for every group of 2^kV
states that share their successors (the same top L - kV bits), the best of them (first
minimum, as np.argmin); (b) every new state's squared distance (0.0, then + diff_j^2 for
j = 0, 1, ...) plus its group's best. Costs are kept in a permuted order, position
(S mod 2^kV) * 2^(L-kV) + (S >> kV), so the group minimum of (a) is an element-wise minimum
of 2^kV contiguous runs and (b) is one contiguous pass over a table permuted the same way:
both compile to vector instructions (where 2^kV <= 2^(L-kV), (b) first copies each run of
groups it reads into one contiguous buffer: ~0.15 ns a state a step on one core here, 6x
the one-state-at-a-time loop). Rows run in parallel (`numba.prange`, one row a task
with buffers of its own). No fast-math, so the costs, hence the paths, are bit-identical
to the numpy path (tests/test_stages_trellis.py).
`AVAILABLE` as in fast_hadamard (numba installed, not disabled by TURBOQUANT_NO_NUMBA=1).
"""

from __future__ import annotations

import threading

import numpy as np

from .fast_hadamard import AVAILABLE

__all__ = ["AVAILABLE", "state_value", "viterbi"]

_LOCK = threading.Lock()
_KERNEL: list = []
_LAYOUTS: dict = {}


def state_value(state, mul, add, mean, std, mix=True):
    """Value j of a trellis state, one at a time (docs/FORMAT.md, "Trellis code"): the
    definition compiled code uses (kernels/cpu_gemv.py njit-s it), equal to
    trellis.state_values, the vectorized one. state < 2^L as an integer; mul, add the code's
    MUL[j], ADD[j]; mean, std its BYTESUM_MEAN, BYTESUM_STD; mix: the shift-xor of trellis
    version 1 (version 2 has none). Returns a float32."""
    h = (np.uint64(state) * np.uint64(mul) + np.uint64(add)) & np.uint64(0xFFFFFFFF)
    if mix:
        h = h ^ (h >> np.uint64(16))
    total = ((h & np.uint64(255)) + ((h >> np.uint64(8)) & np.uint64(255))
             + ((h >> np.uint64(16)) & np.uint64(255)) + (h >> np.uint64(24)))
    return (np.float32(total) - np.float32(mean)) / np.float32(std)


def _row_viterbi(y, table_t, state_at, group_at, pos_of, kv, closing, path, back):
    """One row: y (steps, V); table_t (V, 2^L) in the permuted order; state_at[pos],
    group_at[pos] = state_at[pos] & (2^(L-kV) - 1), pos_of[state]. Fills path (steps,)
    with states and returns the path's cost (float32)."""
    steps, nv = y.shape
    n = table_t.shape[1]
    fan = 1 << kv
    m = n >> kv
    low = m - 1
    inf = np.float32(np.inf)
    cost = np.empty(n, np.float32)
    new = np.empty(n, np.float32)
    best = np.empty(m, np.float32)
    grouped = np.empty(max(1, m >> kv), np.float32)
    for pos in range(n):
        d = (y[0, 0] - table_t[0, pos]) * (y[0, 0] - table_t[0, pos])
        for j in range(1, nv):
            diff = y[0, j] - table_t[j, pos]
            d = d + diff * diff
        cost[pos] = d if closing < 0 or (state_at[pos] & low) == closing else inf
    for t in range(1, steps):
        # (a) group p's states sit at i * m + p, i = their low kV bits
        h = back[t]
        for p in range(m):
            best[p] = cost[p]
            h[p] = 0
        for i in range(1, fan):
            run = cost[i * m : (i + 1) * m]
            for p in range(m):
                c = run[p]
                better = c < best[p]
                best[p] = c if better else best[p]
                h[p] = i if better else h[p]
        # (b) the new state at pos follows group group_at[pos]
        if m >= fan:  # pos = r m + hi m/fan + q holds state hi m + q fan + r: group q fan + r
            _new_costs_runs(y[t], table_t, best, grouped, new, kv)
        else:
            _new_costs_gathered(y[t], table_t, best, group_at, new)
        cost, new = new, cost
    last = -1
    lb = inf
    for s in range(n):  # masked states count as inf (np.argmin's 0 if every one is)
        c = inf if closing >= 0 and (s >> kv) != closing else cost[pos_of[s]]
        if last < 0 or c < lb:
            lb = c
            last = s
    path[steps - 1] = last
    for t in range(steps - 1, 0, -1):
        s = path[t]
        path[t - 1] = ((s & low) << kv) | back[t, s & low]
    return lb


def _new_costs_runs(yt, table_t, best, grouped, new, kv):
    """(b) where 2^kV <= 2^(L-kV): for each r, the groups q 2^kV + r copied into one run,
    then every new state is one contiguous pass (the same sums as _new_costs_gathered)."""
    nv = yt.shape[0]
    n = new.shape[0]
    fan = 1 << kv
    m = n >> kv
    mq = m >> kv
    for r in range(fan):
        for q in range(mq):
            grouped[q] = best[q * fan + r]
        for hi in range(fan):
            base = r * m + hi * mq
            out = new[base : base + mq]
            t0 = table_t[0, base : base + mq]
            y0 = yt[0]
            if nv == 1:
                for q in range(mq):
                    diff = y0 - t0[q]
                    out[q] = diff * diff + grouped[q]
            else:
                t1 = table_t[1, base : base + mq]
                y1 = yt[1]
                for q in range(mq):
                    d0 = y0 - t0[q]
                    d1 = y1 - t1[q]
                    out[q] = (d0 * d0 + d1 * d1) + grouped[q]


def _new_costs_gathered(yt, table_t, best, group_at, new):
    """(b) for any L, kV: each new state's distance plus its group's best, by index."""
    y0 = yt[0]
    t0 = table_t[0]
    if yt.shape[0] == 1:
        for pos in range(new.shape[0]):
            diff = y0 - t0[pos]
            new[pos] = diff * diff + best[group_at[pos]]
    else:
        y1 = yt[1]
        t1 = table_t[1]
        for pos in range(new.shape[0]):
            d0 = y0 - t0[pos]
            d1 = y1 - t1[pos]
            new[pos] = (d0 * d0 + d1 * d1) + best[group_at[pos]]


def _viterbi_rows(y, table_t, state_at, group_at, pos_of, kv, closing, path, total):
    rows, steps = path.shape
    m = table_t.shape[1] >> kv
    for r in _prange(rows):
        back = np.empty((steps, m), dtype=np.uint8)
        total[r] = _row_viterbi(y[r], table_t, state_at, group_at, pos_of, kv, closing[r],
                                path[r], back)


def _prange(n):  # numba.prange once compiled
    return range(n)


def _compiled():
    with _LOCK:
        if not _KERNEL:
            import numba

            scope = globals()
            opts = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
            for name in ("_new_costs_runs", "_new_costs_gathered", "_row_viterbi"):
                scope[name] = numba.njit(**opts)(scope[name])
            scope["_prange"] = numba.prange
            _KERNEL.append(numba.njit(parallel=True, **opts)(_viterbi_rows))
    return _KERNEL[0]


def _layout(state_bits: int, kv: int):
    """(state_at, group_at, pos_of) of the permuted order, int32, cached per (L, kV)."""
    key = (state_bits, kv)
    if key not in _LAYOUTS:
        n, fan = 1 << state_bits, 1 << kv
        m = n >> kv
        s = np.arange(n, dtype=np.int64)
        pos_of = (s & (fan - 1)) * m + (s >> kv)
        state_at = np.empty(n, dtype=np.int64)
        state_at[pos_of] = s
        _LAYOUTS[key] = (state_at.astype(np.int32), (state_at & (m - 1)).astype(np.int32),
                         pos_of.astype(np.int32))
    return _LAYOUTS[key]


def viterbi(code, y: np.ndarray, table: np.ndarray, closing=None):
    """trellis.viterbi's result (states (rows, steps) int64, cost (rows,) float64), compiled."""
    kernel = _compiled()
    rows, steps, _ = y.shape
    kv = code.step_bits
    state_at, group_at, pos_of = _layout(code.state_bits, kv)
    y = np.ascontiguousarray(y, dtype=np.float32)
    table_t = np.ascontiguousarray(np.asarray(table, dtype=np.float32)[state_at].T)
    path = np.empty((rows, steps), dtype=np.int64)
    total = np.empty(rows, dtype=np.float32)
    close = (np.full(rows, -1, dtype=np.int64) if closing is None
             else np.ascontiguousarray(closing, dtype=np.int64))
    kernel(y, table_t, state_at, group_at, pos_of, kv, close, path, total)
    return path, total.astype(np.float64)

"""encode's rotation compiled with numba: the same float32 operations, in the same order, as
rotate.py's numpy/MLX path, so the same bits, several times faster.

One kernel does the whole of `rotate_groups_np` for a chunk of rows: signs, the Hadamard over
the power-of-two factor p, the 12/20/28 or dense factor, and the move to encode's layout.
It works on tiles of 16 rows held column-major, (n, 16), so every step is a loop over the
tile's rows (or over runs of them) that the compiler turns into vector instructions, and a
tile stays in cache from the first step to the last. stages/fast_quantize.py does the rest
of encode the same way.

The order that fixes the bits (module notes of rotate.py):
- butterflies as MLX's CPU `hadamard_n` does them: stages of stride 1, 2, 4, ... in turn,
  each (u + v, u - v) rounded to float32 (two stages are done per pass over the tile, the
  same operations), the scale multiplied in after the last stage (and, for p > 8192, after
  the stage of stride 4096 too: the transform is split there, as rotate() splits it);
- the a x a factor as MLX's `hadamard_m` and the reference sgemm: acc = 0.0, then
  acc = acc + y_k * mat[i, k] for k = 0, 1, ..., each product rounded, then times the scale;
- a group's energy as MLX's sum: 0.0, then + y_g * y_g for g = 0, 1, ..., each rounded.
No fast-math: every float32 product and sum is rounded on its own (no fused multiply-add,
no reordering). tests/test_stages_rotate.py and test_stages_golden.py compare the bytes
with the numpy/MLX path and with the pinned digests.

`AVAILABLE` is False where numba is not installed (or TURBOQUANT_NO_NUMBA=1 is set); the
callers then keep the numpy/MLX path. numba is imported at the first call, and compiled code
is cached on disk (numba's `cache=True`), so only the first process that uses it pays the
compile time (several seconds).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import numpy as np

# numba is imported on first use, not here: importing turboquant (the CLI's own process, the
# runtime) does not load LLVM (~120 MB of RSS)
AVAILABLE = (os.environ.get("TURBOQUANT_NO_NUMBA", "") in ("", "0")
             and importlib.util.find_spec("numba") is not None)
_KERNELS: list[tuple[dict, str]] = []
_LOCK = threading.Lock()
_compiled = False


def _jit(fn):
    """Mark fn as a kernel: compile_kernels() replaces it with its numba version."""
    _KERNELS.append((fn.__globals__, fn.__name__))
    return fn


def compile_kernels() -> None:
    """Import numba and compile (or load from numba's disk cache) every kernel, once."""
    global _compiled
    if _compiled:  # every chunk asks: no lock once done
        return
    with _LOCK:
        if _compiled:
            return
        import numba

        for scope, name in _KERNELS:
            if "literal_unroll" in scope:
                scope["literal_unroll"] = numba.literal_unroll
            scope[name] = numba.njit(cache=True, nogil=True, fastmath=False,
                                     error_model="numpy")(scope[name])
        _compiled = True


TILE = 16  # rows per tile: one AVX-512 vector of float32, (n, 16) buffers stay in cache


@_jit
def _butterflies(buf, h, four, tile):
    """One pass over buf (n, tile): stage h, or stages h and 2h, in every block of p rows (a
    pass's step, 2h or 4h rows, divides p). The rows a butterfly pairs are whole runs of
    h * tile floats: one long loop each."""
    f = buf.reshape(-1)
    run = h * tile
    step = (4 if four else 2) * run
    for a in range(0, f.size, step):
        x = f[a : a + run]  # views: indices from range(run) need no wraparound checks
        y = f[a + run : a + 2 * run]
        if four:
            z = f[a + 2 * run : a + 3 * run]
            w = f[a + 3 * run : a + 4 * run]
            for e in range(run):
                x0 = x[e]
                x1 = y[e]
                x2 = z[e]
                x3 = w[e]
                a0 = x0 + x1
                a1 = x0 - x1
                a2 = x2 + x3
                a3 = x2 - x3
                x[e] = a0 + a2
                z[e] = a0 - a2
                y[e] = a1 + a3
                w[e] = a1 - a3
        else:
            for e in range(run):
                u = x[e]
                v = y[e]
                x[e] = u + v
                y[e] = u - v


@_jit
def _scale(buf, s, tile):
    for j in range(buf.shape[0]):
        for t in range(tile):
            buf[j, t] = buf[j, t] * s


@_jit
def _rotate_tile(x, r0, nt, signs, mat, p, split, s_split, s_p, s_mix, tile, buf, mixed,
                 scratch):
    """Rows r0 .. r0 + nt of x, rotated, into an (n, tile) buffer (returned: buf or mixed)."""
    n = x.shape[1]
    a = n // p
    # indices here are loop variables (over views where needed): numba adds no checks for
    # negative indices, and the loops stay vector code
    xs = x[r0 : r0 + nt]
    if nt == TILE:
        _load_tile(xs, signs, buf)
    else:
        for j in range(n):
            for t in range(nt):
                buf[j, t] = xs[t, j] * signs[j]
    # each p-block's stages (and scale) run while its (p, tile) slice is in L1: the blocks
    # are independent, and each element sees the same operations in the same order
    for k in range(a):
        part = buf[k * p : (k + 1) * p]
        h = 1
        while h < p:  # the Hadamard over p: stages of stride 1, 2, 4, ... in order
            stop = split if h < split else p
            four = 4 * h <= stop
            _butterflies(part, h, four, tile)
            h *= 4 if four else 2
            if h == split and split < p:
                _scale(part, s_split, tile)
        if a > 1 and s_p != 1.0:
            _scale(part, s_p, tile)
    if a == 1:  # the scale is applied as the tile is written out
        return buf
    _mix(buf.reshape(-1), mixed.reshape(-1), mat, a, p * tile, s_mix, MIX_CHUNK, scratch)
    return mixed


LOAD_BLOCK = 16  # columns moved a step: each row's run is one cache line of float32


@_jit
def _load_tile(xs, signs, buf):
    """TILE rows xs (TILE, n), times the signs, into buf (n, TILE): LOAD_BLOCK columns at a
    time, each row's run read whole. A column at a time would read TILE lines that a
    power-of-two row stride puts in one L1 set (they evict each other)."""
    n = xs.shape[1]
    whole = n - n % LOAD_BLOCK
    for j0 in range(0, whole, LOAD_BLOCK):
        s = signs[j0 : j0 + LOAD_BLOCK]
        block = buf[j0 : j0 + LOAD_BLOCK]
        for t in range(TILE):
            run = xs[t, j0 : j0 + LOAD_BLOCK]
            for j in range(LOAD_BLOCK):
                block[j, t] = run[j] * s[j]
    for j in range(whole, n):
        for t in range(TILE):
            buf[j, t] = xs[t, j] * signs[j]


MIX_CHUNK = 512  # floats of each block mixed at a time


@_jit
def _mix(flat_in, flat_out, mat, a, size, s_mix, chunk, scratch):
    """Block i = sum over k in order of mat[i, k] * block k, from 0.0, then times s_mix;
    `chunk` floats of every block at a time. The a input slices of a chunk are first
    copied next to each other into `scratch` (a * chunk floats): in place they lie a
    power-of-two apart, in the same cache sets, and evict each other while every output
    reads them. Outputs are made two at a time, four k a pass (each input load serves
    both; the same additions in the same order as one at a time)."""
    for e0 in range(0, size, chunk):
        width = min(chunk, size - e0)
        for k in range(a):
            src = flat_in[k * size + e0 : k * size + e0 + width]
            dst = scratch[k * chunk : k * chunk + width]
            for e in range(width):
                dst[e] = src[e]
        i = 0
        while i < a:
            acc = flat_out[i * size + e0 : i * size + e0 + width]
            if i + 1 < a:
                bcc = flat_out[(i + 1) * size + e0 : (i + 1) * size + e0 + width]
                _mix_pair(scratch, acc, bcc, mat, i, a, chunk, s_mix)
                i += 2
            else:
                _mix_one(scratch, acc, mat, i, a, chunk, s_mix)
                i += 1


@_jit
def _mix_one(inputs, acc, mat, i, a, stride, s_mix):
    """acc = sum over k in order of mat[i, k] * inputs[k * stride : ...], from 0.0, then
    times s_mix (where not 1)."""
    width = acc.size
    for e in range(width):
        acc[e] = 0.0
    k = 0
    while k + 4 <= a:
        c0, c1, c2, c3 = mat[i, k], mat[i, k + 1], mat[i, k + 2], mat[i, k + 3]
        b = k * stride
        t0 = inputs[b : b + width]
        t1 = inputs[b + stride : b + stride + width]
        t2 = inputs[b + 2 * stride : b + 2 * stride + width]
        t3 = inputs[b + 3 * stride : b + 3 * stride + width]
        for e in range(width):
            acc[e] = (((acc[e] + t0[e] * c0) + t1[e] * c1) + t2[e] * c2) + t3[e] * c3
        k += 4
    while k < a:
        c = mat[i, k]
        term = inputs[k * stride : k * stride + width]
        for e in range(width):
            acc[e] = acc[e] + term[e] * c
        k += 1
    if s_mix != 1.0:
        for e in range(width):
            acc[e] = acc[e] * s_mix


@_jit
def _mix_pair(inputs, acc, bcc, mat, i, a, stride, s_mix):
    """_mix_one for outputs i (acc) and i + 1 (bcc) in one pass over the inputs."""
    width = acc.size
    for e in range(width):
        acc[e] = 0.0
        bcc[e] = 0.0
    k = 0
    while k + 4 <= a:
        c0, c1, c2, c3 = mat[i, k], mat[i, k + 1], mat[i, k + 2], mat[i, k + 3]
        d0, d1, d2, d3 = mat[i + 1, k], mat[i + 1, k + 1], mat[i + 1, k + 2], mat[i + 1, k + 3]
        b = k * stride
        t0 = inputs[b : b + width]
        t1 = inputs[b + stride : b + stride + width]
        t2 = inputs[b + 2 * stride : b + 2 * stride + width]
        t3 = inputs[b + 3 * stride : b + 3 * stride + width]
        for e in range(width):
            u0, u1, u2, u3 = t0[e], t1[e], t2[e], t3[e]
            acc[e] = (((acc[e] + u0 * c0) + u1 * c1) + u2 * c2) + u3 * c3
            bcc[e] = (((bcc[e] + u0 * d0) + u1 * d1) + u2 * d2) + u3 * d3
        k += 4
    while k < a:
        c, d = mat[i, k], mat[i + 1, k]
        term = inputs[k * stride : k * stride + width]
        for e in range(width):
            acc[e] = acc[e] + term[e] * c
            bcc[e] = bcc[e] + term[e] * d
        k += 1
    if s_mix != 1.0:
        for e in range(width):
            acc[e] = acc[e] * s_mix
            bcc[e] = bcc[e] * s_mix


@_jit
def _write_tile(src, r0, out, energy, gs, big_a, big_b, rows, want_energy, scale, tile):
    """A full tile (`tile` = TILE rows), times scale, into the flat layout. The loops over
    the tile's rows run to `tile`, a run-time value: with the literal TILE the compiler
    unrolls them into scalar code (it cannot tell dst, col and acc apart); a loop of
    run-time length is vectorized behind a check that they do not overlap."""
    block = big_b * gs
    acc = np.zeros(tile, dtype=np.float32)
    for i in range(big_a):
        for bb in range(big_b):
            j0 = i * block + bb * gs
            for t in range(tile):
                acc[t] = 0.0
            for g in range(gs):
                o = ((g * big_a + i) * big_b + bb) * rows + r0
                dst = out[o : o + tile]
                col = src[j0 + g]
                for t in range(tile):
                    v = col[t] * scale
                    dst[t] = v
                    acc[t] = acc[t] + v * v
            if want_energy:
                o = (i * big_b + bb) * rows + r0
                dst = energy[o : o + tile]
                for t in range(tile):
                    dst[t] = acc[t]


@_jit
def _write_part(src, r0, nt, out, energy, gs, big_a, big_b, want_energy, scale):
    """The last, partial tile."""
    block = big_b * gs
    for i in range(big_a):
        for bb in range(big_b):
            j0 = i * block + bb * gs
            for t in range(nt):
                acc = np.float32(0.0)
                for g in range(gs):
                    v = src[j0 + g, t] * scale
                    out[g, i, bb, r0 + t] = v
                    acc = acc + v * v
                if want_energy:
                    energy[i, bb, r0 + t] = acc


@_jit
def _rotate_kernel(x, signs, mat, p, split, s_split, s_p, s_mix, tile, out, energy):
    """Rotate rows x (rows, n) into out (group_size, A, B, rows): column j of a row goes to
    [j' % group_size, j // (n / A), j' // group_size, row] with j' = j % (n / A). With
    energy of shape (A, B, rows), also each group's sum of squares, in order from 0.0.
    `tile` is TILE, passed as a value: loops of run-time length over it vectorize better
    than the literal ones where one loop both reads and writes the same buffer."""
    rows, n = x.shape
    gs, big_a, big_b = out.shape[0], out.shape[1], out.shape[2]
    want_energy = energy.shape[2] == rows
    # with no a-factor the last scale is applied on the way out (x * 1.0 is exact)
    scale = s_p if n == p else np.float32(1.0)
    buf = np.zeros((n, tile), dtype=np.float32)
    mixed = np.zeros((n, tile), dtype=np.float32)
    scratch = np.zeros(n // p * MIX_CHUNK, dtype=np.float32)
    for r0 in range(0, rows, tile):
        nt = min(tile, rows - r0)
        src = _rotate_tile(x, r0, nt, signs, mat, p, split, s_split, s_p, s_mix, tile, buf,
                           mixed, scratch)
        if nt == TILE:
            _write_tile(src, r0, out.reshape(-1), energy.reshape(-1), gs, big_a, big_b, rows,
                        want_energy, scale, tile)
        else:
            _write_part(src, r0, nt, out, energy, gs, big_a, big_b, want_energy, scale)
    return out


def rotate_groups(x: np.ndarray, signs: np.ndarray, mat: np.ndarray | None, p: int,
                  split: int, scales: tuple[float, float, float], group_size: int,
                  blocks: int, energy: bool = False):
    """The compiled rotation of float32 rows x (rows, n), laid out (group_size, blocks, b,
    rows) (b = n / (blocks * group_size)); with `energy`, also (group energies (blocks, b,
    rows) float32).

    `mat` is the a x a factor (None: a = 1), `split` the stride after which `scales[0]`
    applies (p: none), `scales[1:]` those of the Hadamard over p and of the a-factor.
    n must be a multiple of p and of blocks * group_size.
    """
    rows, n = x.shape
    m = np.ones((1, 1), np.float32) if mat is None else np.ascontiguousarray(mat, np.float32)
    b = n // (blocks * group_size)
    out = np.empty((group_size, blocks, b, rows), dtype=np.float32)
    e = np.empty((blocks, b, rows) if energy else (0, 0, 0), dtype=np.float32)
    s_split, s_p, s_mix = (np.float32(s) for s in scales)
    compile_kernels()
    _rotate_kernel(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(signs, np.float32),
                   m, p, split, s_split, s_p, s_mix, TILE, out, e)
    return (out, e) if energy else out

"""The CUDA KV decode kernels (kernels/cuda_kv.py), replayed on the CPU.

No GPU here, so two checks stand in for running them:

- a numpy emulation of the two kernels that follows their index arithmetic line by line
  (block and thread ids, chunk and tile ranges, strided reads of the cache's slices and
  queries, the in-block query rotation, code unpacking, shared-memory layouts, the online
  softmax, the merge), fed the very `Launch` that `cuda_kv.prepare` builds, and compared
  with `tq_attention`. Every global read
  checks its coordinates against the input's shape (an out-of-bounds read fails here
  instead of corrupting a GPU run), and every output element is written exactly once;
- the kernel sources wrapped the way `mx.fast.cuda_kernel` wraps them (signature from the
  inputs' dtypes, `<name>_shape` / `<name>_strides` arguments, template arguments as
  constexpr) and compiled with nvcc for sm_90, when nvcc is installed.

tests/test_kernels_cuda_kv.py runs the real kernels against the reference on a GPU.
"""

from __future__ import annotations

import math
import shutil

import mlx.core as mx
import numpy as np
import pytest

from cuda_source import compile_with_nvcc, kernel_source, nvcc_registers
from turboquant.kernels import cuda_kv, cuda_kv_layout, cuda_kv_plan, cuda_kv_sources
from turboquant.kernels.kv_reference import (
    NEG,
    KVParts,
    PackedKV,
    kv_quantize,
    kv_words,
    tq_attention,
)

F32 = np.float32


# ---------------------------------------------------------------------------- kernel inputs


class Arg:
    """A kernel input as the kernel sees it: a flat buffer, an offset, shape, element strides."""

    def __init__(self, buf: np.ndarray, index=()):
        buf = np.ascontiguousarray(buf)
        view = buf[index]
        item = buf.itemsize
        self.flat = buf.reshape(-1)
        self.offset = (view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // item
        self.shape = view.shape
        self.strides = [s // item for s in view.strides]
        self.view = view

    def read(self, *coords, valid=None):
        """flat[offset + sum(coord * stride)] where valid (0 elsewhere); coordinates checked."""
        coords = np.broadcast_arrays(*[np.asarray(c, dtype=np.int64) for c in coords])
        valid = np.ones(coords[0].shape, bool) if valid is None else np.broadcast_to(valid, coords[0].shape)
        assert len(coords) == len(self.shape), (len(coords), self.shape)
        idx = np.full(coords[0].shape, self.offset, dtype=np.int64)
        for axis, (c, n, s) in enumerate(zip(coords, self.shape, self.strides)):
            bad = valid & ((c < 0) | (c >= n))
            assert not bad.any(), f"read out of bounds on axis {axis}: {c[bad][:4]} of {n}"
            idx = idx + np.where(valid, c, 0) * s
        out = np.zeros(coords[0].shape, dtype=self.flat.dtype)
        out[valid] = self.flat[idx[valid]]
        return out

    def read_flat(self, index, valid=None):
        """flat[offset + index] for a contiguous input indexed by hand in the kernel."""
        assert self.view.flags.c_contiguous
        index = np.asarray(index, dtype=np.int64)
        valid = np.ones(index.shape, bool) if valid is None else np.broadcast_to(valid, index.shape)
        bad = valid & ((index < 0) | (index >= self.view.size))
        assert not bad.any(), f"flat read out of bounds: {index[bad][:4]} of {self.view.size}"
        out = np.zeros(index.shape, dtype=self.flat.dtype)
        out[valid] = self.flat[self.offset + index[valid]]
        return out


class Out:
    """An output buffer that records how often each element is written."""

    def __init__(self, shape):
        self.data = np.full(int(np.prod(shape)), np.nan, dtype=F32)
        self.writes = np.zeros(self.data.size, dtype=np.int64)
        self.shape = shape

    def write(self, index, values, valid=None):
        index = np.asarray(index, dtype=np.int64)
        values = np.broadcast_to(np.asarray(values, dtype=F32), index.shape)
        valid = np.ones(index.shape, bool) if valid is None else np.broadcast_to(valid, index.shape)
        i = index[valid]
        assert ((i >= 0) & (i < self.data.size)).all(), "write out of bounds"
        self.data[i] = values[valid]
        np.add.at(self.writes, i, 1)

    def done(self) -> np.ndarray:
        assert (self.writes == 1).all(), f"{(self.writes != 1).sum()} elements not written exactly once"
        return self.data.reshape(self.shape)


# ---------------------------------------------------------------------------- code unpacking


def block_code(w: list[np.ndarray], j: int, bits: int) -> np.ndarray:
    """tq_block_code: code j of a 32-code block held in `bits` words."""
    if bits == 3:
        bit = 3 * j
        k, s = bit >> 5, bit & 31
        c = w[k] >> np.uint32(s)
        if s > 29:
            c = c | (w[k + 1 if k < 2 else 2] << np.uint32(32 - s))
        return (c & np.uint32(7)).astype(np.int64)
    per = 32 // bits
    return ((w[j // per] >> np.uint32((j % per) * bits)) & np.uint32((1 << bits) - 1)).astype(np.int64)


def code_pos(i: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """tq_code_pos: (word, shift) of code i."""
    if bits == 3:
        bit = 3 * (i & 31)
        return 3 * (i >> 5) + (bit >> 5), bit & 31
    per = 32 // bits
    return i // per, (i % per) * bits


def staged_code_at(vw: np.ndarray, u, word, shift, bits, wv, valid) -> np.ndarray:
    """tq_code_at over the shared-memory tile of value codes (row u, `wv` words a row)."""
    def at(w, ok):
        ix = u * wv + w
        assert (ix[ok] < vw.size).all() and (w[ok] < wv).all(), "staged code read out of range"
        return np.where(ok, vw[np.where(ok, ix, 0)], np.uint32(0))

    c = at(word, valid) >> shift.astype(np.uint32)
    if bits == 3:
        straddle = valid & (shift > 29)
        sh = np.where(straddle, 32 - shift, 0).astype(np.uint32)
        c = c | np.where(straddle, at(word + 1, straddle) << sh, np.uint32(0))
    return (c & np.uint32((1 << bits) - 1)).astype(np.int64)


def emulate_query_rows(L: cuda_kv.Launch, queries: Arg, b: int, h: int, fp: bool) -> np.ndarray:
    """The partial block's prologue: qs (R * KD) of KV head h, as the kernel leaves it."""
    T = dict(L.layout.partial_template)
    KD, R, P, BK, BV = T["KD"], T["R"], T["P"], T["BK"], T["BV"]
    A = KD // P
    consts = np.asarray(L.layout.consts)
    at = cuda_kv_layout.consts_layout(KD, A, BK, BV)
    signs, mix = consts[at["signs"]], consts[at["mix"]]
    scale, kscale = consts[at["scales"]]
    i = np.arange(R * KD)
    x = queries.read(b, h * R + i // KD, 0, i % KD).astype(F32)
    if fp:
        return (x * scale).reshape(R, KD)
    qs = x * signs[i % KD]
    lh = 0
    while (1 << lh) < P:  # radix-2 stages over every segment of P
        hh = 1 << lh
        k = np.arange(R * KD // 2)
        j = ((k >> lh) << (lh + 1)) | (k & (hh - 1))
        assert (j + hh < R * KD).all()
        u, w = qs[j].copy(), qs[j + hh].copy()
        qs[j], qs[j + hh] = u + w, u - w
        lh += 1
    out = qs.copy()
    for t in range(R * P):  # a thread per (row, column)
        base = (t // P) * KD + t % P
        v = qs[base + np.arange(A) * P]
        for a in range(A):
            o = F32(0)
            for k in range(A):
                o = F32(o + mix[a * A + k] * v[k])
            out[base + a * P] = o * kscale
    return out.reshape(R, KD)


def key_rows(k_codes: Arg, b, h, t, wk: int, valid, vec_keys: bool) -> list[np.ndarray]:
    """The WK words of each thread's key row: word by word, or (`_PARTIAL_VEC` when its
    guard holds) as whole 16-byte units read flat from the row's start, which must then be
    16-byte aligned; units past the row's end are never read."""
    s2, s3 = k_codes.strides[2], k_codes.strides[3]
    start = k_codes.offset + b * k_codes.strides[0] + h * k_codes.strides[1]
    if not (vec_keys and wk % 4 == 0 and s3 == 1 and s2 % 4 == 0 and start % 4 == 0):
        return [k_codes.read(b, h, t, k, valid=valid) for k in range(wk)]
    base = start + np.where(valid, t, 0) * s2
    assert (base[valid] % 4 == 0).all(), "a 16-byte key load would be misaligned"
    assert (base[valid] + wk <= k_codes.flat.size).all(), "a key load past the buffer"
    return [np.where(valid, k_codes.flat[base + k], np.uint32(0)) for k in range(wk)]


def emulate_partial(L: cuda_kv.Launch, args: dict[str, Arg], vec_keys: bool = False):
    """`_PARTIAL`, or with `vec_keys` the lab's candidate `_PARTIAL_VEC` (a key row read in
    16-byte units where the kernel's guard allows: contiguous, aligned, whole units)."""
    T = dict(L.layout.partial_template)
    KD, DV, BK, BV, R, FPCH = (T[k] for k in ("KD", "DV", "BK", "BV", "R", "FPCH"))
    WK, WV = kv_words(KD, BK), kv_words(DV, BV)  # the kernel's tq_words
    KV = args["k_codes"].shape[1]
    NT, TILE = cuda_kv_plan.NT, cuda_kv_plan.TILE
    NBK = (KD + 31) // 32
    VSLOT = DV if DV < NT else NT
    VG = NT // DV if DV < NT else 1
    DPT = (DV + NT - 1) // NT
    nch = L.layout.nch
    grid_y, grid_x = L.layout.partial_grid[1], L.layout.partial_grid[0] // NT
    assert grid_x == nch and L.layout.partial_grid[2] == 1
    consts = np.asarray(L.layout.consts)
    at = cuda_kv_layout.consts_layout(KD, KD // T["P"], BK, BV)
    lk, lv = consts[at["levels_k"]], consts[at["levels_v"]]
    part_ml = Out((grid_y, nch, R, 2))
    part_acc = Out((grid_y, nch, R, DV))
    tid = np.arange(NT)
    r_ix = np.arange(R)[:, None]

    C = args["k_codes"].shape[2]
    S = args["sink_k"].shape[2] if T["HAS_SINK"] else 0
    TT = args["tail_k"].shape[2] if T["HAS_TAIL"] else 0
    v_scale = F32(1.0) / F32(math.sqrt(DV))
    for bk in range(grid_y):  # blockIdx.y
        b, h = divmod(bk, KV)
        for chunk in range(nch):  # blockIdx.x
            ncc = nch - FPCH
            fp = chunk >= ncc
            n_tok = S + TT if fp else C
            n_chunks = FPCH if fp else ncc
            c_idx = chunk - ncc if fp else chunk
            tiles = (n_tok + TILE - 1) // TILE
            tile0, tile1 = cuda_kv_plan.chunk_tiles(tiles, n_chunks, c_idx)

            qs = emulate_query_rows(L, args["queries"], b, h, fp)
            m_s, l_s = np.full(R, F32(NEG), F32), np.zeros(R, F32)
            mask_shape = args["mask"].shape
            mrow = ((b if mask_shape[0] > 1 else 0) * mask_shape[1]) if T["HAS_MASK"] else 0
            vg, vd = tid // VSLOT, tid % VSLOT
            vpos = [code_pos(vd + k * VSLOT, BV) for k in range(DPT)]
            acc = np.zeros((DPT, R, NT), F32)

            for tile in range(tile0, tile1):
                if not fp:  # the tile's value codes, staged in shared memory
                    i = np.arange(TILE * WV)
                    tt = tile * TILE + i // WV
                    vw = args["v_codes"].read(b, h, tt, i % WV, valid=tt < n_tok)
                t = tile * TILE + tid
                valid = t < n_tok
                s = np.zeros((R, NT), F32)
                if not fp:
                    row = key_rows(args["k_codes"], b, h, t, WK, valid, vec_keys)
                    for blk in range(NBK):
                        w = [row[blk * BK + k] if blk * BK + k < WK else np.zeros(NT, np.uint32)
                             for k in range(BK)]
                        for j in range(32):
                            if blk * 32 + j < KD:
                                s += qs[:, blk * 32 + j : blk * 32 + j + 1] * lk[block_code(w, j, BK)]
                    s *= args["k_norms"].read(b, h, t, valid=valid).astype(F32)
                    vscale = args["v_norms"].read(b, h, t, valid=valid).astype(F32) * v_scale
                    col = S + t
                else:
                    in_sink = t < S
                    for k in range(KD):
                        x = np.zeros(NT, F32)
                        if T["HAS_SINK"]:
                            x += args["sink_k"].read(b, h, t, k, valid=valid & in_sink).astype(F32)
                        if T["HAS_TAIL"]:
                            x += args["tail_k"].read(b, h, t - S, k, valid=valid & ~in_sink).astype(F32)
                        s += qs[:, k : k + 1] * x
                    vscale = np.ones(NT, F32)
                    col = np.where(in_sink, t, C + t)
                bias = np.zeros(NT, F32)
                if T["HAS_MASK"]:
                    assert (col[valid] < args["mask"].shape[1]).all(), "mask column out of range"
                    bias = args["mask"].read_flat(mrow + col, valid=valid).astype(F32)
                sc = np.zeros(TILE * R, F32)  # shared, [token * R + r]
                sc[tid[None] * R + r_ix] = np.where(valid, s + bias, -np.inf)
                vn = np.where(valid, vscale, F32(0))

                a_s = np.zeros(R, F32)
                for r in range(R):  # a warp per row
                    u = np.arange(TILE)
                    row = sc[u * R + r]
                    m_new = max(max(m_s[r], row.max()), F32(NEG))
                    with np.errstate(under="ignore"):
                        p = np.exp(row - m_new).astype(F32)
                    sc[u * R + r] = p * vn[u]
                    a = np.exp(F32(m_s[r] - m_new))
                    a_s[r], l_s[r], m_s[r] = a, l_s[r] * a + p.sum(dtype=F32), m_new
                acc *= a_s[None, :, None]

                ntile = min(TILE, n_tok - tile * TILE)
                # a dim a thread: u = vg, vg + VG, ...
                for step in range(-(-ntile // VG)):
                    u = step * VG + vg
                    active = (vg < VG) & (u < ntile)
                    t2 = tile * TILE + u
                    for k in range(DPT):
                        d = vd + k * VSLOT
                        act = active & (d < DV)
                        if not fp:
                            x = lv[staged_code_at(vw, u, *vpos[k], BV, WV, act)]
                        else:
                            x = np.zeros(NT, F32)
                            if T["HAS_SINK"]:
                                x += args["sink_v"].read(b, h, t2, d, valid=act & (t2 < S)).astype(F32)
                            if T["HAS_TAIL"]:
                                x += args["tail_v"].read(b, h, t2 - S, d, valid=act & (t2 >= S)).astype(F32)
                        pv = sc[np.where(act, u, 0)[None] * R + r_ix]
                        acc[k] += np.where(act, pv * x, F32(0))

            if VG > 1:  # token groups reduce through sc
                red = np.full(TILE * R, np.nan, F32)
                for r in range(R):
                    sel = (vg > 0) & (vg < VG)
                    ix = ((vg - 1) * R + r) * DV + vd
                    assert (ix[sel] < TILE * R).all(), "group reduction overflows sc"
                    red[ix[sel]] = acc[0, r, sel]
                for g in range(1, VG):
                    for r in range(R):
                        sel = vg == 0
                        acc[0, r, sel] += red[((g - 1) * R + r) * DV + vd[sel]]
            prow = (bk * nch + chunk) * R
            for k in range(DPT):
                d = vd + k * VSLOT
                for r in range(R):
                    part_acc.write((prow + r) * DV + d, acc[k, r], valid=(vg == 0) & (d < DV))
            part_ml.write((prow + r_ix[:, 0]) * 2, m_s)
            part_ml.write((prow + r_ix[:, 0]) * 2 + 1, l_s)
    return part_ml.done(), part_acc.done()


def emulate_merge(L: cuda_kv.Launch, part_ml: np.ndarray, part_acc: np.ndarray,
                  split: int | None = None) -> np.ndarray:
    """`_MERGE`, or with `split` Q > 1 `_MERGE_SPLIT` (Q threads a dim); by default what
    the call's layout launches (its merge kernel and threads a block)."""
    if L.layout.merge_kernel == "tq_kv_merge_wide" and split is None:
        return emulate_merge_wide(L, part_ml, part_acc)
    if split is None:
        split = (L.layout.merge_threads // L.layout.v_dim
                 if L.layout.merge_kernel == "tq_kv_merge_split" else 1)
    T = dict(L.layout.merge_template)
    DV, FPCH = T["DV"], T["FPCH"]
    R = part_ml.shape[2]
    unrot = np.asarray(L.layout.unrot).reshape(-1)
    ml, acc = part_ml.reshape(-1), part_acc.reshape(-1)
    nch = part_ml.shape[1]
    assert nch <= cuda_kv_plan.MAX_CHUNKS
    ncc = nch - FPCH
    rows = L.layout.merge_grid[0] // L.layout.merge_threads
    assert rows == L.layout.b * L.layout.h == int(np.prod(L.layout.out_shape[:3]))
    out = Out((rows, DV))
    d = np.arange(DV)
    for row in range(rows):  # blockIdx.x
        bk, r = divmod(row, R)
        c = np.arange(nch)
        m = ml[((bk * nch + c) * R + r) * 2]
        mx_ = max(F32(NEG), m.max())
        w = np.exp(m - mx_).astype(F32)
        total = (ml[((bk * nch + c) * R + r) * 2 + 1] * w).sum(dtype=F32)
        inv = F32(1) / total
        if split > 1:  # thread (d, q): every Q-th chunk, every Q-th row of the un-rotation
            part = np.zeros((split, DV), F32)
            for q in range(split):
                for ci in range(q, ncc, split):
                    part[q] += acc[((bk * nch + ci) * R + r) * DV + d] * w[ci]
            rot = part.sum(axis=0, dtype=F32) * inv
            part[:] = 0
            for ci in range(ncc, nch):
                part[0] += acc[((bk * nch + ci) * R + r) * DV + d] * w[ci]
            part[0] *= inv
            for q in range(split):
                for i in range(q, DV, split):
                    part[q] += rot[i] * unrot[i * DV + d]
            out.write(row * DV + d, part.sum(axis=0, dtype=F32))
            continue
        rot = np.zeros(DV, F32)
        for ci in range(ncc):
            rot += acc[((bk * nch + ci) * R + r) * DV + d] * w[ci]
        rot *= inv
        o = np.zeros(DV, F32)
        for ci in range(ncc, nch):
            o += acc[((bk * nch + ci) * R + r) * DV + d] * w[ci]
        o *= inv
        for i in range(DV):
            o += rot[i] * unrot[i * DV + d]
        out.write(row * DV + d, o)
    return out.done().reshape(L.layout.out_shape)


def _combine(m, s, mo, so):
    """The wide merge's online (max, sum) combine of two chunks' or lanes' pairs."""
    mn = np.maximum(m, mo)
    return mn, (s * np.exp(m - mn) + so * np.exp(mo - mn)).astype(F32)


def emulate_merge_wide(L: cuda_kv.Launch, part_ml: np.ndarray, part_acc: np.ndarray
                       ) -> np.ndarray:
    """`_MERGE_WIDE`: a block of 1024 threads per query row; thread (d4, q) = tid as
    q * G + d4 with G = DV / 4 threads per chunk row; its flat reads of part_ml, part_acc
    (float4 rows) and unrot, its shared arrays and its two-level reductions."""
    NT = cuda_kv_plan.MERGE_WIDE_THREADS
    assert L.layout.merge_threads == NT
    T = dict(L.layout.merge_template)
    DV, FPCH = T["DV"], T["FPCH"]
    G, R, nch = DV // 4, part_ml.shape[2], part_ml.shape[1]
    Q, P = NT // G, NT // DV
    ncc = nch - FPCH
    assert nch <= cuda_kv_plan.MAX_CHUNKS <= NT and FPCH <= 8 <= Q and NT % G == 0
    ml, acc = part_ml.reshape(-1), part_acc.reshape(-1)
    acc4 = acc.reshape(-1, 4)  # float4 view: the kernel's loads must be whole, aligned rows
    unrot4 = np.asarray(L.layout.unrot).reshape(-1, 4)
    rows = L.layout.merge_grid[0] // NT
    assert rows == int(np.prod(L.layout.out_shape[:3]))
    out = Out((rows, DV))
    tid = np.arange(NT)
    d4, q = tid % G, tid // G
    e, p = tid % DV, tid // DV
    for row in range(rows):  # blockIdx.x
        bk, r = divmod(row, R)
        live = tid < nch
        c = np.where(live, tid, 0)
        mc = np.where(live, ml[((bk * nch + c) * R + r) * 2], F32(NEG)).astype(F32)
        sc = np.where(live, ml[((bk * nch + c) * R + r) * 2 + 1], F32(0)).astype(F32)
        m, s_ = mc.reshape(32, 32), sc.reshape(32, 32)  # (warp, lane)
        for o in (16, 8, 4, 2, 1):  # __shfl_xor within each warp
            m, s_ = _combine(m, s_, m[:, np.arange(32) ^ o], s_[:, np.arange(32) ^ o])
        m, s_ = m[:, 0], s_[:, 0]  # red_m, red_s: lane 0 of every warp
        for o in (16, 8, 4, 2, 1):  # every warp combines them
            m, s_ = _combine(m, s_, m[np.arange(32) ^ o], s_[np.arange(32) ^ o])
        assert (m == m[0]).all() and (s_ == s_[0]).all()
        M, inv = m[0], F32(1) / s_[0]
        w = np.exp(mc[:nch] - M).astype(F32)  # shared w[c] for c < nch
        part = np.zeros((NT, 4), F32)
        for k in range(-(-ncc // Q)):  # chunk rows q, q + Q, ...
            ci = q + k * Q
            ok = ci < ncc
            cc = np.where(ok, ci, 0)
            idx = ((bk * nch + cc) * R + r) * G + d4
            assert (idx[ok] < acc4.shape[0]).all()
            part += np.where(ok[:, None], acc4[idx] * w[cc][:, None], 0)
        part_fp = np.zeros((8 * G, 4), F32)
        fq = q < FPCH
        ci = ncc + np.where(fq, q, 0)
        part_fp[(q * G + d4)[fq]] = (acc4[((bk * nch + ci) * R + r) * G + d4] * w[ci][:, None])[fq]

        def reduce_q(part4):  # red2[tid] = sum over rows [p Q/P, (p+1) Q/P) of dim e
            flat = part4.reshape(-1)
            return sum(flat[(p * (Q // P) + j) * DV + e] for j in range(Q // P))

        red2 = reduce_q(part)
        rot = sum(red2[k * DV + np.arange(DV)] for k in range(P)) * inv
        fp = sum((part_fp.reshape(-1)[k * DV + np.arange(DV)] for k in range(FPCH)),
                 np.zeros(DV, F32)) * inv
        o4 = np.zeros((NT, 4), F32)
        for i0 in range(0, DV, Q):  # unrot rows q, q + Q, ...
            i = i0 + q
            ok = i < DV
            ii = np.where(ok, i, 0)
            o4 += np.where(ok[:, None], unrot4[ii * G + d4] * rot[ii][:, None], 0)
        red2 = reduce_q(o4)
        out.write(row * DV + np.arange(DV),
                  fp + sum(red2[k * DV + np.arange(DV)] for k in range(P)))
    return out.done().reshape(L.layout.out_shape)


def mma(a: np.ndarray, b: np.ndarray, exact: bool = True) -> np.ndarray:
    """mma m16n8k16 from its lanes' fragments: as exact floats (the kernel's hi + lo halves
    carry float32's accuracy), or with `exact` False rounded to fp16 first (the kernel's
    fp16 operands): a (32, 4, 2), b (32, 2, 2) -> d (32, 4), the PTX layouts
    (g = lane / 4, c = lane % 4): a = {(g, 2c + i), (g + 8, 2c + i), (g, 2c + 8 + i),
    (g + 8, 2c + 8 + i)}, b = {(2c + i, g), (2c + 8 + i, g)}, d = {(g, 2c), (g, 2c + 1),
    (g + 8, 2c), (g + 8, 2c + 1)}."""
    if not exact:
        a, b = (x.astype(np.float16).astype(np.float64) for x in (a, b))
    lane = np.arange(32)
    g, c = lane >> 2, lane & 3
    A, B = np.zeros((16, 16), np.float64), np.zeros((16, 8), np.float64)
    for i in range(2):
        A[g, 2 * c + i], A[g + 8, 2 * c + i] = a[:, 0, i], a[:, 1, i]
        A[g, 2 * c + 8 + i], A[g + 8, 2 * c + 8 + i] = a[:, 2, i], a[:, 3, i]
        B[2 * c + i, g], B[2 * c + 8 + i, g] = b[:, 0, i], b[:, 1, i]
    D = A @ B
    return np.stack([D[g, 2 * c], D[g, 2 * c + 1], D[g + 8, 2 * c], D[g + 8, 2 * c + 1]],
                    axis=1).astype(F32)


def emulate_partial_mma(L: cuda_kv.Launch, args: dict[str, Arg]):
    """`_PARTIAL_MMA`, lane by lane: which fragment element each lane decodes (the dims
    and tokens it permutes), through `mma`; the prologue and softmax are `_PARTIAL`'s."""
    T = dict(L.layout.partial_template)
    KD, DV, BK, BV, R, FPCH = (T[k] for k in ("KD", "DV", "BK", "BV", "R", "FPCH"))
    EXACT = T["EXACT"]
    WV = kv_words(DV, BV)
    KSTEPS, KPL = KD // 16, KD // 4
    NWL = KPL // 32 * BK
    VWARP = DV // 4
    MTV, VPL = VWARP // 16, VWARP // 8
    KV = args["k_codes"].shape[1]
    TILE, nch = cuda_kv_plan.TILE, L.layout.nch
    grid_y = L.layout.partial_grid[1]
    consts = np.asarray(L.layout.consts)
    at = cuda_kv_layout.consts_layout(KD, KD // T["P"], BK, BV)
    lk, lv = consts[at["levels_k"]], consts[at["levels_v"]]
    part_ml, part_acc = Out((grid_y, nch, R, 2)), Out((grid_y, nch, R, DV))
    lane = np.arange(32)
    g, c4 = lane >> 2, lane & 3
    row_g = np.minimum(g, R - 1)  # lanes of g >= R hold zeros
    C = args["k_codes"].shape[2]
    S = args["sink_k"].shape[2] if T["HAS_SINK"] else 0
    TT = args["tail_k"].shape[2] if T["HAS_TAIL"] else 0
    v_scale = F32(1.0) / F32(math.sqrt(DV))

    def fp_read(key, v, t, d, valid):  # the sink or tail element of token t, dim d
        x = np.zeros(32, F32)
        if T["HAS_SINK"]:
            x += args[f"sink_{key}"].read(b, h, t, d, valid=valid & (t < S)).astype(F32)
        if T["HAS_TAIL"]:
            x += args[f"tail_{key}"].read(b, h, t - S, d, valid=valid & (t >= S)).astype(F32)
        return x

    for bk in range(grid_y):
        b, h = divmod(bk, KV)
        for chunk in range(nch):
            ncc = nch - FPCH
            fp = chunk >= ncc
            n_tok = S + TT if fp else C
            tiles = (n_tok + TILE - 1) // TILE
            tile0, tile1 = cuda_kv_plan.chunk_tiles(tiles, FPCH if fp else ncc,
                                               chunk - ncc if fp else chunk)
            qs = emulate_query_rows(L, args["queries"], b, h, fp)
            qf = np.zeros((KSTEPS, 32, 2, 2), F32)  # B: dims c4 * KPL + 4 ks + {0,1 | 2,3}
            for ks in range(KSTEPS):
                for e in range(4):
                    qf[ks, :, e // 2, e % 2] = np.where(g < R, qs[row_g, c4 * KPL + 4 * ks + e], 0)
            m_s, l_s = np.full(R, F32(NEG), F32), np.zeros(R, F32)
            mask_shape = args["mask"].shape
            mrow = ((b if mask_shape[0] > 1 else 0) * mask_shape[1]) if T["HAS_MASK"] else 0
            acc = np.zeros((4, MTV, 32, 4), F32)
            for tile in range(tile0, tile1):
                if not fp:
                    i = np.arange(TILE * WV)
                    tt = tile * TILE + i // WV
                    vw = args["v_codes"].read(b, h, tt, i % WV, valid=tt < n_tok)
                sc, vn = np.zeros(TILE * R, F32), np.zeros(TILE, F32)
                for warp in range(4):
                    for mt in range(2):
                        s = np.zeros((32, 4), F32)
                        ts_ = [tile * TILE + warp * 32 + mt * 16 + hf * 8 + g for hf in (0, 1)]
                        ok = [t < n_tok for t in ts_]
                        if not fp:
                            kw = [[args["k_codes"].read(b, h, ts_[hf], c4 * NWL + k, valid=ok[hf])
                                   for k in range(NWL)] for hf in (0, 1)]
                        for ks in range(KSTEPS):
                            a = np.zeros((32, 4, 2), F32)
                            for hf in (0, 1):
                                blk, j = (4 * ks) >> 5, (4 * ks) & 31
                                w = kw[hf][blk * BK : blk * BK + BK] if not fp else None
                                for e in range(4):
                                    if fp:
                                        x = fp_read("k", 0, ts_[hf], c4 * KPL + 4 * ks + e, ok[hf])
                                    else:
                                        x = lk[block_code(w, j + e, BK)]
                                    a[:, hf + 2 * (e // 2), e % 2] = x
                            s += mma(a, qf[ks], EXACT)
                        for hf in (0, 1):
                            u = warp * 32 + mt * 16 + hf * 8 + g
                            t, valid = tile * TILE + u, ok[hf]
                            if not fp:
                                kn = args["k_norms"].read(b, h, t, valid=valid).astype(F32)
                                vscale = args["v_norms"].read(b, h, t, valid=valid).astype(F32) * v_scale
                                col = S + t
                            else:
                                kn, vscale = np.ones(32, F32), np.ones(32, F32)
                                col = np.where(t < S, t, C + t)
                            bias = np.zeros(32, F32)
                            if T["HAS_MASK"]:
                                bias = args["mask"].read_flat(mrow + col, valid=valid).astype(F32)
                            for i in range(2):
                                r = 2 * c4 + i
                                sel = r < R
                                sc[u[sel] * R + r[sel]] = np.where(valid, s[:, 2 * hf + i] * kn + bias,
                                                                   -np.inf)[sel]
                            vn[u[c4 == 0]] = np.where(valid, vscale, F32(0))[c4 == 0]
                a_s = np.zeros(R, F32)
                for r in range(R):  # `_PARTIAL`'s online softmax
                    u = np.arange(TILE)
                    m_new = max(max(m_s[r], sc[u * R + r].max()), F32(NEG))
                    with np.errstate(under="ignore"):
                        p = np.exp(sc[u * R + r] - m_new).astype(F32)
                    sc[u * R + r] = p * vn[u]
                    a = np.exp(F32(m_s[r] - m_new))
                    a_s[r], l_s[r], m_s[r] = a, l_s[r] * a + p.sum(dtype=F32), m_new
                for i in range(4):
                    r = 2 * c4 + (i & 1)
                    acc[:, :, :, i] *= np.where(r < R, a_s[np.minimum(r, R - 1)], F32(1))
                ntile = min(TILE, n_tok - tile * TILE)
                for warp in range(4):
                    d0 = warp * VWARP + g * VPL
                    vword0, vsh = (d0 * BV) >> 5, (d0 * BV) & 31
                    for ts in range(TILE // 16):
                        if ts * 16 >= ntile:
                            break
                        u0 = ts * 16 + 2 * c4
                        bf = np.zeros((32, 2, 2), F32)  # B: tokens u0 + {0,1 | 8,9}, row g
                        for e, du in enumerate((0, 1, 8, 9)):
                            bf[:, e // 2, e % 2] = np.where(g < R, sc[(u0 + du) * R + row_g], 0)
                        vt = np.zeros((4, VPL, 32), F32)
                        for e in range(4):
                            u = u0 + (e & 1) + 8 * (e >> 1)
                            if not fp:
                                w0 = vw[u * WV + vword0].astype(np.uint64)
                                nxt = np.minimum(vword0 + 1, WV - 1)
                                w1 = np.where(vword0 + 1 < WV, vw[u * WV + nxt], 0).astype(np.uint64)
                                bits = ((w1 << np.uint64(32)) | w0) >> vsh.astype(np.uint64)
                                for k in range(VPL):
                                    code = (bits >> np.uint64(k * BV)) & np.uint64((1 << BV) - 1)
                                    vt[e, k] = lv[code.astype(np.int64)]
                            else:
                                t = tile * TILE + u
                                for k in range(VPL):
                                    vt[e, k] = fp_read("v", 0, t, d0 + k, t < n_tok)
                        for mt in range(MTV):
                            a = np.zeros((32, 4, 2), F32)
                            for hf in (0, 1):
                                a[:, hf] = vt[0:2, 2 * mt + hf].T
                                a[:, 2 + hf] = vt[2:4, 2 * mt + hf].T
                            acc[warp, mt] += mma(a, bf, EXACT)
            prow = (bk * nch + chunk) * R
            for warp in range(4):
                d0 = warp * VWARP + g * VPL
                for mt in range(MTV):
                    for i in range(4):
                        r = 2 * c4 + (i & 1)
                        part_acc.write((prow + r) * DV + d0 + 2 * mt + (i >> 1), acc[warp, mt, :, i],
                                       valid=r < R)
            part_ml.write((prow + np.arange(R)) * 2, m_s)
            part_ml.write((prow + np.arange(R)) * 2 + 1, l_s)
    return part_ml.done(), part_acc.done()


def emulate(L: cuda_kv.Launch, args: dict[str, Arg], vec_keys: bool = False,
            split: int | None = None) -> np.ndarray:
    """The two kernels of a prepared call; `args` holds the strided inputs by name."""
    names = cuda_kv_sources.PARTIAL_INPUTS
    assert len(L.inputs) == len(names)
    full = {n: args.get(n) or Arg(np.asarray(x)) for n, x in zip(names, L.inputs)}
    vec_keys = vec_keys or L.layout.partial_kernel == "tq_kv_partial_vec"  # as launched
    if L.layout.partial_kernel.startswith("tq_kv_partial_mma"):  # "_b8": the same arithmetic
        ml, acc = emulate_partial_mma(L, full)
    else:
        ml, acc = emulate_partial(L, full, vec_keys)
    assert ml.shape == tuple(L.layout.partial_shapes[0]) and acc.shape == tuple(L.layout.partial_shapes[1])
    return emulate_merge(L, ml, acc, split)


# ---------------------------------------------------------------------------- cases


def _np16(x: mx.array, dtype) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(dtype)


def make_case(*, b=1, kv=2, r=2, kd=64, dv=None, bits=(4, 3), c=300, s=4, t=40, fp=np.float16,
              seed=0, lo=5, spare=7, q_transposed=False):
    """(queries, KVParts for the reference, strided Args for the emulation).

    The compressed span and the tail are slices [lo, lo + n) of larger buffers (as in the
    cache), so the kernel's strides and offsets are exercised; the queries can be a
    transposed view as mlx-lm's attention hands them over.
    """
    dv = dv or kd
    key = mx.random.key(seed)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    h = kv * r
    comp_k = mx.random.normal((b, kv, c, kd), key=k1) * 2.0
    comp_v = mx.random.normal((b, kv, c, dv), key=k2)
    rot_seed = 12345 + seed
    kc, kn = kv_quantize(comp_k, bits[0], rot_seed, True)
    vc, vn = kv_quantize(comp_v, bits[1], rot_seed, True)
    args = {}

    def slab(name, x: np.ndarray, n):
        buf = np.zeros((b, kv, lo + n + spare, *x.shape[3:]), dtype=x.dtype)
        buf[:, :, lo : lo + n] = x
        args[name] = Arg(buf, np.s_[:, :, lo : lo + n])
        return mx.array(args[name].view)

    kc_m = slab("k_codes", np.asarray(kc), c)
    kn_m = slab("k_norms", np.asarray(kn), c)
    vc_m = slab("v_codes", np.asarray(vc), c)
    vn_m = slab("v_norms", np.asarray(vn), c)
    packed = PackedKV(kc_m, kn_m, vc_m, vn_m, bits[0], bits[1], rot_seed, kd, dv)
    sink_k = sink_v = tail_k = tail_v = None
    if s:
        sk = _np16(mx.random.normal((b, kv, s, kd), key=k3) * 2.0, fp)
        sv = _np16(mx.random.normal((b, kv, s, dv), key=k4), fp)
        args["sink_k"], args["sink_v"] = Arg(sk), Arg(sv)
        sink_k, sink_v = mx.array(sk), mx.array(sv)
    if t:
        tk = _np16(mx.random.normal((b, kv, t, kd), key=k4) * 2.0, fp)
        tv = _np16(mx.random.normal((b, kv, t, dv), key=k3), fp)
        tail_k, tail_v = slab("tail_k", tk, t), slab("tail_v", tv, t)
    q = mx.random.normal((b, h, 1, kd), key=k5)
    if q_transposed:  # (B, 1, H, D) memory, viewed as (B, H, 1, D)
        qb = np.ascontiguousarray(np.asarray(q).transpose(0, 2, 1, 3))
        args["queries"] = _transposed(qb)
        q = mx.array(qb).transpose(0, 2, 1, 3)
    parts = KVParts(sink_k, sink_v, packed, tail_k, tail_v)
    return q, parts, args


def _transposed(qb: np.ndarray) -> Arg:
    a = Arg(qb)
    a.view = qb.transpose(0, 2, 1, 3)
    a.shape = a.view.shape
    a.strides = [st // qb.itemsize for st in a.view.strides]
    return a


def check(q, parts, args, scale=0.125, mask=None, atol=2e-5, vec_keys=False, split=None):
    launch = cuda_kv.prepare(q, parts, scale, mask)
    if cuda_kv_layout.fp16_operands(launch.layout):
        atol = max(atol, cuda_kv_layout.MMA_FP16_RTOL)
    got = emulate(launch, args, vec_keys, split)
    want = np.asarray(tq_attention(q, parts, scale, mask).astype(mx.float32))
    err = np.abs(got - want).max()
    assert err < atol * max(1.0, np.abs(want).max()), (
        f"emulated kernel vs tq_attention: max abs diff {err:.3g}, out {got.shape}, "
        f"lengths {parts.lengths}, chunks {launch.layout.ncc}+{launch.layout.fpch}"
    )
    return launch


CASES = {
    "k4v3-d64-gqa2-b2": dict(b=2, kv=2, r=2, kd=64, bits=(4, 3)),
    "k8v3-d128-gqa4": dict(kv=2, r=4, kd=128, bits=(8, 3), c=700, s=0, t=130),
    "k3v3-d128-mha": dict(kv=2, r=1, kd=128, bits=(3, 3), c=200, s=4, t=0),
    "k2v2-d80": dict(kv=1, r=3, kd=80, bits=(2, 2), c=150),
    "k4v4-d256": dict(kv=1, r=2, kd=256, bits=(4, 4), c=140, t=20),
    "k4v8-d96-fp32-parts": dict(kv=1, r=2, kd=96, bits=(4, 8), c=129, fp=np.float32),
    "k8v8-kd64-dv128": dict(kv=1, r=2, kd=64, dv=128, bits=(8, 8), c=64, t=10),
    "transposed-queries": dict(b=2, kv=1, r=4, kd=64, c=130, q_transposed=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernels_match_reference(name):
    check(*make_case(**CASES[name], seed=len(name)))


@pytest.mark.parametrize("name", list(CASES))
def test_candidate_key_loads_match_reference(name):
    """The lab's candidate partial kernel (`cuda_kv_sources._PARTIAL_VEC`: key rows in 16-byte
    loads where they are contiguous and aligned) replayed the same way."""
    check(*make_case(**CASES[name], seed=len(name)), vec_keys=True)


def test_candidate_key_loads_take_16_byte_units_only_where_the_guard_allows():
    rows = np.arange(2 * 3 * 10 * 16, dtype=np.uint32).reshape(2, 3, 10, 16)
    t, valid = np.arange(8), np.ones(8, bool)
    aligned = Arg(rows, (slice(None), slice(None), slice(0, 8)))
    shifted = Arg(rows, (slice(None), slice(None), slice(0, 8)))
    shifted.offset += 2  # the same view two words further on: rows start mid-unit
    for arg in (aligned, shifted):
        want = [arg.read(1, 2, t, k, valid=valid) for k in range(16)]
        got = key_rows(arg, 1, 2, t, 16, valid, vec_keys=True)
        assert all((g == w).all() for g, w in zip(got, want))
    assert aligned.offset % 4 == 0 and shifted.offset % 4 == 2  # the second falls back


@pytest.mark.parametrize("context", [64, 1024, 4096, 16384, 32768, 65536, 262144])
@pytest.mark.parametrize("heads", [(1, 8), (2, 8), (1, 2)])
def test_candidate_plan_fills_waves_at_least_as_well_as_plan(context, heads):
    b, kv = heads
    slots = 132 * cuda_kv_plan.PARTIAL_BLOCKS_PER_SM

    def cost(ncc, fpch):
        tiles = -(-context // cuda_kv_plan.TILE)
        return -(-(ncc + fpch) * b * kv // slots) * -(-tiles // ncc)

    ncc, fpch = cuda_kv_plan.plan_waves(b, kv, context, 68, 132)
    base = cuda_kv_plan.plan(b, kv, context, 68)
    assert fpch == base[1] and 1 <= ncc <= cuda_kv_plan.MAX_CHUNKS - fpch
    assert cost(ncc, fpch) <= cost(*base)
    assert all(cost(n, fpch) > cost(ncc, fpch) for n in range(1, ncc))  # the fewest chunks


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_split_merge_launches_and_matches_reference(name, monkeypatch):
    """KV_MERGE_SPLIT (for every chunk count): the layout launches `_MERGE_SPLIT` with
    Q x DV threads a block, replayed as launched."""
    monkeypatch.setattr(cuda_kv_plan, "KV_MERGE_SPLIT", True)
    monkeypatch.setattr(cuda_kv_plan, "KV_MERGE_WIDE", False)  # the default where it fits
    lay = check(*make_case(**CASES[name], seed=len(name))).layout
    q = min(8, 1024 // lay.v_dim)  # lab, 32K: 10.2 us, 14.5 with 4
    assert lay.merge_kernel == "tq_kv_merge_split" and lay.merge_threads == q * lay.v_dim
    assert lay.merge_grid == (lay.b * lay.h * q * lay.v_dim, 1, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_wide_merge_launches_and_matches_reference(name, monkeypatch):
    """KV_MERGE_WIDE: the layout launches `_MERGE_WIDE` (1024 threads a row) where it fits,
    the split merge elsewhere, replayed as launched."""
    monkeypatch.setattr(cuda_kv_plan, "KV_MERGE_WIDE", True)
    lay = check(*make_case(**CASES[name], seed=len(name))).layout
    if cuda_kv_plan.merge_wide_fits(lay.v_dim):
        assert lay.merge_kernel == "tq_kv_merge_wide" and lay.merge_threads == 1024
        assert lay.merge_grid == (lay.b * lay.h * 1024, 1, 1)
    else:
        assert lay.merge_kernel == "tq_kv_merge_split"


def test_wide_merge_fits_the_head_dims_it_tiles():
    assert [d for d in (32, 64, 80, 96, 128, 256, 512) if cuda_kv_plan.merge_wide_fits(d)] == [
        32, 64, 128, 256]


def test_wide_merge_of_many_chunks_and_fp16_chunks(monkeypatch):
    # every compressed chunk a tile and the most fp16 chunks: the float4 rows, the chunk
    # rows past Q and the fp16 terms of threads q < FPCH all in play
    monkeypatch.setattr(cuda_kv_plan, "KV_MERGE_WIDE", True)
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", 16)
    q, parts, args = make_case(kv=2, r=4, kd=128, bits=(4, 3), c=128 * 40, s=4, t=120)
    launch = check(q, parts, args)
    assert launch.layout.ncc > 1024 // 32 and launch.layout.fpch == cuda_kv_plan.MAX_FP_CHUNKS


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_vector_key_loads_launch_and_match_reference(name, monkeypatch):
    """TURBOQUANT_CUDA_KV_PARTIAL_VEC=1: the layout launches `_PARTIAL_VEC` (same grid and
    inputs), replayed as launched."""
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_VEC", True)
    launch = check(*make_case(**CASES[name], seed=len(name)))
    assert launch.layout.partial_kernel == "tq_kv_partial_vec"
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_VEC", False)
    q, parts, _ = make_case(**CASES[name], seed=len(name))
    plain = cuda_kv.prepare(q, parts, 0.125)
    pk = parts.packed
    batched = "_b8" if cuda_kv_plan.stage_batch(pk.bits_k, pk.bits_v) else ""  # "auto"
    assert plain.layout.partial_kernel == "tq_kv_partial" + batched
    assert plain.layout.partial_grid == launch.layout.partial_grid


@pytest.mark.parametrize("name", ["k4v3-d64-gqa2-b2", "k8v3-d128-gqa4", "k4v4-d256"])
def test_runtime_wave_plan_sets_the_grid_and_matches_reference(name, monkeypatch):
    """KV_PLAN_WAVES on a GPU of 2 SMs (so that waves bind here)."""
    monkeypatch.setattr(cuda_kv_plan, "KV_PLAN_WAVES", True)
    monkeypatch.setattr(cuda_kv.cuda_memory, "sm_count", lambda: 2)
    q, parts, args = make_case(**CASES[name], seed=len(name))
    lay = check(q, parts, args).layout
    s_len, c_len, t_len = parts.lengths
    kv = parts.packed.k_codes.shape[1]
    assert (lay.ncc, lay.fpch) == cuda_kv_plan.plan_waves(q.shape[0], kv, c_len, s_len + t_len, 2)
    assert lay.partial_grid[0] == (lay.ncc + lay.fpch) * cuda_kv_plan.NT


def test_candidate_plan_at_32k_runs_one_wave_of_three_tiles_a_block():
    assert cuda_kv_plan.plan(1, 8, 32768, 68) == (128, 1)  # 1032 blocks: 1.3 waves of 792
    assert cuda_kv_plan.plan_waves(1, 8, 32768, 68, 132) == (86, 1)  # 696 blocks, 3 tiles each


def test_wave_plan_is_searched_once_per_tile_count_not_per_decode_step():
    """A decode step grows the fp16 tail by one token: the plan's search (up to MAX_CHUNKS
    candidates) runs again only when the tiles or the fp16 chunks change."""
    cuda_kv_plan._wave_chunks.cache_clear()
    plans = {cuda_kv_plan.plan_waves(1, 8, 32768 - c, 132 + t, 132)
             for t in range(64) for c in (0, 64)}
    assert len(plans) == 1 and cuda_kv_plan._wave_chunks.cache_info().misses == 1
    cuda_kv_plan.plan_waves(1, 8, 32768 + 128, 140, 132)  # one more tile: searched again
    assert cuda_kv_plan._wave_chunks.cache_info().misses == 2


@pytest.mark.parametrize("name", list(CASES))
def test_candidate_merge_matches_reference(name):
    """The lab's candidate merge (`cuda_kv_sources._MERGE_SPLIT`, 4 threads a dim), replayed."""
    check(*make_case(**CASES[name], seed=len(name)), split=4)


@pytest.mark.parametrize("rotating", [0, 256])
def test_real_cache_layout(rotating):
    # the view a TurboQuant cache hands to attention: slices of its own buffers
    from turboquant.runtime.kvcache import TurboQuantKVCache, TurboQuantRotatingKVCache

    kw = dict(bits_k=4, bits_v=3, window=32, block=16, seed=99)
    cache = (TurboQuantRotatingKVCache(rotating, keep=4, **kw) if rotating
             else TurboQuantKVCache(sink=4, **kw))
    key = mx.random.key(5)
    for n in (150, 200, 1, 1):
        key, k1, k2 = mx.random.split(key, 3)
        k = (mx.random.normal((1, 2, n, 64), key=k1) * 2).astype(mx.float16)
        v = mx.random.normal((1, 2, n, 64), key=k2).astype(mx.float16)
        parts, _ = cache.update_and_fetch(k, v)
    s_len, c_len, t_len = parts.lengths
    lo = cache._c_lo
    assert c_len and t_len and (lo > 0) == bool(rotating)
    names = ("k_codes", "k_norms", "v_codes", "v_norms")
    args = {n: Arg(np.asarray(buf), np.s_[:, :, lo : lo + c_len]) for n, buf in zip(names, cache._comp)}
    args["tail_k"] = Arg(np.asarray(cache._tail_k), np.s_[:, :, :t_len])
    args["tail_v"] = Arg(np.asarray(cache._tail_v), np.s_[:, :, :t_len])
    args["sink_k"], args["sink_v"] = Arg(np.asarray(parts.sink_k)), Arg(np.asarray(parts.sink_v))
    assert args["k_codes"].offset > 0 if rotating else args["tail_k"].strides[1] > t_len * 64
    q = mx.random.normal((1, 4, 1, 64), key=key)
    check(q, parts, args, scale=0.125)


def test_layout_is_built_once_per_shape():
    # decode steps of one layer differ only in their arrays: the Layout (templates, grid,
    # constant inputs) is the same object until the chunk counts change
    from turboquant.runtime.kvcache import TurboQuantKVCache

    cache = TurboQuantKVCache(bits_k=4, bits_v=3, sink=4, window=32, block=16, seed=9)
    k, v = (mx.random.normal((1, 2, 300, 64), key=mx.random.key(i)).astype(mx.float16)
            for i in (1, 2))
    cache.update_and_fetch(k, v)
    q = mx.random.normal((1, 4, 1, 64))
    launches = []
    for i in range(3):
        parts, _ = cache.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        launches.append(cuda_kv.prepare(q, parts, 0.125))
    assert launches[0].layout is launches[1].layout is launches[2].layout
    assert launches[0].inputs[8] is not launches[1].inputs[8]  # the tail grew
    assert launches[0].inputs[2] is launches[1].inputs[2]  # the compressed view did not


def test_decode_steps_take_their_layout_from_the_packed_span(monkeypatch):
    # the host's work per layer per step: after the first step over a compressed span,
    # decode_attention launches with the span's kept Layout and does not call prepare,
    # until the fp16 part reaches another chunk count, a switch changes or a flush
    # replaces the span; the launches equal prepare's in every case
    from turboquant.runtime.kvcache import TurboQuantKVCache

    launched, prepared = [], []
    real_prepare = cuda_kv.prepare

    def fake(name):
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launched.append((name, list(inputs), template, grid))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    def counted(*args, **kwargs):
        prepared.append(args)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(cuda_kv, "_kernel", fake)
    monkeypatch.setattr(cuda_kv, "prepare", counted)
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", 16)
    cache = TurboQuantKVCache(bits_k=4, bits_v=3, sink=4, window=8, block=16, seed=3)
    k, v = (mx.random.normal((1, 2, 200, 64), key=mx.random.key(i)).astype(mx.float16)
            for i in (1, 2))
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])
    q = mx.random.normal((1, 4, 1, 64)).astype(mx.float16)
    spans, fp_counts = [], []
    for i in range(100, 140):
        parts, _ = cache.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        before = len(launched)
        cuda_kv.decode_attention(q, parts, 0.125)
        want = real_prepare(q, parts, 0.125)
        name, inputs, template, grid = launched[before]
        assert name == want.layout.partial_kernel and template == want.layout.partial_template
        assert grid == want.layout.partial_grid
        assert all(a is b for a, b in zip(inputs, want.inputs))
        spans.append(parts.packed)
        fp_counts.append(-(-(parts.lengths[0] + parts.lengths[2]) // 16))
    keys = set(zip(map(id, spans), fp_counts))
    assert len(keys) < len(spans) // 3  # most steps reused a layout
    assert len(prepared) == len(keys)  # prepare ran once per span and fp16 chunk count
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", 32)  # a switch: laid out anew
    cuda_kv.decode_attention(q, parts, 0.125)
    assert len(prepared) == len(keys) + 1
    assert launched[-2][3] == real_prepare(q, parts, 0.125).layout.partial_grid


def test_two_launches_with_only_the_constants_they_need(monkeypatch):
    # host cost per call: two kernel calls, template arguments only for what the source
    # cannot derive, the output shaped (B, H, 1, Dv) by the merge itself
    calls = []

    def fake(name):
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            calls.append((name, len(inputs), dict(template)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    monkeypatch.setattr(cuda_kv, "_kernel", fake)
    q, parts, _ = make_case(b=2, kv=2, r=2, kd=64)
    out = cuda_kv.decode_attention(q.astype(mx.bfloat16), parts, 0.125)
    assert out.shape == (2, 4, 1, 64) and out.dtype == mx.bfloat16
    merge = ("tq_kv_merge_wide" if cuda_kv_plan.KV_MERGE_WIDE else  # where it fits (d64 does)
             "tq_kv_merge_split" if cuda_kv_plan.KV_MERGE_SPLIT else "tq_kv_merge")
    assert [(n.removesuffix("_b8"), k) for n, k, _ in calls] == [
        ("tq_kv_partial", len(cuda_kv_sources.PARTIAL_INPUTS)),
        (merge, len(cuda_kv_sources.MERGE_INPUTS))]
    assert set(calls[0][2]) == {"KD", "DV", "BK", "BV", "R", "P", "FPCH", "HAS_SINK",
                                "HAS_TAIL", "HAS_MASK"}
    assert set(calls[1][2]) == {"DV", "FPCH"}


def test_chunks_of_many_tiles_and_empty_chunks(monkeypatch):
    # 5 compressed tiles over 4 chunks -> 2, 2, 1 tiles and an empty chunk;
    # fp16 tokens over 3 chunks of one tile each
    monkeypatch.setattr(cuda_kv_plan, "TARGET_BLOCKS", 8)
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", 128)
    q, parts, args = make_case(b=1, kv=2, r=2, kd=64, c=600, s=4, t=300)
    launch = check(q, parts, args)
    assert (launch.layout.ncc, launch.layout.fpch) == (4, 3)
    assert [cuda_kv_plan.chunk_tiles(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (6, 5)]


def test_the_wave_plan_follows_the_fp_chunk_size(monkeypatch):
    """FP_TOKENS_PER_CHUNK changed at run time (`kv.py`'s :f<n> configs) reaches the wave
    plan too, whose choices are cached."""
    monkeypatch.setattr(cuda_kv_plan, "KV_PLAN_WAVES", True)
    monkeypatch.setattr(cuda_kv.cuda_memory, "sm_count", lambda: 132)
    q, parts, args = make_case(b=1, kv=2, r=2, kd=64, c=600, s=4, t=300)
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", 256)
    assert check(q, parts, args).layout.fpch == 2  # 304 fp16 tokens, 256 a chunk
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", 64)
    assert check(q, parts, args).layout.fpch == 5


def test_fp16_chunks_are_a_tile_by_default():
    """The runtime's sink + tail (132-196 tokens) in chunks of a tile, so that no block walks
    more fp16 tiles than the compressed chunks at 1K do (the 2026-11-30 run's lab)."""
    assert cuda_kv_plan.FP_TOKENS_PER_CHUNK == cuda_kv_plan.TILE
    assert cuda_kv_plan.plan(1, 8, 1024 - 196, 196)[1] == 2


@pytest.mark.parametrize("exact", [False, True], ids=["fp16-operands", "exact"])
@pytest.mark.parametrize("name", ["k8v3-d128-gqa4", "k3v3-d128-mha", "k4v4-d256", "k4v3-d128-mask",
                                  "k2v4-d128-fp32-parts-r8"])
def test_mma_partial_replayed_matches_reference(name, exact, monkeypatch):
    """`_PARTIAL_MMA` replayed lane by lane (`emulate_partial_mma`: its fragments through the
    PTX layouts of mma m16n8k16) against `tq_attention`, as the runtime launches it: with
    fp16 operands (the default) within MMA_FP16_RTOL, with hi + lo products within 2e-5."""
    monkeypatch.setattr(cuda_kv.cuda_memory, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_MMA", True)
    monkeypatch.setattr(cuda_kv_plan, "KV_MMA_EXACT", exact)
    more = {"k4v3-d128-mask": dict(b=2, kv=2, r=3, kd=128, bits=(4, 3), c=300, s=4, t=140),
            "k2v4-d128-fp32-parts-r8": dict(kv=1, r=8, kd=128, dv=64, bits=(2, 4), c=260, t=30,
                                            fp=np.float32)}
    q, parts, args = make_case(**(CASES.get(name) or more[name]), seed=len(name))
    mask = None
    if name.endswith("mask"):
        mask = mx.array(np.random.default_rng(3).random((2, 1, 1, parts.length)) > 0.3)
    launch = check(q, parts, args, mask=mask)
    assert launch.layout.partial_kernel.removesuffix("_b8") == "tq_kv_partial_mma"
    assert cuda_kv_layout.fp16_operands(launch.layout) is not exact


@pytest.mark.parametrize("name, mma", [("k8v3-d128-gqa4", True), ("k4v4-d256", True),
                                       ("k4v3-d64-gqa2-b2", False), ("k8v8-kd64-dv128", False)])
def test_batched_value_staging_launches_and_matches_reference(name, mma, monkeypatch):
    """KV_STAGE_BATCH: the partial kernels whose value codes are staged 8 loads at a time
    (`_STAGE_V_BATCHED`), replayed as launched; the rest of their source is unchanged."""
    monkeypatch.setattr(cuda_kv_plan, "KV_STAGE_BATCH", "1")
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_MMA", True)
    monkeypatch.setattr(cuda_kv.cuda_memory, "compute_capability", lambda: (9, 0))
    lay = check(*make_case(**CASES[name], seed=len(name))).layout
    assert lay.partial_kernel == ("tq_kv_partial_mma_b8" if mma else "tq_kv_partial_b8")
    for base in ("tq_kv_partial", "tq_kv_partial_mma"):
        full, batched = cuda_kv_sources.SOURCES[base][2], cuda_kv_sources.SOURCES[base + "_b8"][2]
        assert batched == full.replace(cuda_kv_sources._STAGE_V, cuda_kv_sources._STAGE_V_BATCHED)
    assert "#pragma unroll 8\n" in cuda_kv_sources._STAGE_V_BATCHED


@pytest.mark.parametrize("switch", ["auto", "0"])
def test_batched_value_staging_by_default_where_the_lab_measured_it_faster(switch, monkeypatch):
    """KV_STAGE_BATCH "auto" (the default): the batched kernels for every layer, on a wave
    plan of 9 resident blocks for values of at most 4 bits (K4/V3: 43.7 us against 50.9,
    K8/V3 57.3 against 67.4) and of 6 for 8-bit values (K8/V8 101 against 119). "0" turns
    it off, on the 6-block plan."""
    monkeypatch.setattr(cuda_kv_plan, "KV_STAGE_BATCH", switch)
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_MMA", True)
    monkeypatch.setattr(cuda_kv_plan, "KV_PLAN_WAVES", True)
    monkeypatch.setattr(cuda_kv.cuda_memory, "compute_capability", lambda: (9, 0))
    # a GPU of 4 SMs: the 6- and 9-block plans differ at 2000 tokens already (132: ~30K)
    monkeypatch.setattr(cuda_kv.cuda_memory, "sm_count", lambda: 4)
    auto = switch == "auto"
    for bits, batched, blocks in (((8, 8), auto, 6), ((4, 8), auto, 6), ((4, 3), auto, 9),
                                  ((2, 4), auto, 9), ((8, 3), auto, 9), ((8, 4), auto, 9)):
        blocks = blocks if batched else cuda_kv_plan.MMA_BLOCKS_PER_SM
        q, parts, _ = make_case(kv=2, r=4, kd=128, bits=bits, c=2000, s=4, t=140)
        lay = cuda_kv.prepare(q, parts, 0.1).layout
        assert lay.partial_kernel == "tq_kv_partial_mma" + ("_b8" if batched else ""), bits
        assert (lay.ncc, lay.fpch) == cuda_kv_plan.plan_waves(
            1, 2, 2000, 144, 4, cuda_kv_plan.FP_TOKENS_PER_CHUNK, blocks), bits
    assert cuda_kv_plan.plan_waves(1, 2, 2000, 144, 4, cuda_kv_plan.FP_TOKENS_PER_CHUNK, 9) != \
        cuda_kv_plan.plan_waves(1, 2, 2000, 144, 4, cuda_kv_plan.FP_TOKENS_PER_CHUNK, 6)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_batched_value_staging_takes_fewer_registers(tmp_path):
    """Why KV_STAGE_BATCH exists: fully unrolled, the staging loop's addresses stay in
    registers across tiles (nvcc, sm_90: 130 for the K8/V8 tensor-core kernel); batched,
    the K8/V8 and K4/V3 kernels need fewer, and at most 64."""
    q, parts, _ = make_case(kv=2, r=4, kd=128, bits=(8, 8), c=300, s=4, t=140)
    lay = cuda_kv.prepare(q.astype(mx.bfloat16), parts, 0.1).layout
    template = lay.partial_template + (("EXACT", False),)
    dtypes = [mx.bfloat16, mx.float32, mx.uint32, mx.float16, mx.uint32, mx.float16,
              mx.float16, mx.float16, mx.float16, mx.float16, mx.float32]
    regs = {}
    for kernel in ("tq_kv_partial_mma", "tq_kv_partial_mma_b8"):
        src = cuda_kv_sources.HEADER + mlx_kernel_source(kernel, kernel, dtypes,
                                                         [mx.float32] * 2, template)
        regs[kernel] = nvcc_registers(src, tmp_path, kernel)
    assert regs["tq_kv_partial_mma_b8"] <= 64 < regs["tq_kv_partial_mma"], regs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("v_dim", [64, 128, 256])
def test_wide_merge_fits_a_block_of_1024_threads(tmp_path, v_dim):
    """`_MERGE_WIDE` launches 1024 threads a block: at most 64 registers each on sm_90."""
    src = cuda_kv_sources.HEADER + mlx_kernel_source(
        "tq_kv_merge_wide", "tq_kv_merge_wide", [mx.float32] * 3, [mx.bfloat16],
        (("DV", v_dim), ("FPCH", cuda_kv_plan.MAX_FP_CHUNKS)))
    assert nvcc_registers(src, tmp_path, "tq_kv_merge_wide") <= 64


def test_mma_partial_where_it_fits_on_sm80(monkeypatch):
    """KV_PARTIAL_MMA: `_PARTIAL_MMA` for heads of 128/256 dims and up to 8 query rows a KV
    head on an sm_80+ GPU, on its own wave plan (fewer resident blocks); the plain kernel
    elsewhere, and without a CUDA driver (this machine)."""
    monkeypatch.setattr(cuda_kv_plan, "KV_STAGE_BATCH", "0")  # the full-staging kernels' plans
    assert cuda_kv_plan.mma_fits(128, 128, 4) and cuda_kv_plan.mma_fits(256, 256, 8)
    assert not cuda_kv_plan.mma_fits(64, 64, 2) and not cuda_kv_plan.mma_fits(128, 128, 16)
    q, parts, _ = make_case(b=1, kv=2, r=4, kd=128, c=1250, s=4, t=150)
    assert cuda_kv.prepare(q, parts, 0.1).layout.partial_kernel == "tq_kv_partial"  # no driver
    monkeypatch.setattr(cuda_kv.cuda_memory, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(cuda_kv.cuda_memory, "sm_count", lambda: 4)
    monkeypatch.setattr(cuda_kv_plan, "KV_PLAN_WAVES", True)
    monkeypatch.setattr(cuda_kv_plan, "MMA_BLOCKS_PER_SM", 5)  # own plan (6 for `_PARTIAL`)
    lay = cuda_kv.prepare(q, parts, 0.1).layout
    assert lay.partial_kernel == "tq_kv_partial_mma"
    s_len, c_len, t_len = parts.lengths
    tile = cuda_kv_plan.TILE
    assert (lay.ncc, lay.fpch) == cuda_kv_plan.plan_waves(1, 2, c_len, s_len + t_len, 4, tile, 5)
    assert (lay.ncc, lay.fpch) != cuda_kv_plan.plan_waves(1, 2, c_len, s_len + t_len, 4, tile)
    monkeypatch.setattr(cuda_kv.cuda_memory, "compute_capability", lambda: (7, 5))
    assert cuda_kv.prepare(q, parts, 0.1).layout.partial_kernel == "tq_kv_partial"
    monkeypatch.setattr(cuda_kv.cuda_memory, "compute_capability", lambda: (9, 0))
    small = make_case(b=1, kv=2, r=2, kd=64, c=300)
    assert cuda_kv.prepare(*small[:2], 0.1).layout.partial_kernel == "tq_kv_partial"
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_MMA", False)
    assert cuda_kv.prepare(q, parts, 0.1).layout.partial_kernel == "tq_kv_partial"


@pytest.mark.parametrize("kind", ["bool-1d", "bool-batch", "additive-inf", "hide-compressed"])
def test_masks(kind):
    q, parts, args = make_case(b=2, kv=1, r=2, kd=64, c=260, s=4, t=20)
    total = parts.length
    rng = np.random.default_rng(1)
    if kind == "bool-1d":
        mask = mx.array(rng.random(total) > 0.3)
    elif kind == "bool-batch":
        mask = mx.array(rng.random((2, 1, 1, total)) > 0.5)
    elif kind == "additive-inf":
        m = rng.standard_normal((1, total)).astype(F32)
        m[0, ::3] = -np.inf
        mask = mx.array(m)
    else:  # every compressed column masked out: those chunks carry weight 0
        keep = np.ones(total, bool)
        keep[4 : 4 + 260] = False
        mask = mx.array(keep)
    launch = check(q, parts, args, mask=mask)
    assert dict(launch.layout.partial_template)["HAS_MASK"]


def test_fp16_queries_and_output():
    q, parts, args = make_case(kv=2, r=2, kd=64)
    q16 = q.astype(mx.float16)
    launch = cuda_kv.prepare(q16, parts, 0.125)
    got = emulate(launch, {**args, "queries": Arg(np.asarray(q16))})
    want = np.asarray(tq_attention(q16, parts, 0.125).astype(mx.float32))
    assert launch.layout.out_dtype == mx.float16
    assert np.abs(got.astype(np.float16).astype(F32) - want).max() < 2e-3


def test_declines_what_it_does_not_cover():
    q, parts, _ = make_case(kv=2, r=2, kd=64)
    with pytest.raises(NotImplementedError):  # prefill
        cuda_kv.prepare(mx.concatenate([q, q], axis=2), parts, 0.1)
    with pytest.raises(NotImplementedError):  # nothing compressed
        cuda_kv.prepare(q, KVParts(parts.sink_k, parts.sink_v, None, parts.tail_k, parts.tail_v), 0.1)
    with pytest.raises(NotImplementedError):  # per-head mask
        cuda_kv.prepare(q, parts, 0.1, mx.ones((1, 4, 1, parts.length), dtype=mx.bool_))
    with pytest.raises(NotImplementedError):  # too many heads per KV head for shared memory
        big = mx.zeros((1, 2 * 80, 1, 64))
        cuda_kv.prepare(big, parts, 0.1)
    assert cuda_kv.prepare(q, parts, 0.1, "causal").layout.partial_template  # one query: no mask


def test_plan_covers_every_tile_once():
    for b, kv in ((1, 1), (1, 8), (2, 8), (4, 32)):
        for c in (1, 127, 128, 129, 1000, 32768, 131072, 10**6):
            for f in (0, 1, 196, 5000):
                ncc, fpch = cuda_kv_plan.plan(b, kv, c, f)
                assert 1 <= ncc and ncc + fpch <= cuda_kv_plan.MAX_CHUNKS
                assert (fpch == 0) == (f == 0)
                for n_tok, n in ((c, ncc), (f, fpch)):
                    tiles = -(-n_tok // cuda_kv_plan.TILE)
                    seen = []
                    for i in range(n):
                        a, e = cuda_kv_plan.chunk_tiles(tiles, n, i)
                        seen += range(a, e)
                    assert seen == list(range(tiles)), (b, kv, c, f, n)


def test_lazy_registration(monkeypatch):
    from turboquant.kernels import dispatch
    from turboquant.runtime import kv_attention

    monkeypatch.setattr(kv_attention, "_KERNELS", {})
    monkeypatch.setattr(kv_attention, "_SETTLED", set())
    assert kv_attention.kernel_for("cuda") is cuda_kv.decode_attention
    assert kv_attention.kernel_for("metal") is None
    calls = []
    kv_attention.register_kernel("cuda", lambda q, p, s, m: calls.append(1) or mx.zeros_like(q))
    monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
    q, parts, _ = make_case(kv=2, r=2, kd=64, c=64)
    kv_attention.turboquant_attention(q, parts, 0.1)
    with kv_attention.reference_only():
        ref = kv_attention.turboquant_attention(q, parts, 0.1)
    assert calls == [1] and mx.allclose(ref, tq_attention(q, parts, 0.1)).item()
    kv_attention.unregister_kernel("cuda")
    assert kv_attention.kernel_for("cuda") is None  # not loaded again once unregistered


# ---------------------------------------------------------------------------- nvcc


def mlx_kernel_source(func, kernel, input_dtypes, output_dtypes, template) -> str:
    inputs, outputs, source = cuda_kv_sources.SOURCES[kernel]
    return kernel_source(func, inputs, outputs, source, input_dtypes, output_dtypes, template)


def launch_sources(L: cuda_kv.Launch, tag: str) -> str:
    lay = L.layout
    return "".join([
        mlx_kernel_source(f"partial_{tag}", "tq_kv_partial", [x.dtype for x in L.inputs],
                          [mx.float32, mx.float32], lay.partial_template),
        mlx_kernel_source(f"merge_{tag}", "tq_kv_merge", [mx.float32] * 3, [lay.out_dtype],
                          lay.merge_template),
        mlx_kernel_source(f"partial_vec_{tag}", "tq_kv_partial_vec", [x.dtype for x in L.inputs],
                          [mx.float32, mx.float32], lay.partial_template),
        mlx_kernel_source(f"merge_split_{tag}", "tq_kv_merge_split", [mx.float32] * 3,
                          [lay.out_dtype], lay.merge_template),
        mlx_kernel_source(f"merge_wide_{tag}", "tq_kv_merge_wide", [mx.float32] * 3,
                          [lay.out_dtype], lay.merge_template)
        if cuda_kv_plan.merge_wide_fits(lay.v_dim) else "",
        *(mlx_kernel_source(f"partial_mma_{tag}_{exact}", "tq_kv_partial_mma",
                            [x.dtype for x in L.inputs], [mx.float32, mx.float32],
                            lay.partial_template + (("EXACT", exact),))
          for exact in (False, True) if cuda_kv_plan.mma_fits(lay.k_dim, lay.v_dim, lay.r)),
        mlx_kernel_source(f"partial_b8_{tag}", "tq_kv_partial_b8", [x.dtype for x in L.inputs],
                          [mx.float32, mx.float32], lay.partial_template),
        mlx_kernel_source(f"partial_mma_b8_{tag}", "tq_kv_partial_mma_b8",
                          [x.dtype for x in L.inputs], [mx.float32, mx.float32],
                          lay.partial_template + (("EXACT", False),))
        if cuda_kv_plan.mma_fits(lay.k_dim, lay.v_dim, lay.r) else "",
    ])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_sources_compile_with_nvcc(tmp_path):
    launches = []
    for name in ("k4v3-d64-gqa2-b2", "k8v3-d128-gqa4", "k3v3-d128-mha", "k2v2-d80", "k4v4-d256",
                 "k4v8-d96-fp32-parts", "k8v8-kd64-dv128"):
        q, parts, _ = make_case(**CASES[name])
        launches.append(cuda_kv.prepare(q.astype(mx.bfloat16), parts, 0.1))
    q, parts, _ = make_case(b=2, kv=8, r=4, kd=128, c=200, s=4, t=140)
    launches.append(cuda_kv.prepare(q, parts, 0.1, mx.ones((2, 1, 1, parts.length), mx.bool_)))
    q, parts, _ = make_case(kv=2, r=8, kd=128, c=300, fp=np.float32)  # the mma kernel's float loads
    launches.append(cuda_kv.prepare(q, parts, 0.1))
    src = cuda_kv_sources.HEADER + "".join(launch_sources(L, str(i))
                                           for i, L in enumerate(launches))
    compile_with_nvcc(src, tmp_path)


def test_fp_parts_of_one_dtype_or_a_fallback():
    """The fp16 parts' dtype is the kernel's template type: sink and tail must agree (else
    the reference runs); with neither, float16."""
    import dataclasses

    q, parts, _ = make_case(s=4, t=40, fp=np.float16)
    assert cuda_kv._fp_dtype(parts) == mx.float16
    bf16 = dataclasses.replace(parts, tail_k=parts.tail_k.astype(mx.bfloat16),
                               tail_v=parts.tail_v.astype(mx.bfloat16))
    with pytest.raises(NotImplementedError, match="different dtypes"):
        cuda_kv.prepare(q, bf16, 0.1)
    none = dataclasses.replace(parts, sink_k=None, sink_v=None, tail_k=None, tail_v=None)
    assert cuda_kv._fp_dtype(none) == mx.float16
    all_bf16 = dataclasses.replace(bf16, sink_k=bf16.tail_k, sink_v=bf16.tail_v)
    assert cuda_kv._fp_dtype(all_bf16) == mx.bfloat16

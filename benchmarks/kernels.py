"""Decode GEMV timings on the GPU: TurboQuant 2/3/4-bit kernels vs MLX affine and bf16.

Each method runs 20 matrix-vector products per `mx.eval` (amortising MLX's per-evaluation
overhead the same way for all), cycling through enough distinct weight copies that the
working set exceeds the 50 MB L2 cache, so every product streams its weights from HBM as
a real decode step does. Prints microseconds per GEMV and ratios against MLX's affine
`quantized_matmul` at the same bits and MLX bf16, measured in the same run.

By default each evaluation is waited on before the next is built, so a method's time per
GEMV includes the host's building of its call. `--pipelined` times them as a decode loop
runs (mlx-lm's `generate_step`): the next evaluation is built and submitted
(`mx.async_eval`) while the current one runs, so for every method alike the host's work
hides behind the device's and the figure is the device's time per GEMV. `--loop` prints
both.

`--trellis`: the trellis-coded GEMV (`kernels/cuda_trellis.py`) at 3 bits against the scalar
TQ3 kernel and affine-3, single and pipelined, and the GPU Viterbi's weights a second on a
4096x4096 matrix against the CPU encoder on a slice (its words compared).

Reproduce (GPU machine, MLX CUDA build):  python benchmarks/kernels.py [--check] [--pipelined]
[--trellis]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import mlx.core as mx
import numpy as np

from turboquant.kernels import cuda_gemv, cuda_memory
from turboquant.stages import codebook_values

SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672)]
PER_EVAL = 20
PIPELINED = False  # --pipelined: `_time` overlaps evaluations (`_time_pipelined`)
L2_BYTES = 50 * 2**20


def _copies(nbytes: int) -> int:
    return max(1, min(PER_EVAL, math.ceil(3 * L2_BYTES / nbytes)))


def _time(fn, reps: int = 10) -> float:
    """Median seconds per GEMV of `fn()` (which builds PER_EVAL GEMVs), one evaluation at
    a time (each waits for its graph to be built), or `_time_pipelined`'s with --pipelined."""
    if PIPELINED:
        return _time_pipelined(fn, reps)
    mx.eval(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) / PER_EVAL)
    return float(np.median(samples))


def _time_pipelined(fn, reps: int = 10, windows: int = 3, per_batch: int = PER_EVAL) -> float:
    """Seconds per GEMV of `fn()` (`per_batch` GEMVs) with evaluations overlapped as a
    decode loop overlaps its tokens (mlx-lm's `generate_step`): the next batch is built and
    submitted (`mx.async_eval`) before the current one is waited on, so the host's work per
    call hides behind the device's, for every method alike. Median over `windows` windows
    of `reps` batches, each window timed from its first batch's building to its last's end."""
    mx.eval(fn())
    samples = []
    for _ in range(windows):
        t0 = time.perf_counter()
        pending = fn()
        mx.async_eval(pending)
        for _ in range(reps - 1):
            following = fn()
            mx.async_eval(following)
            mx.eval(pending)
            pending = following
        mx.eval(pending)
        samples.append((time.perf_counter() - t0) / (reps * per_batch))
    return float(np.median(samples))


def tq_operands(out_f: int, in_f: int, bits: int, group: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    codes = mx.array(rng.integers(0, 2**bits, size=(out_f, in_f), dtype=np.uint8))
    low, high = cuda_gemv.repack(codes, bits, in_f)
    scales = mx.array((rng.random((out_f, in_f // group)) * 0.02 + 0.01).astype(np.float16))
    return codes, low, high, scales


def tq_gemv(x, low, high, scales, bits, out_f, group=64, rows_per_warp=None, pooled=False):
    """One GEMV call as a runtime layer makes it: the launch, codebook and index arrays
    are built once (`tq_launch`) and the kernel is called with its launch bound, so a call
    is one custom-kernel op. `pooled`: the small operands as plain MLX arrays (in pages the
    host writes too), as before 2026-11-29."""
    run, operands = tq_launch(out_f, x.shape[-1], bits, scales.shape[-1], group, rows_per_warp)
    return run(inputs=[x, low, high, scales,
                       *(_plain_operands(bits) if pooled else operands)])[0]


def bound_gemv(out_f, padded, bits, nscales, group=64, rows_per_warp=None):
    """f(x, low, high, scales) -> y: a GEMV bound once, called as a runtime layer calls its
    launch every token (`kernels.cuda`'s bindings: the launch and its small operands held,
    one custom-kernel call per product)."""
    run, operands = tq_launch(out_f, padded, bits, nscales, group, rows_per_warp)
    return lambda x, low, high, scales: run(inputs=[x, low, high, scales, *operands])[0]


@functools.lru_cache(maxsize=None)
def tq_launch(out_f, padded, bits, nscales, group=64, rows_per_warp=None):
    """(bound launch, (levels, pair_expert, pair_row, bias)) of a one-token GEMV, built
    once (`cuda_gemv.Launch.bound`: what the runtime's layers call every token)."""
    run = cuda_gemv.launch(
        bits=bits, group_size=group, out_features=out_f, padded=padded, nscales=nscales,
        pairs=1, rows_per_warp=rows_per_warp)
    return run.bound(), tuple(cuda_memory.device_constant(a) for a in _plain_operands(bits))


@functools.lru_cache(maxsize=None)
def _plain_operands(bits: int) -> tuple[mx.array, ...]:
    """(levels, pair_expert, pair_row, bias) of a one-token GEMV as plain MLX arrays."""
    pairs = mx.zeros((1,), dtype=mx.int32)
    operands = (codebook_values(bits), pairs, pairs, mx.zeros((1,), dtype=mx.float32))
    mx.eval(operands)
    return operands


def sweep_rows_per_warp(out_f: int = 28672, in_f: int = 8192) -> None:
    """Tuning aid: TQ GEMV time against rows handled per warp."""
    x = mx.random.normal((1, in_f)).astype(mx.float16)
    for bits in (2, 3, 4):
        _, low, high, scales = tq_operands(out_f, in_f, bits, seed=bits)
        for rpw in (1, 2, 4):
            t = _time(lambda: [tq_gemv(x, low, high, scales, bits, out_f, rows_per_warp=rpw)
                               for _ in range(PER_EVAL)])
            print(f"  tq{bits} {out_f}x{in_f} rows/warp {rpw:2d}: {t * 1e6:7.1f} us", flush=True)


def check(out_f: int = 512, in_f: int = 1024, group: int = 64) -> dict:
    """Kernel vs dense reference on random codes: max relative error per width."""
    errs = {}
    x = mx.random.normal((in_f,)).astype(mx.float16)
    for bits in (2, 3, 4):
        codes, low, high, scales = tq_operands(out_f, in_f, bits, group, seed=bits)
        levels = codebook_values(bits)
        dense = levels[codes.astype(mx.int32)] * mx.repeat(scales.astype(mx.float32), group, axis=1)
        ref = dense @ x.astype(mx.float32)
        got = tq_gemv(x[None], low, high, scales, bits, out_f, group)[0].astype(mx.float32)
        errs[bits] = float(mx.max(mx.abs(got - ref)) / mx.max(mx.abs(ref)))
    return errs


def bench_shape(out_f: int, in_f: int) -> dict:
    row = {"shape": f"{out_f}x{in_f}"}
    x = mx.random.normal((1, in_f)).astype(mx.bfloat16)

    w_bytes = out_f * in_f * 2
    ws = [mx.random.normal((out_f, in_f)).astype(mx.bfloat16) * 0.02 for _ in range(_copies(w_bytes))]
    mx.eval(ws)
    row["bf16"] = _time(lambda: [x @ ws[i % len(ws)].T for i in range(PER_EVAL)])
    dense = ws[0]
    del ws

    for bits in (2, 3, 4):
        q = mx.quantize(dense, group_size=64, bits=bits)
        nbytes = sum(a.nbytes for a in q)
        qs = [q] + [tuple(a + 0 for a in q) for _ in range(_copies(nbytes) - 1)]
        mx.eval(qs)
        row[f"affine{bits}"] = _time(lambda: [
            mx.quantized_matmul(x, *qs[i % len(qs)], transpose=True, group_size=64, bits=bits)
            for i in range(PER_EVAL)
        ])
        del qs

        _, low, high, scales = tq_operands(out_f, in_f, bits, seed=bits)
        nbytes = low.nbytes + high.nbytes + scales.nbytes
        ops = [(low, high, scales)] + [
            (low + 0, high + 0, scales + 0) for _ in range(_copies(nbytes) - 1)
        ]
        mx.eval(ops)
        xp = x.astype(mx.float16)
        call = bound_gemv(out_f, in_f, bits, scales.shape[-1])
        row[f"tq{bits}"] = _time(lambda: [call(xp, *ops[i % len(ops)]) for i in range(PER_EVAL)])
        row[f"tq{bits}_gbps"] = nbytes / row[f"tq{bits}"] / 1e9
        del ops
    return row


# one Llama-3-8B decoder layer's linears: (input width, outputs read from that input)
LAYER = [("q/k/v", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)),
         ("gate/up", 4096, (14336, 14336)), ("down", 14336, (4096,))]


def _tq_members(in_f: int, outs, bits: int, seed: int):
    from turboquant.kernels import group
    from turboquant.kernels.reference import words_per_row

    members = []
    for i, o in enumerate(outs):
        codes = mx.random.randint(0, 2**31 - 1, (o, words_per_row(in_f, bits))).astype(mx.uint32) * 2 + 1
        scales = (mx.random.uniform(shape=(o, in_f // 64)) * 0.02 + 0.01).astype(mx.float16)
        members.append(group.Member(codes, scales, bits, 64, in_f, o, in_f, seed * 7 + i))
    return tuple(members)


def bench_layer(bits: int = 3) -> list[dict]:
    """Whole linears as the runtime calls them, x in bf16: TurboQuant (rotation kernel +
    GEMV, one group per shared input) vs mlx-lm's affine (one quantized_matmul per linear,
    4 bits and the same bits) and bf16 matmuls."""
    from turboquant.kernels import group

    rows = []
    for name, in_f, outs in LAYER:
        x = mx.random.normal((1, in_f)).astype(mx.bfloat16)
        row = {"linears": name, "shape": f"{'+'.join(map(str, outs))}x{in_f}"}
        nbytes = sum(o * in_f for o in outs) * 2
        ws = [[mx.random.normal((o, in_f)).astype(mx.bfloat16) * 0.02 for o in outs]
              for _ in range(_copies(nbytes))]
        mx.eval(ws)
        row["bf16"] = _time(lambda: [x @ w.T for i in range(PER_EVAL) for w in ws[i % len(ws)]])
        for b in sorted({4, bits}):
            qs = [[mx.quantize(w, group_size=64, bits=b) for w in copy] for copy in ws]
            mx.eval(qs)
            row[f"affine{b}"] = _time(lambda: [
                mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=b)
                for i in range(PER_EVAL) for q in qs[i % len(qs)]])
            del qs
        del ws
        groups = [_tq_members(in_f, outs, bits, seed=c) for c in range(_copies(nbytes * bits // 16 + 1))]
        mx.eval([[m.codes, m.scales] for g in groups for m in g])
        row[f"tq{bits}"] = _time(lambda: [group.tq_linear_group(x, groups[i % len(groups)])
                                          for i in range(PER_EVAL)])
        singles = [tuple((m,) for m in g) for g in groups]
        row[f"tq{bits}_single"] = _time(lambda: [
            group.tq_linear_group(x, one) for i in range(PER_EVAL) for one in singles[i % len(singles)]])
        rows.append(row)
        del groups, singles
    return rows


def breakdown(bits: int = 3) -> None:
    """Where a TurboQuant linear's time goes: host-side graph building vs device time,
    rotation kernel vs GEMV, next to mlx-lm's affine call (x bf16, 4096x4096 and q/k/v)."""
    from turboquant.kernels import cuda, cuda_gemv as g, cuda_rotate, group

    for in_f, outs in ((4096, (4096,)), (4096, (4096, 1024, 1024)), (14336, (4096,))):
        x = mx.random.normal((1, in_f)).astype(mx.bfloat16)
        members = _tq_members(in_f, outs, bits, seed=1)
        seeds = tuple(m.seed for m in members)
        xr = cuda_rotate.rotate(x, seeds, in_f)
        low, high, scales, _ = cuda._repack_group(members)
        ends = tuple(np.cumsum(outs).tolist())
        e, r = cuda._pair_arrays(1)
        lv = cuda._levels(bits)
        q = mx.quantize(mx.random.normal((sum(outs), in_f)).astype(mx.bfloat16), group_size=64, bits=4)
        mx.eval(xr, q)
        steps = {
            "rotate": lambda: cuda_rotate.rotate(x, seeds, in_f),
            "gemv": lambda: g.gemv(xr if len(outs) > 1 else xr[0], low, high, scales, lv, e, r,
                                   bits=bits, group_size=64, out_features=ends[-1],
                                   out_dtype=mx.bfloat16, ends=ends if len(outs) > 1 else ()),
            "group": lambda: group.tq_linear_group(x, members),
            "affine4": lambda: mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4),
        }
        for name, step in steps.items():
            mx.eval(step())  # the first call builds the group's layouts and launch: not timed
            t0 = time.perf_counter()
            for _ in range(200):
                out = step()
            host = (time.perf_counter() - t0) / 200
            mx.eval(out)
            total = _time(lambda: [step() for _ in range(PER_EVAL)])
            print(f"{'+'.join(map(str, outs))}x{in_f} {name:>8}: host {host * 1e6:6.1f} us/call, "
                  f"host+device {total * 1e6:6.1f} us/call", flush=True)


def print_layer(rows: list[dict], bits: int) -> None:
    print("microseconds per call of a Llama-3-8B layer's linears, x bf16 (rotation included for TQ)")
    cols = ["bf16", "affine4", f"affine{bits}", f"tq{bits}_single", f"tq{bits}"]
    cols = list(dict.fromkeys(cols))
    print(f"{'linears':>8} {'shape':>18} " + " ".join(f"{c:>10}" for c in cols) + "  aff4/tq")
    total = {c: 0.0 for c in cols}
    for r in rows:
        for c in cols:
            total[c] += r[c]
        print(f"{r['linears']:>8} {r['shape']:>18} " + " ".join(f"{r[c] * 1e6:10.1f}" for c in cols)
              + f"  {r['affine4'] / r[f'tq{bits}']:6.2f}")
    print(f"{'layer':>8} {'':>18} " + " ".join(f"{total[c] * 1e6:10.1f}" for c in cols)
          + f"  {total['affine4'] / total[f'tq{bits}']:6.2f}")


def one_linear(out_f: int, in_f: int, bits: int = 3, calls: int = 8) -> None:
    """`calls` single-token calls of one fused TQ linear with random codes: a target for
    Nsight Compute (`ncu --kernel-name regex:tq_linear --launch-skip 4 --launch-count 1`)."""
    from turboquant.kernels import group

    members = tuple(_tq_members(in_f, (out_f,), bits, seed=0))
    x = mx.random.normal((1, in_f)).astype(mx.bfloat16)
    prepared = {}
    for _ in range(calls):
        mx.eval(group.tq_linear_group(x, members, prepared))
    print(f"{calls} calls of a {out_f}x{in_f} {bits}-bit linear")


def gemv_loop(out_f: int = 28672, in_f: int = 8192, bits: int = 3, per_eval: int = 200,
              evals: int = 5, rounds: int = 2) -> None:
    """The GEMV under MLX with many launches per evaluation, next to MLX's affine at the
    same bits: microseconds per GEMV and per call of graph building. Compare with the
    kernel's GPU time alone (`cuda_lab.py`); a target for Nsight Compute over
    back-to-back launches (`ncu --clock-control none --kernel-name regex:tq_gemv
    --launch-skip 400 --launch-count 5`). The methods take turns, `rounds` times over."""
    _, low, high, scales = tq_operands(out_f, in_f, bits, seed=bits)
    ops = [(low, high, scales), (low + 0, high + 0, scales + 0)]
    x = mx.random.normal((1, in_f)).astype(mx.float16)
    q = mx.quantize(mx.random.normal((out_f, in_f)).astype(mx.bfloat16) * 0.02,
                    group_size=64, bits=bits)
    qs = [q, tuple(a + 0 for a in q)]
    mx.eval(ops, x, qs)
    xb = x.astype(mx.bfloat16)
    bound = bound_gemv(out_f, in_f, bits, scales.shape[-1])
    calls = {
        f"tq{bits}": lambda i: bound(x, *ops[i % 2]),
        f"tq{bits}, launch looked up per call": lambda i: tq_gemv(x, *ops[i % 2], bits, out_f),
        f"tq{bits}, small operands pooled": lambda i: tq_gemv(x, *ops[i % 2], bits, out_f,
                                                              pooled=True),
        f"affine{bits}": lambda i: mx.quantized_matmul(xb, *qs[i % 2], transpose=True,
                                                       group_size=64, bits=bits),
    }
    for _ in range(rounds):
        for name, call in calls.items():
            _time_loop(f"{name} {out_f}x{in_f}", call, per_eval, evals)


def _time_loop(label: str, call, per_eval: int, evals: int) -> None:
    """Median over `evals` evaluations of `per_eval` calls: us per call, and of it, graph
    building."""
    mx.eval([call(i) for i in range(per_eval)])
    rows = []
    for _ in range(evals):
        t0 = time.perf_counter()
        outs = [call(i) for i in range(per_eval)]
        t1 = time.perf_counter()
        mx.eval(outs)
        rows.append(((time.perf_counter() - t0) / per_eval, (t1 - t0) / per_eval))
    total, build = sorted(rows)[len(rows) // 2]
    pipelined = _time_pipelined(lambda: [call(i) for i in range(per_eval)], reps=evals,
                                per_batch=per_eval)
    print(f"{label}, {per_eval} per eval: {total * 1e6:7.1f} us per GEMV "
          f"({build * 1e6:.1f} us of graph building per call); "
          f"pipelined {pipelined * 1e6:7.1f} us per GEMV", flush=True)


TRELLIS_SHAPES = [(28672, 8192), (4096, 4096)]


def trellis_operands(out_f: int, in_f: int, bits: int, state_bits: int = 16, seed: int = 0,
                     values: int = 1, version: int = 1):
    """Random trellis-coded rows (any words are a valid code) and float16 scales, group 64."""
    from turboquant.stages.trellis import TrellisCode

    rng = np.random.default_rng(seed)
    words = mx.array(rng.integers(0, 2**32, size=(out_f, in_f * bits // 32), dtype=np.uint64)
                     .astype(np.uint32))
    scales = mx.array((rng.random((out_f, in_f // 64)) * 0.02 + 0.01).astype(np.float16))
    return TrellisCode(state_bits, bits, values, version), words, scales


# the trellis GEMV's variants timed beside version 1 at V=1 (the writers' code): name suffix
# -> (V, trellis version); version 2 (no shift-xor) waits on these timings to be written
TRELLIS_VARIANTS = {"_V2": (2, 1), "v2": (1, 2), "v2_V2": (2, 2)}


def trellis_check(out_f: int = 512, in_f: int = 1024) -> dict:
    """The trellis GEMV and tile decode against `stages.trellis.decode_rows` on random codes."""
    from turboquant.kernels import cuda_trellis
    from turboquant.stages import trellis

    errs = {}
    for bits, version in ((2, 1), (3, 1), (4, 1), (3, 2)):
        code, words, scales = trellis_operands(out_f, in_f, bits, seed=bits, version=version)
        w = trellis.decode_rows(code, np.array(words), np.array(scales), 64, 256)
        x = np.random.default_rng(bits).standard_normal((1, in_f)).astype(np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        got = np.array(cuda_trellis.matvec(mx.array(x), words, scales, code, 256, 64, out_f, in_f))
        tile = np.array(cuda_trellis.dequantize(words, scales, code, 256, 64, in_f, mx.float32))
        errs[bits if version == 1 else f"{bits} v{version}"] = {
                      "gemv": float(np.abs(got - want).max() / np.abs(want).max()),
                      "decode_exact": bool(np.array_equal(tile, w))}
    return errs


def bench_trellis_gemv(out_f: int, in_f: int, bits: int = 3) -> dict:
    """The trellis GEMV against the scalar TQ kernel and MLX affine at the same bits (all on
    one already-rotated token, weights streamed from HBM), and the trellis linear with its
    rotation; single calls, then pipelined, in the same process."""
    from turboquant.kernels import cuda_trellis

    global PIPELINED
    row = {"shape": f"{out_f}x{in_f}", "bits": bits}
    x = mx.random.normal((1, in_f)).astype(mx.bfloat16)
    dense = mx.random.normal((out_f, in_f)).astype(mx.bfloat16) * 0.02
    q = mx.quantize(dense, group_size=64, bits=bits)
    qs = [q] + [tuple(a + 0 for a in q) for _ in range(_copies(sum(a.nbytes for a in q)) - 1)]
    _, low, high, scales = tq_operands(out_f, in_f, bits, seed=bits)
    nbytes = low.nbytes + high.nbytes + scales.nbytes
    ops = [(low, high, scales)] + [(low + 0, high + 0, scales + 0)
                                   for _ in range(_copies(nbytes) - 1)]
    code, words, tscales = trellis_operands(out_f, in_f, bits, seed=bits)
    tbytes = words.nbytes + tscales.nbytes
    tops = [(words, tscales)] + [(words + 0, tscales + 0) for _ in range(_copies(tbytes) - 1)]
    mx.eval(qs, ops, tops)
    xp, xf = x.astype(mx.float16), x.astype(mx.float32)
    call = bound_gemv(out_f, in_f, bits, scales.shape[-1])
    tcall = cuda_trellis.gemv_launch(code, 256, 64, in_f, out_f, mx.float32, 1)  # bound once
    methods = {
        f"affine{bits}": lambda i: mx.quantized_matmul(x, *qs[i % len(qs)], transpose=True,
                                                       group_size=64, bits=bits),
        f"tq{bits}": lambda i: call(xp, *ops[i % len(ops)]),
        f"trellis{bits}": lambda i: tcall(inputs=[xf, *tops[i % len(tops)]])[0],
    }
    for suffix, (values, version) in TRELLIS_VARIANTS.items():  # the same words
        other = type(code)(code.state_bits, bits, values, version)
        run = cuda_trellis.gemv_launch(other, 256, 64, in_f, out_f, mx.float32, 1)
        methods[f"trellis{bits}{suffix}"] = \
            lambda i, run=run: run(inputs=[xf, *tops[i % len(tops)]])[0]
    methods |= {
        f"trellis{bits}_linear": lambda i: cuda_trellis.linear(x, *tops[i % len(tops)], code, 256,
                                                               64, out_f, in_f, seed=1),
    }
    saved = PIPELINED
    try:
        for mode in ("single", "pipelined"):
            PIPELINED = mode == "pipelined"
            for name, fn in methods.items():
                row[f"{name}_{mode}"] = _time(
                    lambda fn=fn: [fn(i) for i in range(PER_EVAL)])
    finally:
        PIPELINED = saved
    row["trellis_gbps_single"] = tbytes / row[f"trellis{bits}_single"] / 1e9
    for rows in (1, 2, 4):  # tuning: rows a warp runs at once (single calls)
        run = cuda_trellis.gemv_launch(code, 256, 64, in_f, out_f, mx.float32, 1, rows)
        row[f"trellis{bits}_rows{rows}"] = _time(
            lambda run=run: [run(inputs=[xf, *tops[i % len(tops)]])[0] for i in range(PER_EVAL)])
    return row


def bench_trellis_encode(rows: int = 4096, cols: int = 4096, cpu_rows: int = 2,
                         cpu_cols: int = 512, state_bits: int = 16) -> list[dict]:
    """GPU Viterbi encode of a Gaussian rows x cols matrix at 2/3/4 bits (L = 16, blocks
    of 256, group 64) against the CPU (numba) encoder on a slice, the slice's GPU words
    compared with the CPU's; weights a second, and the op-count estimate."""
    from turboquant.kernels import cuda_trellis_encode as enc
    from turboquant.stages import trellis

    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    out = []
    for bits in (2, 3, 4):
        code = trellis.TrellisCode(state_bits, bits)
        part = x[:cpu_rows, :cpu_cols]
        trellis.encode_rows(code, part[:1, :256], 64, 256)  # numba compiles first: not timed
        t0 = time.perf_counter()
        cpu = trellis.encode_rows(code, part, 64, 256)
        t_cpu = time.perf_counter() - t0
        gpu_part = enc.encode_rows_gpu(code, part, 64, 256)  # also builds the kernels
        same = bool(np.array_equal(gpu_part.words, cpu.words)
                    and np.array_equal(gpu_part.scales, cpu.scales))
        y = x / np.float32(code.gain)  # the Viterbi alone on the whole matrix's blocks
        blocks = y.reshape(-1, 256)
        t0 = time.perf_counter()
        enc.encode_blocks_gpu(code, blocks)
        t_viterbi = time.perf_counter() - t0
        t0 = time.perf_counter()
        enc.encode_rows_gpu(code, x, 64, 256)
        t_rows = time.perf_counter() - t0
        out.append({"bits": bits, "cpu_weights_per_s": part.size / t_cpu,
                    "gpu_viterbi_weights_per_s": x.size / t_viterbi,
                    "gpu_encode_rows_weights_per_s": x.size / t_rows,
                    "estimate_weights_per_s": enc.estimate_rate(code),
                    "slice_identical": same})
    return out


def trellis_main(json_path: str | None, encode: bool = True) -> None:
    """--trellis: the check, the GEMV table (single and pipelined) and the encode table."""
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    results = {"check": trellis_check(), "gemv": [], "encode": []}
    print("trellis kernels vs decode_rows:", results["check"], flush=True)
    print(f"microseconds per GEMV, 3 bits, one rotated token ({PER_EVAL} per eval, weights "
          "streamed from HBM); trellis_linear includes the input's rotation")
    variants = ["trellis3"] + [f"trellis3{s}" for s in TRELLIS_VARIANTS]
    names = ["affine3", "tq3", *variants, "trellis3_linear"]
    print("trellis3: L=16 V=1 version 1 (the writers' code); _V2: 2 values a step; v2: trellis "
          "version 2 (no shift-xor); the ratios: each trellis GEMV over tq3")
    print(f"{'shape':>12} {'mode':>9} " + " ".join(f"{n:>15}" for n in names)
          + "  trellis/tq3")
    for out_f, in_f in TRELLIS_SHAPES:
        r = bench_trellis_gemv(out_f, in_f, 3)
        results["gemv"].append(r)
        for mode in ("single", "pipelined"):
            print(f"{r['shape']:>12} {mode:>9} "
                  + " ".join(f"{r[f'{n}_{mode}'] * 1e6:15.1f}" for n in names)
                  + "  " + " ".join(f"{r[f'{v}_{mode}'] / r[f'tq3_{mode}']:.2f}"
                                    for v in variants), flush=True)
        print(f"{'':>12} {'rows/warp':>9} " + " ".join(
            f"{n}: {r[f'trellis3_rows{n}'] * 1e6:.1f}" for n in (1, 2, 4)), flush=True)
    if encode:
        from turboquant.stages import trellis

        cpu = "numba" if trellis._COMPILED else "numpy (numba not installed)"
        print(f"trellis encode, L=16 V=1 block 256 group 64, 4096x4096 Gaussian: weights/s; "
              f"the CPU encoder ({cpu}) on a 2x512 slice")
        print(f"{'bits':>4} {'cpu':>12} {'gpu viterbi':>12} {'gpu rows':>12} "
              f"{'estimate':>12} {'gpu/cpu':>8} slice identical")
        for r in bench_trellis_encode():
            results["encode"].append(r)
            print(f"{r['bits']:>4} {r['cpu_weights_per_s']:12.3g} "
                  f"{r['gpu_viterbi_weights_per_s']:12.3g} "
                  f"{r['gpu_encode_rows_weights_per_s']:12.3g} {r['estimate_weights_per_s']:12.3g} "
                  f"{r['gpu_viterbi_weights_per_s'] / r['cpu_weights_per_s']:8.0f} "
                  f"{r['slice_identical']}", flush=True)
    print("reproduce: python benchmarks/kernels.py --trellis (GPU machine, MLX CUDA build)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check kernels against the reference")
    ap.add_argument("--json", help="write results to this file")
    ap.add_argument("--sweep", action="store_true", help="time rows-per-warp choices first")
    ap.add_argument("--layer", action="store_true",
                    help="also time a decoder layer's linears end to end (rotation, grouping)")
    ap.add_argument("--layer-only", action="store_true", help="only the --layer timing")
    ap.add_argument("--breakdown", action="store_true", help="host vs device time per step")
    ap.add_argument("--loop", type=int, nargs="*", metavar="N",
                    help="[OUT IN BITS]: only the GEMV with 200 launches per evaluation")
    ap.add_argument("--pipelined", action="store_true",
                    help="overlap each evaluation with building the next (mx.async_eval), as "
                         "a decode loop does, for every method alike")
    ap.add_argument("--one-linear", type=int, nargs="+", metavar="N",
                    help="OUT IN [BITS]: only call one fused linear a few times (for ncu)")
    ap.add_argument("--trellis", action="store_true",
                    help="only the trellis kernels: GEMV at 3 bits against TQ3 and affine-3 "
                         "(single and pipelined), and the GPU encoder against the CPU's")
    ap.add_argument("--trellis-no-encode", action="store_true",
                    help="with --trellis: leave out the encode table")
    args = ap.parse_args()
    if args.trellis:
        trellis_main(args.json, encode=not args.trellis_no_encode)
        return
    global PIPELINED
    PIPELINED = args.pipelined
    if args.loop is not None:
        gemv_loop(*args.loop)
        return
    if args.one_linear:
        one_linear(*args.one_linear)
        return
    if args.breakdown:
        breakdown()
    if args.layer or args.layer_only:
        rows = bench_layer(3)
        print_layer(rows, 3)
        if args.layer_only:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"layer": rows}, f, indent=1)
            return
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    errs = check()
    print("kernel vs reference, max rel. error:", {b: f"{e:.2e}" for b, e in errs.items()})
    results = {"check": errs, "rows": []}
    if args.sweep:
        sweep_rows_per_warp()
    if not args.check:
        hdr = f"{'shape':>12} {'bf16':>8} " + " ".join(
            f"{'aff' + str(b):>8} {'tq' + str(b):>8} {'x aff':>6}" for b in (2, 3, 4))
        print(f"microseconds per GEMV ({PER_EVAL} per eval, weights streamed from HBM"
              f"{', evaluations pipelined' if PIPELINED else ''})")
        print(hdr)
        for out_f, in_f in SHAPES:
            r = bench_shape(out_f, in_f)
            results["rows"].append(r)
            line = f"{r['shape']:>12} {r['bf16'] * 1e6:8.1f} " + " ".join(
                f"{r[f'affine{b}'] * 1e6:8.1f} {r[f'tq{b}'] * 1e6:8.1f} {r[f'affine{b}'] / r[f'tq{b}']:6.2f}"
                for b in (2, 3, 4))
            print(line, flush=True)
        print("reproduce: python benchmarks/kernels.py (on the GPU machine, MLX CUDA build)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

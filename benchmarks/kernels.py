"""Decode GEMV timings on the GPU: TurboQuant 2/3/4-bit kernels vs MLX affine and bf16.

Each method runs 20 matrix-vector products per `mx.eval` (amortising MLX's per-evaluation
overhead the same way for all), cycling through enough distinct weight copies that the
working set exceeds the 50 MB L2 cache, so every product streams its weights from HBM as
a real decode step does. Prints microseconds per GEMV and ratios against MLX's affine
`quantized_matmul` at the same bits and MLX bf16, measured in the same run.

Reproduce (GPU machine, MLX CUDA build):  python benchmarks/kernels.py [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import mlx.core as mx
import numpy as np

from turboquant.kernels import cuda_gemv
from turboquant.stages import codebook_values

SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672)]
PER_EVAL = 20
L2_BYTES = 50 * 2**20


def _copies(nbytes: int) -> int:
    return max(1, min(PER_EVAL, math.ceil(3 * L2_BYTES / nbytes)))


def _time(fn, reps: int = 10) -> float:
    """Median seconds per GEMV of `fn()` (which builds PER_EVAL GEMVs)."""
    mx.eval(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) / PER_EVAL)
    return float(np.median(samples))


def tq_operands(out_f: int, in_f: int, bits: int, group: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    codes = mx.array(rng.integers(0, 2**bits, size=(out_f, in_f), dtype=np.uint8))
    low, high = cuda_gemv.repack(codes, bits, in_f)
    scales = mx.array((rng.random((out_f, in_f // group)) * 0.02 + 0.01).astype(np.float16))
    return codes, low, high, scales


def tq_gemv(x, low, high, scales, bits, out_f, group=64, rows_per_warp=cuda_gemv.ROWS_PER_WARP):
    pairs = mx.zeros((1,), dtype=mx.int32)
    return cuda_gemv.gemv(
        x, low, high, scales, codebook_values(bits), pairs, pairs,
        bits=bits, group_size=group, out_features=out_f, rows_per_warp=rows_per_warp,
    )


def sweep_rows_per_warp(out_f: int = 28672, in_f: int = 8192) -> None:
    """Tuning aid: TQ GEMV time against rows handled per warp."""
    x = mx.random.normal((1, in_f)).astype(mx.float16)
    for bits in (2, 3, 4):
        _, low, high, scales = tq_operands(out_f, in_f, bits, seed=bits)
        for rpw in (2, 4, 8, 16):
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
        row[f"tq{bits}"] = _time(lambda: [
            tq_gemv(xp, *ops[i % len(ops)], bits, out_f) for i in range(PER_EVAL)
        ])
        row[f"tq{bits}_gbps"] = nbytes / row[f"tq{bits}"] / 1e9
        del ops
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check kernels against the reference")
    ap.add_argument("--json", help="write results to this file")
    ap.add_argument("--sweep", action="store_true", help="time rows-per-warp choices first")
    args = ap.parse_args()
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    errs = check()
    print("kernel vs reference, max rel. error:", {b: f"{e:.2e}" for b, e in errs.items()})
    results = {"check": errs, "rows": []}
    if args.sweep:
        sweep_rows_per_warp()
    if not args.check:
        hdr = f"{'shape':>12} {'bf16':>8} " + " ".join(
            f"{'aff' + str(b):>8} {'tq' + str(b):>8} {'x aff':>6}" for b in (2, 3, 4))
        print("microseconds per GEMV (20 per eval, weights streamed from HBM)")
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

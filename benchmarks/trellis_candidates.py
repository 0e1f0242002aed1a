"""Trellis candidates by measurement (issue 39: "choose L, V, k and the codebook"): for each
state size L, values a step V and bits a weight k, the weight error on Gaussian rows, the
CPU encode speed, the CPU (numba) GEMV time against the scalar code's at the same shape and
bits, and the CUDA GEMV's instructions a weight in its inner loop, read from the SASS that
nvcc builds for sm_90 from the kernel text `kernels/cuda_trellis.py` generates.

    .venv/bin/python benchmarks/codec.py --trellis-candidates      # ~10 min on 2 cores
    .venv/bin/python benchmarks/trellis_candidates.py --books v1,mad --states 12,16

Codebooks (`--books`): `v1` is the format's (stages/trellis.py, trellis version 1: a
multiply-add, a shift-xor, the sum of the four bytes); the others are candidates for a
cheaper one, measured here only (no converter writes them):
- `mad`: v1 without the shift-xor, h = S * MUL + ADD and the sum of its four bytes: trellis
  version 2 (`TrellisCode(..., version=2)`, decoded by every kernel, written by none yet);
- `tri`: a byte difference of v1's hash, (byte0 - byte1) / STD for value 0 and
  (byte2 - byte3) / STD for value 1 (triangular values, two from one hash).
Their MSE comes from the encoder's own reconstruction with the candidate's table
(`stages.trellis.encode_rows(table=...)`); `mad`'s SASS from the GEMV's text at version 2
(`tri` has no kernel: it would need a half2 GEMV).

The instruction count is the longest innermost loop's (the GEMV's chunk loop: 32 weights of each of
ROWS rows an iteration) divided by its weights, at 28672x8192 (the issue's GEMV shape; ROWS
= 4 there); the scalar TQ kernel's (`kernels/cuda_gemv.py`, 2 groups of 64 codes of ROWS
rows an iteration) is printed beside it. A GEMV bound by instruction issue takes about
count x weights / 32 lanes / (SMs x 4 schedulers x clock): at 28672x8192 on an H200 (132
SMs, 1.98 GHz) ~7.0 us a unit of count. Needs nvcc and cuobjdump with nvdisasm on PATH
(`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, their `nvidia/cu13/bin`);
without them the column says "-".
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from turboquant.kernels import cpu_gemv, cuda_gemv, cuda_trellis  # noqa: E402
from turboquant.stages import encode, fast_trellis, trellis  # noqa: E402
from turboquant.stages.trellis import TrellisBits, TrellisCode  # noqa: E402

BLOCK, GROUP = 256, 64
GEMV_OUT, GEMV_IN = 28672, 8192  # the SASS shape (issue 39's GEMV)
TARGETS = {2: 0.075, 3: 0.020, 4: 0.0052}
TRI_STD = math.sqrt(2 * (256**2 - 1) / 12)  # std of the difference of two uniform bytes


# ------------------------------------------------------------------ codebooks


def book(name: str, code: TrellisCode) -> np.ndarray:
    """Every state's V values (2^L, V) float32 under codebook `name`."""
    if name == "v1":
        return trellis.codebook(code)
    s = np.arange(1 << code.state_bits, dtype=np.uint32)
    out = np.empty((len(s), code.values), dtype=np.float32)
    if name == "mad":  # trellis version 2
        return trellis.codebook(TrellisCode(code.state_bits, code.bits, code.values, 2))
    if name == "tri":
        h = s * np.uint32(trellis.MUL[0]) + np.uint32(trellis.ADD[0])
        h ^= h >> np.uint32(16)
        b = [((h >> np.uint32(8 * i)) & 0xFF).astype(np.float32) for i in range(4)]
        out[:, 0] = (b[0] - b[1]) / np.float32(TRI_STD)
        if code.values == 2:
            out[:, 1] = (b[2] - b[3]) / np.float32(TRI_STD)
        return out
    raise ValueError(f"unknown codebook {name!r} (v1, mad, tri)")


def weight_error(code: TrellisCode, x: np.ndarray, table: np.ndarray):
    """(rel. MSE, its standard error over blocks, encode weights/s) of coding rows x: the
    encoder's own reconstruction against `table`."""
    start = time.perf_counter()
    rows = trellis.encode_rows(code, x, GROUP, BLOCK, table=table)
    seconds = time.perf_counter() - start
    ratio = rows.sq_error / rows.sq_norm
    mse = float(rows.sq_error.sum() / rows.sq_norm.sum())
    se = float(ratio.std(ddof=1) / np.sqrt(len(ratio))) if len(ratio) > 1 else float("nan")
    return mse, se, x.size / seconds


# ------------------------------------------------------------------ CPU GEMV


def gemv_times(code: TrellisCode, rows: int, cols: int, repeats: int, rng) -> tuple[float, float]:
    """Best seconds of the numba GEMV (rows x cols, one token) for the trellis code and for
    the scalar code of the same bits, timed alternately. Any words are a valid trellis
    code, so random ones time it."""
    words = rng.integers(0, 2**32, size=(rows, cols * code.bits // 32), dtype=np.uint32)
    scales = rng.uniform(0.5, 1.5, size=(rows, cols // GROUP)).astype(np.float16)
    x = rng.standard_normal((1, cols), dtype=np.float32)
    lloyd = np.linspace(-2, 2, 1 << code.bits, dtype=np.float32)
    tb = TrellisBits(code.bits, code.state_bits, code.values, BLOCK)
    runs = {"trellis": lambda: cpu_gemv.gemv(x, words, scales, None, tb, GROUP),
            "scalar": lambda: cpu_gemv.gemv(x, words, scales, lloyd, code.bits, GROUP)}
    best = {k: float("inf") for k in runs}
    for f in runs.values():
        f()  # compile, warm
    for _ in range(repeats):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t)
    return best["trellis"], best["scalar"]


# ------------------------------------------------------------------ SASS


def sass_tools() -> tuple[str, str] | None:
    """(nvcc, cuobjdump) when both run here (cuobjdump -sass needs nvdisasm on PATH)."""
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists(
        "/usr/local/bin/nvcc") else None)
    dump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if nvcc and dump and (shutil.which("nvdisasm") or os.environ.get("NVDISASM_PATH")):
        return nvcc, dump
    return None


_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


def parse_sass(text: str) -> list[tuple[int, str]]:
    """(address, instruction) of every instruction in cuobjdump -sass output."""
    out = []
    for line in text.splitlines():
        m = _INSN.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def hot_loop(insns: list[tuple[int, str]]) -> list[str]:
    """The instructions of the longest innermost loop (a backward branch's range, target
    through branch, holding no other backward branch): a GEMV's compute loop, not the
    short loops that stage its input. Empty when the code has no loop."""
    loops = []
    for addr, text in insns:
        m = _BRANCH.match(text)
        if m and m.group(2) is not None and int(m.group(2), 16) < addr:
            loops.append((int(m.group(2), 16), addr))
    inner = [(a, b) for a, b in loops
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    if not inner:
        return []
    lo, hi = max(inner, key=lambda r: r[1] - r[0])
    return [t for a, t in insns if lo <= a <= hi]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loop_count(source: str, tools, weights: int) -> tuple[float, collections.Counter]:
    """(instructions a weight, opcode counts) of `source`'s innermost loop, `weights` the
    weights an iteration handles."""
    nvcc, dump = tools
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-cubin", str(cu), "-o",
                        str(cubin)], check=True, capture_output=True, text=True)
        text = subprocess.run([dump, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    loop = hot_loop(parse_sass(text))
    return len(loop) / weights, collections.Counter(opcode(t) for t in loop)


def trellis_source(code: TrellisCode, name: str) -> tuple[str, int]:
    """(kernel source as mx.fast.cuda_kernel builds it, weights a loop iteration) of the
    trellis GEMV at GEMV_OUT x GEMV_IN for codebook `name` (v1 or mad)."""
    from cuda_source import MLX_DEFAULT_HEADER, kernel_source

    rows = cuda_trellis.rows_per_warp_for(GEMV_OUT)
    if name not in ("v1", "mad"):
        raise ValueError(f"no kernel text for codebook {name!r}")
    version = 2 if name == "mad" else 1
    code = TrellisCode(code.state_bits, code.bits, code.values, version)
    body = cuda_trellis.gemv_source(code, BLOCK, GROUP, GEMV_IN, GEMV_OUT, mx.float32,
                                    mx.float32, rows)
    src = MLX_DEFAULT_HEADER + cuda_trellis.header() + kernel_source(
        "tq_trellis_gemv", ["x", "codes", "scales"], ["out"], body,
        [mx.float32, mx.uint32, mx.float16], [mx.float32], [])
    return src, 32 * rows


def scalar_source(bits: int) -> tuple[str, int]:
    """The scalar TQ GEMV (`kernels/cuda_gemv.py`, one matrix) at GEMV_OUT x GEMV_IN."""
    from cuda_source import MLX_DEFAULT_HEADER, kernel_source

    rows = cuda_gemv.rows_per_warp_for(GEMV_OUT)
    constants = (("BITS", bits), ("GS", GROUP), ("OUT", GEMV_OUT), ("PADDED", GEMV_IN),
                 ("NSCALES", GEMV_IN // GROUP), ("ROWS_PER_WARP", rows), ("SEGS", 1),
                 ("END0", GEMV_OUT), ("END1", GEMV_OUT), ("XROWS", 0), ("HAS_BIAS", False),
                 ("OutT", mx.float16))
    inputs = [mx.float16, mx.uint32, mx.uint32, mx.float16, mx.float32, mx.int32, mx.int32,
              mx.float32]
    src = MLX_DEFAULT_HEADER + cuda_gemv.HEADER + kernel_source(
        "tq_gemv", cuda_gemv.INPUTS, ["out0"], cuda_gemv._body(1, constants), inputs,
        [mx.float16], [])
    return src, 2 * 64 * rows


# ------------------------------------------------------------------ the table


def candidates(states, books) -> list[tuple[int, int, int, str]]:
    out = []
    for bits in (2, 3, 4):
        for L in states:
            for values in (1, 2):
                if L <= bits * values:
                    continue
                for name in books:
                    out.append((L, values, bits, name))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--states", default="8,10,12,14,16", help="L candidates")
    p.add_argument("--books", default="v1", help="codebooks: v1, mad, tri (comma-separated)")
    p.add_argument("--cols", type=int, default=4096, help="width of the Gaussian rows")
    p.add_argument("--rows", type=int, default=64, help="most rows a candidate codes")
    p.add_argument("--budget", type=float, default=2.0**31,
                   help="Viterbi work a candidate: rows x cols x 2^L / V x 2 passes")
    p.add_argument("--gemv", default="4096x4096", help="CPU GEMV shape OUTxIN")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-sass", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    states = [int(s) for s in args.states.split(",")]
    books = args.books.split(",")
    g_out, g_in = (int(v) for v in args.gemv.split("x"))
    rng = np.random.default_rng(args.seed)
    pool = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    tools = None if args.no_sass else sass_tools()
    t0 = time.time()

    print(f"trellis candidates: rel. MSE on iid N(0,1) rows of {args.cols} (group {GROUP}, "
          f"fp16 scales refit, tail-biting blocks of {BLOCK}; the expensive candidates code "
          "fewer rows: +- is the standard error over blocks); encode through "
          + ("numba" if fast_trellis.AVAILABLE else "numpy")
          + f" on {os.cpu_count()} cores of a shared {platform.machine()} CPU (w/s: weights a "
          f"second); CPU GEMV {g_out}x{g_in}, one token, numba, best of {args.repeats} "
          "alternating with the scalar code's (same bits, same shape); SASS: instructions a "
          f"weight in the CUDA GEMV's inner loop at {GEMV_OUT}x{GEMV_IN}, sm_90")
    print(f"load average at start {os.getloadavg()[0]:.1f}")
    sass = {}
    if tools:
        jobs = {("scalar", b): scalar_source(b) for b in (2, 3, 4)}
        for L, V, k, name in candidates(states, books):
            if name in ("v1", "mad"):
                jobs[(L, V, k, name)] = trellis_source(TrellisCode(L, k, V), name)
        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool_x:
            futures = {key: pool_x.submit(loop_count, src, tools, w)
                       for key, (src, w) in jobs.items()}
            sass = {key: f.result() for key, f in futures.items()}
        for b in (2, 3, 4):
            per, ops = sass[("scalar", b)]
            print(f"  scalar TQ{b} GEMV: {per:.2f} instructions a weight "
                  f"({', '.join(f'{o} {n}' for o, n in ops.most_common(6))} ...)")
    else:
        print("  (no SASS: nvcc, cuobjdump or nvdisasm missing)")
    print()
    header = (f"{'L':>3} {'V':>2} {'k':>2} {'book':>4} {'rows':>5} | {'rel.MSE':>8} {'+-':>7} "
              f"{'/4^-k':>6} {'target':>6} | {'enc w/s':>8} | {'GEMV ms':>8} {'/scalar':>7} | "
              f"{'SASS/w':>6} {'/scalar':>7} {'~us':>5}")
    print(header)
    print("-" * len(header))
    gemv_cache = {}
    for L, V, k, name in candidates(states, books):
        code = TrellisCode(L, k, V)
        work = 2.0 * args.cols * 2**L / V
        n = int(min(len(pool), max(2, args.budget // work)))
        mse, se, wps = weight_error(code, pool[:n], book(name, code))
        if (L, V, k) not in gemv_cache and name == "v1":
            gemv_cache[(L, V, k)] = gemv_times(code, g_out, g_in, args.repeats, rng)
        gt = gemv_cache.get((L, V, k)) if name == "v1" else None
        s = sass.get((L, V, k, name))
        s_scalar = sass.get(("scalar", k))
        gemv = f"{gt[0] * 1e3:>8.2f} {gt[0] / gt[1]:>7.2f}" if gt else f"{'-':>8} {'-':>7}"
        sa = (f"{s[0]:>6.2f} {s[0] / s_scalar[0]:>7.2f} {s[0] * 7.0:>5.0f}" if s and s_scalar
              else f"{'-':>6} {'-':>7} {'-':>5}")
        print(f"{L:>3} {V:>2} {k:>2} {name:>4} {n:>5} | {mse:>8.5f} {se:>7.5f} "
              f"{mse * 4**k:>6.3f} {'yes' if mse <= TARGETS[k] else 'no':>6} | {wps:>8.0f} | "
              f"{gemv} | {sa}", flush=True)
    print()
    print("/4^-k: MSE over Shannon's bound. target: issue 39's <= 0.075 / 0.020 / 0.0052. "
          "GEMV /scalar: the trellis numba GEMV's time over the scalar code's. SASS/w: "
          "instructions a weight; ~us: issue-bound time at 28672x8192 on an H200 "
          "(7.0 us a unit; an estimate, not a measurement).")
    print(f"load average at end {os.getloadavg()[0]:.1f}; {time.time() - t0:.0f} s")
    print(f"reproduce: .venv/bin/python benchmarks/trellis_candidates.py --states {args.states} "
          f"--books {args.books} --cols {args.cols} --rows {args.rows} --budget "
          f"{args.budget:.0f} --gemv {args.gemv} --repeats {args.repeats} --seed {args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

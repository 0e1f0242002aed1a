"""TurboQuant codec vs MLX's affine quantization: error, real bits per weight, encode speed.

For Gaussian, heavy-tailed (Student-t, 4 d.o.f.) and outlier-channel matrices (a few input
channels scaled 10-50x), stored as bfloat16 like a checkpoint, at 2/3/4 bits and one group
size: relative MSE ||W - W_hat||^2 / ||W||^2 and the stored bits per weight (codes, scales,
biases, padding) of `turboquant.stages.encode` next to `mx.quantize` / `mx.dequantize`
(affine, fp16-class scale and bias per group), measured in the same run, plus encode
throughput of each. Ternary TurboQuant is listed against affine 2-bit, the least MLX offers.
TurboQuant's encode also measures its own error without decoding (`QuantizedTensor.rel_mse`);
the last column is its relative difference from the decoded error.

    .venv/bin/python benchmarks/codec.py            # ~1 minute on a 2-core CPU
    TURBOQUANT_NO_NUMBA=1 .venv/bin/python benchmarks/codec.py   # encode without numba
    .venv/bin/python benchmarks/codec.py --trellis  # trellis candidates vs Lloyd-Max (~6 min)
    .venv/bin/python benchmarks/codec.py --trellis --trellis-states 12,16 --trellis-versions 1,2
    .venv/bin/python benchmarks/codec.py --trellis-candidates  # + CPU GEMV and SASS a weight

--trellis measures the trellis code of stages/trellis.py instead (see trellis_main).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import mlx.core as mx
import numpy as np

from turboquant.stages import decode, encode, fast_hadamard, lloyd_max_mse, ternary_mse


def make_matrices(rows: int, cols: int, seed: int) -> tuple[dict[str, mx.array], mx.array]:
    """The three test matrices (bf16), and a mask of the outlier matrix's ordinary columns."""
    rng = np.random.default_rng(seed)
    gaussian = rng.standard_normal((rows, cols), dtype=np.float32)
    student = rng.standard_t(4, size=(rows, cols)).astype(np.float32)
    outlier = rng.standard_normal((rows, cols), dtype=np.float32)
    channels = rng.choice(cols, size=max(1, cols // 512), replace=False)
    outlier[:, channels] *= rng.uniform(10, 50, size=len(channels)).astype(np.float32)
    ordinary = np.ones(cols, dtype=np.float32)
    ordinary[channels] = 0.0
    mats = {"gaussian": gaussian, "student-t4": student, "outlier-ch": outlier}
    mats = {name: mx.array(m * 0.02).astype(mx.bfloat16) for name, m in mats.items()}
    return mats, mx.array(ordinary)


def rel_mse(w: mx.array, w_hat: mx.array, columns: mx.array | None = None) -> float:
    """||W - W_hat||^2 / ||W||^2 (summed in float64), over the columns where `columns` is 1."""
    w = w.astype(mx.float32)
    err = (w - w_hat.astype(mx.float32)) ** 2
    energy = w * w
    if columns is not None:
        err, energy = err * columns, energy * columns
    err, energy = (np.sum(np.array(a), dtype=np.float64) for a in (err, energy))
    return float(err / energy)


def best_time(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up (compiles kernels, fills caches)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def turboquant_row(w: mx.array, bits, group_size: int, repeats: int, columns) -> dict:
    seconds, qt = best_time(lambda: encode(w, bits, group_size=group_size, seed=1), repeats)
    w_hat = decode(qt)
    mse = rel_mse(w, w_hat)
    return {
        "mse": mse,
        "bulk": rel_mse(w, w_hat, columns),
        "bpw": qt.bits_per_weight,
        "wps": w.size / seconds,
        "err_diff": abs(qt.rel_mse - mse) / mse,
    }


def affine_row(w: mx.array, bits: int, group_size: int, repeats: int, columns) -> dict:
    def run():
        out = mx.quantize(w, group_size=group_size, bits=bits)
        mx.eval(out)
        return out

    seconds, (wq, scales, biases) = best_time(run, repeats)
    w_hat = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    stored = wq.nbytes + scales.nbytes + biases.nbytes
    return {
        "mse": rel_mse(w, w_hat),
        "bulk": rel_mse(w, w_hat, columns),
        "bpw": 8 * stored / w.size,
        "wps": w.size / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--trellis-candidates" in argv:  # its own options: trellis_candidates.py --help
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import trellis_candidates

        return trellis_candidates.main([a for a in argv if a != "--trellis-candidates"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--bits", default="2,3,4,ternary", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trellis-candidates", action="store_true",
                        help="the candidates table (L, V, k, codebook: MSE, encode speed, CPU "
                        "GEMV, SASS instructions a weight): benchmarks/trellis_candidates.py")
    parser.add_argument("--trellis", action="store_true",
                        help="measure trellis codes (L, V, k) against Lloyd-Max and 4^-b")
    parser.add_argument("--trellis-rows", type=int, default=256,
                        help="most Gaussian rows of --cols per trellis candidate")
    parser.add_argument("--trellis-budget", type=float, default=2.0**32,
                        help="trellis work per candidate: rows x cols x 2^L / V x 2 passes")
    parser.add_argument("--trellis-states", default="8,10,12,14,16", help="L candidates")
    parser.add_argument("--trellis-versions", default="1", help="trellis versions (the "
                        "computed codebook, stages/trellis.py VERSIONS) of every candidate, "
                        "on the same rows: e.g. 1,2")
    parser.add_argument("--trellis-constants", type=int, default=12,
                        help="random multiply-add constants the chosen ones are set against")
    parser.add_argument("--trellis-search", type=int, default=0,
                        help="search N random multiply-add constants per value instead")
    args = parser.parse_args(argv)
    if args.trellis and args.trellis_search:
        return trellis_search(args)
    if args.trellis:
        return trellis_main(args)
    bit_list = [b if b == "ternary" else int(b) for b in args.bits.split(",")]

    print(
        f"mlx {mx.__version__} on {mx.default_device()} ({platform.machine()}), "
        f"{args.rows}x{args.cols} bf16 matrices, group {args.group_size}, encode through "
        + ("numba kernels (stages/fast_*.py)" if fast_hadamard.AVAILABLE
           else "numpy/MLX (no numba, or TURBOQUANT_NO_NUMBA=1)")
    )
    print(
        "reference: Lloyd-Max MSE for N(0,1) "
        + ", ".join(f"{b}b {lloyd_max_mse(b):.6f}" for b in (2, 3, 4))
        + f", ternary {ternary_mse():.6f}"
    )
    print()
    header = (
        f"{'matrix':<11} {'bits':>7} | {'TQ rel.MSE':>10} {'TQ bpw':>7} {'TQ Mw/s':>8} | "
        f"{'affine':>6} {'rel.MSE':>9} {'bpw':>5} {'Mw/s':>7} | {'MSE ratio':>9} "
        f"{'bpw ratio':>9} {'speed ratio':>11} | {'err diff':>8}"
    )
    print(header)
    print("-" * len(header))
    mats, ordinary = make_matrices(args.rows, args.cols, args.seed)
    bulk = []
    for name, w in mats.items():
        for bits in bit_list:
            peer_bits = 2 if bits == "ternary" else bits
            tq = turboquant_row(w, bits, args.group_size, args.repeats, ordinary)
            af = affine_row(w, peer_bits, args.group_size, args.repeats, ordinary)
            if name == "outlier-ch":
                bulk.append((bits, peer_bits, tq["bulk"], af["bulk"]))
            print(
                f"{name:<11} {str(bits):>7} | {tq['mse']:>10.6f} {tq['bpw']:>7.3f} "
                f"{tq['wps'] / 1e6:>8.1f} | {f'aff-{peer_bits}':>6} {af['mse']:>9.6f} "
                f"{af['bpw']:>5.2f} {af['wps'] / 1e6:>7.1f} | {tq['mse'] / af['mse']:>9.3f} "
                f"{tq['bpw'] / af['bpw']:>9.3f} {tq['wps'] / af['wps']:>11.3f} | "
                f"{tq['err_diff']:>8.1e}"
            )
    print()
    print("ratios are TurboQuant / affine: MSE and bpw below 1 favour TurboQuant; speed above 1.")
    print()
    n_out = int(args.cols - ordinary.sum().item())
    print(
        f"outlier-ch, error on the {args.cols - n_out} ordinary columns only "
        f"(the {n_out} scaled ones hold most of the energy and dominate rel. MSE above):"
    )
    for bits, peer_bits, tq_bulk, af_bulk in bulk:
        print(
            f"  {str(bits):>7}: TurboQuant {tq_bulk:.6f}  affine-{peer_bits} {af_bulk:.6f}  "
            f"ratio {tq_bulk / af_bulk:.3f}"
        )
    print(
        "reproduce:",
        " ".join(
            [
                ".venv/bin/python",
                "benchmarks/codec.py",
                f"--rows {args.rows}",
                f"--cols {args.cols}",
                f"--group-size {args.group_size}",
                f"--bits {args.bits}",
                f"--repeats {args.repeats}",
                f"--seed {args.seed}",
            ]
        ),
    )
    return 0


def _trellis_error(code, x, group_size, block, **kwargs):
    """(relative MSE, its standard error over blocks, weights/s) of trellis-coding rows x.

    Blocks are coded independently (tail-biting, groups inside blocks), so on iid Gaussian
    rows the per-block errors are iid: the MSE is their mean, the error bar their spread."""
    from turboquant.stages import trellis

    start = time.perf_counter()
    rows = trellis.encode_rows(code, x, group_size, block, **kwargs)
    seconds = time.perf_counter() - start
    if "table" in kwargs:  # other constants: the encoder's own reconstruction
        err, norm = rows.sq_error, rows.sq_norm
    else:
        x_hat = trellis.decode_rows(code, rows.words, rows.scales, group_size, block)
        d = (x.astype(np.float64) - x_hat).reshape(-1, block)
        err, norm = (d * d).sum(axis=1), (x.astype(np.float64) ** 2).reshape(-1, block).sum(1)
    ratio = err / norm
    mse = float(err.sum() / norm.sum())
    se = float(ratio.std(ddof=1) / np.sqrt(len(ratio))) if len(ratio) > 1 else float("nan")
    return mse, se, x.size / seconds


def trellis_search(args) -> int:
    """Choose the multiply-add constants of the computed codebook by measurement.

    For value 0 (codes with V = 1), then value 1 (V = 2, value 0 fixed to the winner):
    N random (odd multiplier, addend) pairs are scored at L = 12 on rows A by the mean over
    k = 2, 3, 4 of rel. MSE / 4^-k; the best 4, and the constants in the code, are scored
    again on independent rows B, and the best on B wins (no selection bias in its score).
    """
    from turboquant.stages import trellis
    from turboquant.stages.trellis import TrellisCode

    gs, block = args.group_size, 256
    rng = np.random.default_rng(args.seed + 1)
    rows_a = rng.standard_normal((8, 1024), dtype=np.float32)
    rows_b = rng.standard_normal((48, 1024), dtype=np.float32)
    draw = np.random.default_rng(2026)
    mul, add = list(trellis.MUL), list(trellis.ADD)

    def score(values, m, a, x):
        errs = []
        for bits in (2, 3, 4):
            code = TrellisCode(12, bits, values)
            table = trellis.codebook(code, m, a)
            errs.append(_trellis_error(code, x, gs, block, table=table)[0] * 4**bits)
        return float(np.mean(errs))

    print(f"constant search: {args.trellis_search} candidates a value, L=12, k=2,3,4, "
          f"score = mean rel.MSE / 4^-k; rows A {rows_a.shape}, rows B {rows_b.shape}")
    for j, values in ((0, 1), (1, 2)):
        found = []
        for _ in range(args.trellis_search):
            m, a = list(mul), list(add)
            m[j] = int(draw.integers(0, 2**31)) * 2 + 1
            a[j] = int(draw.integers(0, 2**32))
            found.append((score(values, m, a, rows_a), m[j], a[j]))
        found.sort()
        spread = np.array([f[0] for f in found])
        print(f"  value {j}: on A min {spread.min():.4f} median {np.median(spread):.4f} "
              f"max {spread.max():.4f}")
        finalists = [(mul[j], add[j], "in code")] + [(f[1], f[2], "top") for f in found[:4]]
        best = None
        for m_j, a_j, label in finalists:
            m, a = list(mul), list(add)
            m[j], a[j] = m_j, a_j
            on_b = score(values, m, a, rows_b)
            print(f"    {label:<7} MUL {m_j:#010x} ADD {a_j:#010x}: on B {on_b:.4f}", flush=True)
            if best is None or on_b < best[0]:
                best = (on_b, m_j, a_j)
        mul[j], add[j] = best[1], best[2]
        print(f"  value {j} chooses MUL {best[1]:#010x} ADD {best[2]:#010x}")
    print(f"reproduce: .venv/bin/python benchmarks/codec.py --trellis --trellis-search "
          f"{args.trellis_search} --group-size {gs} --seed {args.seed}")
    return 0


def trellis_main(args) -> int:
    """Trellis candidates against the scalar Lloyd-Max code and Shannon's bound 4^-b.

    Every number is a per-weight mean over iid Gaussian rows (rotation leaves iid Gaussian
    rows iid Gaussian, so the trellis codes them unrotated), group RMS scales refit by least
    squares, blocks of 256 weights; the expensive candidates (large L, kV) get fewer rows
    (the work per row grows as 2^L / V): the error bar says how much that costs.
    """
    from turboquant.stages import fast_trellis, trellis
    from turboquant.stages.trellis import TrellisCode

    cols, gs, block = args.cols, args.group_size, 256
    rng = np.random.default_rng(args.seed)
    pool = rng.standard_normal((args.trellis_rows, cols), dtype=np.float32)
    print(
        f"trellis codes on iid N(0,1) rows of {cols}, group {gs} (fp16 scales, least-squares "
        f"refit), tail-biting blocks of {block}; Viterbi through "
        + ("numba (stages/fast_trellis.py, two passes of 2^L a step, rows over "
           f"{os.cpu_count()} cores)" if fast_trellis.AVAILABLE else "numpy")
        + f"; {platform.machine()}, shared 2-core CPU under nice: speeds are "
        "ratios to the scalar encode in this run, not absolute claims"
    )
    print()

    # 1. the computed codebook: its distribution, and the multiply-add constants against
    # random odd ones (value 0 for V = 1; value 1 with value 0 fixed for V = 2)
    v = trellis.codebook(TrellisCode(16, 2, 2)).astype(np.float64)
    grid = np.sort(v[:, 0])
    normal_cdf = 0.5 * (1 + np.vectorize(math.erf)(grid / math.sqrt(2)))
    ks = float(np.max(np.abs(np.arange(1, len(grid) + 1) / len(grid) - normal_cdf)))
    print(
        f"computed codebook, L=16, MUL={[hex(m) for m in trellis.MUL]} "
        f"ADD={[hex(a) for a in trellis.ADD]}: value 0 mean {v[:, 0].mean():+.4f} std "
        f"{v[:, 0].std():.4f}, max |v| {np.abs(v).max():.3f}, Kolmogorov distance to N(0,1) "
        f"{ks:.4f}, corr(value 0, value 1) {np.corrcoef(v[:, 0], v[:, 1])[0, 1]:+.4f}"
    )
    x = pool[:4, :1024]
    search = np.random.default_rng(12345)
    for values in (1, 2):
        code = TrellisCode(12, 2, values)
        mine = _trellis_error(code, x, gs, block)[0]
        others = []
        for _ in range(args.trellis_constants):
            mul, add = list(trellis.MUL), list(trellis.ADD)
            mul[values - 1] = int(search.integers(0, 2**31)) * 2 + 1
            add[values - 1] = int(search.integers(0, 2**32))
            table = trellis.codebook(code, mul, add)
            others.append(_trellis_error(code, x, gs, block, table=table)[0])
        others = np.array(others)
        print(
            f"  L=12 k=2 V={values}, value {values - 1}'s constants: chosen {mine:.5f}; "
            f"{len(others)} random odd multipliers: min {others.min():.5f} median "
            f"{np.median(others):.5f} max {others.max():.5f}"
        )
    print()

    # 2. the gain the search aims with (the stored scale is refit, so only the path moves)
    print("gain (Viterbi target y / gain), L=12 V=1, rel. MSE:")
    gains = (0.9, 1.0, 1.05, 1.1, 1.2)
    for bits in (2, 3, 4):
        code = TrellisCode(12, bits, 1)
        errs = [_trellis_error(code, x, gs, block, gain=g)[0] for g in gains]
        print(
            f"  {bits} bits: " + "  ".join(f"{g:.2f} {e:.5f}" for g, e in zip(gains, errs))
            + f"   (code's gain {trellis.GAIN[bits]:.3f})"
        )
    print()

    # 3. the candidates, with the scalar code and the bound of the same run
    scalar = {}
    for bits in (2, 3, 4):
        w = mx.array(pool)
        seconds, qt = best_time(lambda b=bits: encode(w, b, group_size=gs, seed=1),
                                args.repeats)
        scalar[bits] = (rel_mse(w, decode(qt)), pool.size / seconds)
    targets = {2: 0.075, 3: 0.020, 4: 0.0052}
    versions = [int(v) for v in args.trellis_versions.split(",")]
    header = (
        f"{'L':>3} {'V':>2} {'k':>2} {'ver':>3} {'bpw':>5} {'rows':>5} | {'rel.MSE':>8} "
        f"{'+-':>7} | "
        f"{'/LloydMax':>9} {'/4^-k':>6} {'target':>7} | {'kw/s':>7} {'/scalar':>8}"
    )
    print(header)
    print("-" * len(header))
    for bits in (2, 3, 4):
        mse_s, wps_s = scalar[bits]
        print(
            f"{'LM':>3} {'-':>2} {bits:>2} {'-':>3} {bits + 16 / gs:>5.2f} {len(pool):>5} | "
            f"{mse_s:>8.5f} {'':>7} | {1.0:>9.3f} {mse_s * 4**bits:>6.3f} "
            f"{targets[bits]:>7.4f} | {wps_s / 1e3:>7.0f} {1.0:>8.3f}"
        )
        for states in (int(s) for s in args.trellis_states.split(",")):
            for values in (1, 2):
                if states <= bits * values:
                    continue
                for version in versions:  # the same rows for every version
                    code = TrellisCode(states, bits, values, version)
                    work = 2.0 * cols * 2**states / values  # a step: each state's min and cost
                    n_rows = int(min(len(pool), max(1, args.trellis_budget // work)))
                    mse, se, wps = _trellis_error(code, pool[:n_rows], gs, block)
                    print(
                        f"{states:>3} {values:>2} {bits:>2} {version:>3} {bits + 16 / gs:>5.2f} "
                        f"{n_rows:>5} | "
                        f"{mse:>8.5f} {se:>7.5f} | {mse / mse_s:>9.3f} {mse * 4**bits:>6.3f} "
                        f"{'yes' if mse <= targets[bits] else 'no':>7} | {wps / 1e3:>7.2f} "
                        f"{wps / wps_s:>8.1e}",
                        flush=True,
                    )
    print()
    print("LM: the scalar Lloyd-Max code (stages.encode, rotation included), same rows. "
          "/4^-k: MSE over Shannon's bound. target: the issue's <= 0.075 / 0.020 / 0.0052. "
          "ver: the trellis version (2: no shift-xor in the computed codebook).")
    print(
        "reproduce: .venv/bin/python benchmarks/codec.py --trellis "
        f"--cols {cols} --group-size {gs} --trellis-rows {args.trellis_rows} "
        f"--trellis-budget {args.trellis_budget:.0f} --trellis-states {args.trellis_states} "
        f"--trellis-versions {args.trellis_versions} "
        f"--trellis-constants {args.trellis_constants} --seed {args.seed}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

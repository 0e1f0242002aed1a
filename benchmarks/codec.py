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
"""

from __future__ import annotations

import argparse
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--bits", default="2,3,4,ternary", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())

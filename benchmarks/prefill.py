"""Prefill GEMM timings: TurboQuant's "matmul" op vs MLX affine `quantized_matmul` and bf16.

For M activation rows (prompt tokens) and Llama-3-8B's and -70B's linear shapes, one run
times, per product y = x W^T in bf16:
- `bf16`: MLX's matmul on the dense bf16 weight;
- `affine3`, `affine4`: MLX's `quantized_matmul` (group 64);
- `tqN`: the backend's TurboQuant "matmul" (on CUDA the stored codes decoded tile by tile
  to bf16, `kernels/cuda_dequant.py`, each tile through MLX's matmul), `decode` its
  decoding alone;
- `tq3-ref`: the pure-MLX reference GEMM (float32), the path prefill took before.
Activations arrive rotated (the rotation, O(M K log K), is not timed here: it is the same
for every width). Each timing is the median of evaluations of `PER_EVAL` products over
distinct weight copies. Ratios are against affine-4 and bf16 measured in the same run.

Reproduce (GPU machine, MLX CUDA build):  python benchmarks/prefill.py [--tokens 16 128 2048]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import mlx.core as mx

from turboquant.kernels import dispatch, reference
from turboquant.kernels.reference import words_per_row

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
PER_EVAL = 4


def _time(fn, reps: int = 5) -> float:
    """Median seconds per product of `fn()` (PER_EVAL products), after one warm-up."""
    mx.eval(fn())
    runs = timeit.repeat(lambda: mx.eval(fn()), number=1, repeat=reps)
    return statistics.median(runs) / PER_EVAL


def tq_weights(out_f: int, in_f: int, bits, copies: int):
    """`copies` random (codes, scales) of a TurboQuant weight (speed does not depend on values)."""
    out = []
    for i in range(copies):
        words = words_per_row(in_f, bits)
        top = 3**20 if bits == "ternary" else 2**32
        codes = mx.random.uniform(shape=(out_f, words), key=mx.random.key(i)) * top
        codes = codes.astype(mx.uint32)
        scales = (mx.random.uniform(shape=(out_f, in_f // 64)) * 0.02 + 0.01).astype(mx.float16)
        out.append((codes, scales))
    mx.eval(out)
    return out


def bench(m: int, out_f: int, in_f: int, widths, reference_too: bool) -> dict:
    row = {"tokens": m, "shape": f"{out_f}x{in_f}", "flops": 2 * m * out_f * in_f}
    x = (mx.random.normal((m, in_f)) * 0.5).astype(mx.bfloat16)
    dense = [(mx.random.normal((out_f, in_f)) * 0.02).astype(mx.bfloat16) for _ in range(PER_EVAL)]
    mx.eval(x, dense)
    row["bf16"] = _time(lambda: [x @ w.T for w in dense])
    for bits in (3, 4):
        qs = [mx.quantize(w, group_size=64, bits=bits) for w in dense]
        mx.eval(qs)
        row[f"affine{bits}"] = _time(lambda: [
            mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=bits) for q in qs])
    matmul = dispatch.get("matmul")
    for bits in widths:
        ws = tq_weights(out_f, in_f, bits, PER_EVAL)
        row[f"tq{bits}"] = _time(lambda: [
            matmul(x, c, s, bits, 64, out_f, in_f) for c, s in ws])
        if dispatch.backend() == "cuda":
            from turboquant.kernels import cuda_dequant

            row[f"tq{bits}-decode"] = _time(lambda: [
                cuda_dequant.dequantize(c, s, bits, 64, in_f) for c, s in ws])
        if bits == 3 and reference_too:
            row["tq3-ref"] = _time(lambda: [
                reference.tq_matmul(x, c, s, bits, 64, out_f, in_f) for c, s in ws], reps=2)
    return row


def print_row(row: dict) -> None:
    ms = {k: v * 1e3 for k, v in row.items() if isinstance(v, float)}
    cells = "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
    tq3 = ms.get("tq3")
    ratios = ""
    if tq3:
        ratios = (f"  | tq3 {ms['affine4'] / tq3:.2f}x of affine4, {ms['affine3'] / tq3:.2f}x of "
                  f"affine3, {ms['bf16'] / tq3:.2f}x of bf16, {row['flops'] / tq3 / 1e9:.1f} TFLOP/s")
    print(f"M={row['tokens']:>5} {row['shape']:>11} ms: {cells}{ratios}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 2048])
    ap.add_argument("--bits", nargs="+", default=["2", "3", "4"],
                    help="TurboQuant widths (2, 3, 4, ternary)")
    ap.add_argument("--no-reference", action="store_true", help="skip the float32 reference GEMM")
    ap.add_argument("--small", action="store_true", help="small shapes (a smoke test on the CPU)")
    args = ap.parse_args()
    widths = [b if b == "ternary" else int(b) for b in args.bits]
    shapes = [(256, 512), (512, 256)] if args.small else SHAPES
    print(f"device {mx.default_device()}, backend {dispatch.backend()}, "
          f"matmul: {dispatch.describe()['matmul']}")
    for m in args.tokens:
        for out_f, in_f in shapes:
            print_row(bench(m, out_f, in_f, widths, not args.no_reference))
    print("reproduce: python benchmarks/prefill.py --tokens " + " ".join(map(str, args.tokens)))


if __name__ == "__main__":
    main()

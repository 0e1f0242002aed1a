"""One token's attention over a KV buffer: `kernels/cuda_attend.py` against MLX's sdpa.

The kernel reads the whole buffer's rows up to a position given as an array (what the
whole decode step, `runtime/whole_step.py`, needs); MLX's
`mx.fast.scaled_dot_product_attention` gets the buffer sliced to the same rows. Llama-3-8B
heads (32 query heads, 8 KV heads of 128, bf16), one sequence; `--calls` independent
calls an evaluation, so launch overhead is amortised the same way for both.

`--compiled` instead times `--calls` kernel launches inside one `mx.compile`d function,
its first call (trace and JIT compiles) apart from the timed ones. On 2026-12-01 such a
function did not finish on the H200 (graphs on or off, within 20-80 s; the uncompiled
calls and the whole step's one launch a layer did), but its queries were then `q + i`
inside the function: scalar constants, which MLX's CUDA backend writes into the source of
the elementwise kernels it fuses, so possibly one NVRTC compile per call rather than a
hang. The queries are the function's inputs now. `--give-up S` prints where it waits
after S seconds and exits, so a run records a hang instead of eating its time limit.

Reproduce (GPU machine, MLX CUDA build):  python benchmarks/attention.py [--compiled]
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import time

import mlx.core as mx

SIZES = (1024, 4096, 32768)


def timed(run, repeats: int = 7) -> float:
    """Median seconds of `run()` after one call to warm up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def buffers(size: int):
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, size, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, size, 128)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    return q, k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=64, help="independent calls an evaluation")
    ap.add_argument("--compiled", action="store_true",
                    help="time the kernel's calls inside one compiled function instead")
    ap.add_argument("--merge", choices=["block", "launch"], default=None,
                    help="how the kernel merges a buffer's chunks (TURBOQUANT_CUDA_ATTEND_MERGE)")
    ap.add_argument("--give-up", type=float, default=60, metavar="S",
                    help="dump the stack and exit after S seconds (0: never)")
    args = ap.parse_args()
    if args.give_up:
        faulthandler.dump_traceback_later(args.give_up, exit=True)
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        raise SystemExit("benchmarks/attention.py times the CUDA kernel: run it on a GPU "
                         "machine with MLX's CUDA build")
    from turboquant.kernels import cuda_attend
    from turboquant.runtime import fuse

    if args.merge:
        cuda_attend.MERGE = args.merge
    n, scale = args.calls, 128 ** -0.5
    for size in SIZES:
        q, k, v = buffers(size)
        for row in (size // 4, size - 1):
            # as the whole step passes it: not a host-made scalar (MLX's pool of <= 8-byte
            # arrays stalled every launch ~15 us reading one, 2026-12-04)
            position = fuse._offset_array(row)
            mx.eval(position)

            def ours():
                mx.eval([cuda_attend.buffer_attention(q + i, k, v, position, scale, slot=i)
                         for i in range(n)])

            if args.compiled:
                queries = [q + i for i in range(n)]
                mx.eval(queries)
                step = mx.compile(lambda p, *qs: [
                    cuda_attend.buffer_attention(x, k, v, p, scale, slot=i)
                    for i, x in enumerate(qs)])
                print(f"buffer {size:6d}, position {row:6d}: compiled ...", flush=True)
                start = time.perf_counter()
                mx.eval(step(position, *queries))
                first = time.perf_counter() - start
                took = timed(lambda: mx.eval(step(position, *queries))) / n
                print(f"{'':>33} first call {first:.2f} s, then {took * 1e6:7.1f} us a call",
                      flush=True)
                continue

            def theirs():
                mx.eval([mx.fast.scaled_dot_product_attention(
                    q + i, k[:, :, :row + 1], v[:, :, :row + 1], scale=scale) for i in range(n)])

            a, b = timed(ours) / n, timed(theirs) / n
            print(f"buffer {size:6d}, position {row:6d}: kernel {a * 1e6:7.1f} us, "
                  f"sdpa {b * 1e6:7.1f} us a call (kernel {b / a:.2f}x)", flush=True)
    print(f"reproduce: python benchmarks/attention.py --calls {n} --merge {cuda_attend.MERGE}"
          f"{' --compiled' if args.compiled else ''} (GPU machine, MLX CUDA build)")


if __name__ == "__main__":
    main()

"""`turboquant plan`: projected against measured peak memory, and the time to plan 235B.

1. Converts the two reference models (reference/models/pystd-dense, pystd-moe) with the
   pipeline, runs each in a fresh process at several contexts (prefill, then generation,
   through mlx-lm's stream_generate as `turboquant generate` does) and compares MLX's peak
   memory with plan's projection (weights + KV cache + workspace). Target: within 15%.
2. Writes Qwen3-235B-A22B's layout (exact names and shapes, 118 shards, sparse files) and
   times the plan: in process (headers + projection) and the whole CLI in a subprocess.
   Target: under 5 s.

    python benchmarks/plan.py                         # contexts 256 1024 2048
    python benchmarks/plan.py --contexts 512 4096 --new-tokens 8

CPU numbers; the workspace model is fitted to MLX's CPU backend (pipeline/fit.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_plan_big import write_qwen3_235b_layout  # noqa: E402
from test_plan_measured import convert_reference, measure_peak, projected_peak  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--skip-measure", action="store_true")
    args = p.parse_args(argv)
    print(f"reproduce: python benchmarks/plan.py --contexts {' '.join(map(str, args.contexts))}"
          f" --new-tokens {args.new_tokens}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not args.skip_measure:
            print("\nmodel         context  projected MB  measured MB   ratio")
            for name in ("pystd-dense", "pystd-moe"):
                repo = convert_reference(name, tmp / name)
                for ctx in args.contexts:
                    m = measure_peak(repo, ctx, args.new_tokens)
                    peak, _ = projected_peak(repo, ctx)
                    ratio = peak / m["peak"]
                    worst = max(worst, abs(ratio - 1))
                    print(f"{name:<13} {ctx:>7}  {peak / 1e6:>12.2f}  {m['peak'] / 1e6:>11.2f}"
                          f"   {ratio:.3f}")
            print(f"largest difference: {worst:.1%} (target: within 15%)")

        big = tmp / "Qwen3-235B-A22B"
        t = time.perf_counter()
        total = write_qwen3_235b_layout(big)
        print(f"\nQwen3-235B-A22B layout: {total / 2 / 1e9:.1f}B parameters, "
              f"{total / 1e9:.0f} GB of bf16 in 118 sparse shards "
              f"({sum(f.stat().st_blocks * 512 for f in big.iterdir()) / 1e6:.1f} MB on disk), "
              f"written in {time.perf_counter() - t:.1f} s")
        from turboquant.pipeline.fit import GB, Machine, project
        from turboquant.pipeline.fit_weights import inventory
        from turboquant.pipeline.sources import LocalSource

        t = time.perf_counter()
        proj = project(inventory(LocalSource(big)), 4096, Machine("cpu", 24 * GB, "24 GB"))
        inproc = time.perf_counter() - t
        cmd = [sys.executable, "-m", "turboquant.plan", str(big), "--memory-gb", "24",
               "--backend", "cpu"]
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        cli = time.perf_counter() - t
        print(f"plan (headers + projection, in process): {inproc:.2f} s; whole CLI "
              f"(python start, imports, suggestions): {cli:.2f} s (target: under 5 s)")
        print(f"verdict at 24 GB, 4096 tokens: {proj.summary()}")
        if r.returncode not in (0, 1):
            print(r.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

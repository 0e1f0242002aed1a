"""Time to first token of a new process: TurboQuant 3-bit against mlx-lm's affine 4-bit.

Each run is a fresh Python process that builds the model (8B-shaped Llama, random
weights: `decode.build`) and then generates through mlx-lm's `generate_step`, as
`turboquant generate` does; it reports the seconds from the call to the first token
(the prompt's prefill: its kernels compiled on first use), to the second (the first
decode step: the decode kernels compiled), and the build before. Each variant runs in two
processes one after the other, sharing one compiled-kernel cache folder made empty for
the benchmark: the first process is a machine's first run, the second one what every
later process pays. With TURBOQUANT_KERNEL_CACHE=1 (`--kernel-cache on`) TurboQuant's
kernels come from that folder in the second process (kernels/compiled.py); off, MLX
compiles them in every process. The ratios are against affine-4's process of the same
order.

Reproduce (GPU machine, MLX CUDA build):
  python benchmarks/first_token.py --kernel-cache on
  python benchmarks/first_token.py --kernel-cache off
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(variant: str, tiny: bool, prompt_tokens: int) -> dict:
    """One process's figures (run in the fresh process)."""
    start = time.perf_counter()
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    import decode

    if tiny:
        decode.LLAMA3_8B.update(decode.TINY_LLAMA)
    imported = time.perf_counter()
    model = decode.build(variant)
    built = time.perf_counter()
    prompt = mx.array([(7 * i + 3) % 500 + 1 for i in range(prompt_tokens)])
    times = []
    t0 = time.perf_counter()
    for token, _ in generate_step(prompt, model, max_tokens=3,
                                  prompt_cache=make_prompt_cache(model)):
        times.append(time.perf_counter() - t0)
    return dict(variant=variant, import_s=imported - start, build_s=built - imported,
                first_token_s=times[0], second_token_s=times[1] - times[0],
                third_token_s=times[2] - times[1])


def run(variant: str, args, env: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant,
           "--prompt-tokens", str(args.prompt_tokens)] + (["--tiny"] if args.tiny else [])
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"first_token.py: {variant} failed:\n{out.stderr[-3000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    figures["process_s"] = wall
    figures["said"] = [line for line in out.stderr.splitlines() if "turboquant:" in line]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="affine4,tq3")
    ap.add_argument("--kernel-cache", choices=("on", "off"), default=None,
                    help="TURBOQUANT_KERNEL_CACHE for the processes (default: as set here)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke run on the CPU)")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tiny, args.prompt_tokens)))
        return
    env = dict(os.environ)
    if args.kernel_cache is not None:
        env["TURBOQUANT_KERNEL_CACHE"] = "1" if args.kernel_cache == "on" else "0"
    rows = []
    with tempfile.TemporaryDirectory(prefix="tq_first_token_") as folder:
        env["TURBOQUANT_CACHE_DIR"] = folder  # empty: the first process is a first run
        for order in (1, 2):
            for variant in args.variants.split(","):
                rows.append(dict(run(variant, args, env), order=order))
    cache = env.get("TURBOQUANT_KERNEL_CACHE", "0")
    print(f"time to first token, fresh process each (TURBOQUANT_KERNEL_CACHE={cache}, "
          f"{'2-layer' if args.tiny else '8B-shaped'} Llama, {args.prompt_tokens}-token prompt)")
    print(f"{'variant':>8} {'process':>7} {'import s':>9} {'build s':>8} {'1st token s':>12} "
          f"{'2nd token s':>12} {'3rd token s':>12} {'process s':>10} {'1st / affine4':>14}")
    peers = {r["order"]: r for r in rows if r["variant"] == "affine4"}
    for r in rows:
        peer = peers.get(r["order"])
        ratio = f"{r['first_token_s'] / peer['first_token_s']:.2f}x" if peer else "-"
        print(f"{r['variant']:>8} {r['order']:>7} {r['import_s']:>9.2f} {r['build_s']:>8.2f} "
              f"{r['first_token_s']:>12.3f} {r['second_token_s']:>12.3f} "
              f"{r['third_token_s']:>12.3f} {r['process_s']:>10.2f} {ratio:>14}")
    for r in rows:
        for line in r["said"]:
            print(f"  {r['variant']} process {r['order']} said: {line}")
    kc = f" --kernel-cache {'on' if cache == '1' else 'off'}"
    print("command: python benchmarks/first_token.py" + kc + (" --tiny" if args.tiny else "")
          + (f" --variants {args.variants}" if args.variants != "affine4,tq3" else ""))


if __name__ == "__main__":
    main()

"""A decode's steady tokens, bracketed for a GPU profiler, as mlx-lm's `generate_step` runs
them (the next token built while this one evaluates).

Builds decode.py's model (Llama-3-8B shape, `--layers` of it), prefills `--context`
tokens, decodes a round to warm up (kernels compiled, buffer sizes traced), then a second
round with `cuProfilerStart` / `cuProfilerStop` around `--tokens` tokens after the 16th.
Under ncu, every kernel of those tokens with its GPU time (a profile on 2026-12-04 found the position
stall this way):

  ncu --profile-from-start off --cache-control none --clock-control none \\
      --metrics gpu__time_duration.sum --print-summary per-kernel --csv \\
      python3 tools/decode_ncu.py --variant tq3-whole --context 4096 --layers 8

(`--cache-control none --clock-control none`: warm caches and the GPU's own clocks, as in
a decode; ncu's defaults flush the caches before every kernel.) The ms a token it prints
are the round's before the range: under ncu they are ncu's launch overhead, not decode
speed (decode.py measures that). Without the CUDA driver (here: the CPU) the range is
skipped.  Reproduce: python tools/decode_ncu.py --tiny (a smoke run on the CPU)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode  # noqa: E402  (benchmarks/decode.py: its model shapes and profiler range)

WARM = 16  # tokens of the profiled round before the range opens


def decode_round(model, prompt: mx.array, tokens: int, profiled: bool) -> float:
    """Seconds a token over the WARM tokens before the range (the first, prefill's, left
    out); with `profiled`, the profiler range around the `tokens` after them."""
    stamps = []
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=WARM + tokens + 2,
                                        sampler=make_sampler(0.0))):
        stamps.append(time.perf_counter())
        if profiled and i == WARM:
            decode.cuda_profiler(True)
        if profiled and i == WARM + tokens:
            decode.cuda_profiler(False)
    steady = stamps[1:WARM + 1]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="tq3",
                    help="a decode.py variant (tq3: the defaults; tq3-whole, tq3-layers, affine4, ...)")
    ap.add_argument("--context", type=int, default=16, help="prompt tokens")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B shape")
    ap.add_argument("--tokens", type=int, default=4, help="tokens inside the profiler range")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer small model (CPU smoke run)")
    args = ap.parse_args()
    decode.LLAMA3_8B.update(num_hidden_layers=args.layers)
    if args.tiny:
        decode.LLAMA3_8B.update(decode.TINY_LLAMA)
    with decode.variant_switches(args.variant):
        model = decode.build(args.variant)
        prompt = mx.array([i % 250 + 1 for i in range(args.context)])
        for profiled in (False, True):
            took = decode_round(model, prompt, args.tokens, profiled)
            print(f"{args.variant}, {args.context}-token prompt, "
                  f"{decode.LLAMA3_8B['num_hidden_layers']} layers"
                  f"{' (profiled round)' if profiled else ''}: {took * 1e3:.2f} ms a token",
                  flush=True)
    print(f"reproduce: python tools/decode_ncu.py --variant {args.variant} --context "
          f"{args.context} --layers {args.layers} --tokens {args.tokens}"
          f"{' --tiny' if args.tiny else ''}")


if __name__ == "__main__":
    main()

"""Decode speed on MLX's CPU backend: TurboQuant (compiled GEMV and pure-MLX reference)
against mlx-lm's bf16 and affine 4-bit, on the bundled reference model, in one run.

A bundled reference model (`--model`: pystd-dense, 8.4M parameters, or pystd-moe) is
converted at 3 bits (recipe default) into a temporary folder with `turboquant convert --no-prefect`,
then each variant decodes `--tokens` tokens greedily (the compiled GEMVs of
kernels/cpu.py, dense and gathered experts, or the pure-MLX reference) after the same prompt through mlx-lm's
`generate_step`; the figure is tokens/s after the first token.

`--prefill N` also times each variant's processing of an N-token prompt (the cache
evaluated, as mlx-lm's prefill does).

Reproduce:  python benchmarks/cpu_decode.py [--tokens 64] [--model pystd-moe] [--prefill 512]
            python benchmarks/cpu_decode.py --gemv   # one GEMV: the kernel vs MLX affine
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from turboquant.kernels import dispatch
from turboquant.runtime import load

import decode  # noqa: E402  (benchmarks/decode.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "reference" / "models"
PROMPT = "def read_config(path):\n"


def tokens_per_second(model, tokenizer, tokens: int) -> float:
    prompt = mx.array(tokenizer.encode(PROMPT))
    t0 = None
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=tokens,
                                        sampler=make_sampler(0.0))):
        if i == 0:
            t0 = time.perf_counter()
    return (tokens - 1) / (time.perf_counter() - t0)


def measure(model, tokenizer, tokens: int) -> float:
    tokens_per_second(model, tokenizer, 8)  # warm up (compiles kernels)
    return tokens_per_second(model, tokenizer, tokens)


def prefill_tps(model, tokens: int, repeats: int = 3) -> float:
    """Prompt tokens per second of a `tokens`-long prompt, the cache evaluated as mlx-lm's
    prefill evaluates it (not the logits): decode.py's measure."""
    return decode.prefill_tps(model, tokens, repeats, cache_only=True)


def gemv_table(shapes=((1024, 4096), (4096, 4096)), reps: int = 20) -> None:
    """One token's GEMV on the CPU: the compiled TurboQuant kernel (numba) against MLX's
    affine `quantized_matmul` at the same bits, microseconds per product, same run."""
    import numpy as np

    from turboquant.kernels import cpu_gemv, reference
    from turboquant.stages import encode

    def best(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e6

    print("CPU GEMV, one token, microseconds (best of %d)" % reps)
    for out_f, in_f in shapes:
        w = mx.random.normal((out_f, in_f)) * 0.02
        x = mx.random.normal((1, in_f))
        for bits in (2, 3, 4):
            qt = encode(w, bits, 64, seed=1)
            args = (np.asarray(x), np.asarray(qt.codes), np.asarray(qt.scales),
                    np.asarray(reference.levels(bits)), bits, 64)
            tq = best(lambda: cpu_gemv.gemv(*args))
            wq, sc, bi = mx.quantize(w, group_size=64, bits=bits)
            affine = best(lambda: mx.eval(mx.quantized_matmul(x, wq, sc, bi, transpose=True,
                                                              group_size=64, bits=bits)))
            print(f"  {out_f}x{in_f} {bits}-bit: TurboQuant {tq:8.1f}  MLX affine {affine:8.1f}"
                  f"  ({affine / tq:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="pystd-dense", choices=["pystd-dense", "pystd-moe"])
    ap.add_argument("--gemv", action="store_true", help="only the GEMV table (against MLX "
                    "affine quantized_matmul)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also time each variant's prefill of an N-token prompt")
    args = ap.parse_args()
    if args.gemv:
        mx.set_default_device(mx.cpu)
        gemv_table()
        return
    model_dir = MODELS / args.model
    mx.set_default_device(mx.cpu)
    results, prefills = {}, {}

    def run(name, model, tok):
        results[name] = measure(model, tok, args.tokens)
        if args.prefill:
            prefills[name] = prefill_tps(model, args.prefill)

    model, tok = mlx_lm_load(str(model_dir))
    try:
        run("mlx-lm bf16", model, tok)
    except RuntimeError as e:  # MLX's CPU gather_mm (MoE experts) takes float32 only
        print(f"mlx-lm bf16: {e}; the unquantized peer runs in float32")
        model.set_dtype(mx.float32)
        run("mlx-lm float32", model, tok)
    nn.quantize(model, group_size=64, bits=4)
    run("mlx-lm affine-4", model, tok)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tq3"
        subprocess.run([sys.executable, "-m", "turboquant", "convert", str(model_dir), str(out),
                        "--bits", "3", "--no-prefect", "-q"], check=True)
        model, tok = load(out)
        run("turboquant 3-bit (CPU GEMV)", model, tok)
        ops = ("matvec", "matmul", "gather_matmul", "linear_group")
        kernels = {op: dispatch.registered("cpu", op) for op in ops}
        for op in kernels:
            dispatch.unregister("cpu", op)
        try:
            run("turboquant 3-bit (reference)", model, tok)
        finally:
            for op, kernel in kernels.items():
                if kernel is not None:
                    dispatch.register("cpu", op, kernel)
    print(f"CPU decode, {model_dir.name}, {args.tokens} tokens, greedy (tokens/s after the first)")
    peer = results["mlx-lm affine-4"]
    for name, tps in results.items():
        print(f"  {name:>30}: {tps:8.1f} tok/s  ({tps / peer:.2f}x affine-4)")
    if prefills:
        print(f"CPU prefill of a {args.prefill}-token prompt (prompt tokens/s, median of 3)")
        peer = prefills["mlx-lm affine-4"]
        for name, tps in prefills.items():
            print(f"  {name:>30}: {tps:8.1f} tok/s  ({tps / peer:.2f}x affine-4)")
    prefill = f" --prefill {args.prefill}" if args.prefill else ""
    print(f"reproduce: python benchmarks/cpu_decode.py --model {args.model}{prefill}")


if __name__ == "__main__":
    main()

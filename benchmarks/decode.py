"""End-to-end decode speed of an 8B-shaped Llama: TurboQuant vs mlx-lm affine vs bf16.

`--moe`: a Qwen3-30B-A3B-shaped MoE instead (hidden 2048, 128 experts of 768, top 8, 32/4
heads of 128; `--layers` of its 48 decoder layers, 12 by default), the experts as
`TQSwitchLinear` (a decode step's experts through the "gather_matmul" kernel: on CUDA one
GEMV launch over the step's (token, expert) pairs) against mlx-lm's affine
`QuantizedSwitchLinear`. `--moe gpt-oss`: a gpt-oss-120b-shaped MoE (hidden 2880, 128
experts of 2880, top 4, 64/8 heads of 64, sliding and full attention alternating, learned
sinks; biases on the attention, router and experts), `--layers` of its 36.

The model has Llama-3-8B's shapes (32 layers, hidden 4096, MLP 14336, 32/8 heads, vocab
128256) and random weights (speed does not depend on their values). Three variants are
built in turn in the same run: bf16; mlx-lm's affine 4-bit (`nn.quantize`, group 64); and
TurboQuant 3-bit, every decoder Linear replaced by `TQLinear` with random codes. Embeddings
and lm_head stay bf16 in all three. Each variant decodes `--tokens` tokens after a short
prompt through mlx-lm's `generate_step`; the figure is tokens/s after the first token
(`--token-times` adds each variant's per-token percentiles: steady or stalling;
`--context N` makes the prompt N tokens, so each decoded token attends over N and more).
`--prefill N` also times each variant's processing of an N-token prompt (prompt tokens/s,
the median of 3 after one to warm up): prefill runs TurboQuant's "matmul" op (more than 8
tokens a linear), not the decode kernels.

Reproduce (GPU machine, MLX CUDA build):  python benchmarks/decode.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics

import mlx.core as mx
import mlx.nn as nn
import time

from mlx_lm.generate import generate_step
from mlx_lm.models import gpt_oss, llama, qwen3_moe
from mlx_lm.sample_utils import make_sampler

from turboquant.kernels import cuda, cuda_attend, dispatch
from turboquant.runtime import fuse, whole_step
from turboquant.runtime.fuse import fuse_blocks, group_linears
from turboquant.runtime.layers import TQLinear, TQSwitchLinear, padded
from turboquant.kernels.reference import words_per_row

LLAMA3_8B = dict(
    model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=128256,
    rope_theta=500000.0, tie_word_embeddings=False,
)


QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=12, intermediate_size=6144,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=151936,
    rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=40960,
)

GPT_OSS_120B = dict(
    model_type="gpt_oss", hidden_size=2880, num_hidden_layers=12, intermediate_size=2880,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
    num_experts_per_tok=4, sliding_window=128, rope_theta=150000, rms_norm_eps=1e-5,
    vocab_size=201088,
)

# --tiny: 2-layer models of the same families (smoke runs on the CPU)
TINY_LLAMA = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
TINY_MOE = dict(num_hidden_layers=2, hidden_size=256, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, vocab_size=512)
TINY_GPT_OSS = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=128,
                    num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=512, sliding_window=16)


def _random_codes(lead: tuple, in_f: int, b: int) -> tuple[mx.array, mx.array]:
    """Random codes (*lead, words) and scales (*lead, groups) of a width-in_f weight."""
    p = padded(in_f, 64)
    codes = mx.random.randint(0, 2**31 - 1, (*lead, words_per_row(p, b))).astype(mx.uint32) * 2 + 1
    scales = (mx.random.uniform(shape=(*lead, p // 64)) * 0.02 + 0.01).astype(mx.float16)
    return codes, scales


def moe_model(moe) -> nn.Module:
    """The --moe model of random weights: "gpt-oss" its shape, anything else true Qwen3's."""
    if moe == "gpt-oss":
        args = dict(GPT_OSS_120B)
        args["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(args["num_hidden_layers"])]
        return gpt_oss.Model(gpt_oss.ModelArgs.from_dict(args))
    return qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(QWEN3_30B_A3B))


def build(variant: str, bits: int = 3, moe=False) -> nn.Module:
    """A model of random weights as `variant`; `moe`: False (the 8B Llama), True or "qwen3"
    (the Qwen3-30B-A3B shape), "gpt-oss" (the gpt-oss-120b shape)."""
    if moe:
        model = moe_model(moe)
    else:
        model = llama.Model(llama.ModelArgs.from_dict(LLAMA3_8B))
    model.set_dtype(mx.bfloat16)
    if variant.startswith("affine"):
        nn.quantize(model, group_size=64, bits=int(variant[len("affine")]),
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and p != "lm_head"
                    and not isinstance(m, nn.Embedding))
    elif variant.startswith("tq"):
        b = int(variant[2])

        def swap(path, m):
            seed = hash(path) % 2**31
            if type(m).__name__ == "SwitchLinear":
                n_experts, out_f, in_f = m.weight.shape
                layer = TQSwitchLinear(in_f, out_f, n_experts, "bias" in m, bits=b,
                                       group_size=64, seed=seed)
                layer.codes, layer.scales = _random_codes((n_experts, out_f), in_f, b)
                return layer
            if not isinstance(m, nn.Linear) or path == "lm_head":
                return m
            out_f, in_f = m.weight.shape
            layer = TQLinear(in_f, out_f, "bias" in m, bits=b, group_size=64, seed=seed)
            layer.codes, layer.scales = _random_codes((out_f,), in_f, b)
            return layer

        leaves = [(path, m) for path, m in model.named_modules()]
        for path, m in leaves:
            new = swap(path, m)
            if new is not m:
                parent_path, _, name = path.rpartition(".")
                parent = model if not parent_path else dict(model.named_modules())[parent_path]
                setattr(parent, name, new)
        if "-single" not in variant:
            group_linears(model)  # q/k/v and gate/up as one kernel, as runtime.load does on CUDA
        if "-single" not in variant and "-grouped" not in variant and fuse.BLOCKS:
            fuse_blocks(model)  # norms, SwiGLU and residuals in the kernels, as runtime.load does
            whole_step.enable(model)  # where WHOLE_STEP (the call checks it; -whole)
    mx.eval(model.parameters())
    return model


@contextlib.contextmanager
def reference_kernel(op: str, on: bool):
    """While inside (when `on`), `op` runs through the pure-MLX reference on this backend."""
    kernel = dispatch.registered(dispatch.backend(), op) if on else None
    if kernel is not None:
        dispatch.unregister(dispatch.backend(), op)
    try:
        yield
    finally:
        if kernel is not None:
            dispatch.register(dispatch.backend(), op, kernel)


@contextlib.contextmanager
def switched(module, name: str, value: bool | None):
    """While inside, the runtime switch `module.name` (cuda.COMPACT_GATHER,
    fuse.COMPILE_STEP) is `value`; None leaves it as the environment set it."""
    saved = getattr(module, name)
    setattr(module, name, saved if value is None else value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def variant_switches(variant: str):
    """While inside, the runtime switches a variant's suffixes name (see --variants)."""
    with reference_kernel("gather_matmul", "-refgather" in variant), \
            reference_kernel("matmul", "-refmatmul" in variant), \
            switched(cuda, "GATHER_MM", True if "-gathermm" in variant
                     else False if "-perexpert" in variant else None), \
            switched(cuda, "COMPACT_GATHER", True if "-compact" in variant
                     else False if "-broadcast" in variant else None), \
            switched(fuse, "COMPILE_STEP", True if "-compiled" in variant
                     else False if "-eager" in variant else None), \
            switched(fuse, "ATTENTION", False if "-mlxattn" in variant else None), \
            switched(fuse, "ROPE", False if "-mlxrope" in variant else None), \
            switched(whole_step, "WHOLE_STEP", True if "-whole" in variant
                     else False if "-layers" in variant else None), \
            switched(whole_step, "MAX_CONTEXT", 0 if "-whole" in variant else None), \
            switched(cuda_attend, "MERGE", "launch" if "-joinmerge" in variant else None):
        yield


def cuda_profiler(start: bool) -> bool:
    """cuProfilerStart (or Stop) once the GPU is idle, for ncu's `--profile-from-start off`
    or nsys's `--capture-range=cudaProfilerApi`; False without the CUDA driver."""
    mx.synchronize()
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    (lib.cuProfilerStart if start else lib.cuProfilerStop)()
    return True


def token_gaps(model, tokens: int, prompt_len: int = 16) -> list[float]:
    """Seconds between consecutive generated tokens (greedy, mlx-lm's `generate_step`,
    which builds the next token's graph while the current one evaluates)."""
    prompt = mx.array(list(range(1, prompt_len + 1)))
    stamps = [time.perf_counter() for _ in generate_step(prompt, model, max_tokens=tokens,
                                                         sampler=make_sampler(0.0))]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def decode_tps(model, tokens: int, prompt_len: int = 16) -> float:
    """Generated tokens per second after the first (prefill excluded), greedy."""
    return tokens_per_second(token_gaps(model, tokens, prompt_len))


def tokens_per_second(gaps: list[float]) -> float:
    """Tokens per second over these gaps between tokens (0 for none: one token made)."""
    return len(gaps) / sum(gaps) if gaps else 0.0


def round_ratios(results: dict[str, list[float]], peer: str = "affine4") -> dict:
    """Each variant's tokens/s over the peer's, round by round (the k-th run of a variant
    against the peer's k-th: variants listed in turn take turns with it), for variants
    with as many rounds as the peer or fewer; none without the peer."""
    if peer not in results:
        return {}
    return {v: [t / p for t, p in zip(runs, results[peer])] for v, runs in results.items()}


def describe_gaps(gaps: list[float]) -> str:
    """Percentiles of the per-token times in ms, and how many tokens took over 1.25x the
    median: whether a slow run is slow throughout or stalls now and then."""
    ms = sorted(g * 1e3 for g in gaps)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    slow = sum(m > 1.25 * pick(0.5) for m in ms)
    return (f"token ms p10 {pick(0.1):.2f} p50 {pick(0.5):.2f} p90 {pick(0.9):.2f} "
            f"max {ms[-1]:.2f}, {slow}/{len(ms)} over 1.25x the median")


def split_ms(model, steps: int = 32, prompt_len: int = 16) -> tuple[float, float]:
    """(ms building a token's graph, ms evaluating it), a token at a time (no overlap of
    the next token's building with this one's evaluation, unlike `generate_step`)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([list(range(1, prompt_len + 1))]), cache=cache)
    y = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(y)
    build = total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        t1 = time.perf_counter()
        mx.eval(y)
        build, total = build + t1 - t0, total + time.perf_counter() - t0
    return 1e3 * build / steps, 1e3 * (total - build) / steps


def prefill_tps(model, tokens: int, repeats: int = 3, cache_only: bool = False) -> float:
    """Prompt tokens per second of one `tokens`-long prompt into a fresh cache: the median
    of `repeats` timed runs after one that warms up (kernels compiled, layouts built).
    The logits are evaluated, or with `cache_only` only the cache, as mlx-lm's prefill
    does (benchmarks/cpu_decode.py)."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([[i % 250 + 1 for i in range(tokens)]])
    seconds = []
    for _ in range(repeats + 1):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        logits = model(prompt, cache=cache)
        mx.eval([c.state for c in cache] if cache_only else logits)
        seconds.append(time.perf_counter() - start)
    return tokens / statistics.median(seconds[1:])


def check_layer(bits: int = 3, out_f: int = 512, in_f: int = 1000) -> float:
    """Max relative difference of a TQLinear through the dispatched kernel vs the reference."""
    from turboquant.kernels import reference
    from turboquant.stages import encode

    w = mx.random.normal((out_f, in_f))
    layer = TQLinear.from_quantized(encode(w, bits, 64, seed=7))
    x = mx.random.normal((1, in_f))
    got = layer(x)
    want = reference.tq_matvec(layer.rotate_input(x), layer.codes, layer.scales, bits, 64,
                               out_f, layer.padded_in)
    return float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)))


def run_variant(model, args, first: bool = False) -> list[float] | None:
    """Per-token seconds of a decode after a warm-up (`token_gaps`); None when --profile
    printed a profile instead. The `first` variant of a process warms up as long as it
    is timed: on the H200 a process's first round ran 35-45% slower than its others
    (2026-12-01: affine-4 77 and 93 tok/s, then 126-155), which skewed its ratios."""
    # compile kernels, build layouts (and trace the buffer sizes the timed decode meets)
    decode_tps(model, max(8, args.tokens) if first else 8, args.context)
    if not args.profile:
        return token_gaps(model, args.tokens, args.context)
    import cProfile
    import pstats

    with cProfile.Profile() as prof:
        decode_tps(model, 32)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--variants", default="bf16,affine4,tq3,tq4,tq3-grouped,tq3-single",
                    help="tqN: as loaded (grouped q/k/v and gate/up, fused decoder blocks); "
                         "tqN-grouped: grouped, mlx-lm's blocks; "
                         "tqN-single: one kernel per linear; "
                         "a -refgather suffix runs the experts through the pure-MLX gather, "
                         "-refmatmul prefill's products through the pure-MLX GEMM, "
                         "-gathermm / -perexpert prefill's experts decoded in one launch "
                         "and multiplied by MLX's gather_mm (GATHER_MM, the default) / "
                         "one tiled product per expert in use, "
                         "-compact / -broadcast through the compact / broadcast gathered "
                         "path (COMPACT_GATHER), "
                         "-compiled / -eager with fused blocks' single-token step compiled "
                         "or built op by op (COMPILE_STEP), "
                         "-mlxattn with their single-token attention through mlx-lm's "
                         "Attention (ATTENTION off), "
                         "-mlxrope with RoPE as mlx-lm's op after the q/k/v launch "
                         "(ROPE off), "
                         "-whole with a token's step compiled whole at any context "
                         "(the default, unless TURBOQUANT_WHOLE_STEP_MAX_CONTEXT sets a "
                         "limit), -layers with it compiled per layer around mlx-lm's "
                         "cache (TURBOQUANT_WHOLE_STEP=0), -joinmerge with that attention's chunks merged by a "
                         "second launch (TURBOQUANT_CUDA_ATTEND_MERGE=launch)")
    ap.add_argument("--context", type=int, default=16, metavar="N",
                    help="prompt tokens before the timed decode (each token then attends "
                         "over N and more)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also time each variant's prefill of an N-token prompt")
    ap.add_argument("--token-times", action="store_true",
                    help="also print each variant's per-token time percentiles")
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test on CPU)")
    ap.add_argument("--moe", nargs="?", const="qwen3", default=False, choices=["qwen3", "gpt-oss"],
                    help="an MoE instead: the Qwen3-30B-A3B shape (the default) or gpt-oss-120b's")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers of the --moe model")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the host side of decoding (first variant only), top 30 by own time")
    ap.add_argument("--memory-limit-gb", type=float, default=0,
                    help="mx.set_memory_limit before building (MLX waits for work in flight "
                         "once its active memory passes the limit): the peak a machine with "
                         "that much memory would see")
    args = ap.parse_args()
    if args.memory_limit_gb:
        mx.set_memory_limit(int(args.memory_limit_gb * 2**30))
    limit = mx.get_memory_limit()
    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "(MLX default)")
    print(f"device {mx.default_device()}, kernels: {dispatch.describe()}, "
          f"MLX_USE_CUDA_GRAPHS={graphs}, "
          f"TurboQuant CUDA linears {'fused' if cuda.FUSED else 'unfused'}, "
          f"decoder blocks {'fused' if fuse.BLOCKS else 'as mlx-lm'}, "
          f"experts {'rotated in their launch' if cuda.FUSED_GATHER else 'rotated by MLX ops'}, "
          f"memory limit {limit / 2**30:.1f} GiB")
    for b in (2, 3, 4):
        print(f"TQLinear {b}-bit, dispatched vs reference: max rel. diff {check_layer(b):.2e}")
    QWEN3_30B_A3B.update(num_hidden_layers=args.layers)
    GPT_OSS_120B.update(num_hidden_layers=args.layers)
    if args.tiny:
        LLAMA3_8B.update(TINY_LLAMA)
        QWEN3_30B_A3B.update(TINY_MOE)
        GPT_OSS_120B.update(TINY_GPT_OSS)
    results: dict[str, list[float]] = {}  # variant -> tokens/s of each of its rounds
    prefills: dict[str, list[float]] = {}  # variant -> prompt tokens/s of each round
    for i, variant in enumerate(args.variants.split(",")):
        with variant_switches(variant):  # the model built inside: `load` reads some
            model = build(variant, moe=args.moe)
            gaps = run_variant(model, args, first=i == 0)
            if gaps is None:
                return
            building, evaluating = split_ms(model)
            peak = mx.get_peak_memory()
            if args.prefill:
                mx.reset_peak_memory()
                prefills.setdefault(variant, []).append(prefill_tps(model, args.prefill))
                prefill_peak = mx.get_peak_memory()
        tps = tokens_per_second(gaps)
        results.setdefault(variant, []).append(tps)
        print(f"{variant:>8}: {tps:7.1f} tok/s  (peak memory {peak / 1e9:.1f} GB; "
              f"a token at a time: {building:.2f} ms building + {evaluating:.2f} evaluating; "
              f"ended {time.strftime('%H:%M:%S')})", flush=True)
        if args.token_times:
            print(f"{'':>8}  {describe_gaps(gaps)}", flush=True)
        if args.prefill:
            print(f"{'':>8}  prefill of {args.prefill} tokens: {prefills[variant][-1]:.1f} "
                  f"prompt tok/s (peak memory {prefill_peak / 1e9:.1f} GB)", flush=True)
        del model
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
    for v, ratios in round_ratios(results).items():
        print(f"{v:>8} / affine4 = {', '.join(f'{r:.2f}' for r in ratios)}x by round "
              f"(median {statistics.median(ratios):.2f}x)")
    for v, ratios in round_ratios(prefills).items():
        print(f"prefill {v:>8} / affine4 = {', '.join(f'{r:.2f}' for r in ratios)}x by round "
              f"(median {statistics.median(ratios):.2f}x)")
    print("reproduce: python benchmarks/decode.py (GPU machine, MLX CUDA build)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

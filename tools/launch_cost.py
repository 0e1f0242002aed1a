"""Where decode time goes on the GPU: host cost per kernel call, per launch, per token.

Three measurements, all in one run on the GPU machine (MLX CUDA build):

1. graph building: microseconds of host time per call (no evaluation) for mlx-lm's
   `quantized_matmul`, `mx.fast.cuda_kernel` calls of growing size (template arguments,
   inputs, header length, outputs), a `precompiled_cuda_kernel` call, and this project's
   rotation and GEMV launches;
2. evaluation: microseconds per launch to evaluate a chain of 200 dependent tiny kernels
   (encoding plus the GPU running them back to back);
3. decode: one token of an 8B-shaped Llama cut to `--layers` layers, split into building
   the graph, `async_eval` (encoding) and waiting for the GPU, for affine-4 and TQ3.

Run it twice to compare CUDA graphs: `MLX_USE_CUDA_GRAPHS=0 python tools/launch_cost.py`
and `=1`. The figures locate host overhead; `benchmarks/decode.py` is the end-to-end figure.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # decode.py

CALLS = 2000
PROFILE = False  # --profile: cProfile the graph building of the timed decode tokens


class _BuildProfile:
    """cProfile around graph building only (one per variant), printed by own time."""

    def __init__(self, name: str):
        import cProfile

        self.name, self.prof = name, cProfile.Profile() if PROFILE else None

    def __enter__(self):
        if self.prof:
            self.prof.enable()

    def __exit__(self, *exc):
        if self.prof:
            self.prof.disable()

    def report(self, rows: int = 25):
        if self.prof:
            import pstats

            print(f"--- graph building of {self.name} (steady tokens only), by own time")
            pstats.Stats(self.prof).sort_stats("tottime").print_stats(rows)
            print(f"--- graph building of {self.name} (steady tokens only), by cumulative time")
            pstats.Stats(self.prof).sort_stats("cumulative").print_stats(rows)


def per_call_us(step, calls: int = CALLS) -> float:
    """Host microseconds per call of step() while only building the graph."""
    outs = []
    for _ in range(20):
        outs.append(step())
    mx.eval(outs)
    outs.clear()
    t0 = time.perf_counter()
    for i in range(calls):
        outs.append(step())
        if len(outs) == 200:  # bound the graph; evaluation is outside the timed region
            t1 = time.perf_counter()
            mx.eval(outs)
            outs.clear()
            t0 += time.perf_counter() - t1
    elapsed = time.perf_counter() - t0
    mx.eval(outs)
    return elapsed / calls * 1e6


def chain_us(step, x, length: int = 200, reps: int = 20) -> float:
    """Microseconds per link to evaluate a chain of `length` dependent calls (build excluded)."""
    best = float("inf")
    for _ in range(reps):
        y = x
        for _ in range(length):
            y = step(y)
        t0 = time.perf_counter()
        mx.eval(y)
        best = min(best, time.perf_counter() - t0)
    return best / length * 1e6


_TRIVIAL = "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < 1024) out0[i] = x0[i];\n"


def trivial_kernel(name, inputs=1, outputs=1, header=""):
    return mx.fast.cuda_kernel(
        name=name, input_names=[f"x{i}" for i in range(inputs)],
        output_names=[f"out{i}" for i in range(outputs)],
        source=_TRIVIAL + "".join(f"  if (i < 1024) out{o}[i] = x0[i];\n" for o in range(1, outputs)),
        header=header)


def graph_building() -> dict:
    rows = {}
    x = mx.random.normal((1024,))
    xb = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    q = mx.quantize(mx.random.normal((4096, 4096)).astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(x, xb, q)
    rows["quantized_matmul 4096x4096"] = per_call_us(
        lambda: mx.quantized_matmul(xb, *q, transpose=True, group_size=64, bits=4))
    rows["mx.add (builtin elementwise)"] = per_call_us(lambda: x + 1.0)
    common = dict(grid=(1024, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(1024,)],
                  output_dtypes=[mx.float32])
    k = trivial_kernel("probe_plain")
    rows["cuda_kernel: 1 in, 1 out, no template"] = per_call_us(lambda: k(inputs=[x], **common)[0])
    tmpl = [(f"T{i}", i + 1) for i in range(12)]
    rows["cuda_kernel: + 12 int template args"] = per_call_us(
        lambda: k(inputs=[x], template=tmpl, **common)[0])
    rows["cuda_kernel: + 1 dtype template arg"] = per_call_us(
        lambda: k(inputs=[x], template=[("OutT", mx.float16)], **common)[0])
    k8 = trivial_kernel("probe_8in", inputs=8)
    rows["cuda_kernel: 8 inputs"] = per_call_us(lambda: k8(inputs=[x] * 8, **common)[0])
    kh = trivial_kernel("probe_header", header="// " + "x" * 10000 + "\n")
    rows["cuda_kernel: 10 KB header"] = per_call_us(lambda: kh(inputs=[x], **common)[0])
    k3 = trivial_kernel("probe_3out", outputs=3)
    rows["cuda_kernel: 3 outputs"] = per_call_us(
        lambda: k3(inputs=[x], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
                   output_shapes=[(1024,)] * 3, output_dtypes=[mx.float32] * 3)[0])
    pre = precompiled_probe(x, common)
    if pre is not None:
        rows["precompiled_cuda_kernel: 1 in, 1 out, 1 scalar"] = per_call_us(pre)
    rows.update(project_launches())
    return rows


_SCALAR_HEADER = r"""
extern "C" __global__ void tq_probe_scalar(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i];
}
"""


def precompiled_probe(x, common):
    """A kernel with a scalar argument, compiled through cuda_kernel's JIT (the header
    holds it), its binary read back from MLX's cache and run by precompiled_cuda_kernel."""
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache:
        print("precompiled probe skipped: set MLX_PTX_CACHE_DIR")
        return None
    k = trivial_kernel("probe_scalar_host", header=_SCALAR_HEADER)
    mx.eval(k(inputs=[x], **common)[0])
    found = glob.glob(os.path.join(cache, "*probe_scalar_host*.ptx"))
    if not found:
        print("precompiled probe: no cached binary in", os.listdir(cache)[:10])
        return None
    binary = open(found[0], "rb").read()
    print(f"precompiled probe: {found[0]} ({len(binary)} bytes)")

    def run():
        return mx.fast.precompiled_cuda_kernel(
            name="tq_probe_scalar", compiled_source=binary, inputs=[x],
            output_shapes=[(1024,)], output_dtypes=[mx.float32], scalars=[1024],
            grid=(1024, 1, 1), threadgroup=(256, 1, 1))[0]

    y = run()
    mx.eval(y)
    assert mx.array_equal(y, x).item(), "precompiled probe returned wrong values"
    return run


def project_launches() -> dict:
    from turboquant.kernels import cuda, group
    from turboquant.runtime.layers import padded
    from turboquant.kernels.reference import words_per_row

    rows = {}
    for in_f, outs in ((4096, (4096,)), (4096, (4096, 1024, 1024))):
        members = []
        for i, out_f in enumerate(outs):
            p = padded(in_f, 64)
            codes = mx.random.randint(0, 2**31 - 1, (out_f, words_per_row(p, 3))).astype(mx.uint32)
            scales = (mx.random.uniform(shape=(out_f, p // 64)) * 0.02 + 0.01).astype(mx.float16)
            members.append(group.Member(codes=codes, scales=scales, bits=3, group_size=64,
                                        seed=11 + i, in_features=in_f, out_features=out_f,
                                        padded_in=p, bias=None))
        members = tuple(members)
        x = mx.random.normal((1, in_f)).astype(mx.bfloat16)
        tag = "+".join(map(str, outs))
        fused = cuda.FUSED
        try:
            cuda.FUSED = False
            plan = cuda._Plan(members)
        finally:
            cuda.FUSED = fused
        rotate, gemv, expert, row, grouped = plan._launches(x.shape[:-1], x.dtype)
        xr = rotate(x, plan.signs, plan.mix)
        mx.eval(xr)
        rows[f"tq rotate launch {tag}x{in_f}"] = per_call_us(lambda: rotate(x, plan.signs, plan.mix))
        rows[f"tq gemv launch {tag}x{in_f}"] = per_call_us(
            lambda: gemv(xr, plan.low, plan.high, plan.scales, plan.levels, expert, row, plan.bias))
        rows[f"tq unfused plan call {tag}x{in_f}"] = per_call_us(lambda: plan(x)[0])
        fused_plan = cuda._Plan(members)
        if fused_plan.fused:
            rows[f"tq fused plan call {tag}x{in_f}"] = per_call_us(lambda: fused_plan(x)[0])
        prepared = {}
        rows[f"tq_linear_group {tag}x{in_f} (default path)"] = per_call_us(
            lambda: group.tq_linear_group(x, members, prepared)[0])
    return rows


def evaluation() -> dict:
    x = mx.random.normal((1024,))
    mx.eval(x)
    common = dict(grid=(1024, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(1024,)],
                  output_dtypes=[mx.float32])
    k = trivial_kernel("probe_plain")
    k8 = trivial_kernel("probe_8in", inputs=8)
    tmpl = [(f"T{i}", i + 1) for i in range(12)]
    return {
        "mx.add chain": chain_us(lambda y: y + 1.0, x),
        "cuda_kernel chain": chain_us(lambda y: k(inputs=[y], **common)[0], x),
        "cuda_kernel 12 template args chain": chain_us(
            lambda y: k(inputs=[y], template=tmpl, **common)[0], x),
        "cuda_kernel 8 inputs chain": chain_us(lambda y: k8(inputs=[y] * 8, **common)[0], x),
    }


def greedy(model, cache):
    """token (1, 1) -> the model's greedy next token (1, 1), as a graph."""
    return lambda tok: mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None]


def _profiler_range(start: bool) -> None:
    """cuProfilerStart / Stop around the steady tokens when TQ_PROFILER_RANGE=1, for
    `nsys profile --capture-range=cudaProfilerApi` (GPU time per steady token)."""
    if os.environ.get("TQ_PROFILER_RANGE") == "1":
        import decode

        decode.cuda_profiler(start)


def split_tokens(step, tok, name: str, tokens: int, warm: int = 8) -> dict:
    """Decode `tokens` tokens with step(tok) -> next token (graph only), timing per token
    the graph building, `async_eval` (encoding) and the wait for the GPU, averaged after
    `warm` tokens, and the first token whole."""
    build = enc = wait = first = 0.0
    prof = _BuildProfile(name)
    for i in range(tokens):
        if i == warm:
            _profiler_range(True)
        t0 = time.perf_counter()
        with prof if i >= warm else contextlib.nullcontext():  # first-token costs left out
            nxt = step(tok)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        mx.eval(nxt)
        t3 = time.perf_counter()
        tok = nxt
        if i == 0:
            first = t3 - t0
        if i >= warm:
            build, enc, wait = build + t1 - t0, enc + t2 - t1, wait + t3 - t2
    _profiler_range(False)
    prof.report()
    n = tokens - warm
    return dict(build_ms=build / n * 1e3, async_eval_ms=enc / n * 1e3, wait_ms=wait / n * 1e3,
                first_ms=first * 1e3)


def decode_split(layers: int, tokens: int = 40, variants=("affine4", "tq3")) -> dict:
    """Per token: graph building, async_eval (encoding) and the wait, for each variant."""
    import decode as dec
    from mlx_lm.models.cache import make_prompt_cache

    dec.LLAMA3_8B.update(num_hidden_layers=layers)
    rows = {}
    for variant in variants:
        model = dec.build(variant)
        cache = make_prompt_cache(model)
        y = mx.array([[1, 2, 3, 4]])
        logits = model(y, cache=cache)
        mx.eval(logits)
        tok = mx.argmax(logits[:, -1], axis=-1)[:, None]
        row = split_tokens(greedy(model, cache), tok, variant, tokens)
        rows[variant] = dict(row, tok_s_pipelined=dec.decode_tps(model, 64))
        del model, cache
        mx.clear_cache()
    return rows


def kv_split(layers: int, context: int, tokens: int = 40, names=("fp16", "K4V3")) -> dict:
    """Per token: build / async_eval / wait of a bf16 8B-shaped Llama cut to `layers`
    layers at `context`, with mlx-lm's fp16 cache and the TurboQuant K4/V3 cache."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from turboquant.runtime.kvcache import make_turboquant_cache

    shape = dict(model_type="llama", hidden_size=4096, num_hidden_layers=layers,
                 intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0)
    model = llama.Model(llama.ModelArgs.from_dict(shape))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, 128256, (1, context))
    rows = {}
    for name in names:
        cache = (make_prompt_cache(model) if name == "fp16"
                 else make_turboquant_cache(model, bits_k=4, bits_v=3))
        for i in range(0, context, 2048):
            mx.eval(model(prompt[:, i : i + 2048], cache=cache))
        rows[name] = split_tokens(greedy(model, cache), mx.array([[1]]), name, tokens)
        del cache
        mx.clear_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the decode split")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--variants", default="affine4,tq3",
                    help="of the decode split (benchmarks/decode.py's names)")
    ap.add_argument("--decode-only", action="store_true", help="only the decode token split")
    ap.add_argument("--kv", type=int, default=0, metavar="CONTEXT",
                    help="only the KV cache split at this context (fp16 vs TurboQuant K4/V3)")
    ap.add_argument("--kv-caches", default="fp16,K4V3", help="of the KV split")
    ap.add_argument("--tokens", type=int, default=40,
                    help="decode tokens of a split (the first 8 are left out of its figures)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the decode tokens' graph building (timings then include it)")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    from turboquant.kernels import cuda

    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "(default)")
    print(f"mlx {mx.__version__}, {mx.default_device()}, MLX_USE_CUDA_GRAPHS={graphs}, "
          f"TurboQuant linears {'fused' if cuda.FUSED else 'unfused'} (TURBOQUANT_CUDA_FUSED)")
    if args.kv:
        print(f"one decode token at {args.kv} context, bf16 Llama cut to {args.layers} layers (ms):")
        for name, r in kv_split(args.layers, args.kv, args.tokens,
                                args.kv_caches.split(",")).items():
            print(f"  {name:>6}: build {r['build_ms']:.2f}  async_eval {r['async_eval_ms']:.2f}  "
                  f"wait {r['wait_ms']:.2f}  | first decode token {r['first_ms']:.1f}", flush=True)
        return
    if not args.decode_only:
        print("host microseconds per call, graph building only:")
        for name, us in graph_building().items():
            print(f"  {name:<48} {us:7.2f}", flush=True)
        print("microseconds per link, evaluating a chain of 200 dependent calls:")
        for name, us in evaluation().items():
            print(f"  {name:<48} {us:7.2f}", flush=True)
    if not args.skip_decode:
        print(f"one decode token, 8B-shaped Llama cut to {args.layers} layers (ms per token):")
        for variant, r in decode_split(args.layers, args.tokens,
                                       variants=args.variants.split(",")).items():
            print(f"  {variant:>8}: build {r['build_ms']:.2f}  async_eval {r['async_eval_ms']:.2f}  "
                  f"wait {r['wait_ms']:.2f}  | generate_step {r['tok_s_pipelined']:.1f} tok/s",
                  flush=True)
    print("reproduce: MLX_PTX_CACHE_DIR=/tmp/mlxptx MLX_USE_CUDA_GRAPHS=0|1 "
          "python tools/launch_cost.py")


if __name__ == "__main__":
    main()

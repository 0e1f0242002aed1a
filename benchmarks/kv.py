"""KV cache benchmark: TurboQuant against the fp16 cache and mlx-lm's affine QuantizedKVCache.

CPU part (default), on the reference models (reference/models/pystd-dense, pystd-moe):

- quality: reference/heldout.txt cut into context chunks of --ctx tokens, each fed through
  the cache --step tokens at a time (1 = token-by-token decode). With a small --sink and
  --window almost every key a query reads is compressed, so the compressed path is what is
  measured. Per cache: perplexity, its change against the uncompressed cache, mean KL(fp ||
  cache) of the next-token distributions, and top-1 agreement with the uncompressed cache.
  mlx-lm's QuantizedKVCache (group 64, kv_bits 8 and 4) runs in the same loop as the peer.
- retrieval: a constant planted early in a Python file (`FOO_BAR = 1` from two random
  words, right after the sink tokens, so it is compressed), ~400 tokens of stdlib code,
  then `print(FOO_` at the end. A hit: the greedy next token is the planted `BAR`'s first
  token (the tiny reference models copy the first token, rarely the whole name). Compared
  with the uncompressed cache on the same trials: hit rate, same outcome as fp16, accuracy
  and log-prob of the value's tokens (teacher forced).
- bytes of KV per token: fp16, affine 8/4 (group 64, fp16 scale and bias), TurboQuant
  (packed codes + fp16 norm), for the reference shapes and an 8B shape, and the bytes the
  benchmark's caches really held at the end of a chunk (sinks and window included).

The models are cast to float32 (MLX's CPU gather_mm needs it for the MoE), so the
uncompressed baseline cache holds float32; sizes are counted for fp16.

GPU part (for the GPU machine):

- --gpu-decode: decode tokens/s of an 8B-shaped random Llama at 1K-32K context, the fp16
  cache against TurboQuant caches through the CUDA decode kernel (kernels/cuda_kv.py) and,
  for the configs named with ":ref", through the pure-MLX reference. See `gpu_decode`.
- --gpu-attention: one layer's decode attention alone (8B shape: 32 query heads, 8 KV
  heads, head_dim 128), MLX's fused SDPA over the bf16 cache against the kernel and the
  reference over the compressed one, microseconds per call. See `gpu_attention`.

Host cost (CPU or GPU):

- --host-cost: one layer's decode step (cache update + attention), graph building only,
  the fp16 cache + SDPA against TurboQuant caches: microseconds, MLX ops, kernel calls and
  template arguments per step. Off the GPU the kernels are fakes. See `host_cost`.

Reproduce:
    .venv/bin/python benchmarks/kv.py --host-cost --contexts 1024 32768 --attention-configs K4V3
    .venv/bin/python benchmarks/kv.py                       # CPU, both reference models
    .venv/bin/python benchmarks/kv.py --models pystd-dense --chunks 2 --trials 10
    python benchmarks/kv.py --gpu-decode --gpu-attention    # GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
MODELS = {name: ROOT / "reference" / "models" / name for name in ("pystd-dense", "pystd-moe")}
HELDOUT = ROOT / "reference" / "heldout.txt"
MAIN_CONFIGS = ("K8V3", "K4V3", "K4V4", "K3V3")
DEFAULT_CONFIGS = ("fp16", "affine8", "affine4", *MAIN_CONFIGS, "K4V3:raw", "K4V3:p2")


# ---------------------------------------------------------------------------- caches


# a cache name's options: flags (field, value) and numbers p<n>, w<n>, f<n> (field)
_SPEC_FLAGS = {"raw": ("norm_correction", False), "ref": ("reference", True),
               "vec": ("vec", True), "mma": ("mma", True), "plain": ("plain", True),
               "exact": ("exact", True), "b8": ("stage_batch", True),
               "eager": ("eager_flush", True), "wide": ("merge_wide", True)}
_SPEC_NUMBERS = {"p": "protect", "w": "window", "f": "fp_tokens"}


@dataclass(frozen=True)
class CacheSpec:
    """One cache to measure, parsed from names like "K4V3", "K4V3:raw:p2:w128", "affine4".

    TurboQuant options: raw (no norm correction), p<n> (protect the first and last n KV
    layers at 8 bits), w<n> (fp16 window of n tokens instead of --window), ref (decode
    through the pure-MLX reference even where a decode kernel is registered), f<n> (the
    CUDA decode kernel's fp16 tokens per chunk, `cuda_kv.FP_TOKENS_PER_CHUNK`, instead of
    its default), vec (the CUDA partial kernel reading key rows in 16-byte loads,
    `cuda_kv.KV_PARTIAL_VEC`), mma (the tensor-core partial kernel, `cuda_kv.KV_PARTIAL_MMA`,
    the default where it fits), plain (neither: the plain partial kernel, for a same-run
    comparison with the default), exact (the tensor-core kernel with hi + lo products,
    `cuda_kv.KV_MMA_EXACT`, instead of fp16 operands), b8 (the partial kernels staging
    value codes 8 loads at a time for every layer, `cuda_kv.KV_STAGE_BATCH` "1"; by
    default layers with 8-bit values or with keys and values of at most 4 bits do), eager
    (a decode step's compression through the plain kv_quantize, `kvcache.COMPILED_FLUSH`
    "0", instead of the compiled one on a GPU), wide (the wide merge kernel,
    `cuda_kv.KV_MERGE_WIDE`: the default since 2026-11-30; run with
    TURBOQUANT_CUDA_KV_MERGE_WIDE=0 to compare it with the split merge in one process).
    """

    name: str
    kind: str  # "fp16", "affine", "tq"
    bits_k: int = 16
    bits_v: int = 16
    norm_correction: bool = True
    protect: int = 0
    window: int | None = None
    reference: bool = False
    fp_tokens: int | None = None
    vec: bool = False
    mma: bool = False
    plain: bool = False
    exact: bool = False
    stage_batch: bool = False
    eager_flush: bool = False
    merge_wide: bool = False

    @classmethod
    def parse(cls, name: str) -> "CacheSpec":
        if name == "fp16":
            return cls(name, "fp16")
        if name.startswith("affine"):
            b = int(name[6:])
            return cls(name, "affine", b, b)
        head, *opts = name.split(":")
        if not (head.startswith("K") and "V" in head):
            raise ValueError(
                f"cache spec {name!r}: use fp16, affine8, affine4 or "
                "K<b>V<b>[:raw][:p<n>][:w<n>][:ref][:f<n>][:vec][:mma][:plain][:exact][:b8]"
                "[:eager][:wide]"
            )
        bk, bv = head[1:].split("V")
        kw = {}
        for o in opts:
            if o in _SPEC_FLAGS:
                kw[_SPEC_FLAGS[o][0]] = _SPEC_FLAGS[o][1]
            elif o[:1] in _SPEC_NUMBERS and o[1:].isdigit():
                kw[_SPEC_NUMBERS[o[:1]]] = int(o[1:])
            else:
                raise ValueError(f"cache spec {name!r}: unknown option {o!r}")
        return cls(name, "tq", int(bk), int(bv), **kw)

    def make(self, model, sink: int, window: int, block: int = 16):
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        from turboquant.runtime.kvcache import make_turboquant_cache

        if self.kind == "fp16":
            return make_prompt_cache(model)
        if self.kind == "affine":
            return [QuantizedKVCache(group_size=64, bits=self.bits_k) for _ in model.layers]
        return make_turboquant_cache(
            model, bits_k=self.bits_k, bits_v=self.bits_v, sink=sink,
            window=self.window if self.window is not None else window,
            protect_layers=self.protect, protect_bits=8, block=block,
            norm_correction=self.norm_correction,
        )


def load(path: Path):
    """mlx_lm.load, cast to float32."""
    from mlx_lm import load as mlx_load

    model, tok = mlx_load(str(path))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, tok


def kv_shape(model) -> tuple[int, int, int]:
    """(KV layers, KV heads, head dim) from the model's args."""
    a = model.args
    heads = getattr(a, "num_key_value_heads", None) or a.num_attention_heads
    dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    return a.num_hidden_layers, heads, dim


# ---------------------------------------------------------------------------- quality


def feed(model, tokens: mx.array, cache, step: int) -> mx.array:
    """Log-probs (T, V) of every position, the tokens fed `step` at a time through `cache`."""
    out = []
    for i in range(0, tokens.size, step):
        logits = model(tokens[None, i : i + step], cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out, axis=0)


def quality(model, ids: list[int], specs, *, ctx, chunks, step, sink, window, log) -> dict:
    """Per spec: nll, kl, top1 agreement, bytes/token held, over `chunks` chunks of `ctx`."""
    acc = {s.name: dict(nll=0.0, kl=0.0, agree=0.0, n=0, bytes=0, secs=0.0) for s in specs}
    n_chunks = min(chunks, len(ids) // ctx)
    for c in range(n_chunks):
        tokens = mx.array(ids[c * ctx : (c + 1) * ctx])
        targets = tokens[1:]
        base = None
        for s in specs:
            t0 = time.perf_counter()
            cache = s.make(model, sink, window)
            lp = feed(model, tokens, cache, step)[:-1]
            a = acc[s.name]
            a["secs"] += time.perf_counter() - t0
            a["nll"] += -mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item()
            if base is None:
                base = lp
            a["kl"] += mx.sum(mx.exp(base) * (base - lp)).item()
            a["agree"] += mx.sum(lp.argmax(-1) == base.argmax(-1)).item()
            a["n"] += targets.size
            a["bytes"] += sum(x.nbytes for x in cache) / ctx
        log(f"  chunk {c + 1}/{n_chunks} done")
    out = {}
    for name, a in acc.items():
        n = max(a["n"], 1)
        out[name] = {
            "ppl": math.exp(a["nll"] / n),
            "kl": a["kl"] / n,
            "agree": a["agree"] / n,
            "bytes_per_token": a["bytes"] / max(n_chunks, 1),
            "secs": a["secs"],
        }
    return out


# ---------------------------------------------------------------------------- retrieval


def _words(text: str) -> list[str]:
    return sorted(set(re.findall(r"\b[a-z]{4,9}\b", text)))


def retrieval_prompts(tok, trials: int, length: int, seed: int = 0):
    """(prompt ids, value ids) pairs: a constant defined early, stdlib code, a use at the end.

        import os
        <A>_<B> = 1            (two random lower-case words of the held-out text, upper-cased)
        ... stdlib code up to `length` tokens ...
        print(<A>_             -> the model should continue with <B>)

    The value's first token cannot be guessed without reading the definition back.
    """
    rng = random.Random(seed)
    text = HELDOUT.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    words = _words(text)
    out = []
    for _ in range(trials):
        a, b = rng.choice(words).upper(), rng.choice(words).upper()
        head = f"import os\n\n{a}_{b} = 1\n\n"
        query, value = f"\n\nprint({a}_", f"{b})"
        start = rng.randrange(0, max(1, len(lines) - 400))
        filler, n = [], 0
        budget = length - len(tok.encode(head + query + value))
        for line in lines[start:]:
            m = len(tok.encode(line))
            if n + m > budget:
                break
            filler.append(line)
            n += m
        prompt = tok.encode(head + "".join(filler) + query)
        full = tok.encode(head + "".join(filler) + query + value)
        k = 0  # the tokenizer may merge across the boundary: split where they part
        while k < min(len(prompt), len(full)) and prompt[k] == full[k]:
            k += 1
        out.append((full[:k], full[k:]))
    return out


def seeded(spec: CacheSpec, model, prefix, sink: int, window: int, block: int = 16):
    """A fresh cache of `spec` holding the K/V of an uncompressed prefill (`prefix`).

    The same as prefilling through `spec`'s cache for TurboQuant, whose prefill step
    attends its own tokens in fp16 and compresses them before the next step; for mlx-lm's
    affine cache it is its `quantized_kv_start` path (quantize after the prefill).
    """
    cache = spec.make(model, sink, window, block)
    for c, p in zip(cache, prefix):
        k, v = p.state[0][:, :, : p.offset], p.state[1][:, :, : p.offset]
        c.update_and_fetch(k, v)
    return cache


def retrieval(model, tok, specs, prompts, *, sink, window, query_step=16) -> dict:
    """Per spec: first-token hit rate, same outcome as fp16, value token accuracy, log-prob.

    The prompt is prefilled once, uncompressed; each cache starts from that prefill and
    then reads the last `query_step` prompt tokens and the value as one step (teacher
    forcing), so every query of that step reads the definition from the compressed part.
    A hit: the greedy next token after the prompt is the value's first token.
    """
    from mlx_lm.models.cache import make_prompt_cache

    res = {s.name: {"hits": 0, "same": 0, "acc": 0.0, "logprob": 0.0} for s in specs}
    for prompt, value in prompts:
        seq = mx.array(prompt + value)
        split = len(prompt) - query_step
        prefix = make_prompt_cache(model)
        mx.eval(model(seq[None, :split], cache=prefix))
        base_hit = None
        for s in specs:
            cache = seeded(s, model, prefix, sink, window)
            logits = model(seq[None, split:], cache=cache)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            lp = lp[query_step - 1 : -1]  # predictions of the value tokens
            v = mx.array(value)
            ok = lp.argmax(-1) == v
            hit = bool(ok[0].item())
            r = res[s.name]
            r["hits"] += hit
            r["acc"] += ok.astype(mx.float32).mean().item()
            r["logprob"] += mx.take_along_axis(lp, v[:, None], axis=-1).sum().item()
            if base_hit is None:
                base_hit = hit
            r["same"] += hit == base_hit
    n = max(len(prompts), 1)
    return {k: {"success": r["hits"] / n, "same_as_fp16": r["same"] / n, "token_acc": r["acc"] / n,
                "logprob": r["logprob"] / n} for k, r in res.items()}


# ---------------------------------------------------------------------------- bytes


def bytes_per_token(layers: int, heads: int, dim: int, spec: CacheSpec) -> float:
    """Bytes of K and V per token, all layers, long-context limit (no sinks or window)."""
    from turboquant.runtime.kvcache import kv_bytes_per_token

    if spec.kind == "fp16":
        return layers * heads * 2 * dim * 2
    if spec.kind == "affine":
        return layers * heads * 2 * (dim * spec.bits_k / 8 + dim / 64 * 2 * 2)
    return layers * heads * kv_bytes_per_token(dim, spec.bits_k, spec.bits_v)


SHAPE_8B = (32, 8, 128)  # Llama-3-8B: layers, KV heads, head dim


# ---------------------------------------------------------------------------- GPU decode


LLAMA_8B = dict(
    hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=131072, tie_word_embeddings=False,
)


@contextlib.contextmanager
def _attention_path(spec: CacheSpec):
    """A context in which TurboQuant attention takes the path `spec` asks for."""
    from turboquant.kernels import cuda_kv_plan
    from turboquant.runtime import kv_attention, kvcache

    flush = kvcache.COMPILED_FLUSH
    kvcache.COMPILED_FLUSH = "0" if spec.eager_flush else flush
    saved = {name: getattr(cuda_kv_plan, name) for name in (
        "FP_TOKENS_PER_CHUNK", "KV_PARTIAL_VEC", "KV_PARTIAL_MMA", "KV_MMA_EXACT",
        "KV_STAGE_BATCH", "KV_MERGE_WIDE")}
    for name, value in dict(
            FP_TOKENS_PER_CHUNK=spec.fp_tokens or saved["FP_TOKENS_PER_CHUNK"],
            KV_PARTIAL_VEC=spec.vec or (saved["KV_PARTIAL_VEC"] and not spec.plain),
            KV_PARTIAL_MMA=spec.mma or (saved["KV_PARTIAL_MMA"] and not spec.plain),
            KV_MMA_EXACT=spec.exact or saved["KV_MMA_EXACT"],
            KV_STAGE_BATCH="1" if spec.stage_batch else saved["KV_STAGE_BATCH"],
            KV_MERGE_WIDE=spec.merge_wide or saved["KV_MERGE_WIDE"]).items():
        setattr(cuda_kv_plan, name, value)
    try:
        with kv_attention.reference_only() if spec.reference else contextlib.nullcontext():
            yield
    finally:
        for name, value in saved.items():
            setattr(cuda_kv_plan, name, value)
        kvcache.COMPILED_FLUSH = flush


def _kernel_name() -> str:
    from turboquant.kernels import dispatch
    from turboquant.runtime import kv_attention

    backend = dispatch.backend()
    fn = None if backend == "cpu" else kv_attention.kernel_for(backend)
    return "reference (no kernel)" if fn is None else f"{fn.__module__}.{fn.__name__}"


def gpu_decode(
    contexts=(1024, 4096, 16384, 32768),
    configs=("fp16", "K4V3", "K4V3:ref", "K8V3", "K4V3:p2"),
    steps: int = 64,
    sink: int = 4,
    window: int = 128,
    shape: dict | None = None,
    rounds: int = 3,
    log=print,
) -> list[dict]:
    """Decode tokens/s of an 8B-shaped random Llama (bf16) at each context, per cache.

    Random tokens are prefilled once per context into the fp16 cache (2048 per call, as
    mlx_lm.generate does); each cache starts from that prefill's K/V (`seeded`). Two
    timings of `steps` greedy tokens each, one after the other on the same cache:
    - generation (the headline): mlx-lm's own `generate_step` loop, as `turboquant generate`
      and `mlx_lm.generate` decode: it builds token n + 1's graph while the GPU evaluates
      token n (`mx.async_eval`), so the host's work hides behind the GPU's where it is
      shorter;
    - a token at a time (one mx.eval per token, no overlap), split into building the graph
      and evaluating it: where each token's time goes.
    The generation timing runs `rounds` times, the caches taking turns (fp16, K4V3, fp16,
    ...), and reports each cache's median: the GPU host's speed swings by a third and more
    between rounds of the same code (2026-11-30, fp16 at 32K, graphs off: 65.8, 118.0 and
    71.0 tok/s in one process), so only same-time, alternating figures compare.
    Run on the GPU machine: `python benchmarks/kv.py --gpu-decode`. TurboQuant decode uses
    the kernel runtime/kv_attention.py finds for the backend (on CUDA kernels/cuda_kv.py);
    configs with ":ref" force the pure-MLX reference, so both paths are timed in one run.
    `shape` overrides LLAMA_8B's fields (a smaller model for a smoke test).
    """
    from mlx_lm.models import llama

    log(f"TurboQuant decode attention: {_kernel_name()}; ':ref' configs: the pure-MLX reference")
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **{**LLAMA_8B, **(shape or {})})
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    rows = []
    for ctx in contexts:
        prompt = mx.random.randint(0, args.vocab_size, (ctx,), key=mx.random.key(ctx))
        prefix = CacheSpec.parse("fp16").make(model, sink, window)
        for i in range(0, ctx - 1, 2048):  # one uncompressed prefill per context
            model(prompt[None, i : min(i + 2048, ctx - 1)], cache=prefix)
            mx.eval([c.state for c in prefix])
        row = {"context": ctx}
        caches, last = {}, {}
        for name in configs:
            spec = CacheSpec.parse(name)
            cache = caches[name] = seeded(spec, model, prefix, sink, window, block=64)
            y = prompt[-1:]
            with _attention_path(spec):
                for _ in range(3):  # warm up (and compress what left the window)
                    y = model(y[None], cache=cache)[0, -1].argmax(keepdims=True)
                    mx.eval(y)
                build = 0.0
                per_step = {True: [], False: []}  # ms, steps with a compression or without
                t0 = time.perf_counter()
                for _ in range(steps):
                    held = _compressed_tokens(cache)
                    t1 = time.perf_counter()
                    y = model(y[None], cache=cache)[0, -1].argmax(keepdims=True)
                    build += time.perf_counter() - t1
                    mx.eval(y)
                    per_step[_compressed_tokens(cache) != held].append(
                        1e3 * (time.perf_counter() - t1))
                total = time.perf_counter() - t0
                for flushed, times in per_step.items():
                    key = name + (":flush_ms" if flushed else ":step_ms")
                    row[key] = sorted(times)[len(times) // 2] if times else float("nan")
                row[name + ":serial"] = steps / total
                # a token's time split: building its graph (host) vs evaluating it (encoding
                # the launches, the GPU's work, the wait for it)
                row[name + ":build_ms"] = 1e3 * build / steps
                row[name + ":eval_ms"] = 1e3 * (total - build) / steps
            last[name] = y
            row[name + ":GB"] = sum(c.nbytes for c in cache) / 1e9
        runs = {name: [] for name in configs}
        for _ in range(rounds):
            for name in configs:
                with _attention_path(CacheSpec.parse(name)):
                    tps, last[name] = generation_tps(model, caches[name], last[name], steps)
                runs[name].append(tps)
        for name in configs:
            row[name] = sorted(runs[name])[len(runs[name]) // 2]
            row[name + ":runs"] = " ".join(f"{t:.1f}" for t in runs[name])
        del caches, prefix
        mx.clear_cache()
        log("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in row.items()))
        rows.append(row)
    for title, key in ((f"decode tokens/s, generation (mlx-lm's generate_step, median of "
                         f"{rounds} alternating rounds; ratio to fp16)", ""),
                       ("decode tokens/s, a token at a time (ratio to fp16)", ":serial")):
        log(f"\n{title}")
        log(f"{'context':>8} " + " ".join(f"{c:>18}" for c in configs))
        for r in rows:
            cells = [f"{r[c + key]:8.1f} ({r[c + key] / r['fp16' + key]:.2f}x)" if "fp16" in r
                     else f"{r[c + key]:8.1f}" for c in configs]
            log(f"{r['context']:>8} " + " ".join(f"{c:>18}" for c in cells))
    log("\nms per token, a token at a time: building the graph + evaluating it")
    for r in rows:
        cells = [f"{r[c + ':build_ms']:6.2f} + {r[c + ':eval_ms']:6.2f}" for c in configs]
        log(f"{r['context']:>8} " + " ".join(f"{c:>18}" for c in cells))
    log("\nms per token, a token at a time, median: steps without a compression | steps with "
        "one (a layer's block of tokens coded and packed; `make_turboquant_cache` staggers "
        "the layers)")
    for r in rows:
        cells = [f"{r[c + ':step_ms']:6.2f} | {r[c + ':flush_ms']:6.2f}" for c in configs]
        log(f"{r['context']:>8} " + " ".join(f"{c:>18}" for c in cells))
    log("\nKV cache GB (ratio fp16 / cache)")
    for r in rows:
        cells = [f"{r[c + ':GB']:8.3g} ({r['fp16:GB'] / r[c + ':GB']:.2f}x)" if "fp16" in r
                 else f"{r[c + ':GB']:8.3g}" for c in configs]
        log(f"{r['context']:>8} " + " ".join(f"{c:>18}" for c in cells))
    _reproduce(log)
    return rows


def _compressed_tokens(cache: list) -> int:
    """Tokens held compressed over a cache list's TurboQuant layers (0 for other caches)."""
    return sum(getattr(c, "compressed_tokens", 0) for c in cache)


def generation_tps(model, cache, y: mx.array, steps: int) -> tuple[float, mx.array]:
    """(greedy tokens/s, the last token) of mlx-lm's `generate_step` continuing from token
    `y` on `cache`: `steps` tokens timed from the first one out (the one-token prompt's step
    excluded)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    t0, tok = None, None
    for i, (tok, _) in enumerate(generate_step(y, model, max_tokens=steps + 1,
                                               prompt_cache=cache, sampler=make_sampler(0.0))):
        if i == 0:
            t0 = time.perf_counter()
    return steps / (time.perf_counter() - t0), mx.array([tok])


ATTN_PER_EVAL = 20  # calls per mx.eval: amortises MLX's per-evaluation overhead
L2_BYTES = 50 * 2**20  # H200


def _time_calls(fn, reps: int = 10) -> float:
    """Median seconds per call of `fn()`, which builds ATTN_PER_EVAL calls."""
    mx.eval(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) / ATTN_PER_EVAL)
    return float(sorted(samples)[len(samples) // 2])


def gpu_attention(
    contexts=(1024, 4096, 16384, 32768),
    configs=("K4V3", "K8V3"),
    batch: int = 1,
    heads: int = 32,
    kv_heads: int = 8,
    dim: int = 128,
    reference: bool = True,
    log=print,
) -> list[dict]:
    """One layer's one-token attention, microseconds per call, at each context.

    fp16: `mx.fast.scaled_dot_product_attention` over bf16 K/V (B, KV, ctx, D) with GQA.
    Per TurboQuant config: a TurboQuantKVCache (sink 4, window 128) filled with the same
    K/V, then the CUDA kernel (`cuda_kv.decode_attention`) and, with `reference`, the
    pure-MLX `tq_attention` over the view a decode step sees. Several copies of the data
    rotate through the calls so that the 50 MB L2 does not hold it between them.
    """
    from turboquant.kernels import cuda_kv
    from turboquant.kernels.kv_reference import KVParts, PackedKV, tq_attention
    from turboquant.runtime.kvcache import TurboQuantKVCache

    scale = dim ** -0.5
    rows = []
    for ctx in contexts:
        key = mx.random.key(ctx)
        k1, k2, k3 = mx.random.split(key, 3)
        k = mx.random.normal((batch, kv_heads, ctx, dim), key=k1).astype(mx.bfloat16)
        v = mx.random.normal((batch, kv_heads, ctx, dim), key=k2).astype(mx.bfloat16)
        q = mx.random.normal((batch, heads, 1, dim), key=k3).astype(mx.bfloat16)
        mx.eval(k, v, q)
        n = max(1, min(ATTN_PER_EVAL, math.ceil(3 * L2_BYTES / (k.nbytes + v.nbytes))))
        kvs = [(k, v)] + [(k + 0, v + 0) for _ in range(n - 1)]
        mx.eval(kvs)
        row = {"context": ctx}
        row["fp16"] = _time_calls(lambda: [
            mx.fast.scaled_dot_product_attention(q, *kvs[i % n], scale=scale)
            for i in range(ATTN_PER_EVAL)])
        del kvs
        for name in configs:
            spec = CacheSpec.parse(name)
            cache = TurboQuantKVCache(spec.bits_k, spec.bits_v, sink=4, window=128, block=64)
            for a in range(0, ctx - 1, 2048):
                cache.update_and_fetch(k[:, :, a : min(a + 2048, ctx - 1)],
                                       v[:, :, a : min(a + 2048, ctx - 1)])
            p, _ = cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
            pk = p.packed
            nbytes = pk.k_codes.nbytes + pk.v_codes.nbytes + pk.k_norms.nbytes + pk.v_norms.nbytes
            n = max(1, min(ATTN_PER_EVAL, math.ceil(3 * L2_BYTES / nbytes)))
            views = [p] + [KVParts(p.sink_k, p.sink_v, PackedKV(
                pk.k_codes + 0, pk.k_norms + 0, pk.v_codes + 0, pk.v_norms + 0, pk.bits_k,
                pk.bits_v, pk.seed, pk.k_dim, pk.v_dim), p.tail_k, p.tail_v)
                for _ in range(n - 1)]
            mx.eval([[x for x in (w.sink_k, w.sink_v, w.tail_k, w.tail_v, w.packed.k_codes,
                                  w.packed.v_codes, w.packed.k_norms, w.packed.v_norms)
                      if x is not None] for w in views])
            row[name] = _time_calls(lambda: [
                cuda_kv.decode_attention(q, views[i % n], scale) for i in range(ATTN_PER_EVAL)])
            row[name + ":GB/s"] = nbytes / row[name] / 1e9
            if reference:
                row[name + ":ref"] = _time_calls(lambda: [
                    tq_attention(q, views[i % n], scale) for i in range(ATTN_PER_EVAL)], reps=3)
            del cache, views
            mx.clear_cache()
        rows.append(row)
        log("  " + "  ".join(f"{c}={x * 1e6:.1f}us" if isinstance(x, float) and not
                             c.endswith("GB/s") else f"{c}={x:.4g}" for c, x in row.items()))
    cols = ["fp16"] + [c for name in configs
                       for c in (name, *((name + ":ref",) if reference else ()))]
    log(f"\none layer's decode attention, us per call (fp16 time / this), "
        f"B={batch} H={heads} KV={kv_heads} D={dim}")
    log(f"{'context':>8} " + " ".join(f"{c:>17}" for c in cols))
    for r in rows:
        cells = [f"{r[c] * 1e6:7.1f} ({r['fp16'] / r[c]:5.2f}x)" for c in cols]
        log(f"{r['context']:>8} " + " ".join(f"{c:>17}" for c in cells))
    log("kernel bandwidth over the packed span, GB/s: " + ", ".join(
        f"{r['context']}: " + "/".join(f"{r[n + ':GB/s']:.0f}" for n in configs) for r in rows))
    _reproduce(log)
    return rows


# ---------------------------------------------------------------------------- host cost


class _FakeKernel:
    """Stands in for a GPU kernel off the GPU: outputs of the right shapes (one cheap
    `Depends` node over pre-built zeros and the call's inputs); counts calls and template
    arguments."""

    def __init__(self, counts: dict):
        self.counts, self._zeros = counts, {}

    def _zero(self, shape, dtype):
        key = (tuple(shape), dtype)
        if key not in self._zeros:
            self._zeros[key] = mx.zeros(shape, dtype)
            mx.eval(self._zeros[key])
        return self._zeros[key]

    def outputs(self, inputs, shapes, dtypes, template=()):
        self.counts["kernels"] += 1
        self.counts["template_args"] += len(template or ())
        zeros = [self._zero(s, d) for s, d in zip(shapes, dtypes)]
        return mx.depends(zeros, [x for x in inputs if isinstance(x, mx.array)])

    def cuda_kernel(self, name):
        def call(inputs, output_shapes, output_dtypes, template=None, **_):
            return self.outputs(inputs, output_shapes, output_dtypes, template)

        return call

    def sdpa(self, q, k, v, scale, mask=None, sinks=None, **_):
        return self.outputs([q, k, v], [(*q.shape[:-1], v.shape[-1])], [q.dtype])[0]


@contextlib.contextmanager
def _fake_gpu(counts: dict):
    """Off the GPU: TurboQuant attention takes the CUDA path with fake kernels, and
    mx.fast.scaled_dot_product_attention is a fake kernel too (one call, like on the GPU)."""
    from turboquant.kernels import cuda_kv, dispatch
    from turboquant.runtime import kv_attention

    fake = _FakeKernel(counts)
    saved = cuda_kv._kernel, dispatch.backend, mx.fast.scaled_dot_product_attention
    kernels, settled = dict(kv_attention._KERNELS), set(kv_attention._SETTLED)
    cuda_kv._kernel, dispatch.backend = fake.cuda_kernel, lambda: "cuda"
    mx.fast.scaled_dot_product_attention = fake.sdpa
    kv_attention.register_kernel("cuda", cuda_kv.decode_attention)  # whatever ran before
    try:
        yield
    finally:
        cuda_kv._kernel, dispatch.backend, mx.fast.scaled_dot_product_attention = saved
        kv_attention._KERNELS.clear()
        kv_attention._KERNELS.update(kernels)
        kv_attention._SETTLED.clear()
        kv_attention._SETTLED.update(settled)


def graph_ops(arrays) -> dict:
    """Operations in the unevaluated graph behind `arrays`, by name (mx.export_to_dot)."""
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    ops: dict = {}
    for name in re.findall(r'label ="([^"]+)"', buf.getvalue()):
        ops[name] = ops.get(name, 0) + 1
    return ops


def call_events(step, skip: tuple[str, ...] = ()) -> dict:
    """Python functions and builtins called while `step()` builds a graph (sys.setprofile;
    calls made from the files in `skip`, such as stand-in kernels, left out): an exact
    measure of the host's interpreter work, whatever the machine's speed. MLX's operations
    are nanobind functions: not among the builtins."""
    counts = {"call": 0, "c_call": 0}
    own = call_events.__code__  # its own sys.setprofile(None) is not the step's

    def count(frame, event, arg):
        if event in counts and frame.f_code is not own and frame.f_code.co_filename not in skip:
            counts[event] += 1

    sys.setprofile(count)
    try:
        mx.eval(step())
    finally:
        sys.setprofile(None)
    return dict(py_calls=counts["call"], c_calls=counts["c_call"])


def _state_arrays(cache) -> list:
    """The arrays a cache holds (what a decode step writes)."""
    if hasattr(cache, "parts"):  # TurboQuant: its buffers (parts() would add slices)
        xs = [cache._sink_k, cache._sink_v, cache._tail_k, cache._tail_v, *(cache._comp or [])]
    else:
        xs = [cache.keys, cache.values]
    return [x for x in xs if x is not None]


def layer_step_cost(name: str, ctx: int, steps: int, b: int, h: int, kv: int, d: int,
                    warm: int = 4) -> dict:
    """Host cost of one layer's decode step (cache update + attention), graph building only.

    The cache is filled with `ctx` random bf16 tokens, then `warm` + `steps` one-token
    steps are built and evaluated; the building of the last `steps` is timed. Off the GPU the kernels are fakes
    (`_fake_gpu`): the figures are the Python and MLX graph-building work around them,
    plus counts of kernel calls and template arguments, whose own cost is on the GPU's
    host only (see `host_cost`)."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import KVCache

    from turboquant.runtime.kvcache import TurboQuantKVCache

    spec = CacheSpec.parse(name)
    cache = KVCache() if spec.kind == "fp16" else TurboQuantKVCache(
        spec.bits_k, spec.bits_v, sink=4, window=128, block=64)
    key = mx.random.key(ctx)
    for a in range(0, ctx, 2048):
        n = min(2048, ctx - a)
        k1, k2, key = mx.random.split(key, 3)
        cache.update_and_fetch(mx.random.normal((b, kv, n, d), key=k1).astype(mx.bfloat16),
                               mx.random.normal((b, kv, n, d), key=k2).astype(mx.bfloat16))
        mx.eval(_state_arrays(cache))
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((b, h, 1, d), key=k1).astype(mx.bfloat16)
    k = mx.random.normal((b, kv, 1, d), key=k2).astype(mx.bfloat16)
    v = mx.random.normal((b, kv, 1, d), key=k3).astype(mx.bfloat16)
    mx.eval(q, k, v)
    counts = dict(kernels=0, template_args=0)
    fake = _fake_gpu(counts) if mx.default_device() == mx.cpu else contextlib.nullcontext()
    update, attend, ops = [], [], None
    with fake:
        for i in range(-warm, steps):
            t0 = time.perf_counter()
            keys, values = cache.update_and_fetch(k, v)
            t1 = time.perf_counter()
            out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=d ** -0.5,
                                               mask=None)
            t2 = time.perf_counter()
            if i == steps // 2 and ops is None:
                ops = graph_ops([out, *_state_arrays(cache)])
            mx.eval(out, _state_arrays(cache))
            if i < 0:  # warm-up: the first flush of the prefill, one-time set-up
                counts.update(kernels=0, template_args=0)
                continue
            update.append(t1 - t0)
            attend.append(t2 - t1)
        events = _steady_step_calls(cache, q, k, v, d)
    total = [u + a for u, a in zip(update, attend)]
    kernels = ops.pop("Depends", 0) if fake is not None and counts["kernels"] else 0
    return dict(
        mean_us=1e6 * sum(total) / steps, median_us=1e6 * sorted(total)[steps // 2],
        update_us=1e6 * sorted(update)[steps // 2], attention_us=1e6 * sorted(attend)[steps // 2],
        ops=sum(ops.values()), op_names=ops, kernels_per_step=kernels,
        template_args_per_step=counts["template_args"] / steps if counts["kernels"] else 0.0,
        **events,
    )


def _steady_step_calls(cache, q, k, v, d: int) -> dict:
    """`call_events` of one decode step (cache update + attention) without a compression
    in it, this script's fakes left out."""
    from mlx_lm.models.base import scaled_dot_product_attention

    def step():
        keys, values = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=d ** -0.5,
                                           mask=None)
        return [out, *_state_arrays(cache)]

    while True:
        held = getattr(cache, "compressed_tokens", 0)
        events = call_events(step, skip=(__file__,))
        if getattr(cache, "compressed_tokens", 0) == held:
            return events


CUDA_KERNEL_BUILD_US = 2.5  # per mx.fast.cuda_kernel call, beyond Python (launch-cost-h200.txt)
TEMPLATE_ARG_US = 0.2  # per template argument
LAUNCH_ENCODE_US = 5.5  # per launch, graphs off


def host_cost(contexts=(1024, 32768), configs=("fp16", "K4V3"), steps: int = 192,
              b: int = 1, h: int = 32, kv: int = 8, d: int = 128, log=print) -> list[dict]:
    """One layer's decode step, host side: the fp16 cache + SDPA against TurboQuant caches.

    Prints per cache: microseconds of graph building per step (mean over `steps`, flushes
    into the compressed part included; median; the median of its cache update and of its
    attention call), MLX operations per step (a steady step's graph, kernels excluded),
    kernel calls and template arguments per step. Off the GPU the kernels are fakes, so
    the last column estimates the CUDA host cost: build + calls * CUDA_KERNEL_BUILD_US +
    template args * TEMPLATE_ARG_US + (ops + calls) * LAUNCH_ENCODE_US (graphs off). py
    and C: Python functions and builtins called in a steady step (`call_events`, exact;
    on the H200's host a Python call costs ~0.8 us, NOTES.md)."""
    where = "fake kernels (CPU)" if mx.default_device() == mx.cpu else str(mx.default_device())
    log(f"host cost of one layer's decode step, B={b} H={h} KV={kv} D={d}, {steps} steps, {where}")
    rows = []
    for ctx in contexts:
        row = {"context": ctx}
        for name in configs:
            row[name] = layer_step_cost(name, ctx, steps, b, h, kv, d)
            mx.clear_cache()
        rows.append(row)
        log(f"\ncontext {ctx}")
        log(f"{'cache':<8} {'mean us':>8} {'median':>7} {'update':>7} {'attend':>7} {'ops':>4} "
            f"{'kernels':>7} {'tmpl':>5} {'py':>4} {'C':>4} {'est. CUDA host us':>18}  "
            "ops by name")
        base = None
        for name in configs:
            r = row[name]
            est = (r["median_us"] + r["kernels_per_step"] * CUDA_KERNEL_BUILD_US
                   + r["template_args_per_step"] * TEMPLATE_ARG_US
                   + (r["ops"] + r["kernels_per_step"]) * LAUNCH_ENCODE_US)
            r["est_us"] = est
            base = base or r
            ratio = f"({est / base['est_us']:.2f}x)"
            names = ", ".join(f"{k} {v}" for k, v in sorted(r["op_names"].items()))
            log(f"{name:<8} {r['mean_us']:8.1f} {r['median_us']:7.1f} {r['update_us']:7.1f} "
                f"{r['attention_us']:7.1f} {r['ops']:4d} {r['kernels_per_step']:7d} "
                f"{r['template_args_per_step']:5.0f} {r['py_calls']:4d} {r['c_calls']:4d} "
                f"{est:10.1f} {ratio:>7}  {names}")
        for name in configs[1:]:
            log(f"{name} / fp16: build (median) {row[name]['median_us'] / row[configs[0]]['median_us']:.2f}x, "
                f"ops {row[name]['ops']} vs {row[configs[0]]['ops']}, kernels "
                f"{row[name]['kernels_per_step']} vs {row[configs[0]]['kernels_per_step']}")
    _reproduce(log)
    return rows


def _reproduce(log=print):
    cmd = " ".join([sys.executable.replace(str(ROOT) + "/", ""), "benchmarks/kv.py", *sys.argv[1:]])
    log(f"reproduce: {cmd}")


# ---------------------------------------------------------------------------- report


def _heldout_ids(tok) -> list[int]:
    return tok.encode(HELDOUT.read_text(encoding="utf-8"))


def run_cpu(args, log=print) -> dict:
    specs = [CacheSpec.parse(c) for c in args.configs]
    if specs[0].kind != "fp16":
        specs.insert(0, CacheSpec.parse("fp16"))
    results = {}
    for name in args.models:
        path = Path(args.model_dir) / name if args.model_dir else MODELS.get(name, Path(name))
        if not (path / "config.json").exists():
            log(f"skip {name}: no model at {path}")
            continue
        log(f"{name}: loading {path}")
        model, tok = load(path)
        layers, heads, dim = kv_shape(model)
        ids = _heldout_ids(tok)
        t0 = time.perf_counter()
        q = quality(model, ids, specs, ctx=args.ctx, chunks=args.chunks, step=args.step,
                    sink=args.sink, window=args.window, log=log)
        log(f"  quality: {time.perf_counter() - t0:.0f} s")
        t0 = time.perf_counter()
        prompts = retrieval_prompts(tok, args.trials, args.retrieval_len)
        r = retrieval(model, tok, specs, prompts, sink=args.sink, window=args.window)
        log(f"  retrieval: {len(prompts)} trials, {time.perf_counter() - t0:.0f} s")
        results[name] = dict(shape=(layers, heads, dim), quality=q, retrieval=r,
                             trials=len(prompts))
        del model
        mx.clear_cache()
    report(results, specs, args, log)
    return results


def report(results: dict, specs, args, log=print):
    for name, res in results.items():
        layers, heads, dim = res["shape"]
        q, r = res["quality"], res["retrieval"]
        base = q["fp16"]
        log(f"\n{name}: {layers} layers x {heads} KV heads x head_dim {dim}; ctx {args.ctx}, "
            f"step {args.step}, sink {args.sink}, window {args.window}; "
            f"retrieval {res['trials']} trials")
        log(f"{'cache':<12} {'ppl':>8} {'dppl %':>8} {'KL':>9} {'top1=fp':>8} {'retr':>6} "
            f"{'=fp':>5} {'tokacc':>6} {'logp':>7} {'B/tok':>8} {'B/tok held':>10} {'x fp16':>7}")
        fp_bytes = bytes_per_token(layers, heads, dim, specs[0])
        for s in specs:
            qs, rs = q[s.name], r[s.name]
            bpt = bytes_per_token(layers, heads, dim, s)
            if s.kind == "tq" and s.protect:
                n8 = min(2 * s.protect, layers)
                bpt = bpt * (layers - n8) / layers + n8 * bytes_per_token(
                    1, heads, dim, CacheSpec("", "tq", 8, 8))
            log(f"{s.name:<12} {qs['ppl']:8.3f} {100 * (qs['ppl'] / base['ppl'] - 1):+8.2f} "
                f"{qs['kl']:9.5f} {qs['agree']:8.3f} {rs['success']:6.2f} "
                f"{rs['same_as_fp16']:5.2f} {rs['token_acc']:6.2f} {rs['logprob']:7.2f} "
                f"{bpt:8.0f} {qs['bytes_per_token']:10.0f} {fp_bytes / bpt:7.2f}")
    log("\nbytes of KV per token (all layers, long context; TurboQuant without sinks/window)")
    shapes = {n: res["shape"] for n, res in results.items()}
    shapes["8B-shaped"] = SHAPE_8B
    table_specs = [CacheSpec.parse(c) for c in ("fp16", "affine8", "affine4", *MAIN_CONFIGS)]
    log(f"{'shape':<26} " + " ".join(f"{s.name:>15}" for s in table_specs))
    for n, (layers, heads, dim) in shapes.items():
        fp = bytes_per_token(layers, heads, dim, table_specs[0])
        cells = []
        for s in table_specs:
            b = bytes_per_token(layers, heads, dim, s)
            cells.append(f"{b:7.0f} ({fp / b:4.2f}x)")
        log(f"{n + f' ({layers}x{heads}x{dim})':<26} " + " ".join(f"{c:>15}" for c in cells))
    log("\nB/tok: long-context bytes per token; held: what the caches held after a chunk "
        "(float32 baseline on CPU,\nsinks and window in float32 too); x fp16: fp16 bytes over "
        "B/tok;\nretr: retrieval hit rate; =fp: same hit/miss as fp16; tokacc, logp: the value's "
        "tokens, teacher forced")
    _reproduce(log)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--model-dir", default=None,
                    help="folder holding the --models (default reference/models)")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--ctx", type=int, default=512, help="tokens per held-out chunk")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--step", type=int, default=1, help="tokens per forward step (1: decode)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--retrieval-len", type=int, default=400, help="tokens per retrieval prompt")
    ap.add_argument("--gpu-decode", action="store_true",
                    help="decode tokens/s, 8B shape (GPU machine)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--gpu-configs", nargs="+",
                    default=["fp16", "K4V3", "K4V3:ref", "K8V3", "K4V3:p2"],
                    help="caches for --gpu-decode (':ref': the pure-MLX reference path)")
    ap.add_argument("--gpu-steps", type=int, default=64)
    ap.add_argument("--gpu-rounds", type=int, default=3,
                    help="--gpu-decode: alternating generation rounds per cache (the median)")
    ap.add_argument("--gpu-attention", action="store_true",
                    help="one layer's decode attention: fp16 SDPA vs kernel vs reference (GPU)")
    ap.add_argument("--attention-configs", nargs="+", default=["K4V3", "K8V3"])
    ap.add_argument("--host-cost", action="store_true",
                    help="host cost (graph building) of one layer's decode step, fp16 vs "
                         "TurboQuant; off the GPU with fake kernels")
    ap.add_argument("--host-steps", type=int, default=192)
    ap.add_argument("--no-reference", action="store_true",
                    help="--gpu-attention: skip timing the pure-MLX reference")
    args = ap.parse_args(argv)
    if args.gpu_attention:
        gpu_attention(tuple(args.contexts), tuple(args.attention_configs),
                      reference=not args.no_reference)
    if args.gpu_decode:
        gpu_decode(tuple(args.contexts), tuple(args.gpu_configs), steps=args.gpu_steps,
                   rounds=args.gpu_rounds)
    if args.host_cost:
        host_cost(tuple(args.contexts), ("fp16", *args.attention_configs), args.host_steps)
    if args.gpu_attention or args.gpu_decode or args.host_cost:
        return
    run_cpu(args)


if __name__ == "__main__":
    main()

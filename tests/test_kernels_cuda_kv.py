"""The CUDA KV decode kernel (kernels/cuda_kv.py) against the pure-MLX reference, on a GPU.

Skipped unless MLX runs on CUDA. Run on the GPU machine with either of

    python3 -m pytest -q tests/test_kernels_cuda_kv.py
    python3 tests/test_kernels_cuda_kv.py            # no pytest needed: prints PASS/FAIL per case

Each case fills a real TurboQuantKVCache (sink 4, hot window 128, block 64) with random
K/V, takes the view one decode step sees (sink | compressed slice | tail slice, strided as
in a model run), and compares `cuda_kv.decode_attention` with `tq_attention` computed on
the CPU stream in float32 (the oracle). A failure names the case and prints the max abs
difference, where it is (batch, head, dim), the tolerance, shapes, the parts' lengths and
the kernel's chunking. The CPU-side replay of the kernels' indexing is
tests/test_kv_cuda_layout.py.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

try:
    import pytest
except ImportError:  # runnable as a script on a machine without pytest
    pytest = None

from turboquant.kernels import cuda_kv, cuda_kv_layout, cuda_kv_plan, dispatch
from turboquant.kernels.kv_reference import KVParts, tq_attention


def on_cuda() -> bool:
    return dispatch.backend() == "cuda"


if pytest is not None:
    pytestmark = pytest.mark.skipif(not on_cuda(), reason="MLX is not running on CUDA")


@dataclass(frozen=True)
class Case:
    b: int = 1
    kv: int = 8
    r: int = 4  # query heads per KV head (GQA group)
    dim: int = 128
    bits: tuple = (4, 3)
    ctx: int = 1000  # tokens in the cache at the decode step
    dtype: str = "bfloat16"  # K/V and query dtype
    sink: int = 4
    window: int = 128
    rotating: int = 0  # max_size of a sliding-window cache (0: plain cache)

    @property
    def name(self) -> str:
        n = (f"b{self.b}-kv{self.kv}x{self.r}-d{self.dim}-K{self.bits[0]}V{self.bits[1]}"
             f"-ctx{self.ctx}-{self.dtype}")
        n += f"-sink{self.sink}" if self.sink != 4 else ""
        n += f"-window{self.window}" if self.window != 128 else ""
        return n + (f"-rot{self.rotating}" if self.rotating else "")


CASES = [
    Case(),  # 8B shape, K4/V3
    Case(dim=64, kv=4, r=2),
    Case(b=2, bits=(8, 3)),
    Case(b=2, kv=2, r=8, dim=64, bits=(4, 4), ctx=300),
    Case(kv=4, r=1, bits=(3, 3), ctx=5000),
    Case(kv=2, r=4, dim=64, bits=(2, 2), ctx=700),
    Case(kv=2, r=2, bits=(8, 8), ctx=400, dtype="float16"),
    Case(kv=2, r=4, dim=64, bits=(2, 4), ctx=2000, dtype="float32"),
    Case(b=2, kv=2, r=4, dim=96, bits=(4, 3), ctx=600),
    Case(kv=2, r=3, dim=80, bits=(2, 3), ctx=500),  # rotation of 20 segments of 4, in-block
    Case(kv=8, r=4, bits=(4, 3), ctx=40000),  # many chunks, several tiles each
    Case(b=2, kv=8, r=4, bits=(4, 3), ctx=20000),
    Case(kv=2, r=4, bits=(4, 3), ctx=197),  # just past the window: one block compressed
    Case(kv=2, r=4, bits=(4, 3), ctx=1500, sink=0),  # no sinks
    Case(kv=2, r=4, bits=(4, 3), ctx=1500, window=0),  # only the newest token in fp16
    Case(kv=2, r=4, bits=(4, 3), ctx=3000, rotating=1024),  # sliding window: offset slice
    Case(kv=2, r=4, bits=(4, 3), ctx=3000, window=400),  # the fp16 part in 2 chunks
    # the tensor-core partial kernel's other shapes (replayed on the CPU; written in
    # 2026-11-30 after its device time was spent, not yet run on a GPU)
    Case(kv=2, r=4, bits=(4, 3), ctx=900, dtype="float32"),  # float32 parts, 16-byte loads
    Case(kv=1, r=2, dim=256, bits=(4, 4), ctx=700),  # KD 256: 2 code blocks a lane
]
BELOW_WINDOW = [Case(ctx=100), Case(b=2, kv=2, r=4, dim=64, ctx=128)]


def _tol(dtype) -> float:
    # relative to max |reference|: f32 differs only in summation order; bf16/f16 outputs round
    return {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 8e-3}[dtype]


def cache_parts(case: Case, seed: int = 0):
    """(queries, KVParts, cache) one decode step of `case` sees."""
    from turboquant.runtime.kvcache import TurboQuantKVCache, TurboQuantRotatingKVCache

    dtype = getattr(mx, case.dtype)
    kw = dict(bits_k=case.bits[0], bits_v=case.bits[1], window=case.window, block=64,
              seed=1234567 + seed)
    if case.rotating:
        cache = TurboQuantRotatingKVCache(case.rotating, keep=case.sink, **kw)
    else:
        cache = TurboQuantKVCache(sink=case.sink, **kw)
    key = mx.random.key(seed)
    # keys with a few strong channels and an offset, like real ones
    boost = mx.ones((case.dim,)).at[mx.array([1, 7, case.dim - 3])].add(mx.array([6.0, -4.0, 3.0]))
    done = 0
    parts = None
    while done < case.ctx:
        n = min(2048, case.ctx - done) if done + 1 < case.ctx else 1
        if done + n == case.ctx and n > 1:
            n -= 1  # the last token is a decode step of its own
        key, k1, k2 = mx.random.split(key, 3)
        k = (mx.random.normal((case.b, case.kv, n, case.dim), key=k1) * boost + 0.5).astype(dtype)
        v = mx.random.normal((case.b, case.kv, n, case.dim), key=k2).astype(dtype)
        parts, _ = cache.update_and_fetch(k, v)
        mx.eval([x for x in (parts.sink_k, parts.tail_k) if x is not None])
        done += n
    q = mx.random.normal((case.b, case.kv * case.r, 1, case.dim), key=key).astype(dtype)
    return q, parts, cache


def reference(q, parts: KVParts, scale, mask=None):
    """tq_attention in float32 on the CPU stream (the oracle), else on the GPU."""
    try:
        with mx.stream(mx.cpu):
            out = tq_attention(q.astype(mx.float32), parts, scale, mask).astype(mx.float32)
            mx.eval(out)
        return out, "cpu"
    except Exception:  # noqa: BLE001 - no CPU access to GPU arrays: the GPU reference
        out = tq_attention(q.astype(mx.float32), parts, scale, mask).astype(mx.float32)
        mx.eval(out)
        return out, "gpu"


def compare(q, parts: KVParts, scale: float, mask=None, label: str = "") -> str:
    """Kernel vs reference; raises AssertionError with the details, returns a summary."""
    launch = cuda_kv.prepare(q, parts, scale, mask)
    got = cuda_kv.run(launch)
    mx.eval(got)
    want, where = reference(q, parts, scale, mask)
    g = np.asarray(got.astype(mx.float32))
    w = np.asarray(want)
    shapes = f"q {tuple(q.shape)} {q.dtype}, out {tuple(got.shape)} {got.dtype}"
    info = (f"{label}: {shapes}, lengths (sink, compressed, tail) {parts.lengths}, "
            f"chunks {launch.layout.ncc}+{launch.layout.fpch}, {launch.layout.partial_kernel}"
            f"{' (fp16 operands)' if cuda_kv_layout.fp16_operands(launch.layout) else ''}, "
            f"reference on {where}")
    assert g.shape == w.shape, f"{info}: shape {g.shape} != reference {w.shape}"
    assert np.isfinite(g).all(), f"{info}: {np.size(g) - np.isfinite(g).sum()} non-finite outputs"
    diff = np.abs(g - w)
    err = float(diff.max())
    scale_ref = max(1.0, float(np.abs(w).max()))
    rtol = max(_tol(q.dtype), cuda_kv_layout.MMA_FP16_RTOL
               if cuda_kv_layout.fp16_operands(launch.layout) else 0)
    tol = rtol * scale_ref * (1 if where == "cpu" else 5)
    at = np.unravel_index(int(diff.argmax()), diff.shape)
    msg = (f"{info}: max abs diff {err:.3g} at (b, h, 0, d) = {tuple(int(i) for i in at)} "
           f"(kernel {g[at]:.5g}, reference {w[at]:.5g}), tol {tol:.3g}, max |ref| {scale_ref:.3g}, "
           f"mean abs diff {float(diff.mean()):.3g}")
    assert err <= tol, msg
    return msg


def check_case(case: Case) -> list[str]:
    q, parts, _ = cache_parts(case, seed=sum(map(ord, case.name)) % 1000)
    assert parts.packed is not None, f"{case.name}: nothing compressed, the case is misbuilt"
    out = [compare(q, parts, case.dim ** -0.5, None, case.name)]
    if q.dtype != mx.float32:  # float32 queries -> float32 output: the tight check
        out.append(compare(q.astype(mx.float32), parts, case.dim ** -0.5, None,
                           case.name + " (float32 queries)"))
    return out


def check_fp_chunks_of_a_tile() -> list[str]:
    """The 8B case with the fp16 part (sink + a tail of 128-192) in chunks of one tile
    (`cuda_kv_plan.FP_TOKENS_PER_CHUNK` = TILE, the next default candidate): 2 fp16 chunks."""
    q, parts, _ = cache_parts(Case(), seed=11)
    saved = cuda_kv_plan.FP_TOKENS_PER_CHUNK
    cuda_kv_plan.FP_TOKENS_PER_CHUNK = cuda_kv_plan.TILE
    try:
        fpch = cuda_kv.prepare(q, parts, 128 ** -0.5).layout.fpch
        assert fpch == 2, f"fp16 part of {parts.lengths} in {fpch} chunks, 2 expected"
        return [compare(q, parts, 128 ** -0.5, None, "fp16 chunks of a tile")]
    finally:
        cuda_kv_plan.FP_TOKENS_PER_CHUNK = saved


def check_exact_products() -> list[str]:
    """The tensor-core kernel with hi + lo products (KV_MMA_EXACT), at float32's tolerance:
    the 8B case, float32 parts, head dim 256."""
    saved = cuda_kv_plan.KV_MMA_EXACT
    cuda_kv_plan.KV_MMA_EXACT = True
    try:
        out = []
        for case in (Case(), Case(kv=2, r=4, bits=(4, 3), ctx=900, dtype="float32"),
                     Case(kv=1, r=2, dim=256, bits=(4, 4), ctx=700)):
            q, parts, _ = cache_parts(case, seed=5)
            lay = cuda_kv.prepare(q, parts, case.dim ** -0.5).layout
            if lay.partial_kernel.startswith("tq_kv_partial_mma"):  # sm_80+
                assert not cuda_kv_layout.fp16_operands(lay), f"{case.name}: {lay.partial_template}"
            out.append(compare(q.astype(mx.float32), parts, case.dim ** -0.5, None,
                               case.name + " (exact products, float32 queries)"))
        return out
    finally:
        cuda_kv_plan.KV_MMA_EXACT = saved


def check_masks() -> list[str]:
    case = Case(b=2, kv=2, r=4, dim=128, ctx=900)
    q, parts, _ = cache_parts(case, seed=7)
    total, b = parts.length, case.b
    rng = np.random.default_rng(0)
    out = []
    keep = rng.random(total) > 0.3
    out.append(compare(q, parts, 0.09, mx.array(keep), "bool mask (T,)"))
    out.append(compare(q, parts, 0.09, mx.array(rng.random((b, 1, 1, total)) > 0.5),
                       "bool mask (B, 1, 1, T)"))
    add = rng.standard_normal((1, total)).astype(np.float32)
    add[0, ::5] = -np.inf
    out.append(compare(q, parts, 0.09, mx.array(add), "additive mask with -inf (1, T)"))
    hide = np.ones(total, bool)
    hide[case.sink : case.sink + parts.lengths[1]] = False
    out.append(compare(q, parts, 0.09, mx.array(hide), "mask hiding every compressed token"))
    out.append(compare(q, parts, 0.09, "causal", "causal (one query: no mask)"))
    return out


def check_decode_steps() -> list[str]:
    """Consecutive decode steps of one cache, across a flush into the compressed part: the
    kernel (whose Layout and compressed view are reused between steps) matches each step."""
    case = Case(kv=2, r=4, ctx=1000)
    q, parts, cache = cache_parts(case, seed=11)
    out, layouts = [], set()
    key = mx.random.key(5)
    for i in range(70):  # block 64: at least one flush on the way
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((1, case.kv, 1, case.dim), key=k1).astype(mx.bfloat16)
        v = mx.random.normal((1, case.kv, 1, case.dim), key=k2).astype(mx.bfloat16)
        parts, _ = cache.update_and_fetch(k, v)
        layouts.add(id(cuda_kv.prepare(q, parts, 0.09).layout))
        # decode_attention's launch, from the layout kept with the packed span after the
        # first step over it, is prepare's launch: the same bits
        got = cuda_kv.decode_attention(q, parts, 0.09)
        want = cuda_kv.run(cuda_kv.prepare(q, parts, 0.09))
        assert mx.array_equal(got, want), f"decode step {i}: decode_attention != prepare + run"
        if i % 10 == 0 or i == 69:
            out.append(compare(q, parts, 0.09, None, f"decode step {i}"))
    assert len(layouts) <= 3, f"{len(layouts)} layouts for 70 steps: the Layout is not reused"
    return out


def check_wide_merge() -> list[str]:
    """The candidate merge (`cuda_kv_sources._MERGE_WIDE`, KV_MERGE_WIDE): head dims 64/128/256,
    many chunks, two fp16 chunks, float32 parts, a mask."""
    saved = cuda_kv_plan.KV_MERGE_WIDE
    cuda_kv_plan.KV_MERGE_WIDE = True
    try:
        out = []
        for case in (Case(), Case(dim=64, kv=4, r=2), Case(kv=1, r=2, dim=256, bits=(4, 4),
                     ctx=700), Case(kv=8, r=4, ctx=40000), Case(kv=2, r=4, ctx=3000, window=400),
                     Case(kv=2, r=4, ctx=900, dtype="float32"), Case(b=2, bits=(8, 8))):
            q, parts, _ = cache_parts(case, seed=13)
            lay = cuda_kv.prepare(q, parts, case.dim ** -0.5).layout
            assert lay.merge_kernel == "tq_kv_merge_wide", f"{case.name}: {lay.merge_kernel}"
            out.append(compare(q, parts, case.dim ** -0.5, None, case.name + " (wide merge)"))
        q, parts, _ = cache_parts(Case(b=2, kv=2, r=4, ctx=900), seed=7)
        keep = np.random.default_rng(1).random(parts.length) > 0.3
        out.append(compare(q, parts, 0.09, mx.array(keep), "bool mask (T,) (wide merge)"))
        return out
    finally:
        cuda_kv_plan.KV_MERGE_WIDE = saved


def check_compiled_compression() -> list[str]:
    """A decode step's block compressed by the mx.compile'd kv_quantize (the default on a
    GPU, runtime/kvcache.COMPILED_FLUSH) against the plain one, on the GPU: the same codes
    (a code may differ only where fused float arithmetic moves a coordinate across a
    threshold) and norms within fp16 rounding."""
    from turboquant.runtime import kvcache
    from turboquant.runtime.kvcache import TurboQuantKVCache

    out, saved = [], kvcache.COMPILED_FLUSH
    key = mx.random.key(9)
    k = (mx.random.normal((1, 8, 700, 128), key=key) * 3).astype(mx.bfloat16)
    try:
        for bits in ((4, 3), (8, 8), (2, 4)):
            packed = {}
            for mode in ("0", "auto"):
                kvcache.COMPILED_FLUSH = mode
                cache = TurboQuantKVCache(*bits, sink=4, window=128, block=64)
                cache.update_and_fetch(k[:, :, :500], k[:, :, :500])
                for i in range(500, 700):  # decode: three block-sized compressions
                    cache.update_and_fetch(k[:, :, i : i + 1], k[:, :, i : i + 1])
                packed[mode] = cache.parts().packed
            a, b = packed["0"], packed["auto"]
            assert kvcache._compiled_kv_quantize.cache_info().currsize > 0, "compiled path unused"
            for name in ("k_codes", "v_codes"):
                x, y = getattr(a, name), getattr(b, name)
                differ = mx.sum(x != y).item()
                assert differ <= x.size // 10000, f"K{bits[0]}V{bits[1]} {name}: {differ} words differ"
            for name in ("k_norms", "v_norms"):
                x, y = (getattr(p, name).astype(mx.float32) for p in (a, b))
                assert mx.allclose(x, y, rtol=2e-3, atol=0).item(), f"{name} differ"
            out.append(f"K{bits[0]}V{bits[1]}: compiled compression matches "
                       f"({a.length} tokens compressed)")
    finally:
        kvcache.COMPILED_FLUSH = saved
    return out


def check_fallbacks() -> list[str]:
    """Cases the kernel declines fall back to the reference through the hook."""
    from turboquant.runtime import kv_attention

    out = []
    for case in BELOW_WINDOW:
        q, parts, _ = cache_parts(case)
        assert parts.packed is None, f"{case.name}: expected nothing compressed"
        try:
            cuda_kv.prepare(q, parts, 0.1)
            raise AssertionError(f"{case.name}: the kernel should decline an uncompressed cache")
        except NotImplementedError:
            pass
        got = kv_attention.turboquant_attention(q, parts, 0.1)
        want = tq_attention(q, parts, 0.1)
        assert mx.array_equal(got, want).item(), f"{case.name}: fallback differs from reference"
        out.append(f"{case.name}: declined, reference used")
    q, parts, _ = cache_parts(Case(kv=2, r=4, ctx=600))
    per_head = mx.ones((1, 8, 1, parts.length), dtype=mx.bool_)
    got = kv_attention.turboquant_attention(q, parts, 0.1, per_head)
    assert mx.allclose(got, tq_attention(q, parts, 0.1, per_head)).item(), "per-head mask fallback"
    out.append("per-head mask: declined, reference used")
    return out


def check_hook_loads_kernel() -> str:
    """On CUDA the hook imports kernels/cuda_kv.py by itself and runs it for decode."""
    from turboquant.runtime import kv_attention

    saved = dict(kv_attention._KERNELS), set(kv_attention._SETTLED)
    kv_attention._KERNELS.clear()
    kv_attention._SETTLED.clear()
    try:
        assert kv_attention.kernel_for("cuda") is cuda_kv.decode_attention, "not loaded lazily"
        q, parts, _ = cache_parts(Case(kv=2, r=4, ctx=600))
        got = kv_attention.turboquant_attention(q, parts, 0.1)
        direct = cuda_kv.decode_attention(q, parts, 0.1)
        assert mx.array_equal(got, direct).item(), "the hook did not run the kernel"
    finally:
        kv_attention._KERNELS.clear()
        kv_attention._KERNELS.update(saved[0])
        kv_attention._SETTLED.clear()
        kv_attention._SETTLED.update(saved[1])
    return "hook: cuda_kv loaded lazily and used for one-token decode"


def check_model_decode() -> str:
    """A small Llama decodes with the kernel as with the reference (teacher forced logits)."""
    from mlx_lm.models import llama

    from turboquant.runtime import kv_attention
    from turboquant.runtime.kvcache import make_turboquant_cache

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=4,
                           intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=64, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                           tie_word_embeddings=False)
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, args.vocab_size, (1, 420), key=mx.random.key(4))
    calls = []

    def spy(q, p, s, m):
        calls.append(q.shape)
        return cuda_kv.decode_attention(q, p, s, m)

    def run(use_kernel: bool):
        cache = make_turboquant_cache(model, window=32, protect_layers=1, block=16)
        model(tokens[:, :400], cache=cache)
        logits = []
        for i in range(400, 420):
            if use_kernel:
                logits.append(model(tokens[:, i : i + 1], cache=cache))
            else:
                with kv_attention.reference_only():
                    logits.append(model(tokens[:, i : i + 1], cache=cache))
            mx.eval(logits[-1])
        return mx.concatenate(logits, axis=1)

    saved = kv_attention._KERNELS.get("cuda")
    kv_attention.register_kernel("cuda", spy)
    try:
        with_kernel = run(True)
        assert calls, "the decode kernel was never called"
        reference_logits = run(False)
    finally:
        if saved is None:
            kv_attention.unregister_kernel("cuda")
        else:
            kv_attention.register_kernel("cuda", saved)
    err = float(mx.max(mx.abs(with_kernel - reference_logits)))
    top = float(mx.mean(with_kernel.argmax(-1) == reference_logits.argmax(-1)))
    msg = (f"model decode: {len(calls)} kernel calls, logits max abs diff {err:.3g}, "
           f"greedy agreement {top:.2f}")
    assert err < 1e-2 * max(1.0, float(mx.max(mx.abs(reference_logits)))), msg
    return msg


# ---------------------------------------------------------------------------- entry points

# the checks besides the cases: (name, check) -> the lines it reports, or one line
CHECKS = [("masks", check_masks), ("exact_products", check_exact_products),
          ("fp_chunks_of_a_tile", check_fp_chunks_of_a_tile),
          ("decode_steps", check_decode_steps), ("declined_cases_fall_back", check_fallbacks),
          ("compiled_compression", check_compiled_compression),
          ("wide_merge", check_wide_merge),
          ("hook_loads_the_kernel", check_hook_loads_kernel),
          ("model_decode_matches_reference", check_model_decode)]


def _report(res) -> list[str]:
    return res if isinstance(res, list) else [res]


if pytest is not None:

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_kernel_matches_reference(case):
        for line in check_case(case):
            print(line)

    @pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
    def test_check(check):
        for line in _report(check()):
            print(line)


def main() -> int:
    if not on_cuda():
        print(f"SKIP: MLX is not running on CUDA (backend {dispatch.backend()!r})")
        return 0
    checks = [(c.name, lambda c=c: check_case(c)) for c in CASES] + CHECKS
    failed = 0
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            for line in _report(fn()):
                print(f"PASS {name}: {line}")
        except Exception as e:  # noqa: BLE001 - report every case, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            if not isinstance(e, AssertionError):
                traceback.print_exc()
        print(f"     ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"\n{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

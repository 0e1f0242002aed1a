"""runtime/whole_step.py: a fused model's single-token step as one compiled function.

On the CPU with the pure-MLX kernels (the CUDA ones run in tests/test_kernels_cuda_attend.py),
the whole step must give the per-layer step's logits and tokens, keep mlx-lm's `KVCache`
consistent (offset, rows written, buffers grown), update the buffers in place, and step
aside for anything it does not take.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from turboquant.kernels import attend
from turboquant.runtime import whole_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode  # noqa: E402  (the benchmark scripts build the models)

TINY, TINY_MOE = decode.TINY_LLAMA, decode.TINY_MOE  # 2-layer models of the benchmark


@pytest.fixture
def cpu_whole_step(monkeypatch):
    """The whole step on the CPU: pure-MLX kernels (traceable), the CPU a backend it takes."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    monkeypatch.setattr(whole_step, "BACKENDS", ("cpu",))
    monkeypatch.setattr(whole_step, "WHOLE_STEP", True)  # the default (TURBOQUANT_WHOLE_STEP=1)
    try:
        with decode.reference_kernel("linear_group", True), \
                decode.reference_kernel("matvec", True), \
                decode.reference_kernel("gather_matmul", True):
            yield
    finally:
        mx.set_default_device(device)


def _model(monkeypatch, moe: bool = False):
    if moe:
        monkeypatch.setattr(decode, "QWEN3_30B_A3B", dict(decode.QWEN3_30B_A3B, **TINY_MOE))
    else:
        monkeypatch.setattr(decode, "LLAMA3_8B", dict(decode.LLAMA3_8B, **TINY))
    return decode.build("tq3", moe=moe)


def _greedy(model, prompt: list[int], tokens: int, cache=None):
    """(tokens, each step's last logits, the cache): greedy decoding a token at a time."""
    cache = cache if cache is not None else make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out, seen = [], []
    for _ in range(tokens):
        y = mx.argmax(logits, axis=-1)
        out.append(y.item())
        logits = model(y[:, None], cache=cache)[:, -1]
        seen.append(logits)
    return out, seen, cache


def _counting_runs(monkeypatch) -> list:
    calls = []
    run = whole_step._run

    def counted(*args):
        calls.append(1)
        return run(*args)

    monkeypatch.setattr(whole_step, "_run", counted)
    return calls


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "qwen3_moe"])
def test_the_whole_step_gives_the_per_layer_steps_logits(cpu_whole_step, monkeypatch, moe):
    model = _model(monkeypatch, moe)
    inner = model.model
    assert isinstance(inner, whole_step.WholeStepModel)
    calls = _counting_runs(monkeypatch)
    prompt = list(range(1, 17))
    monkeypatch.setattr(whole_step, "WHOLE_STEP", False)
    want, want_logits, _ = _greedy(model, prompt, 12)
    assert not calls
    monkeypatch.setattr(whole_step, "WHOLE_STEP", True)
    got, got_logits, cache = _greedy(model, prompt, 12)
    assert len(calls) == 12  # every single-token step took the compiled whole step
    assert got == want
    for a, b in zip(want_logits, got_logits):
        scale = mx.max(mx.abs(a)).item()
        assert scale > 0 and mx.max(mx.abs(a - b)).item() <= 1e-5 * scale
    assert all(c.offset == len(prompt) + 12 for c in cache)


def test_the_buffers_grow_and_hold_what_mlx_lms_cache_holds(cpu_whole_step, monkeypatch):
    model = _model(monkeypatch)
    monkeypatch.setattr(whole_step, "GROW", 8)
    prompt = list(range(3, 12))

    def small_steps():
        cache = make_prompt_cache(model)
        for c in cache:
            c.step = 8  # mlx-lm's buffer: 16 rows after the 9-token prompt
        return cache

    monkeypatch.setattr(whole_step, "WHOLE_STEP", False)
    _, _, want = _greedy(model, prompt, 20, small_steps())
    monkeypatch.setattr(whole_step, "WHOLE_STEP", True)
    _, _, got = _greedy(model, prompt, 20, small_steps())
    n = len(prompt) + 20
    for a, b in zip(want, got):
        assert b.offset == a.offset == n
        assert b.keys.shape[2] == 40  # 16 -> 24 -> 40: half as long again, GROW's multiples
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert mx.array_equal(x[..., :n, :], y[..., :n, :]).item()


def test_the_buffers_grow_by_half_so_a_long_decode_retraces_few_times():
    """Each new buffer size is a new trace of the whole step: from a short prompt's 256 rows
    to 32K tokens the buffers take 8 sizes (32 at a fixed GROW), each a multiple of GROW
    and at least the rows asked for, with fewer rows to spare than half the rows in use
    plus 2 GROW."""
    grow, sizes, size = whole_step.GROW, [], 256
    for rows in range(257, 32769):
        if rows > size:
            size = whole_step.grown_size(size, rows)
            sizes.append(size)
            assert size >= rows and size % grow == 0
            assert size - rows < max(rows // 2, grow) + grow
    assert sizes == [2048, 3072, 5120, 8192, 12288, 18432, 27648, 41984]
    assert whole_step.grown_size(4352, 5000) == 7168  # after a 4K prompt: 4352 * 1.5, rounded


def test_the_buffers_are_updated_in_place(cpu_whole_step, monkeypatch):
    model = _model(monkeypatch)
    cache = make_prompt_cache(model)
    for c in cache:
        c.step = 1 << 15  # buffers far larger than a step's temporaries (the weights' decode)
    _greedy(model, [1, 2, 3], 1, cache)
    before = [c.keys.shape for c in cache]
    mx.eval([c.state for c in cache])
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    y = mx.array([[5]])
    for _ in range(4):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(y, [c.keys for c in cache], [c.values for c in cache])
    buffers = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert [c.keys.shape for c in cache] == before
    # a copy of the buffers each step would raise the peak by their size at least
    assert buffers >= 8 * 2**20 and mx.get_peak_memory() - start < buffers / 4


def test_other_caches_and_calls_take_mlx_lms_step(cpu_whole_step, monkeypatch):
    model = _model(monkeypatch)
    calls = _counting_runs(monkeypatch)
    quantized = [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    _greedy(model, [1, 2, 3], 2, quantized)  # not a plain KVCache
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    model(mx.array([[4, 5]]), cache=cache)  # two tokens
    model(mx.array([[6]]))  # no cache
    assert not calls
    model(mx.array([[6]]), cache=cache)
    assert len(calls) == 1 and all(type(c) is KVCache and c.offset == 6 for c in cache)


def test_a_compressed_kv_cache_takes_mlx_lms_step(cpu_whole_step, monkeypatch):
    """TurboQuant's KV cache has no `keys` buffer: the whole step steps aside (it raised
    AttributeError on CUDA, where the whole step is on, before its type was asked)."""
    from turboquant.runtime.kvcache import kv_cache_from_args

    model = _model(monkeypatch)
    calls = _counting_runs(monkeypatch)
    tokens, _, cache = _greedy(model, [1, 2, 3], 3, kv_cache_from_args(model, 4, 3))
    assert not calls and len(tokens) == 3 and cache[0].offset == 6


def test_a_model_whose_blocks_are_not_all_fused_is_not_enabled(monkeypatch):
    monkeypatch.setattr(decode, "LLAMA3_8B", dict(decode.LLAMA3_8B, **TINY))
    assert not isinstance(decode.build("tq3-grouped").model, whole_step.WholeStepModel)
    assert not isinstance(decode.build("bf16").model, whole_step.WholeStepModel)


@pytest.mark.parametrize("size, position", [(1, 0), (16, 0), (16, 9), (300, 299), (300, 17)])
def test_the_reference_attends_over_the_rows_up_to_the_position(size, position):
    mx.random.seed(size + position)
    q = mx.random.normal((2, 6, 1, 32))
    k, v = mx.random.normal((2, 3, size, 32)), mx.random.normal((2, 3, size, 48))
    got = attend.buffer_attention(q, k, v, mx.array(position, mx.int32), 0.2)
    n = position + 1
    want = mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=0.2)
    assert got.shape == (2, 6, 1, 48)
    assert mx.allclose(got, want, atol=1e-6, rtol=1e-5).item()


def test_the_whole_step_is_on_by_default_and_off_when_asked(cpu_whole_step, monkeypatch):
    """On by default since 2026-12-01 (TURBOQUANT_WHOLE_STEP=0 turns it off): off, an
    enabled model steps per layer."""
    def read(env_value):
        env = {k: v for k, v in os.environ.items() if k != "TURBOQUANT_WHOLE_STEP"}
        if env_value is not None:
            env["TURBOQUANT_WHOLE_STEP"] = env_value
        out = subprocess.run(
            [sys.executable, "-c", "from turboquant.runtime import whole_step as w; "
             "print(w.WHOLE_STEP)"], env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert (read(None), read("0"), read("1")) == ("True", "False", "True")
    model = _model(monkeypatch)
    calls = _counting_runs(monkeypatch)
    monkeypatch.setattr(whole_step, "WHOLE_STEP", False)
    _greedy(model, [1, 2, 3], 3, make_prompt_cache(model))
    assert not calls


def test_past_max_context_the_per_layer_step_takes_over(cpu_whole_step, monkeypatch):
    """From MAX_CONTEXT cached tokens on, mlx-lm's per-layer step runs (MLX's attention is
    faster there), on the same cache: the tokens match the per-layer decode's."""
    model = _model(monkeypatch)
    prompt = list(range(3, 12))
    monkeypatch.setattr(whole_step, "WHOLE_STEP", False)
    want, _, _ = _greedy(model, prompt, 12, make_prompt_cache(model))
    monkeypatch.setattr(whole_step, "WHOLE_STEP", True)
    monkeypatch.setattr(whole_step, "MAX_CONTEXT", len(prompt) + 5)
    calls = _counting_runs(monkeypatch)
    got, _, cache = _greedy(model, prompt, 12, make_prompt_cache(model))
    assert len(calls) == 5 and got == want and cache[0].offset == len(prompt) + 12


@pytest.fixture
def ordered_kernel(cpu_whole_step):
    """A CPU "buffer_attention" that, like the CUDA kernel, takes `after` (the reference's
    values); yields the `after` shapes each traced call got."""
    from turboquant.kernels import dispatch

    seen = []

    def kernel(queries, keys, values, position, scale, slot=None, store=None, after=None):
        seen.append(None if after is None else (after.shape, after.dtype, slot))
        return attend.buffer_attention(queries, keys, values, position, scale, slot, store)

    kernel.orders_after = True
    dispatch.register("cpu", "buffer_attention", kernel)
    try:
        yield seen
    finally:
        dispatch.unregister("cpu", "buffer_attention")


def test_each_layers_launch_is_ordered_after_its_last_one(ordered_kernel, monkeypatch):
    """MLX's CUDA graphs order a kernel only after the last writer of its inputs: the
    whole step hands each layer's launch the layer's last attention output (`after`), so
    two steps' launches over the same buffers and counters never run at once (issue 35:
    a decode fed its tokens ran them at once and merged stale partials)."""
    model = _model(monkeypatch)
    steps = []
    compiled_for = whole_step.fuse.compiled_for

    def recording(owner, build):
        step = compiled_for(owner, build)

        def run(tokens, position, keys, values, done):
            out = step(tokens, position, keys, values, done)
            steps.append((list(done), out[3]))
            return out

        return run

    monkeypatch.setattr(whole_step.fuse, "compiled_for", recording)
    cache = make_prompt_cache(model)
    _greedy(model, [1, 2, 3], 4, cache)
    heads, dim = model.layers[0].q_heads[0], model.layers[0].kv_heads[2]
    assert len(steps) == 4 and len(ordered_kernel) == len(model.layers)  # traced once
    assert all(shape == (1, heads, 1, dim) for shape, _, _ in ordered_kernel)
    assert len({slot for _, _, slot in ordered_kernel}) == len(model.layers)
    assert not any(mx.any(d).item() for d in steps[0][0])  # zeros before the first step
    for (_, made), (given, _) in zip(steps, steps[1:]):
        assert all(a is b for a, b in zip(made, given))  # the last step's outputs, as they are
    assert all(getattr(c, whole_step.ATTENDED) is o for c, o in zip(cache, steps[-1][1]))
    model(mx.array([[7, 8]]), cache=cache)  # mlx-lm's step waits for them, and drops them
    assert all(getattr(c, whole_step.ATTENDED) is None for c in cache)


def test_a_growing_buffer_waits_for_the_last_steps_stores(ordered_kernel, monkeypatch):
    """Growing copies the buffers, a copy MLX's graph would not order after the launches
    that stored into them: the last step's launches are evaluated first."""
    model = _model(monkeypatch)
    monkeypatch.setattr(whole_step, "GROW", 8)
    settled = []
    settle = whole_step._settle
    monkeypatch.setattr(whole_step, "_settle", lambda cache: settled.append(
        [getattr(c, whole_step.ATTENDED, None) for c in cache]) or settle(cache))
    cache = make_prompt_cache(model)
    for c in cache:
        c.step = 8
    _greedy(model, list(range(3, 10)), 12, cache)
    grown = [s for s in settled if all(d is not None for d in s)]
    assert grown and cache[0].keys.shape[2] > 16


def assert_the_same_logits_every_time(model, monkeypatch, steps: int = 260):
    """Determinism (issue 35): the whole step over the same inputs gives bit-identical
    logits: a decode of the same tokens fed in, built lazily (on CUDA, MLX's graphs then
    hold several steps at once: what let two steps' launches run together before `after`
    ordered them), twice over fresh caches; then the last step run twice more on its cache
    (its row stored again). Also run by the GPU file (`tests/test_kernels_cuda_attend.py`)."""
    calls = _counting_runs(monkeypatch)
    prompt = mx.array([list(range(1, 40))])
    vocab = model.model.embed_tokens.weight.shape[0]
    fed = [int(t) for t in mx.random.randint(0, vocab, (steps,), key=mx.random.key(0)).tolist()]

    def decode_fed():
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)
        rows = [model(mx.array([[t]]), cache=cache)[0, -1] for t in fed]
        mx.eval(rows)
        return rows, cache

    first, cache = decode_fed()
    second, _ = decode_fed()
    assert len(calls) == 2 * steps and cache[0].offset == 39 + steps
    same = [mx.array_equal(a, b).item() for a, b in zip(first, second)]
    assert all(same), f"{same.count(False)} of {steps} steps differ"
    again = []
    for _ in range(2):
        for c in cache:
            c.offset -= 1
        again.append(model(mx.array([[fed[-1]]]), cache=cache)[0, -1])
        mx.eval(again[-1])
    assert mx.array_equal(again[0], again[1]).item() and mx.array_equal(again[0], first[-1]).item()


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "qwen3_moe"])
def test_a_decode_step_gives_the_same_logits_every_time(cpu_whole_step, monkeypatch, moe):
    monkeypatch.setattr(whole_step, "GROW", 64)
    assert_the_same_logits_every_time(_model(monkeypatch, moe), monkeypatch, steps=90)

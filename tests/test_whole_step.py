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

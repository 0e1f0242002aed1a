"""CUDA "buffer_attention" (`kernels/cuda_attend.py`): one token's attention over a KV
buffer whose length is read on the GPU.

Everywhere: the chunk plan and the shapes the kernel takes; where nvcc is installed, the
three kernels' source compiled for the shapes models use. On the GPU machine (MLX's CUDA
build): the kernel's values against the reference (`kernels/attend.py`) for one chunk and
many, every group size and position, and a model's decode through the compiled whole step
(`runtime/whole_step.py`) against its per-layer step.

Where a C++ compiler is, the kernels run on the CPU (`tests/cuda_emulation.py`) against
float64 attention, both merges: `test_kernels_cuda_attend_emulated.py`, and the merge of many
chunks in `test_kernels_cuda_attend_merge_emulated.py` (files apart, so that two test
processes share the emulation's minutes).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from turboquant.kernels import attend, cuda_attend

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cuda_source  # noqa: E402

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
on_gpu = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")


# ---------------------------------------------------------------------------- everywhere


@pytest.mark.parametrize("size", [1, 16, 64, 65, 256, 1024, 4096, 16384, 32768, 1 << 20])
def test_the_plan_covers_the_buffer_in_whole_chunks(size):
    rows, chunks = cuda_attend.plan(size)
    assert rows >= cuda_attend.CHUNK_TOKENS and rows * chunks >= size > rows * (chunks - 1)
    assert chunks <= cuda_attend.MAX_CHUNKS


def test_the_kernel_takes_the_shapes_of_the_models_it_serves():
    ok = cuda_attend.supports
    for heads, kv, dim in ((32, 8, 128), (32, 4, 128), (28, 4, 128), (64, 8, 128), (16, 16, 64),
                           (40, 8, 128), (14, 2, 64), (16, 2, 256), (8, 8, 256)):
        assert ok((1, heads, 1, dim), (1, kv, 512, dim), (1, kv, 512, dim), mx.bfloat16)
        assert ok((2, heads, 1, dim), (2, kv, 512, dim), (2, kv, 512, dim), mx.float16)
    assert not ok((1, 32, 1, 128), (1, 8, 512, 128), (1, 8, 512, 128), mx.float32)
    assert not ok((1, 32, 2, 128), (1, 8, 512, 128), (1, 8, 512, 128), mx.bfloat16)  # 2 queries
    assert not ok((1, 32, 1, 96), (1, 8, 512, 96), (1, 8, 512, 96), mx.bfloat16)  # 96 / 8 = 12
    assert not ok((1, 30, 1, 128), (1, 8, 512, 128), (1, 8, 512, 128), mx.bfloat16)
    assert not ok((1, 32, 1, 128), (1, 2, 512, 128), (1, 2, 512, 128), mx.bfloat16)  # R = 16
    assert not ok((1, 32, 1, 128), (1, 8, 512, 128), (1, 8, 512, 64), mx.bfloat16)  # Dv != D


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_kernels_compile_without_spills(tmp_path):
    """The one-launch kernel (last-block merge), and MERGE "launch"'s two: the partials
    and the merge; each with and without the store of the new token."""
    source = cuda_attend._HEADER
    join = cuda_attend._filled(cuda_attend._JOIN)
    for dtype in (mx.bfloat16, mx.float16):
        for d, r in ((128, 4), (128, 8), (64, 7), (256, 2), (128, 1), (64, 8)):
            name = f"{d}_{r}_{dtype}".replace("mlx.core.", "")
            template = [("T", dtype), ("D", d), ("R", r), ("CH", 64)]
            for merge, store in (("block", False), ("block", True), ("launch", True)):
                ins, body = cuda_attend.kernel_source(0.125, merge, store)
                source += cuda_source.kernel_source(
                    f"{merge}_{int(store)}_{name}", ins, ["out", "ml", "part"], body,
                    [mx.int32 if n in ("position", "counter") else dtype for n in ins],
                    [dtype, mx.float32, mx.float32], template)
            source += cuda_source.kernel_source(
                "join_" + name, ["ml", "part", "position"], ["out"], join,
                [mx.float32, mx.float32, mx.int32], [dtype], template + [("KVH", 8)])
    cuda_source.compile_with_nvcc(source, tmp_path, "attend")


# ---------------------------------------------------------------------------- on the GPU


@on_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, kv, dim", [(32, 8, 128), (8, 8, 64), (28, 4, 128), (16, 2, 256)])
@pytest.mark.parametrize("size, position", [(64, 0), (64, 63), (256, 0), (256, 16), (1024, 1023),
                                            (1025, 700), (4096, 4095), (4096, 130),
                                            (40000, 39000)])
def test_the_kernel_matches_the_reference(dtype, heads, kv, dim, size, position):
    mx.random.seed(size + position + heads)
    q = mx.random.normal((2, heads, 1, dim)).astype(dtype)
    k = mx.random.normal((2, kv, size, dim)).astype(dtype)
    v = mx.random.normal((2, kv, size, dim)).astype(dtype)
    pos = mx.array(position, mx.int32)
    got = cuda_attend.buffer_attention(q, k, v, pos, dim ** -0.5)
    n = position + 1
    want = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), k[:, :, :n].astype(mx.float32), v[:, :, :n].astype(mx.float32),
        scale=dim ** -0.5)
    assert got.shape == (2, heads, 1, dim) and got.dtype == dtype
    err = mx.max(mx.abs(got.astype(mx.float32) - want)).item()
    assert err <= 2e-2, err


@on_gpu
@pytest.mark.parametrize("size, position", [(64, 10), (1024, 1023), (1025, 700), (4096, 130),
                                            (40000, 39000)])
def test_the_two_launch_merge_matches_the_reference(monkeypatch, size, position):
    """MERGE "launch": the chunks' partials merged by a second launch (no counters)."""
    monkeypatch.setattr(cuda_attend, "MERGE", "launch")
    test_the_kernel_matches_the_reference(mx.bfloat16, 32, 8, 128, size, position)
    test_the_kernel_matches_the_reference(mx.float16, 28, 4, 128, size, position)


@on_gpu
def test_rows_past_the_position_do_not_count():
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16)
    pos = mx.array(100, mx.int32)
    a = cuda_attend.buffer_attention(q, k, v, pos, 0.1)
    def junk(x):
        return mx.concatenate([x[:, :, :101], 1e3 * mx.ones_like(x[:, :, 101:])], axis=2)

    b = cuda_attend.buffer_attention(q, junk(k), junk(v), pos, 0.1)
    assert mx.array_equal(a, b).item()


@on_gpu
def test_a_slot_serves_launch_after_launch():
    """Launches sharing a slot's counters, one after another: each launch's last blocks
    reset them for the next (a stale count would let a block merge before the others)."""
    q = mx.random.normal((2, 32, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((2, 8, 4096, 128)).astype(mx.bfloat16)
    v = mx.random.normal((2, 8, 4096, 128)).astype(mx.bfloat16)
    want = cuda_attend.buffer_attention(q, k, v, mx.array(3000, mx.int32), 0.1)
    for position in (3000, 10, 3000, 4095, 3000):
        got = cuda_attend.buffer_attention(q, k, v, mx.array(position, mx.int32), 0.1, slot="t")
        mx.eval(got)
        if position == 3000:
            assert mx.array_equal(got, want).item()
    assert not mx.any(cuda_attend._counters("t")).item()


@on_gpu
def test_the_reference_is_the_kernels_oracle_through_dispatch():
    from turboquant.kernels import dispatch

    assert dispatch.registered("cuda", "buffer_attention") is cuda_attend.buffer_attention
    assert dispatch.get("buffer_attention").__wrapped__ is cuda_attend.buffer_attention
    assert attend.buffer_attention is not cuda_attend.buffer_attention


@on_gpu
@pytest.mark.parametrize("merge", ["block", "launch"])
@pytest.mark.parametrize("moe", [False, True], ids=["llama", "qwen3_moe"])
def test_the_whole_step_decodes_as_the_per_layer_step_on_the_gpu(monkeypatch, moe, merge):
    import decode
    from mlx_lm.models.cache import make_prompt_cache

    from turboquant.runtime import whole_step

    if moe:
        monkeypatch.setattr(decode, "QWEN3_30B_A3B", dict(
            decode.QWEN3_30B_A3B, num_hidden_layers=2, hidden_size=512, moe_intermediate_size=256,
            num_experts=16, num_experts_per_tok=4, vocab_size=1024))
    else:
        monkeypatch.setattr(decode, "LLAMA3_8B", dict(
            decode.LLAMA3_8B, num_hidden_layers=3, hidden_size=1024, intermediate_size=2048,
            num_attention_heads=16, num_key_value_heads=4, vocab_size=1024))
    monkeypatch.setattr(whole_step, "GROW", 64)
    monkeypatch.setattr(cuda_attend, "MERGE", merge)
    model = decode.build("tq3", moe=moe)
    assert isinstance(model.model, whole_step.WholeStepModel)

    def decode_with(on: bool, forced=None):
        """Greedy tokens (or `forced` ones fed in) and each step's logits."""
        monkeypatch.setattr(whole_step, "WHOLE_STEP", on)
        cache = make_prompt_cache(model)
        logits = model(mx.array([list(range(1, 40))]), cache=cache)[:, -1]
        tokens, rows = [], []
        for i in range(300):  # past mlx-lm's 256 rows and several GROW steps
            y = mx.argmax(logits, axis=-1) if forced is None else mx.array([forced[i]])
            tokens.append(y.item())
            logits = model(y[:, None], cache=cache)[:, -1]
            rows.append(logits.astype(mx.float32))
        return tokens, rows, cache

    tokens, want, layered = decode_with(False)
    _, got, cache = decode_with(True, forced=tokens)
    assert cache[0].offset == 339 and cache[0].keys.shape[2] == 384
    # the first layer's keys and values come from the embeddings alone: the launch stored
    # every token's (in place on CUDA) as mlx-lm's cache did
    for a, b in ((layered[0].keys, cache[0].keys), (layered[0].values, cache[0].values)):
        assert mx.allclose(a[:, :, :339], b[:, :, :339], atol=1e-2).item()
    errors = sorted(mx.max(mx.abs(a - b)).item() / mx.max(mx.abs(a)).item()
                    for a, b in zip(want, got))
    # bf16 logits of random weights, two attention kernels: ~1% apart, a few steps ~3%; an
    # MoE router's near-tie may flip an expert at a step or two (12% once, 2026-12-01)
    assert errors[len(errors) // 2] <= 1.5e-2 and errors[-6] <= 5e-2, errors
    same = sum(mx.argmax(a).item() == mx.argmax(b).item() for a, b in zip(want, got))
    assert same >= 0.95 * len(want)


@on_gpu
def test_the_whole_step_pipelined_as_generate_step_decodes_as_step_by_step(monkeypatch):
    """mlx-lm's `generate_step` builds and starts a token's step before the last one is
    done: the launches that store into the buffers (in place, ordered by `mx.depends`)
    must give the tokens of a decode evaluated a step at a time."""
    import decode
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from turboquant.runtime import whole_step

    monkeypatch.setattr(decode, "LLAMA3_8B", dict(
        decode.LLAMA3_8B, num_hidden_layers=3, hidden_size=1024, intermediate_size=2048,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=1024))
    monkeypatch.setattr(whole_step, "GROW", 64)
    monkeypatch.setattr(whole_step, "WHOLE_STEP", True)
    model = decode.build("tq3")
    prompt = mx.array(list(range(1, 30)))
    pipelined = [t for t, _ in generate_step(prompt, model, max_tokens=200,
                                             prompt_cache=make_prompt_cache(model))]
    cache = make_prompt_cache(model)  # as generate_step: the prompt's last token a step
    model(prompt[None, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    y, stepwise = prompt[-1:], []
    for _ in range(200):
        logits = model(y[None], cache=cache)[:, -1, :]
        y = mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
        stepwise.append(y.item())
    assert pipelined == stepwise


@on_gpu
@pytest.mark.parametrize("merge", ["block", "launch"])
@pytest.mark.parametrize("moe", [False, True], ids=["llama", "qwen3_moe"])
def test_a_decode_step_gives_the_same_logits_every_time(monkeypatch, moe, merge):
    """Determinism (issue 35): the same decode step over the same inputs gives
    bit-identical logits (`test_whole_step.assert_the_same_logits_every_time`: a fed
    decode twice, built lazily so MLX's CUDA graphs hold several steps at once, past 64
    rows (the merge runs) and a buffer's growth; and one step run again on its cache)."""
    import decode
    import test_whole_step

    from turboquant.runtime import whole_step

    if moe:
        monkeypatch.setattr(decode, "QWEN3_30B_A3B", dict(decode.QWEN3_30B_A3B, **decode.TINY_MOE))
    else:
        monkeypatch.setattr(decode, "LLAMA3_8B", dict(decode.LLAMA3_8B, **decode.TINY_LLAMA))
    monkeypatch.setattr(whole_step, "GROW", 64)
    monkeypatch.setattr(whole_step, "WHOLE_STEP", True)
    monkeypatch.setattr(cuda_attend, "MERGE", merge)
    test_whole_step.assert_the_same_logits_every_time(decode.build("tq3", moe=moe), monkeypatch)

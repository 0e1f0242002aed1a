"""CUDA "buffer_attention" (`kernels/cuda_attend.py`) run on the CPU: its kernels compiled by
the host's C++ compiler (`tests/cuda_emulation.py`) against float64 attention, both merges
("block": the last block of a group merges; "launch": a second launch does), for one chunk
and several, every query-row count a KV head, the token's store, rows past the position,
the counters and the blocks' order; two launches of a layer at once. The merge over many
chunks: `tests/test_kernels_cuda_attend_merge_emulated.py` (a file apart, so that two test
processes share the emulation's minutes); the GPU's checks: `tests/test_kernels_cuda_attend.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import cuda_attend

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_emulation  # noqa: E402


@pytest.fixture(scope="module")
def emulation_folder(tmp_path_factory):
    return cuda_emulation.folder_or_skip(tmp_path_factory, "attend_emulated")


def _forget_kernels():
    cuda_attend._kernel.cache_clear()
    cuda_attend._join_kernel.cache_clear()


@pytest.fixture
def emulated(monkeypatch, emulation_folder):
    """`cuda_attend.buffer_attention` itself, its kernels run by `cuda_emulation` (built
    once a module: the folder keeps them); yields the kernels made."""
    with cuda_emulation.emulating(monkeypatch, emulation_folder, _forget_kernels) as made:
        yield made


def attention(q, k, v, position, merge, monkeypatch, slot=None):
    monkeypatch.setattr(cuda_attend, "MERGE", merge)
    return cuda_attend.buffer_attention(q, k, v, mx.array(position, mx.int32), 0.125, slot=slot)


def softmax_attention(q, k, v, position):
    """float64 attention of q over rows 0..position, scale 0.125."""
    q, k, v = (np.array(x.astype(mx.float32), np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (np.repeat(x[:, :, :position + 1], groups, axis=1) for x in (k, v))
    s = np.einsum("bhld,bhtd->bhlt", q, k) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhlt,bhtd->bhld", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("merge", ["block", "launch"])
@pytest.mark.parametrize("dtype, heads, kv, dim", [(mx.bfloat16, 8, 2, 64),
                                                   (mx.float16, 8, 1, 128),
                                                   (mx.bfloat16, 2, 2, 32),
                                                   (mx.float16, 28, 4, 64)],
                         ids=["bf16-R4-D64", "fp16-R8-D128", "bf16-R1-D32", "fp16-R7-D64"])
@pytest.mark.parametrize("size, position", [(64, 0), (64, 63), (256, 100), (1025, 700)])
def test_the_emulated_kernel_matches_softmax_attention(emulated, monkeypatch, merge, dtype,
                                                       heads, kv, dim, size, position):
    """Every chunk count (one: no merge; four with two in use; 17), query rows a KV head
    1, 4, 7 and 8, both merges: the kernel's indexing, workers, shuffles and merges. Two
    and four KV heads (groups) in three of the shapes; R8-D128, the widest, on one (the
    emulation's time goes with its blocks)."""
    mx.random.seed(size + position + heads)
    q = mx.random.normal((1, heads, 1, dim)).astype(dtype)
    k = mx.random.normal((1, kv, size, dim)).astype(dtype)
    v = mx.random.normal((1, kv, size, dim)).astype(dtype)
    got = attention(q, k, v, position, merge, monkeypatch)
    want = softmax_attention(q, k, v, position)
    assert got.shape == q.shape and got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=1.5e-2, rtol=1e-2)
    first = emulated[0]  # the attention kernel (the join, when there is one, is second)
    if merge == "block" and size > cuda_attend.CHUNK_TOKENS:  # the counter is back to zero
        assert not first.last_inputs[4].any()


@pytest.mark.parametrize("merge", ["block", "launch"])
@pytest.mark.parametrize("size, position", [(64, 0), (256, 100), (1025, 700), (1025, 1024)])
def test_the_emulated_kernel_stores_the_new_token_and_attends_to_it(emulated, monkeypatch, merge,
                                                                    size, position):
    """`store`: the block holding the position writes the token's key and value into the
    buffers (the launch's inputs, as it left them) and attends to them; no other row
    changes. The buffers hold junk at the position before."""
    mx.random.seed(position + 7)
    q = mx.random.normal((2, 8, 1, 64)).astype(mx.bfloat16)
    k = mx.random.normal((2, 2, size, 64)).astype(mx.bfloat16)
    v = mx.random.normal((2, 2, size, 64)).astype(mx.bfloat16)
    new_k = mx.random.normal((2, 2, 1, 64)).astype(mx.bfloat16)
    new_v = mx.random.normal((2, 2, 1, 64)).astype(mx.bfloat16)
    monkeypatch.setattr(cuda_attend, "MERGE", merge)
    got = cuda_attend.buffer_attention(q, k, v, mx.array(position, mx.int32), 0.125,
                                       store=(new_k, new_v))
    at = mx.array(position).reshape(1, 1, 1, 1)
    stored_k, stored_v = (mx.put_along_axis(x, at, n, axis=2) for x, n in ((k, new_k), (v, new_v)))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               softmax_attention(q, stored_k, stored_v, position),
                               atol=1.5e-2, rtol=1e-2)
    kernel = next(e for e in emulated if "new_keys" in e.input_names)
    names = kernel.input_names
    assert np.array_equal(kernel.last_inputs[names.index("keys")], cuda_emulation.bits(stored_k))
    assert np.array_equal(kernel.last_inputs[names.index("values")], cuda_emulation.bits(stored_v))


@pytest.mark.parametrize("merge", ["block", "launch"])
def test_the_emulated_kernel_ignores_the_rows_past_the_position(emulated, monkeypatch, merge):
    mx.random.seed(3)
    q = mx.random.normal((2, 8, 1, 64)).astype(mx.bfloat16)
    k = mx.random.normal((2, 2, 300, 64)).astype(mx.bfloat16)
    v = mx.random.normal((2, 2, 300, 64)).astype(mx.bfloat16)
    junk = 1e3 * mx.ones((2, 2, 300 - 131, 64), mx.bfloat16)
    a = attention(q, k, v, 130, merge, monkeypatch)
    b = attention(q, mx.concatenate([k[:, :, :131], junk], 2),
                mx.concatenate([v[:, :, :131], junk], 2), 130, merge, monkeypatch)
    assert mx.array_equal(a, b).item()
    np.testing.assert_allclose(np.array(a.astype(mx.float32)),
                               softmax_attention(q, k, v, 130), atol=1.5e-2, rtol=1e-2)


def test_the_emulated_counters_serve_launch_after_launch(emulated, monkeypatch):
    """The one-launch merge's counters: each launch's last blocks reset them, so the next
    launch with the same array merges right (a stale count would merge early). The
    emulation cannot write into an MLX array: each launch gets the counters the last
    left, through the slot's array."""
    mx.random.seed(5)
    q = mx.random.normal((2, 8, 1, 64)).astype(mx.bfloat16)
    k = mx.random.normal((2, 2, 512, 64)).astype(mx.bfloat16)
    v = mx.random.normal((2, 2, 512, 64)).astype(mx.bfloat16)
    counters = {"emulated": mx.zeros((cuda_attend.MAX_GROUPS,), mx.int32)}
    monkeypatch.setattr(cuda_attend, "_counters", lambda slot: counters[slot])
    for position in (511, 40, 300):
        got = attention(q, k, v, position, "block", monkeypatch, slot="emulated")
        counters["emulated"] = mx.array(emulated[0].last_inputs[4])
        assert not emulated[0].last_inputs[4].any()
        np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                   softmax_attention(q, k, v, position), atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("merge", ["block", "launch"])
def test_the_emulated_kernel_gives_the_same_bits_whichever_block_runs_last(emulated, monkeypatch,
                                                                          merge):
    """Determinism of one launch: the blocks run in shuffled orders (any block of a group
    may be the one that merges) and the output is bit-identical to grid order's, the
    token stored, the counters back at zero. (Launches running at once the emulation
    cannot show: the whole step orders them, `tests/test_whole_step.py`.)"""
    mx.random.seed(11)
    q = mx.random.normal((1, 8, 1, 64)).astype(mx.bfloat16)  # a batch of one: two groups of
    k = mx.random.normal((1, 2, 1025, 64)).astype(mx.bfloat16)  # 17 chunks, 11 in use, four
    v = mx.random.normal((1, 2, 1025, 64)).astype(mx.bfloat16)  # orders of their 34 blocks
    new = tuple(mx.random.normal((1, 2, 1, 64)).astype(mx.bfloat16) for _ in range(2))
    monkeypatch.setattr(cuda_attend, "MERGE", merge)
    outputs = []
    for shuffle in (None, 1, 2, 3):
        monkeypatch.setattr(cuda_emulation.CudaKernelOnCPU, "shuffle", shuffle, raising=False)
        outputs.append(cuda_attend.buffer_attention(q, k, v, mx.array(700, mx.int32), 0.125,
                                                    store=new))
        first = emulated[0]
        if merge == "block":
            assert not first.last_inputs[first.input_names.index("counter")].any()
    assert all(mx.array_equal(outputs[0], o).item() for o in outputs[1:])
    stored = mx.put_along_axis(k, mx.array(700).reshape(1, 1, 1, 1), new[0], axis=2)
    assert np.array_equal(emulated[0].last_inputs[1], cuda_emulation.bits(stored))


@pytest.mark.parametrize("merge", ["block", "launch"])
def test_two_launches_of_a_layer_at_once_go_wrong_in_order_they_do_not(emulated, monkeypatch,
                                                                        merge):
    """Why the whole step orders a layer's launch after its last (`after`; issue 35): two
    steps' launches of one layer share the buffers and, with the one-launch merge, the
    slot's counters. Run one after the other (as ordered), each gives its attention and
    the counters end at zero; their blocks interleaved (as MLX's CUDA graphs ran them):
    with "block", a block of the second counts into the first's count, one launch merges
    before its partials are written, the other never merges; with "launch", the second
    reads the row the first has not stored yet."""
    mx.random.seed(21)
    q = [mx.random.normal((1, 8, 1, 64)).astype(mx.bfloat16) for _ in range(2)]
    k = mx.random.normal((1, 2, 256, 64)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 256, 64)).astype(mx.bfloat16)
    new = [tuple(mx.random.normal((1, 2, 1, 64)).astype(mx.bfloat16) for _ in range(2))
           for _ in range(2)]
    monkeypatch.setattr(cuda_attend, "MERGE", merge)
    p = 200  # step 1 stores row 200 and attends to 0..200; step 2 row 201, 0..201
    cuda_attend.buffer_attention(q[0], k, v, mx.array(p, mx.int32), 0.125, slot="t",
                                 store=new[0])  # builds the kernel
    kernel = next(iter(emulated[0].compiled.values()))
    names = emulated[0].input_names

    def inputs(i):
        given = dict(queries=q[i], keys=k, values=v, position=mx.array([p + i], mx.int32),
                     counter=mx.zeros((cuda_attend.MAX_GROUPS,), mx.int32),
                     new_keys=new[i][0], new_values=new[i][1])
        return [cuda_emulation.bits(given[n]) for n in names]

    shared = {"keys", "values", "counter"}
    chunk, chunks = cuda_attend.plan(256, 2)
    shapes = [(1, 8, 1, 64), (2, chunks, 4, 2), (2, chunks, 4, 64)]
    grid, group = (chunks * cuda_attend.NT, 2, 1), (cuda_attend.NT, 1, 1)
    blocks = [(0, c + chunks * g) for g in range(2) for c in range(chunks)]
    ordered = blocks + [(1, i) for _, i in blocks]
    interleaved = [x for pair in zip(blocks, [(1, i) for _, i in blocks]) for x in pair]
    if merge == "launch":  # the second launch's chunk of row 200 before the first's
        interleaved = [(1, i) for _, i in blocks] + blocks
    runs = {}
    for name, order in (("ordered", ordered), ("interleaved", interleaved)):
        runs[name] = cuda_emulation.run_pair(
            kernel, inputs(0), [None if n in shared else x for n, x in zip(names, inputs(1))],
            shapes, grid, group, order)
    (a_out, a_ins), (b_out, b_ins) = runs["ordered"]
    stored_k = mx.put_along_axis(k, mx.array(p).reshape(1, 1, 1, 1), new[0][0], axis=2)
    assert np.array_equal(a_ins[names.index("keys")][:, :, p], cuda_emulation.bits(new[0][0])[:, :, 0])
    if merge == "block":
        assert not a_ins[names.index("counter")].any()
        for out, i in ((a_out, 0), (b_out, 1)):
            keys = stored_k if i == 0 else mx.put_along_axis(
                stored_k, mx.array(p + 1).reshape(1, 1, 1, 1), new[1][0], axis=2)
            values = mx.put_along_axis(v, mx.array(p).reshape(1, 1, 1, 1), new[0][1], axis=2)
            if i == 1:
                values = mx.put_along_axis(values, mx.array(p + 1).reshape(1, 1, 1, 1),
                                           new[1][1], axis=2)
            got = np.array(cuda_emulation.from_bits(out[0], mx.bfloat16).astype(mx.float32))
            np.testing.assert_allclose(got, softmax_attention(q[i], keys, values, p + i),
                                       atol=1.5e-2, rtol=1e-2)
        (a_bad, _), (b_bad, _) = runs["interleaved"]
        wrong = [not np.array_equal(x[0], y[0]) for x, y in ((a_bad, a_out), (b_bad, b_out))]
        assert any(wrong)  # one launch merged early or never
    else:
        last = chunks - 1  # the chunk holding rows 200, 201: the second launch's partial
        (_, _), (b_bad, _) = runs["interleaved"]
        assert not np.allclose(b_bad[2][:, last], b_out[2][:, last], equal_nan=True)

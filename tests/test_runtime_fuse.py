"""Grouped q/k/v and gate/up linears (runtime/fuse.py): same results, fewer kernel calls.

On the CPU the group runs member by member (the compiled GEMV with numba, else the
reference), so logits must be identical to those of the model loaded with `fuse=False`; the count of `tq_linear_group` calls shows the grouping (on CUDA one
call is one rotation launch and one GEMV launch). The CUDA kernels themselves are compared
with the reference in tests/test_kernels_cuda_linear.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from test_runtime_fixtures import default_codec, make_checkpoint, write_repo

from turboquant import kernels
from turboquant.kernels import dispatch, group
from turboquant.runtime import load
from turboquant.runtime.fuse import (
    FusedAttentionBlock,
    FusedDecoderBlock,
    TQGroupedLinear,
    fusable_block,
    fuse_blocks,
    group_linears,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kv import graph_ops  # noqa: E402  (the benchmark script's graph count)

PROMPT = mx.array([[1, 5, 70, 33, 200, 9, 12, 250, 3, 4]])  # 10 tokens: prefill path


def _decode(model, steps: int = 3) -> list[mx.array]:
    """Logits of the prompt, then of `steps` single-token steps with a KV cache."""
    cache = make_prompt_cache(model)
    out = [model(PROMPT, cache=cache)]
    tok = mx.argmax(out[-1][:, -1:], axis=-1)
    for _ in range(steps):
        out.append(model(tok, cache=cache))
        tok = mx.argmax(out[-1][:, -1:], axis=-1)
    mx.eval(out)
    return out


def _repo(tmp_path, kind, codec=None):
    config, weights = make_checkpoint(kind, seed=3)
    write_repo(tmp_path / kind, config, weights, bits=3, codec=codec)
    return tmp_path / kind


@pytest.mark.parametrize("kind, groups", [("llama", 4), ("qwen2_moe", 4)])
def test_grouping_keeps_every_logit(tmp_path, kind, groups):
    model, _ = load(_repo(tmp_path, kind), fuse=False)
    before = _decode(model)
    assert group_linears(model) == groups  # per layer: q/k/v and gate/up (qwen2_moe's shared expert)
    after = _decode(model)
    for a, b in zip(before, after):
        assert mx.array_equal(a, b)
    attn = model.layers[0].self_attn
    assert all(isinstance(getattr(attn, n), TQGroupedLinear) for n in ("q_proj", "k_proj", "v_proj"))
    assert "bias" in attn.q_proj or kind == "llama"  # qwen2's biased q/k/v group too


def _count_calls(monkeypatch, modes: list | None = None) -> list[int]:
    """Members per linear-group kernel call from now on (and each call's extras mode):
    the kernel `dispatch.get` hands out is wrapped, so the calls a decode step makes
    through its bound group calls (`kernels.bind_linear_group`) count too."""
    calls = []
    real_get = dispatch.get

    def counting_get(op, *args):
        fn = real_get(op, *args)
        if op != "linear_group":
            return fn

        def counting(x, members, prepared=None, extras=kernels.NO_EXTRAS):
            calls.append(len(members))
            if modes is not None:
                modes.append(extras.mode)
            return fn(x, members, prepared, extras)

        return counting

    monkeypatch.setattr(dispatch, "get", counting_get)
    dispatch._changed()  # group calls bound before chose their kernel uncounted
    return calls


def test_one_call_per_group_when_decoding(tmp_path, monkeypatch):
    model, _ = load(_repo(tmp_path, "llama"), fuse=False)
    cache = make_prompt_cache(model)
    mx.eval(model(PROMPT, cache=cache))
    calls = _count_calls(monkeypatch)
    mx.eval(model(PROMPT[:, :1], cache=cache))
    assert calls == [1] * 15  # 2 layers x 7 linears, lm_head
    group_linears(model)
    calls.clear()
    mx.eval(model(PROMPT[:, :1], cache=cache))
    assert calls == [3, 1, 2, 1] * 2 + [1]  # qkv, o, gate/up, down; lm_head
    calls.clear()
    mx.eval(model(PROMPT, cache=cache))  # prefill: each linear on its own
    assert calls == [1] * 15


def test_members_with_other_codecs_stay_apart(tmp_path, monkeypatch):
    def codec(name, v):
        return 4 if name.endswith("v_proj.weight") else default_codec(name, v, 3)

    model, _ = load(_repo(tmp_path, "llama", codec=codec), fuse=False)
    before = _decode(model, steps=1)
    assert group_linears(model) == 4  # q/k and gate/up in each layer
    assert type(model.layers[0].self_attn.v_proj).__name__ == "TQLinear"
    calls = _count_calls(monkeypatch)
    after = _decode(model, steps=1)
    assert calls[-11:] == [2, 1, 1, 2, 1] * 2 + [1]  # the decode step: q/k, v, o, gate/up, down
    for a, b in zip(before, after):
        assert mx.array_equal(a, b)


def _member(out_features, bits=3, bias=None, padded_in=128):
    return group.Member(mx.zeros((out_features, 12), dtype=mx.uint32),
                        mx.zeros((out_features, 2), dtype=mx.float16), bits, 64, 128,
                        out_features, padded_in, 0, bias)


def test_fusable_rules():
    assert group.fusable((_member(64), _member(16), _member(16)))
    assert group.fusable((_member(64), _member(20)))  # only the last may end mid-block
    assert not group.fusable((_member(20), _member(64)))
    assert not group.fusable((_member(64), _member(64, bits=4)))
    assert not group.fusable((_member(64), _member(64, bias=mx.zeros((64,)))))
    assert not group.fusable((_member(64, bits="ternary"),))


def test_group_checks_the_input_width():
    with pytest.raises(ValueError, match="last axis"):
        kernels.tq_linear_group(mx.zeros((1, 96)), (_member(64),))


def test_no_output_outlives_the_forward_pass(tmp_path):
    """Groups hand each member its output once; nothing is held after the step (a held
    prefill output per layer would be gigabytes on a big model)."""
    from turboquant.runtime.layers import LinearGroup

    model, _ = load(_repo(tmp_path, "llama"), fuse=False)
    group_linears(model)
    cache = make_prompt_cache(model)
    mx.eval(model(PROMPT, cache=cache))  # prefill: layers one by one
    mx.eval(model(PROMPT[:, :1], cache=cache))  # decode: grouped
    groups = {id(g): g for _, m in model.named_modules()
              for g in (m.__dict__.get("_alone"), m.__dict__.get("_group")) if g is not None}
    assert groups and all(isinstance(g, LinearGroup) for g in groups.values())
    assert all(g.pending is None for g in groups.values())


@pytest.mark.parametrize("kind, fused, attention_only", [
    ("llama", 2, 0), ("qwen2", 2, 0), ("qwen3", 2, 0), ("qwen2_moe", 2, 2), ("mixtral", 2, 2),
    ("qwen3_moe", 2, 2)])
def test_fused_blocks_keep_every_logit(tmp_path, kind, fused, attention_only):
    """On the CPU the extras are MLX's own ops (rms_norm, the SwiGLU, the adds) done by the
    group call instead of the block: every logit stays the same, prefill and decode. MoE
    blocks get the fused attention half only (their sparse MLP stays mlx-lm's)."""
    model, _ = load(_repo(tmp_path, kind), fuse=False)
    before = _decode(model)
    group_linears(model)
    assert fuse_blocks(model) == fused
    blocks = [m for _, m in model.named_modules()]
    assert sum(isinstance(m, FusedAttentionBlock) for m in blocks) == attention_only
    assert sum(isinstance(m, FusedDecoderBlock) for m in blocks) == fused - attention_only
    after = _decode(model)
    for a, b in zip(before, after):
        assert mx.array_equal(a, b)


def _reference_kernels(monkeypatch) -> None:
    """The pure-MLX reference stands in for a GPU's kernels: graph nodes (the CPU's numba
    ones evaluate inside the call, which a trace cannot, and cut the step's graph)."""
    dispatch.get("matvec")  # the CPU backend loaded (it registers its kernels on import)
    for op in ("matvec", "matmul", "linear_group", "gather_matmul"):
        monkeypatch.delitem(dispatch._TABLE, ("cpu", op), raising=False)
        monkeypatch.delitem(dispatch._WRAPPED, ("cpu", op), raising=False)
    dispatch._changed()


def _compiling(monkeypatch, compiled: bool) -> None:
    """The reference kernels as graph nodes on the CPU (as a GPU's are), the fused blocks'
    single-token step compiled or not."""
    from turboquant.runtime import fuse

    _reference_kernels(monkeypatch)
    monkeypatch.setattr(fuse, "GRAPH_KERNEL_BACKENDS", ("cpu",))
    monkeypatch.setattr(fuse, "COMPILE_STEP", compiled)


def _close(want: list, got: list) -> None:
    """MLX may fuse the CPU's elementwise ops in a compiled step: close, not equal."""
    for a, b in zip(want, got):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_a_compiled_step_keeps_the_logits_and_is_traced_once(tmp_path, monkeypatch, kind):
    """COMPILE_STEP: a fused block's single-token step runs as two compiled halves around
    the cache (MoE blocks: with their sparse MLP), with the logits of the step built op by
    op. Python runs each half once per block, then MLX replays it at every position (RoPE's
    offset is an input of the trace, not a constant)."""
    from turboquant.runtime import fuse

    model, _ = load(_repo(tmp_path, kind), fuse=False)
    group_linears(model)
    assert fuse_blocks(model) == 2
    _compiling(monkeypatch, False)
    want = _decode(model, steps=5)
    traced, after = [], []
    queries, step_after = fuse._queries, fuse._step_after
    monkeypatch.setattr(fuse, "_queries", lambda *a: traced.append(a[0]) or queries(*a))
    monkeypatch.setattr(fuse, "_step_after", lambda *a: after.append(a[0]) or step_after(*a))
    _compiling(monkeypatch, True)
    _close(want, _decode(model, steps=5))
    assert traced == after == list(model.layers)  # once per block, not once per token
    assert all("_step_compiled" in layer.__dict__ for layer in model.layers)


@pytest.mark.parametrize("kind, prefixes", [
    ("llama", ("model.layers.0.mlp.down_proj.", "model.layers.1.input_layernorm.")),
    ("qwen3_moe", ("model.layers.0.mlp.gate.", "model.layers.1.mlp.switch_mlp.down_proj."))])
def test_a_compiled_step_follows_new_weights(tmp_path, monkeypatch, kind, prefixes):
    """A trace holds the weights it read as constants: replacing a TurboQuant layer's
    arrays (a linear's, an expert stack's), a norm's weight or a router's traces the step
    again, never serving the old weights."""
    from turboquant.runtime import fuse

    model, _ = load(_repo(tmp_path, kind), fuse=False)
    config, weights = make_checkpoint(kind, seed=4)  # other weights, same shapes
    write_repo(tmp_path / "other", config, weights, bits=3)
    other, _ = load(tmp_path / "other", fuse=False)
    for m in (model, other):
        group_linears(m), fuse_blocks(m)
    _compiling(monkeypatch, True)
    before = _decode(model)
    for prefix in prefixes:
        swapped = [(k, v) for k, v in tree_flatten(other.parameters()) if k.startswith(prefix)]
        assert swapped
        model.load_weights(swapped, strict=False)
        # the switch alone: re-registering the kernels would trace again anyway
        monkeypatch.setattr(fuse, "COMPILE_STEP", False)
        want = _decode(model)
        monkeypatch.setattr(fuse, "COMPILE_STEP", True)
        assert not mx.allclose(want[-1], before[-1], rtol=1e-4, atol=1e-4).item()
        _close(want, _decode(model))
        before = want


def test_a_model_with_compiled_steps_is_freed_when_let_go(tmp_path, monkeypatch):
    """Each block holds its compiled halves, which hold the block (a cycle) and MLX's trace
    of its weights: letting the model go (a server switching models) frees all of it."""
    import gc
    import weakref

    path = _repo(tmp_path, "llama")
    _compiling(monkeypatch, True)

    def decode_and_let_go():
        model, _ = load(path, fuse=False)
        group_linears(model), fuse_blocks(model)
        _decode(model)
        assert all("_step_compiled" in layer.__dict__ for layer in model.layers)
        return weakref.ref(model)

    first = decode_and_let_go()  # the process's own caches filled (kernels, offsets)
    gc.collect()
    assert first() is None
    before = mx.get_active_memory()
    gone = decode_and_let_go()
    gc.collect()
    assert gone() is None
    assert mx.get_active_memory() == before  # no weights kept by a trace


def test_streamed_experts_stay_out_of_the_compiled_step(tmp_path, monkeypatch):
    """Expert streaming evaluates the router's choice to read experts from disk, which a
    trace cannot: an MoE block whose experts stream compiles its attention half only, and
    decodes as it does built op by op."""
    from turboquant.runtime import fuse
    from turboquant.runtime.experts import StreamedExperts

    path = _repo(tmp_path, "qwen3_moe")
    model, _ = load(path, fuse=False, expert_budget="100%")
    group_linears(model)
    assert fuse_blocks(model) == 2
    assert any(isinstance(m, StreamedExperts) for _, m in model.named_modules())
    assert not any(layer.moe_compiles for layer in model.layers)
    _compiling(monkeypatch, False)
    want = _decode(model, steps=5)
    traced = []
    queries = fuse._queries
    monkeypatch.setattr(fuse, "_queries", lambda *a: traced.append(a[0]) or queries(*a))
    _compiling(monkeypatch, True)
    _close(want, _decode(model, steps=5))
    assert traced == list(model.layers)  # streaming changes no traced array: traced once


def test_a_step_whose_rope_reads_its_offset_is_not_compiled(tmp_path, monkeypatch):
    """DynamicNTKScalingRoPE computes its base from the offset in Python: such a block
    keeps the step built op by op (a trace would fix one position), same logits."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    model, _ = load(_repo(tmp_path, "llama"), fuse=False)
    group_linears(model)
    for layer in model.layers:
        rope = layer.self_attn.rope
        layer.self_attn.rope = DynamicNTKScalingRoPE(rope.dims, 64, False, rope.base, 2.0)
    _reference_kernels(monkeypatch)  # the kernels `_compiling` leaves, for both runs
    want = _decode(model)
    fuse_blocks(model)
    assert not any(layer.compiles for layer in model.layers)
    _compiling(monkeypatch, True)
    got = _decode(model)
    assert not any("_step_compiled" in layer.__dict__ for layer in model.layers)
    for a, b in zip(want, got):
        assert mx.array_equal(a, b)


def test_a_fused_decode_step_is_four_calls_per_layer(tmp_path, monkeypatch):
    model, _ = load(_repo(tmp_path, "llama"), fuse=False)
    group_linears(model)
    fuse_blocks(model)
    cache = make_prompt_cache(model)
    modes = []
    calls = _count_calls(monkeypatch, modes)
    mx.eval(model(PROMPT, cache=cache))  # prefill: mlx-lm's block, each linear alone
    assert calls == [1] * 15 and set(modes) == {(False, False, False, False)}
    calls.clear(), modes.clear()
    mx.eval(model(PROMPT[:, :1], cache=cache))
    assert calls == [3, 1, 2, 1] * 2 + [1]  # qkv, o, gate/up, down; lm_head
    norm, residual, gate_residual, plain = ((True, False, False, False),
                                            (False, False, True, False),
                                            (False, True, True, False), (False, False, False, False))
    # q/k/v's extras bring RoPE too (the CPU's kernel leaves it to the module after it)
    norm_rope = (True, False, False, True)
    assert modes == [norm_rope, residual, norm, gate_residual] * 2 + [plain]
    groups = [m.__dict__.get(k) for _, m in model.named_modules() for k in ("_alone", "_group")]
    assert all(g.extras is kernels.NO_EXTRAS for g in groups if g is not None)  # reset
    assert all(g.ready is None and g.pending is None for g in groups if g is not None)


def test_blocks_with_ungrouped_linears_are_not_fused(tmp_path):
    def codec(name, v):
        return 4 if name.endswith("v_proj.weight") else default_codec(name, v, 3)

    model, _ = load(_repo(tmp_path, "llama", codec=codec), fuse=False)
    assert not fusable_block(model.layers[0])  # before grouping: nothing is grouped
    group_linears(model)  # q/k group without v
    assert fuse_blocks(model) == 0


def test_extras_are_checked():
    x = mx.zeros((1, 128))
    one, three = (_member(64),), (_member(64), _member(16), _member(16))
    bad = [
        (one, group.Extras(norm=mx.ones((128,)), up=mx.ones((1, 128))), "not both"),
        (one, group.Extras(norm=mx.ones((96,))), "norm weight"),
        (one, group.Extras(up=mx.ones((2, 128))), "gate"),
        (three, group.Extras(residual=mx.ones((1, 64))), "residual"),
        (one, group.Extras(residual=mx.ones((1, 32))), "residual"),
    ]
    for members, extras, message in bad:
        with pytest.raises(ValueError, match=message):
            kernels.tq_linear_group(x, members, extras=extras)
    # RoPE: only for a group's first two members viewed as heads, at one position
    import mlx.nn as nn

    x3 = mx.zeros((1, 1, 128))
    heads = ((1, 4, 1, 16), (1, 1, 1, 16), (1, 1, 1, 16))
    rope = group.Rope(nn.RoPE(16), mx.ones((8,)), mx.array(3, dtype=mx.int32))
    rope_bad = [
        (three, heads, group.Rope(rope.module, mx.ones((4,)), rope.offset), "head size 8"),
        (three, ((1, 64), (1, 16), (1, 16)), rope, "viewed as"),
        (one, ((1, 4, 1, 16),), rope, "viewed as"),
        (three, heads, group.Rope(rope.module, rope.inverse, mx.array([3, 4])), "one position"),
    ]
    for members, views, r, message in rope_bad:
        with pytest.raises(ValueError, match=message):
            kernels.bind_linear_group(x3, members, extras=group.Extras(rope=r), views=views)
    with pytest.raises(ValueError, match="views"):
        kernels.tq_linear_group(x3, three, extras=group.Extras(rope=rope))


def test_the_loader_groups_where_a_kernel_runs_groups(tmp_path):
    """CUDA, and the CPU with numba, have a linear_group kernel: `load` groups q/k/v and
    gate/up there (decoder blocks are fused on CUDA only); `fuse=False` keeps them apart."""
    repo = _repo(tmp_path, "llama")
    grouped = kernels.describe()["linear_group"] != "reference"
    model, _ = load(repo)
    assert isinstance(model.layers[0].self_attn.q_proj, TQGroupedLinear) == grouped
    assert not isinstance(model.layers[0], FusedDecoderBlock)  # not on the CPU
    model, _ = load(repo, fuse=False)
    assert type(model.layers[0].self_attn.q_proj).__name__ == "TQLinear"


def _step_ops(model, cache) -> dict:
    """Operations by name in the unevaluated graph of one single-token decode step (the
    benchmarks' `kv.graph_ops`)."""
    logits = model(PROMPT[:, :1], cache=cache)
    ops = graph_ops([logits])
    mx.eval(logits)  # the cache too: the next step's graph starts from evaluated arrays
    return ops


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_a_fused_single_token_step_skips_the_head_transposes(tmp_path, monkeypatch, kind):
    """For one token the attention's head transposes are reshapes: a fused block's step
    has 4 operations fewer per layer than mlx-lm's attention, its 4 transposes (each is
    host time on a GPU), with the same logits (test_fused_blocks_keep_every_logit). The
    reference kernels stand in for the GPU's, so the step is one graph."""
    model, _ = load(_repo(tmp_path, kind), fuse=False)
    group_linears(model)
    _reference_kernels(monkeypatch)
    cache = make_prompt_cache(model)
    mx.eval(model(PROMPT, cache=cache))
    plain = _step_ops(model, cache)
    assert fuse_blocks(model) == len(model.layers) == 2
    from turboquant.runtime import fuse

    _step_ops(model, cache)  # the position's first buffer (fuse._offset_array), if it takes one
    last = fuse._last_offset[0]
    fused = _step_ops(model, cache)
    if fuse._last_offset[0] != last:  # RoPE in the q/k/v call (an array position): a steady
        for op in ("Add", "Slice", "Reshape"):  # step's is the last one's plus one, a view
            fused[op] -= 1
    # mlx-lm's attention: a reshape and a transpose for each of q, k, v and the output
    assert plain["Transpose"] - fused.get("Transpose", 0) == 4 * 2
    assert plain["Reshape"] == fused["Reshape"]
    assert sum(plain.values()) - sum(fused.values()) == 4 * 2


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_attention_half_keeps_the_logits_with_turboquants_kv_cache(
        tmp_path, monkeypatch, kind, compiled):
    """The fused attention half calls the cache and the attention function as mlx-lm's
    Attention does, so TurboQuant's compressed KV cache (its attention hook included) sees
    the same calls: the same logits over steps that compress blocks of the cache; with the
    step compiled too (the cache stays between the compiled halves)."""
    from turboquant.runtime.kvcache import make_turboquant_cache

    def decode(model):
        cache = make_turboquant_cache(model, sink=2, window=4, block=4, protect_layers=0)
        out = [model(PROMPT, cache=cache)]
        tok = mx.argmax(out[-1][:, -1:], axis=-1)
        for _ in range(9):  # past the window: blocks of 4 tokens compressed as it goes
            out.append(model(tok, cache=cache))
            tok = mx.argmax(out[-1][:, -1:], axis=-1)
        mx.eval(out)
        assert all(c._n_comp > 0 for c in cache)  # compressed blocks were attended to
        return out

    model, _ = load(_repo(tmp_path, kind), fuse=False)
    group_linears(model)
    _compiling(monkeypatch, compiled)
    before = decode(model)
    assert fuse_blocks(model) == 2
    after = decode(model)
    assert all(("_step_compiled" in layer.__dict__) == compiled for layer in model.layers)
    if compiled:
        _close(before, after)
    else:
        for a, b in zip(before, after):
            assert mx.array_equal(a, b)


def test_rope_inverse_turns_pairs_as_mlx_lms_rope():
    """`fuse.rope_inverse`: the angle a q/k/v launch turns pair (i, i + D / 2) of a head by
    is offset * inverse[i]; turned so, a head equals mlx-lm's RoPE module's output, for
    nn.RoPE (base, position scale) and Llama3RoPE; None where a launch cannot do the
    module's RoPE (traditional pairs, part of a head, YaRN's value scale)."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

    from turboquant.runtime.fuse import rope_inverse

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 256}
    q = mx.random.normal((1, 3, 1, 32), key=mx.random.key(4))
    x1, x2 = q[..., :16], q[..., 16:]
    for rope in (nn.RoPE(32, base=10000.0, scale=0.25), nn.RoPE(32, base=500000.0),
                 Llama3RoPE(32, base=500000.0, scaling_config=llama3)):
        inverse = rope_inverse(rope, 32)
        assert inverse.shape == (16,) and inverse.dtype == mx.float32
        for offset in (0, 9, 3000):
            angle = offset * inverse
            c, s = mx.cos(angle), mx.sin(angle)
            turned = mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
            want = rope(q, offset=mx.array(offset, dtype=mx.int32))
            assert mx.allclose(turned, want, atol=2e-3).item(), (rope, offset)
    assert rope_inverse(nn.RoPE(32, traditional=True), 32) is None
    assert rope_inverse(nn.RoPE(16), 32) is None
    assert rope_inverse(YarnRoPE(32), 32) is None


@pytest.mark.parametrize("kind, head", [("llama", 16), ("qwen2", 16), ("mixtral", 16),
                                        ("qwen3", 0)])
def test_a_fused_block_asks_its_q_k_v_call_for_rope(tmp_path, monkeypatch, kind, head):
    """A fused block whose RoPE a q/k/v launch can do hands it to its group call
    (`kernels.Rope` in the extras; the group told the head size, so a GPU's plan lays its
    rows out for it): on the CPU the call rotates with the module (every logit the same:
    test_fused_blocks_keep_every_logit). Qwen3 normalises q and k between the call and
    RoPE: its blocks keep their RoPE; so does every block with TURBOQUANT_FUSE_ROPE=0."""
    from turboquant.runtime import fuse

    rotated = []
    with_rope = group.with_rope
    monkeypatch.setattr(group, "with_rope", lambda ys, r: rotated.append(r) or with_rope(ys, r))
    for on in (True, False):
        monkeypatch.setattr(fuse, "ROPE", on)
        model, _ = load(_repo(tmp_path, kind), fuse=False)
        group_linears(model)
        assert fuse_blocks(model) == 2
        qkv = model.layers[0].self_attn.q_proj._group
        assert qkv.rope_dims == (head if on else 0)
        assert qkv.prepared == ({"rope_dims": head} if on and head else {})
        rotated.clear()
        _decode(model, steps=3)
        assert len(rotated) == (3 * 2 if on and head else 0)  # 3 steps, 2 layers


def test_a_steps_position_is_the_last_ones_plus_one_on_the_device(monkeypatch):
    """`fuse._offset_array`: the offset as a scalar view of a 4-lane int32 buffer (past
    MLX's CUDA pool of arrays of <= 8 bytes, which the host writes), the next offset's
    buffer the last one's plus one, so no new scalar is written by the host a token."""
    from turboquant.runtime import fuse

    monkeypatch.setattr(fuse, "_last_offset", (None, None, None))
    first = fuse._offset_array(7)
    lanes = fuse._last_offset[1]
    assert first.shape == () and first.dtype == mx.int32 and first.item() == 7
    assert lanes.shape == (fuse.POSITION_LANES,) and lanes.nbytes > 8
    assert fuse._offset_array(7) is first  # a token's layers share it
    second = fuse._offset_array(8)
    assert second.item() == 8 and fuse._last_offset[1] is not lanes
    assert fuse._last_offset[1].tolist() == [8] * fuse.POSITION_LANES
    assert fuse._offset_array(3).item() == 3 and fuse._offset_array(4).item() == 4
    batched = mx.array([2, 5], mx.int32)
    assert fuse._offset_array(batched) is batched

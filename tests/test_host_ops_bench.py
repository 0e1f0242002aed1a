"""The benchmarks' exact host measure (kv.call_events, host_ops.py and kv.py --host-cost use
it): calls made while building a step's graph."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # kv.py, decode.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import host_ops  # noqa: E402  (tools/host_ops.py)


def _leaf() -> int:
    return 1


def _step() -> mx.array:
    return mx.array(_leaf() + len([1, 2]))


def test_call_events_count_python_functions_and_builtins():
    # the step itself and _leaf; len is the one builtin (MLX's nanobind ops are not counted)
    assert host_ops._call_events(_step) == dict(py_calls=2, c_calls=1)


def test_call_events_leave_out_the_stand_ins_own_calls():
    x = mx.zeros((2, 3))
    ev = host_ops._call_events(lambda: host_ops._stand_in([x], [(2, 3)], [mx.float32])[0])
    assert ev == dict(py_calls=1, c_calls=0)  # only the lambda: _stand_in is the script's


def test_kv_host_cost_counts_a_steady_steps_calls():
    """kv.py --host-cost: one layer's decode step, fake kernels on the CPU; the fp16 cache's
    step is mlx-lm's update, fetch and attention (3 Python calls), TurboQuant's 11 (30
    before 2026-11-30: the cache's helpers, properties and `prepare` on every step)."""
    import kv

    fp16 = kv.layer_step_cost("fp16", 300, 4, 1, 4, 2, 64, warm=2)
    tq = kv.layer_step_cost("K4V3", 300, 4, 1, 4, 2, 64, warm=2)
    assert fp16["py_calls"] == 3 and fp16["kernels_per_step"] == 1
    assert 8 <= tq["py_calls"] <= 11 and tq["kernels_per_step"] == 2


def _fake_cuda_layer(monkeypatch, shape: str, moe: bool, variant: str = "tq3-eager",
                     **small) -> dict:
    """host_ops.per_layer for one small TQ3 decoder layer of decode.py's `shape` (its
    fields overridden by `small`), the CUDA path faked on the CPU; built op by op unless
    `variant` says otherwise (the compiled step replays its kernel calls: none to count)."""
    import decode

    # host_ops sets the layers and the vocabulary itself
    monkeypatch.setattr(decode, shape, dict(getattr(decode, shape), **small))
    host_ops._on_fake_cuda(monkeypatch.setattr)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        return host_ops.per_layer(variant, layers=1, moe=moe, steps=2)
    finally:
        mx.set_default_device(device)


def test_a_fused_tq3_layer_builds_its_step_in_as_few_calls_as_affine4(monkeypatch):
    """host_ops.py on a small Llama, CUDA path faked: a fused TQ3 decoder layer's step is
    its 4 kernel calls and at most affine-4's 30 Python calls (70 before 2026-11-30: the
    member checks, `dispatch.backend()`, the extras' helpers, Module.__getattr__ on every
    linear call), 7 builtins (58), all of them mlx-lm's attention's; no reshape."""
    tq3 = _fake_cuda_layer(monkeypatch, "LLAMA3_8B", moe=False, hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    assert tq3["calls"] == 4  # q/k/v, o_proj, gate/up, down_proj: the CUDA path ran
    assert tq3["py_calls"] <= 30 and tq3["c_calls"] <= 7
    # o_proj's launch reads the attention's heads as its row: no reshape (2026-12-01)
    assert "Reshape" not in tq3["ops"], tq3["ops"]


def test_a_tq3_moe_layer_binds_its_experts_calls(monkeypatch):
    from turboquant.kernels import cuda

    monkeypatch.setattr(cuda, "FUSED_GATHER", False)  # rotation ops, then the gathered GEMV
    """host_ops.py --moe on a small Qwen3-MoE, CUDA path faked: a TQ3 decoder layer's step
    is its 6 kernel calls (q/k/v, o_proj, the router, the experts' gate, up and down) in at
    most 58 Python and 19 builtin calls (142 and 65 before: each switch call rotated
    through the plan lookup, chose its kernel through `dispatch.get` and `backend()`, and
    worked out its pair arrays and launch every token; a linear group's outputs waited
    for their members in a set, two builtin calls and one more a member)."""
    tq3 = _fake_cuda_layer(monkeypatch, "QWEN3_30B_A3B", moe=True, hidden_size=256,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert tq3["calls"] == 6  # the CUDA path ran, one launch a projection
    assert tq3["py_calls"] <= 58 and tq3["c_calls"] <= 19


def test_a_fused_gather_moe_layer_drops_the_rotations_ops(monkeypatch):
    """The same layer fused, the default (TURBOQUANT_CUDA_FUSED_GATHER): each expert
    projection rotates x in its launch, so the step keeps its 6 kernel calls and loses the
    rotations' ops (Hadamard transforms, casts, pads: 68 MLX ops a layer before, 50 after;
    affine-4 54)."""
    from turboquant.kernels import cuda

    small = dict(hidden_size=256, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64)
    monkeypatch.setattr(cuda, "FUSED_GATHER", False)
    plain = _fake_cuda_layer(monkeypatch, "QWEN3_30B_A3B", moe=True, **small)
    monkeypatch.setattr(cuda, "FUSED_GATHER", True)  # the default
    fused = _fake_cuda_layer(monkeypatch, "QWEN3_30B_A3B", moe=True, **small)
    assert fused["calls"] == plain["calls"] == 6
    assert "Hadamard" not in fused["ops"] and plain["ops"]["Hadamard"] == 3
    assert sum(fused["ops"].values()) <= sum(plain["ops"].values()) - 15
    assert fused["py_calls"] <= plain["py_calls"]


# (benchmark shape, MoE, the small model's sizes) of the compiled-step tests
SMALL_MODELS = (
    ("LLAMA3_8B", False, dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2)),
    ("QWEN3_30B_A3B", True, dict(hidden_size=256, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)),
)


def test_a_compiled_step_replays_its_graph_in_fewer_calls(monkeypatch):
    """The compiled single-token step per layer (`fuse.COMPILE_STEP`, the whole step
    off as by default): no kernel call made in Python (MLX replays the traced launches)
    and a few Python calls a layer (the block, the cache, the attention function): dense
    7 against 23 built op by op, MoE 7 against 41 (its sparse MLP in the trace). The
    dense graph is the same; the MoE one smaller (compile fuses the router's elementwise
    ops and drops its stop_gradients)."""
    for shape, is_moe, small in SMALL_MODELS:
        eager = _fake_cuda_layer(monkeypatch, shape, is_moe, "tq3-eager", **small)
        compiled = _fake_cuda_layer(monkeypatch, shape, is_moe, "tq3-layers", **small)
        assert compiled["calls"] == 0 and eager["calls"] == (6 if is_moe else 4)
        assert compiled["py_calls"] <= 8 and eager["py_calls"] >= (40 if is_moe else 20)
        if is_moe:
            assert sum(compiled["ops"].values()) < sum(eager["ops"].values())
        else:
            assert compiled["ops"] == eager["ops"]


def test_the_whole_step_builds_a_layer_without_python(monkeypatch):
    """TURBOQUANT_WHOLE_STEP=1 on CUDA (`runtime/whole_step.py`): a token's step is one
    compiled call, so a decoder layer costs no Python call at all (8 with the step
    compiled per layer) and 6 operations instead of 9: its 4 launches, the attention's
    (which stores the key and the value at the position itself: no scatters, no slices
    of the cache) and the `mx.depends` handing on the buffers it wrote. Dense and MoE
    alike; 4 rows a warp, so the dense layer's RoPE is in its q/k/v launch as a
    Llama-3-8B layer's is. (Until 2026-12-04 the whole step never saw the kernel's
    `stores_in_place` behind `dispatch.get`'s wrapper: 2 scatters a layer.)"""
    from turboquant.kernels import cuda_gemv

    monkeypatch.setattr(cuda_gemv, "WARPS_WANTED", 1)
    for shape, is_moe, small in SMALL_MODELS:
        layers = _fake_cuda_layer(monkeypatch, shape, is_moe, "tq3-layers", **small)
        whole = _fake_cuda_layer(monkeypatch, shape, is_moe, "tq3-whole", **small)
        assert whole["calls"] == 0 and whole["py_calls"] == 0 and layers["py_calls"] >= 7
        assert "ScatterAxis" not in whole["ops"] and "SliceUpdate" not in whole["ops"]
        # the cache's two slices gone (an MoE router slices its top-k: those stay)
        assert whole["ops"].get("Slice", 0) == layers["ops"]["Slice"] - 2
        assert sum(whole["ops"].values()) == sum(layers["ops"].values()) - 3
        if not is_moe:
            assert sum(whole["ops"].values()) == 6


def test_rope_in_the_q_k_v_launch_drops_a_layers_two_rope_ops(monkeypatch):
    """host_ops.py on a small Llama, CUDA path faked, 4 rows a warp (so the q/k/v rows fit
    in RoPE pairs, as a Llama-3-8B layer's do): with RoPE in the q/k/v launch (the default)
    a fused layer's step has no RoPE op and two operations fewer than with mlx-lm's RoPE
    after the launch (`-mlxrope`), with the same 4 kernel calls."""
    from turboquant.kernels import cuda_gemv

    monkeypatch.setattr(cuda_gemv, "WARPS_WANTED", 1)
    small = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
    apart = _fake_cuda_layer(monkeypatch, "LLAMA3_8B", moe=False, variant="tq3-eager-mlxrope",
                             **small)
    fused = _fake_cuda_layer(monkeypatch, "LLAMA3_8B", moe=False, **small)
    # one node each (`Depends`, host_ops' stand-ins): the 4 launches, sdpa and 2 RoPEs
    assert (apart["ops"]["Depends"], fused["ops"]["Depends"]) == (7, 5)
    assert sum(apart["ops"].values()) - sum(fused["ops"].values()) == 2  # 12 against 10
    assert apart["calls"] == fused["calls"] == 4

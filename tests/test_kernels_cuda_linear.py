"""The CUDA linear path (fused rotation + GEMV, or the two unfused launches; grouped
members) against the reference.

Runs only where MLX runs on an NVIDIA GPU (skipped elsewhere): on the GPU machine,
`python3 -m pytest -q tests/test_kernels_cuda_linear.py`. The decomposition the rotation
kernel uses is checked on the CPU in tests/test_kernels_cuda_rotate.py, and these checks
run at small shapes on the CPU, every launch emulated, in
tests/test_kernels_cuda_emulated.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from turboquant import kernels
from turboquant.kernels import cuda, group, reference
from turboquant.stages import encode

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")


def _members(in_f, outs, bits, bias=False, seed=0, group_size=64):
    out = []
    for i, o in enumerate(outs):
        w = mx.random.normal((o, in_f), key=mx.random.key(seed + i)) * 0.02
        qt = encode(w, bits, group_size, seed=1000 * seed + i + 1)
        b = mx.random.normal((o,), key=mx.random.key(99 + i)) * 0.1 if bias else None
        s = qt.spec
        out.append(group.Member(qt.codes, qt.scales, bits, s.group_size, in_f, o,
                                s.padded_in, s.seed, b))
    return tuple(out)


def _reference(x, members):
    """Member by member on the pure-MLX reference (no CUDA kernel anywhere)."""
    outs = []
    for m in members:
        y = reference.tq_matvec(group.rotated_input(x, m), m.codes, m.scales, m.bits,
                                m.group_size, m.out_features, m.padded_in)
        outs.append(y if m.bias is None else y + m.bias)
    return outs


CASES = [
    (4096, (4096, 1024, 1024)),  # Llama-3-8B q/k/v
    (4096, (2048, 2048)),  # gate/up shaped
    (14336, (512,)),  # down_proj: 28 x 512 rotation
    (992, (64, 40)),  # 31 x 32 rotation, padded input, last member not a multiple of 8 rows
    (13824, (256,)),  # dense 27 x 512 rotation
    (16384, (128,)),  # two 8192 halves
]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("in_f, outs", CASES)
def test_group_matches_reference(bits, in_f, outs):
    members = _members(in_f, outs, bits)
    assert group.fusable(members)
    prepared = {}
    for tokens, dtype in ((1, mx.bfloat16), (3, mx.float16), (2, mx.float32)):
        x = mx.random.normal((tokens, in_f), key=mx.random.key(tokens)).astype(dtype)
        got = kernels.tq_linear_group(x, members, prepared)
        assert isinstance(prepared["cuda"], cuda._Plan)  # the kernels ran, not a fallback
        assert prepared["cuda"].fused
        want = _reference(x, members)
        for g, w, m in zip(got, want, members):
            assert g.shape == (tokens, m.out_features) and g.dtype == dtype
            err = float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w)))
            print(f"bits {bits} in {in_f} out {m.out_features} tokens {tokens} {dtype}: {err:.2e}")
            assert err < 1e-2, err


TILE_CASES = [  # (in_features, outs, bits, group size, rows per warp, tiles per block)
    (4096, (4096, 1024, 1024), 3, 64, 4, 4),
    (14336, (512,), 4, 64, 2, 2),
    (992, (64, 40), 2, 64, 1, 8),  # the last block's tiles run past the rows
    (4096, (2048, 2048), 3, 32, 4, 2),
    (4096, (1024,), 4, 128, 2, 4),
]


@pytest.mark.parametrize("in_f, outs, bits, gs, rpw, tiles", TILE_CASES)
def test_blocks_of_several_tiles_match_reference(monkeypatch, in_f, outs, bits, gs, rpw, tiles):
    """A block rotating once for several tiles of rows, with 1, 2 or 4 rows per warp and
    groups of 32, 64 or 128 weights (the defaults pick tiles only for large matrices)."""
    from turboquant.kernels import cuda_linear

    monkeypatch.setattr(cuda_linear, "rows_per_warp_for", lambda ends: rpw)
    monkeypatch.setattr(cuda_linear, "tiles_for", lambda ends, rows_per_warp: tiles)
    members = _members(in_f, outs, bits, group_size=gs)
    prepared = {}
    x = mx.random.normal((2, in_f), key=mx.random.key(3)).astype(mx.bfloat16)
    got = kernels.tq_linear_group(x, members, prepared)
    constants = dict(next(iter(prepared["cuda"].launches.values())).constants)
    assert (constants["ROWS_PER_WARP"], constants["TILES"]) == (rpw, tiles)
    for g, w in zip(got, _reference(x, members)):
        err = float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w)))
        print(f"tiles {tiles} rpw {rpw} bits {bits} gs {gs} out {g.shape[-1]}: {err:.2e}")
        assert err < 1e-2, err


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
@pytest.mark.parametrize("in_f, out_f", [(8192, 2048), (992, 40), (14336, 512)])
def test_matvec_matches_reference(bits, in_f, out_f):
    """The GEMV alone on a rotated row (`dispatch.tq_linear`, few tokens): one matrix, its
    row staged in shared memory; rows past the last whole warp read moved-back rows;
    ternary codes as 2-bit codes."""
    (m,) = _members(in_f, (out_f,), bits)
    x = mx.random.normal((3, in_f), key=mx.random.key(5))
    x_rot = group.rotated_input(x, m)
    got = kernels.tq_linear(x_rot, m.codes, m.scales, bits, m.group_size, out_f, m.padded_in)
    want = reference.tq_matvec(x_rot, m.codes, m.scales, bits, m.group_size, out_f, m.padded_in)
    assert kernels.describe()["matvec"] == "cuda"
    err = float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)))
    print(f"matvec bits {bits} {out_f}x{in_f}: {err:.2e}")
    assert got.shape == (3, out_f) and err < 1e-2, err


@pytest.mark.parametrize("bits", [2, 3, 4, "ternary"])
@pytest.mark.parametrize("in_f, out_f, rows", [(4096, 1024, 1), (992, 40, 2)])
def test_gathered_experts_match_reference(bits, in_f, out_f, rows):
    """A decode step's MoE experts in one GEMV launch (`cuda.gather`, ternary as 2-bit
    codes), against the reference."""
    n_experts = 6
    w = mx.random.normal((n_experts * out_f, in_f), key=mx.random.key(11)) * 0.02
    qt = encode(w, bits, 64, seed=21)
    codes = qt.codes.reshape(n_experts, out_f, -1)
    scales = qt.scales.reshape(n_experts, out_f, -1)
    padded = qt.spec.padded_in
    x = mx.random.normal((2, 3, 1, rows, padded), key=mx.random.key(12))  # (B, L, 1, M, K)
    indices = mx.array([[[5, 0], [2, 2], [1, 4]], [[3, 0], [0, 5], [4, 1]]])  # (B, L, top-2)
    got = cuda.gather(x, codes, scales, indices, bits, 64, out_f, padded)
    want = reference.tq_gather_matmul(x, codes, scales, indices, bits, 64, out_f, padded)
    assert got.shape == want.shape == (2, 3, 2, rows, out_f)
    err = float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)))
    print(f"gather bits {bits} {out_f}x{in_f} rows {rows}: {err:.2e}")
    assert err < 1e-2, err


@pytest.mark.parametrize("bits", [3, "ternary"])
def test_gathered_experts_with_uint32_routing_written_in_bf16(bits):
    """The routing as mlx-lm's argpartition gives it (uint32) and the output in the
    caller's dtype (bf16), x broadcast over the top-k as SwitchGLU passes it: on the
    compact path (the default) the kernel reads x's rows through pair_row and writes bf16
    itself; TURBOQUANT_CUDA_COMPACT_GATHER=0 checks the broadcast path."""
    n_experts, in_f, out_f = 8, 2048, 768
    w = mx.random.normal((n_experts * out_f, in_f), key=mx.random.key(13)) * 0.02
    qt = encode(w, bits, 64, seed=23)
    codes = qt.codes.reshape(n_experts, out_f, -1)
    scales = qt.scales.reshape(n_experts, out_f, -1)
    padded = qt.spec.padded_in
    x = mx.random.normal((1, 2, 1, 1, padded), key=mx.random.key(14))
    indices = mx.array([[[7, 0, 3], [3, 5, 1]]], dtype=mx.uint32)
    got = cuda.gather(x, codes, scales, indices, bits, 64, out_f, padded, out_dtype=mx.bfloat16)
    want = reference.tq_gather_matmul(x, codes, scales, indices, bits, 64, out_f, padded)
    assert got.dtype == mx.bfloat16 and got.shape == want.shape == (1, 2, 3, 1, out_f)
    err = float(mx.max(mx.abs(got.astype(mx.float32) - want)) / mx.max(mx.abs(want)))
    print(f"gather bf16 uint32 bits {bits}: {err:.2e} (compact {cuda.COMPACT_GATHER})")
    assert err < 2e-2, err


@pytest.mark.parametrize("bits, in_f, out_f", [(3, 2048, 768), (4, 768, 2048),
                                               ("ternary", 2048, 768), (2, 992, 256)])
def test_fused_gather_matches_rotation_then_reference(monkeypatch, bits, in_f, out_f):
    """A switch layer's projection in one launch (`cuda.bind_gather_linear`, rotation in
    the kernel, TURBOQUANT_CUDA_FUSED_GATHER=1) against the rotation and the reference
    gather, for the shapes of Qwen3-30B-A3B's gate/up and down and a padded width, the
    routing as mlx-lm gives it (uint32, top-k broadcast over x), out in bf16."""
    monkeypatch.setattr(cuda, "FUSED_GATHER", True)
    n_experts, seed = 8, 29
    w = mx.random.normal((n_experts * out_f, in_f), key=mx.random.key(15)) * 0.02
    qt = encode(w, bits, 64, seed=seed)
    codes = qt.codes.reshape(n_experts, out_f, -1)
    scales = qt.scales.reshape(n_experts, out_f, -1)
    padded = qt.spec.padded_in
    x = mx.random.normal((1, 2, 1, 1, in_f), key=mx.random.key(16)).astype(mx.bfloat16)
    indices = mx.array([[[7, 0, 3], [3, 5, 1]]], dtype=mx.uint32)
    run = cuda.bind_gather_linear(x, codes, scales, indices, bits, 64, out_f, padded,
                                  seed=qt.spec.seed, out_dtype=mx.bfloat16)
    got = run(x, codes, scales, indices)
    x_rot = group.rotate_padded(x, qt.spec.seed, padded)
    want = reference.tq_gather_matmul(x_rot, codes, scales, indices, bits, 64, out_f, padded)
    assert got.dtype == mx.bfloat16 and got.shape == want.shape == (1, 2, 3, 1, out_f)
    err = float(mx.max(mx.abs(got.astype(mx.float32) - want)) / mx.max(mx.abs(want)))
    print(f"fused gather bits {bits} {out_f}x{in_f}: {err:.2e}")
    assert err < 2e-2, err


@pytest.mark.parametrize("in_f, outs", [CASES[0], CASES[2], CASES[3]])
def test_unfused_launches_match_reference(monkeypatch, in_f, outs):
    monkeypatch.setattr(cuda, "FUSED", False)
    members = _members(in_f, outs, 3, bias=True)
    prepared = {}
    x = mx.random.normal((2, in_f)).astype(mx.bfloat16)
    got = kernels.tq_linear_group(x, members, prepared)
    assert not prepared["cuda"].fused
    for g, w in zip(got, _reference(x, members)):
        assert float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w))) < 1e-2


EXTRAS_CASES = [  # (in_features, outs, extras mode): q/k/v normed, o_proj, down_proj
    (4096, (4096, 1024, 1024), "norm"),
    (4096, (4096,), "residual"),
    (14336, (4096,), "gate+residual"),
    (992, (64, 40), "norm"),
]


@pytest.mark.parametrize("in_f, outs, kind", EXTRAS_CASES)
def test_extras_match_reference(in_f, outs, kind):
    """The norm, gate and residual done inside the launch, against MLX's ops around the
    reference product (the kernel keeps float32 where MLX rounds to bf16 in between)."""
    members = _members(in_f, outs, 3, bias=kind == "norm")
    key = iter(mx.random.split(mx.random.key(7), 4))
    x = (mx.random.normal((2, 1, in_f), key=next(key)) * 3).astype(mx.bfloat16)
    extras = group.Extras(
        norm=(mx.random.uniform(0.5, 1.5, (in_f,), key=next(key)).astype(mx.bfloat16)
              if kind == "norm" else None),
        eps=1e-5,
        up=mx.random.normal(x.shape, key=next(key)).astype(mx.bfloat16) if "gate" in kind else None,
        residual=(mx.random.normal((2, 1, outs[0]), key=next(key)).astype(mx.bfloat16)
                  if "residual" in kind else None),
    )
    prepared = {}
    got = kernels.tq_linear_group(x, members, prepared, extras)
    assert prepared["cuda"].fused and len(prepared["cuda"].launches) == 1
    want = group.with_residual(_reference(group.input_of(x, extras), members), extras)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == mx.bfloat16
        err = float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w)))
        print(f"{kind} in {in_f} out {g.shape[-1]}: {err:.2e}")
        assert err < 1e-2, err


def test_bias_and_batch_shape():
    members = _members(4096, (1024, 256, 256), 3, bias=True)
    x = mx.random.normal((2, 1, 4096)).astype(mx.bfloat16)
    got = kernels.tq_linear_group(x, members)
    want = _reference(x, members)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w))) < 1e-2


def test_prefill_matches_the_reference():
    members = _members(512, (64,), 3)
    x = mx.random.normal((20, 512))
    got = kernels.tq_linear_group(x, members)[0]  # 20 tokens: cuda.prefill_group
    want = _reference(x, members)[0]  # the reference GEMV, summed in another order
    # measured on the H200 through the reference GEMM: 2.5e-4 (the GPU's float32 GEMM
    # rounds more than the CPU's); tests/test_kernels_cuda_dequant.py has the prefill path's
    assert float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))) < 1e-3


def test_ternary_group_runs_the_gemv_member_by_member():
    ternary = _members(512, (64,), "ternary")
    assert not group.fusable(ternary)  # no fused launch: the member through cuda.matvec
    x1 = mx.random.normal((1, 512))
    got = kernels.tq_linear_group(x1, ternary)[0]
    want = _reference(x1, ternary)[0]
    # the GEMV reads the rotated input as float16 (a relative rounding of 2^-11 per
    # element): 6.2e-4 measured on the H200 on 2026-11-30
    assert float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))) < 2e-3


def test_loaded_model_matches_the_cpu(tmp_path):
    from test_runtime_fixtures import make_checkpoint, write_repo

    from turboquant.runtime import load
    from turboquant.runtime.fuse import FusedDecoderBlock, TQGroupedLinear

    config, weights = make_checkpoint("llama", seed=5)
    write_repo(tmp_path / "m", config, weights, bits=3)
    model, _ = load(tmp_path / "m")
    assert isinstance(model.layers[0].self_attn.q_proj, TQGroupedLinear)  # grouped on CUDA
    assert isinstance(model.layers[0], FusedDecoderBlock)  # norms and adds in the kernels
    tokens = mx.array([[1, 5, 70, 33]])
    gpu = model(tokens[:, :1])
    mx.eval(gpu)
    mx.set_default_device(mx.cpu)  # the reference path, on the same weights
    try:
        cpu = model(tokens[:, :1])
        mx.eval(cpu)
    finally:
        mx.set_default_device(mx.gpu)
    err = float(mx.max(mx.abs(gpu - cpu)) / mx.max(mx.abs(cpu)))
    assert err < 2e-2, err


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_a_compiled_step_matches_the_step_built_op_by_op(tmp_path, monkeypatch, kind):
    """COMPILE_STEP on CUDA: a fused block's single-token step as two compiled halves around
    the cache (traced launches replayed, RoPE's offset an input) gives the logits of the
    step built op by op, token after token with a cache."""
    from test_runtime_fixtures import make_checkpoint, write_repo

    from turboquant.runtime import fuse, load, whole_step

    monkeypatch.setattr(whole_step, "WHOLE_STEP", False)  # the per-layer halves, not the whole step
    config, weights = make_checkpoint(kind, seed=6)
    write_repo(tmp_path / kind, config, weights, bits=3)
    model, _ = load(tmp_path / kind)
    runs = []
    for compiled in (False, True):
        monkeypatch.setattr(fuse, "COMPILE_STEP", compiled)
        runs.append(_cached_steps(model, steps=6))
    assert all("_step_compiled" in layer.__dict__ for layer in model.layers)
    for plain, traced in zip(*runs):
        err = float(mx.max(mx.abs(plain - traced)) / mx.max(mx.abs(plain)))
        assert err < 1e-3, err


def _cached_steps(model, steps: int = 4, tokens: list[int] | None = None) -> list[mx.array]:
    """Logits of `steps` greedy single-token steps after a 4-token prompt, with a cache;
    of the steps that feed `tokens` instead, if given (runs whose logits differ in
    rounding would otherwise part where two tokens' logits nearly tie)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[1, 5, 70, 33]]), cache=cache)
    tok, logits = mx.array([[7]]), []
    for i in range(len(tokens) if tokens else steps):
        if tokens:
            tok = mx.array([[tokens[i]]])
        out = model(tok, cache=cache)
        logits.append(out)
        tok = mx.argmax(out[:, -1:], axis=-1)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_the_attention_half_matches_mlx_lms_attention(tmp_path, monkeypatch, kind):
    """A fused block's single-token step with a cache (`fuse._attention_half`: the head
    transposes as reshapes) gives the logits of mlx-lm's Attention on the same kernels;
    for MoE blocks (FusedAttentionBlock) against their whole mlx-lm step."""
    from test_runtime_fixtures import make_checkpoint, write_repo

    from turboquant.runtime import fuse, load

    config, weights = make_checkpoint(kind, seed=7)
    write_repo(tmp_path / kind, config, weights, bits=3)
    model, _ = load(tmp_path / kind)
    fused = (fuse.FusedDecoderBlock, fuse.FusedAttentionBlock)
    assert all(isinstance(layer, fused) for layer in model.layers)
    runs = []
    monkeypatch.setattr(fuse, "COMPILE_STEP", False)  # the compiled step has its own test
    for attention in (False, True):
        monkeypatch.setattr(fuse, "ATTENTION", attention)
        runs.append(_cached_steps(model))
    # dense blocks: only the views differ; MoE blocks: their whole mlx-lm step, whose norm
    # and residual MLX rounds where the kernels keep float32 (as test_extras_match_reference)
    tolerance = 2e-2 if kind in ("qwen3_moe", "mixtral") else 1e-3
    for theirs, ours in zip(*runs):
        err = float(mx.max(mx.abs(theirs - ours)) / mx.max(mx.abs(theirs)))
        assert err < tolerance, err


def _rope_extras(in_f, rope, offset, key):
    """Extras of a q/k/v call with its norm and `rope` at `offset`."""
    from turboquant.runtime.fuse import rope_inverse

    norm = mx.random.uniform(0.5, 1.5, (in_f,), key=key).astype(mx.bfloat16)
    inverse = rope_inverse(rope, rope.dims)
    return group.Extras(norm=norm, eps=1e-5,
                        rope=group.Rope(rope, inverse, mx.array(offset, dtype=mx.int32)))


@pytest.mark.parametrize("bits, bias, rope_kind", [(3, False, "llama3"), (3, True, "plain"),
                                                   (2, True, "llama3"), (4, False, "plain")])
def test_rope_in_the_q_k_v_launch_matches_mlx_rope(bits, bias, rope_kind):
    """A q/k/v group whose rows are in RoPE pairs (`cuda.pair_order`): one launch normalises,
    multiplies, rotates queries and keys and stores them in their heads' order, against
    the reference product rotated by mlx-lm's RoPE module, at positions far and near; the
    same plan without RoPE (3 tokens) stores every row where it belongs."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    head = 128
    rope = (Llama3RoPE(head, scaling_config={"factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192})
            if rope_kind == "llama3" else nn.RoPE(head, base=500000.0, scale=0.5))
    members = _members(4096, (4096, 1024, 1024), bits, bias=bias, seed=3)
    prepared = {"rope_dims": head}
    views = ((1, 32, 1, head), (1, 8, 1, head), (1, 8, 1, head))
    x = (mx.random.normal((1, 1, 4096), key=mx.random.key(11)) * 3).astype(mx.bfloat16)
    for offset in (0, 7, 4097, 131000):
        extras = _rope_extras(4096, rope, offset, mx.random.key(12))
        run = kernels.bind_linear_group(x, members, prepared, extras, views)
        got = run(x, extras)
        assert prepared["cuda"].pairs == head
        flat = _reference(group.input_of(x, extras), members)
        want = group.with_rope(group.reshaped(flat, views), extras.rope)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == mx.bfloat16
            err = float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w)))
            print(f"{rope_kind} {bits}-bit at {offset}, {g.shape}: {err:.2e}")
            assert err < 1e-2, err
        # in float32 the launch's RoPE is the module's on the launch's own product, to
        # float32's rounding (the angle's grows with the position): the rotation alone,
        # apart from the product's error
        tolerance = 1e-4 + 4 * offset * float(extras.rope.inverse.max()) * 2**-24
        x32 = x.astype(mx.float32)
        plain = kernels.bind_linear_group(x32, members, prepared, extras.unroped(), views)
        turned = group.with_rope(plain(x32, extras), extras.rope)
        fused = kernels.bind_linear_group(x32, members, prepared, extras, views)(x32, extras)
        for g, w in zip(fused, turned):
            assert g.dtype == mx.float32
            err = float(mx.max(mx.abs(g - w)) / mx.max(mx.abs(w)))
            print(f"  float32, against the module on the launch's product: {err:.2e}")
            assert err < tolerance, (err, tolerance)
    x3 = mx.random.normal((3, 1, 4096), key=mx.random.key(13)).astype(mx.bfloat16)
    for g, w in zip(kernels.tq_linear_group(x3, members, prepared), _reference(x3, members)):
        err = float(mx.max(mx.abs(g.astype(mx.float32) - w)) / mx.max(mx.abs(w)))
        assert err < 1e-2, err


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("mixtral", {}),
])
def test_a_step_with_rope_in_the_launch_matches_mlx_rope(tmp_path, monkeypatch, kind, overrides):
    """Blocks whose q/k/v launch does RoPE (`fuse.ROPE`, rows in pairs: 4 rows a warp even
    for these small layers) give the logits of blocks that leave RoPE to mlx-lm's module,
    compiled and op by op, token after token (the same tokens) with a cache."""
    from test_runtime_fixtures import make_checkpoint, write_repo

    from turboquant.kernels import cuda_gemv
    from turboquant.runtime import fuse, load

    monkeypatch.setattr(cuda_gemv, "WARPS_WANTED", 1)  # 4 rows a warp: pairs fit
    config, weights = make_checkpoint(kind, seed=8, **overrides)
    write_repo(tmp_path / kind, config, weights, bits=3)
    runs = {}
    for rope in (False, True):
        monkeypatch.setattr(fuse, "ROPE", rope)
        model, _ = load(tmp_path / kind)
        assert all((layer.rope_inverse is not None) == rope for layer in model.layers)
        for compiled in (False, True):
            monkeypatch.setattr(fuse, "COMPILE_STEP", compiled)
            runs[rope, compiled] = _cached_steps(model, tokens=[7, 90, 3, 250, 41, 18, 66])
        plan = model.layers[0].self_attn.q_proj._group.prepared["cuda"]
        assert plan.pairs == (16 if rope else 0)
    # the launch rounds q and k to bf16 once, after RoPE; mlx-lm's module rounds them
    # before and after: logits a few 1e-3 apart (H200: 4.6e-3 and 6.7e-3 on llama's first
    # two steps), the bound of test_loaded_model_matches_the_cpu (the kernels themselves:
    # test_rope_in_the_q_k_v_launch_matches_mlx_rope)
    for key in ((True, False), (True, True)):
        for plain, roped in zip(runs[False, key[1]], runs[key]):
            err = float(mx.max(mx.abs(plain - roped)) / mx.max(mx.abs(plain)))
            print(f"{kind} {overrides and 'llama3'} compiled={key[1]}: {err:.2e}")
            assert err < 2e-2, err

"""TQLinear, TQSwitchLinear and TQEmbedding against dense layers holding the decoded weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU

from turboquant.runtime import TQEmbedding, TQLinear, TQSwitchLinear
from turboquant.stages import QuantSpec, decode, encode

WIDTHS = (2, 3, 4, "ternary")


def _close(a, b, tol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-12)).item()
    assert err < tol, err


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("shape", [(90,), (1, 1, 90), (2, 9, 90), (40, 90)])
def test_tq_linear_is_x_times_decoded_weight(bits, shape):
    mx.random.seed(3)
    qt = encode(mx.random.normal((40, 90)), bits, 32, seed=11)
    bias = mx.random.normal((40,))
    layer = TQLinear.from_quantized(qt, bias=bias)
    x = mx.random.normal(shape)
    _close(layer(x), x @ decode(qt).T + bias)
    assert layer.spec == qt.spec
    _close(layer.weight, decode(qt))


def test_tq_linear_keeps_bf16_activations():
    qt = encode(mx.random.normal((64, 128)), 4, 64, seed=2)
    layer = TQLinear.from_quantized(qt)
    x = mx.random.normal((3, 128))
    y = layer(x.astype(mx.bfloat16))
    assert y.dtype == mx.bfloat16
    _close(y.astype(mx.float32), x @ decode(qt).T, tol=2e-2)


def test_a_decode_call_follows_replaced_weights():
    """A decode-sized call runs the group call bound for its shape; weights loaded over
    the layer's afterwards (as `load_weights` does) are what the next call multiplies."""
    first, second = (encode(mx.random.normal((40, 90), key=mx.random.key(k)), 3, 32, seed=11)
                     for k in (1, 2))
    layer = TQLinear.from_quantized(first)
    x = mx.random.normal((1, 1, 90))
    _close(layer(x), x @ decode(first).T)
    layer.update({"codes": second.codes, "scales": second.scales})
    _close(layer(x), x @ decode(second).T)


def _replace(layer, how: str, qt) -> None:
    """Put qt's codes and scales in place of the layer's, the way `how` names."""
    if how == "setattr":
        layer.codes, layer.scales = qt.codes, qt.scales
    elif how == "item":
        layer["codes"], layer["scales"] = qt.codes, qt.scales
    elif how == "update":
        layer.update({"codes": qt.codes, "scales": qt.scales})
    else:  # a model's load_weights, by parameter name
        model = nn.Sequential(layer)
        model.load_weights([("layers.0.codes", qt.codes), ("layers.0.scales", qt.scales)],
                           strict=False)


@pytest.mark.parametrize("how", ["setattr", "item", "update", "load_weights"])
def test_a_group_follows_a_members_weights_however_replaced(how):
    """A LinearGroup checks its members again only after some TQLinear's arrays were set
    (`TQLinear.__setitem__`): every way of setting them must tell it."""
    from turboquant.runtime.layers import LinearGroup

    q, k, new_k = (encode(mx.random.normal((40, 90), key=mx.random.key(s)), 3, 32, seed=11)
                   for s in (1, 2, 3))
    layers = [TQLinear.from_quantized(q), TQLinear.from_quantized(k)]
    shared = LinearGroup(layers)
    x = mx.random.normal((1, 1, 90))
    _close(shared.outputs(x)[1], x @ decode(k).T)
    _replace(layers[1], how, new_k)
    ys = shared.outputs(x)
    _close(ys[0], x @ decode(q).T)
    _close(ys[1], x @ decode(new_k).T)


@pytest.mark.parametrize("how", ["none", "del"])
def test_a_decode_call_follows_a_removed_bias(how):
    qt = encode(mx.random.normal((40, 90)), 3, 32, seed=11)
    layer = TQLinear.from_quantized(qt, bias=mx.ones((40,)))
    x = mx.random.normal((1, 1, 90))
    _close(layer(x), x @ decode(qt).T + 1)
    if how == "none":
        layer.bias = None  # Module.__setattr__ pops it from the layer's arrays
    else:
        del layer.bias
    assert "bias" not in layer
    _close(layer(x), x @ decode(qt).T)


def test_other_layers_replaced_weights_keep_a_groups_prepared_kernels():
    """A replacement anywhere makes every group compare its members once; a group whose
    members are unchanged keeps what its backend prepared."""
    first, second = (encode(mx.random.normal((40, 90), key=mx.random.key(k)), 3, 32, seed=11)
                     for k in (1, 2))
    layer, other = TQLinear.from_quantized(first), TQLinear.from_quantized(first)
    x = mx.random.normal((1, 1, 90))
    layer(x)
    shared = layer.group()
    prepared, bound = shared.prepared, shared.bound
    other.codes, other.scales = second.codes, second.scales
    _close(layer(x), x @ decode(first).T)
    assert shared.prepared is prepared and shared.bound is bound


def test_tq_layers_hold_codes_and_scales_only_and_are_frozen():
    layer = TQLinear(100, 30, bias=True, bits=3, group_size=64, seed=9)
    params = dict(tree_flatten(layer.parameters()))
    assert set(params) == {"codes", "scales", "bias"}
    assert params["codes"].shape == (30, 12) and params["codes"].dtype == mx.uint32
    assert params["scales"].shape == (30, 2) and params["scales"].dtype == mx.float16
    assert tree_flatten(layer.trainable_parameters()) == []
    assert layer.spec == QuantSpec(3, 64, 9, 100, 128, True)
    with pytest.raises(ValueError, match="last axis 100"):
        layer(mx.zeros((2, 99)))
    with pytest.raises(ValueError, match="bits"):
        TQLinear(64, 8, bits=5)


@pytest.mark.parametrize("bits", WIDTHS)
def test_tq_switch_linear_drops_into_switch_glu(bits):
    mx.random.seed(4)
    e, d, h = 4, 64, 40
    glu = SwitchGLU(d, h, e)
    dense = SwitchGLU(d, h, e)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(glu, name)
        qts = [encode(lin.weight[i], bits, 32, seed=21) for i in range(e)]
        setattr(glu, name, TQSwitchLinear.from_quantized(qts))
        getattr(dense, name).weight = mx.stack([decode(q) for q in qts])
    for tokens in (1, 5, 40):  # 40 tokens x top-2 >= 64: SwitchGLU sorts
        x = mx.random.normal((1, tokens, d))
        idx = mx.argpartition(-mx.random.normal((1, tokens, e)), 2, axis=-1)[..., :2]
        _close(glu(x, idx), dense(x, idx))


def test_tq_switch_linear_bias_and_shapes():
    qts = [encode(mx.random.normal((24, 64)), 4, 64, seed=1) for _ in range(3)]
    bias = mx.random.normal((3, 24))
    layer = TQSwitchLinear.from_quantized(qts, bias=bias)
    assert layer.codes.shape == (3, 24, 8) and layer.num_experts == 3
    w = mx.stack([decode(q) for q in qts])
    x = mx.random.normal((2, 1, 1, 64))
    idx = mx.array([[2, 0], [1, 1]])
    ref = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx) + mx.expand_dims(bias[idx], -2)
    _close(layer(x, idx), ref)
    with pytest.raises(ValueError, match="differ"):
        TQSwitchLinear.from_quantized([qts[0], encode(mx.random.normal((24, 64)), 4, 64, seed=2)])


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("d", [64, 90, 96])  # one transform, a dense factor, padded rows
def test_a_switch_layers_bound_decode_call_is_its_unbound_call(bits, d):
    """A decode step's switch call is bound per shape (the rotation's plan, the kernel's
    choice); it returns what the unbound call, prefill's, returns, bit for bit."""
    qts = [encode(mx.random.normal((40, d), key=mx.random.key(i)), bits, 32, seed=21)
           for i in range(4)]
    layer = TQSwitchLinear.from_quantized(qts)
    codes, scales = layer["codes"], layer["scales"]
    for shape, idx in [((1, 1, 1, 1, d), [[[3, 0]]]), ((1, 2, 1, 1, d), [[[3, 0], [1, 1]]]),
                       ((1, 1, 2, 1, d), [[[2, 1]]])]:
        x = mx.random.normal(shape).astype(mx.bfloat16)
        for dtype in (mx.uint32, mx.int32):
            i = mx.array(idx, dtype=dtype)
            for _ in range(2):  # binds, then runs what it bound
                y = layer(x, i)
                want = layer._experts(x, i, codes, scales, False)
                assert y.dtype == want.dtype == mx.bfloat16
                assert mx.array_equal(y, want).item()
    assert len(layer._bound) == 6


@pytest.mark.parametrize("how", ["setattr", "item", "update", "load_weights"])
def test_a_switch_layer_follows_its_weights_however_replaced(how):
    """New codes reach the bound call (it takes them per call), and the layer lets go of
    what it bound for the old ones (their kernel layout)."""
    first, second = ([encode(mx.random.normal((24, 64), key=mx.random.key(k + i)), 3, 32,
                             seed=2) for i in range(3)] for k in (1, 10))
    layer = TQSwitchLinear.from_quantized(first)
    x, idx = mx.random.normal((1, 1, 1, 1, 64)), mx.array([[[2, 0]]])
    w = mx.stack([decode(q) for q in second])
    layer(x, idx)
    assert layer._bound
    new = TQSwitchLinear.from_quantized(second)
    _replace(layer, how, new)
    assert not layer._bound
    _close(layer(x, idx), mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx))
    assert set(dict(tree_flatten(layer.parameters()))) == {"codes", "scales"}


@pytest.mark.parametrize("bits", WIDTHS)
def test_tq_embedding_lookup_and_tied_head(bits):
    mx.random.seed(5)
    qt = encode(mx.random.normal((50, 96)), bits, 64, seed=8)
    emb = TQEmbedding.from_quantized(qt, dtype=mx.float32)
    dense = nn.Embedding(50, 96)
    dense.weight = decode(qt)
    ids = mx.array([[0, 49, 7], [7, 7, 1]])
    _close(emb(ids), dense(ids))
    x = mx.random.normal((2, 3, 96))
    _close(emb.as_linear(x), dense.as_linear(x))
    assert TQEmbedding.from_quantized(qt, dtype=mx.bfloat16)(ids).dtype == mx.bfloat16

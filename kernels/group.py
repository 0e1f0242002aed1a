"""A TurboQuant linear, or several reading the same input (q/k/v, gate/up), as one call.

`Member` holds one weight's packed codes, scales, spec and optional bias; `tq_linear_group`
returns each member's x W^T + b in x's dtype. The reference rotates x once per member (each
weight has its own rotation seed) and runs the GEMV/GEMM entry point; a backend kernel can
rotate for all members in one launch and run one GEMV over their stacked rows
(`kernels/cuda.py`), which is why the members travel together.

`Extras` is the work a decoder layer does right around its linears, which a kernel can do
on the row it loads and the value it stores instead of in launches of their own: the
RMSNorm before q/k/v and gate/up, the SwiGLU gate before down, the residual add after
o_proj and down, and RoPE on one token's queries and keys (`Rope`). The reference does it
with the same MLX ops as mlx-lm's layers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from turboquant.stages import rotate
from turboquant.stages.rotate import single_transform

from . import dispatch
from .reference import is_trellis


class Rope:
    """RoPE on the outputs of a q/k/v group's first two members (the queries and keys of
    one token, in their views' shape (B, heads, 1, dims)): `module`, mlx-lm's RoPE of the
    attention, at position `offset` (an int32 array: one trace serves every position).
    `inverse` holds what a kernel rotates pair (i, i + dims / 2) of every head by: the
    angle offset * inverse[i] (float32, dims / 2), the module's frequencies (`module` is
    what the reference calls). Not to be changed once made."""

    __slots__ = ("module", "inverse", "offset")

    def __init__(self, module, inverse: mx.array, offset: mx.array):
        self.module, self.inverse, self.offset = module, inverse, offset

    @property
    def dims(self) -> int:
        return 2 * self.inverse.shape[0]


class Extras:
    """What a group call does around its product. The input is x, or rms_norm(x, norm,
    eps) with `norm`, or silu(x) * up with `up` (x is then the gate); `residual` (the
    output's shape) is added to the output of a single-member group; `rope` (`Rope`)
    rotates the first two members' outputs (a call with views only). Not to be changed
    once made.

    `mode` is (norm, gate, residual, rope): which of them a call does, the key of its
    kernel.
    A field, not a property, and a plain class, not a dataclass (whose `__post_init__`
    would be one more call): a decoder layer makes a few of these and reads their mode on
    every decode step, where each Python call costs the GPU's host time."""

    __slots__ = ("norm", "eps", "up", "residual", "rope", "mode")

    def __init__(self, norm: mx.array | None = None, eps: float = 0.0,
                 up: mx.array | None = None, residual: mx.array | None = None,
                 rope: Rope | None = None):
        self.norm, self.eps, self.up, self.residual = norm, eps, up, residual
        self.rope = rope
        self.mode = (norm is not None, up is not None, residual is not None, rope is not None)

    def unroped(self) -> "Extras":
        """These extras without the RoPE (for a kernel that leaves it to MLX's op)."""
        return Extras(self.norm, self.eps, self.up, self.residual)


NO_EXTRAS = Extras()


def input_of(x: mx.array, extras: Extras) -> mx.array:
    """The row the members multiply: x, normalised or gated as `extras` says."""
    if extras.norm is not None:
        return mx.fast.rms_norm(x, extras.norm, extras.eps)
    if extras.up is not None:
        return _swiglu(x, extras.up)
    return x


@functools.partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up


def with_residual(ys: list[mx.array], extras: Extras) -> list[mx.array]:
    return ys if extras.residual is None else [extras.residual + ys[0]]


def with_rope(ys: list[mx.array], rope: Rope) -> list[mx.array]:
    """The outputs (in their views' shapes) with the queries and keys rotated by `rope`:
    the attention's own RoPE module, as mlx-lm calls it."""
    module, offset = rope.module, rope.offset
    return [module(ys[0], offset=offset), module(ys[1], offset=offset), *ys[2:]]


def check_extras(x: mx.array, members: tuple["Member", ...], extras: Extras) -> None:
    if extras.norm is not None and extras.up is not None:
        raise ValueError("a linear group's input is normalised or gated, not both")
    if extras.norm is not None and extras.norm.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {tuple(extras.norm.shape)} does not match inputs "
                         f"{tuple(x.shape)}")
    if extras.up is not None and extras.up.shape != x.shape:
        raise ValueError(f"gate {tuple(x.shape)} and up {tuple(extras.up.shape)} differ")
    if extras.residual is not None:
        want = (*x.shape[:-1], members[0].out_features)
        if len(members) != 1 or extras.residual.shape != want:
            raise ValueError(f"a residual {tuple(extras.residual.shape)} needs one member "
                             f"with output {want}")


def check_rope(members: tuple["Member", ...], rope: Rope, views: tuple | None) -> None:
    """RoPE rotates the first two members' outputs of one token, viewed as heads of its
    size: (B, heads, 1, dims), every row at the one position."""
    heads = tuple(views or ())[:2]
    if len(members) < 2 or len(heads) < 2 or any(
            len(v) != 4 or v[2] != 1 or v[3] != rope.dims for v in heads):
        raise ValueError(f"RoPE of head size {rope.dims} needs the outputs of a group's first "
                         f"two members viewed as (B, heads, 1, {rope.dims}), got views {views}")
    if rope.offset.size != 1:
        raise ValueError(f"RoPE in a linear group takes one position, got offsets of shape "
                         f"{tuple(rope.offset.shape)}")


@dataclass(frozen=True, eq=False)
class Member:
    codes: mx.array
    scales: mx.array
    bits: int | str
    group_size: int
    in_features: int
    out_features: int
    padded_in: int
    seed: int
    bias: mx.array | None = None
    # float16 (in,) (format 2): W = decode(codes, scales) * in_scales column by column, so
    # the member multiplies in_scales * x. The entry points fold it into the input (or the
    # norm / up operand of the extras) before any backend sees the members: no kernel
    # knows of it
    in_scales: mx.array | None = None


def scaled_input(x: mx.array, extras: Extras, t: mx.array | None) -> tuple[mx.array, Extras]:
    """(x, extras) whose row (`input_of`) is the original row times t: t folded into the
    RMSNorm's weight (rms_norm(x, g) * t = rms_norm(x, g * t)) or the SwiGLU's up operand
    where the extras have one, else x * t. The extras keep their mode (a bound kernel
    takes them)."""
    if t is None:
        return x, extras
    if extras.norm is not None:
        norm = extras.norm * t.astype(extras.norm.dtype)
        return x, Extras(norm, extras.eps, None, extras.residual, extras.rope)
    if extras.up is not None:
        up = extras.up * t.astype(extras.up.dtype)
        return x, Extras(None, extras.eps, up, extras.residual, extras.rope)
    return x * t.astype(x.dtype), extras


def _scaled_parts(members: tuple[Member, ...], prepared: dict | None) -> list:
    """[(indices, members without in_scales, t, the part's `prepared`)]: runs of
    consecutive members with the same in_scales (or none), each run's input scaled once
    (one launch where the backend fuses a group). One part when every member has the same
    t. Kept in `prepared` (cleared with the members' arrays)."""
    if prepared is not None and "in_scales_parts" in prepared:
        return prepared["in_scales_parts"]
    from dataclasses import replace

    def same(a, b) -> bool:
        if a is b:
            return True
        return (a is not None and b is not None and a.shape == b.shape
                and bool(mx.array_equal(a, b)))

    runs: list[list[int]] = []
    for i, m in enumerate(members):
        if runs and same(members[runs[-1][0]].in_scales, m.in_scales):
            runs[-1].append(i)
        else:
            runs.append([i])
    keep = {k: v for k, v in (prepared or {}).items() if k == "rope_dims"}
    parts = [(tuple(run), tuple(replace(members[i], in_scales=None) for i in run),
              members[run[0]].in_scales, dict(keep) if len(runs) == 1 else {})
             for run in runs]
    if prepared is not None:
        prepared["in_scales_parts"] = parts
    return parts


def _has_in_scales(members: tuple[Member, ...]) -> bool:
    return any(m.in_scales is not None for m in members)


def rotate_padded(x: mx.array, seed: int, padded_in: int) -> mx.array:
    """R^T x along the last axis in float32, zero-padded to padded_in: what every kernel
    takes (TurboQuant layers rotate their inputs with this)."""
    xr = rotate(x.astype(mx.float32), seed)
    pad = padded_in - x.shape[-1]
    if pad:
        xr = mx.pad(xr, [(0, 0)] * (xr.ndim - 1) + [(0, pad)])
    return xr


def bind_rotate_padded(n: int, seed: int, padded_in: int):
    """`rotate_padded(x, seed, padded_in)` for inputs of last axis n, as f(x) with the same
    ops: where the rotation is one Hadamard transform (`single_transform`), its plan
    is looked up here, once, not on every decode step of a switch layer."""
    single = single_transform(seed, n)
    if single is None:
        return lambda x: rotate_padded(x, seed, padded_in)
    signs, scale = single
    pad = padded_in - n

    def rotated(x: mx.array) -> mx.array:
        xr = mx.hadamard_transform(x.astype(mx.float32) * signs, scale=scale)
        return mx.pad(xr, [(0, 0)] * (xr.ndim - 1) + [(0, pad)]) if pad else xr

    return rotated


def rotated_input(x: mx.array, m: Member) -> mx.array:
    """R^T x in float32, zero-padded to the member's padded_in."""
    return rotate_padded(x, m.seed, m.padded_in)


def reference_group(x: mx.array, members: tuple[Member, ...], prepared=None,
                    extras: Extras = NO_EXTRAS) -> list[mx.array]:
    """Each member on its own: rotate, GEMV or GEMM, cast, bias (`prepared` is unused);
    `extras` around them with MLX's ops."""
    x = input_of(x, extras)
    outs = []
    for m in members:
        y = dispatch.tq_linear(
            rotated_input(x, m), m.codes, m.scales, m.bits, m.group_size,
            m.out_features, m.padded_in,
        ).astype(x.dtype)
        outs.append(y if m.bias is None else y + m.bias)
    return with_residual(outs, extras)


def bind_linear_group(x: mx.array, members: tuple[Member, ...], prepared: dict | None = None,
                      extras: Extras = NO_EXTRAS, views: tuple | None = None,
                      given: tuple | None = None):
    """`tq_linear_group` for inputs of x's shape and dtype and extras of its mode, as a
    callable f(x, extras): the checks and the choice of kernel are made here, once, so a
    decode step that calls it for every token pays little more than the launch. A
    backend's kernel may offer a `bind` of its own (CUDA's: its launch with the weights
    bound); otherwise f calls the kernel as `tq_linear_group` would.

    `views`: a shape per member to return its output in (the same values, reshaped: an
    attention's heads), for a caller that would reshape them at once. A backend's launch
    may declare them as its outputs' shapes, saving the reshapes; otherwise f reshapes.
    Extras with a `Rope` need views; a backend's launch may rotate as it stores (CUDA's
    fused one), otherwise f applies the attention's RoPE module to the views.

    `given`: the shape f's x will arrive in, where it is not x's (the same values in
    row-contiguous memory: an attention's (B, heads, 1, D) output as o_proj's (B, 1,
    heads * D) row). A backend's launch may read that memory as it is (CUDA's fused one),
    saving the reshape; otherwise f reshapes x to x's shape first."""
    check_members(x, members)
    check_extras(x, members, extras)
    if views is not None:
        check_views(x, members, views)
    if extras.rope is not None:
        check_rope(members, extras.rope, views)
    if given is not None and math.prod(given) != x.size:
        raise ValueError(f"x given as {tuple(given)} cannot be read as {tuple(x.shape)}")
    if _has_in_scales(members):
        return _bind_scaled(x, members, prepared, extras, views, given)
    fn = dispatch.get_for("linear_group", group_bits(members))
    binder = dispatch.binder_of(fn, "bind")
    if binder is not None:
        try:
            return binder(x, members, prepared, extras, views, given)
        except NotImplementedError:  # the kernel does not cover these: it falls back per call
            pass
    if given is not None:
        run, shape = bind_linear_group(x, members, prepared, extras, views), tuple(x.shape)
        return lambda x, extras: run(x.reshape(shape), extras)
    if extras.rope is not None:
        # the call bound without RoPE (which it ignores in the extras it is given), then
        # mlx-lm's RoPE on the viewed queries and keys
        run = bind_linear_group(x, members, prepared, extras.unroped(), views)
        return lambda x, extras: with_rope(run(x, extras), extras.rope)
    return viewed(lambda x, extras: fn(x, members, prepared, extras), views)


def _bind_scaled(x, members, prepared, extras, views, given):
    """bind_linear_group of members with in_scales: each part's call bound on members
    without them, its input scaled first (`scaled_input`: in the norm's weight or the up
    operand where the extras have them, which the kernel then applies as ever)."""
    if given is not None:  # x * t needs x in its own shape
        run, shape = bind_linear_group(x, members, prepared, extras, views), tuple(x.shape)
        return lambda x, extras: run(x.reshape(shape), extras)
    parts = _scaled_parts(members, prepared)
    if len(parts) == 1:
        _, bare, t, sub = parts[0]
        xs, es = scaled_input(x, extras, t)
        run = bind_linear_group(xs, bare, sub, es, views)
        return lambda x, extras: run(*scaled_input(x, extras, t))
    unroped = extras if extras.rope is None else extras.unroped()
    runs = []
    for idx, bare, t, sub in parts:
        xs, es = scaled_input(x, unroped, t)
        part_views = None if views is None else tuple(views[i] for i in idx)
        runs.append((idx, t, bind_linear_group(xs, bare, sub, es, part_views)))

    def run(x, extras):
        outs: list = [None] * len(members)
        plain = extras if extras.rope is None else extras.unroped()
        for idx, t, bound in runs:
            for i, y in zip(idx, bound(*scaled_input(x, plain, t))):
                outs[i] = y
        return outs if extras.rope is None else with_rope(outs, extras.rope)

    return run


def viewed(run, views: tuple | None):
    """f(x, extras) returning `run`'s outputs reshaped to `views` (`run` itself for None)."""
    if views is None:
        return run
    return lambda x, extras: reshaped(run(x, extras), views)


def reshaped(ys: list[mx.array], views: tuple | None) -> list[mx.array]:
    """Each output in its view's shape (the outputs themselves for None)."""
    return ys if views is None else [y.reshape(v) for y, v in zip(ys, views)]


def check_views(x: mx.array, members: tuple[Member, ...], views: tuple) -> None:
    """Each view must hold its member's output for x: as many values, in one shape each."""
    tokens = x.size // x.shape[-1]
    if len(views) != len(members) or any(
            math.prod(v) != tokens * m.out_features for v, m in zip(views, members)):
        raise ValueError(f"views {views} do not hold the outputs of {len(members)} members "
                         f"of widths {[m.out_features for m in members]} for x of shape "
                         f"{tuple(x.shape)}")


def check_members(x: mx.array, members: tuple[Member, ...]) -> None:
    if not members:
        raise ValueError("a linear group needs at least one member")
    widths = {m.in_features for m in members}
    if widths != {x.shape[-1]}:
        raise ValueError(
            f"linear group expects inputs with last axis {sorted(widths)}, got {tuple(x.shape)}"
        )


def fusable(members: tuple[Member, ...], rows_per_block: int = 8) -> bool:
    """Whether members can share one stacked GEMV: same input, codec and widths that
    split at kernel row blocks."""
    first = members[0]
    same = all(
        (m.bits, m.group_size, m.in_features, m.padded_in)
        == (first.bits, first.group_size, first.in_features, first.padded_in)
        for m in members
    )
    aligned = all(m.out_features % rows_per_block == 0 for m in members[:-1])
    biased = {m.bias is None for m in members}
    return (same and aligned and len(biased) == 1 and first.bits != "ternary"
            and not is_trellis(first.bits))


def group_bits(members: tuple[Member, ...]):
    """The members' code for choosing a kernel: a trellis member's if any has one (the
    trellis table's kernel, or the reference, handles the group), else the first's."""
    return next((m.bits for m in members if is_trellis(m.bits)), members[0].bits)


dispatch.add_op("linear_group", reference_group)


def tq_linear_group(x: mx.array, members: tuple[Member, ...], prepared: dict | None = None,
                    extras: Extras = NO_EXTRAS) -> list[mx.array]:
    """[x W_i^T + b_i for each member], in x's dtype, on the device's best kernel; with
    `extras`, of the normalised or gated x, the residual added.

    `prepared`: a dict the caller keeps with these members (and clears when their arrays
    change), where a backend keeps what it derived from them (kernel layouts, launches);
    without it the backend keeps them in a cache of its own, keyed on the arrays. (RoPE
    needs the outputs' views: `bind_linear_group`.)"""
    check_members(x, members)
    check_extras(x, members, extras)
    if extras.rope is not None:
        raise ValueError("a linear group's RoPE needs its outputs' views: bind_linear_group")
    if _has_in_scales(members):
        outs: list = [None] * len(members)
        for idx, bare, t, sub in _scaled_parts(members, prepared):
            xs, es = scaled_input(x, extras, t)
            ys = dispatch.get_for("linear_group", group_bits(bare))(xs, bare, sub, es)
            for i, y in zip(idx, ys):
                outs[i] = y
        return outs
    return dispatch.get_for("linear_group", group_bits(members))(x, members, prepared, extras)

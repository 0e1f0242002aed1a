"""A TurboQuant linear, or several reading the same input (q/k/v, gate/up), as one call.

`Member` holds one weight's packed codes, scales, spec and optional bias; `tq_linear_group`
returns each member's x W^T + b in x's dtype. The reference rotates x once per member (each
weight has its own rotation seed) and runs the GEMV/GEMM entry point; a backend kernel can
rotate for all members in one launch and run one GEMV over their stacked rows
(`kernels/cuda.py`), which is why the members travel together.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from turboquant.stages import rotate

from . import dispatch


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


def rotate_padded(x: mx.array, seed: int, padded_in: int) -> mx.array:
    """R^T x along the last axis in float32, zero-padded to padded_in: what every kernel
    takes (TurboQuant layers rotate their inputs with this)."""
    xr = rotate(x.astype(mx.float32), seed)
    pad = padded_in - x.shape[-1]
    if pad:
        xr = mx.pad(xr, [(0, 0)] * (xr.ndim - 1) + [(0, pad)])
    return xr


def rotated_input(x: mx.array, m: Member) -> mx.array:
    """R^T x in float32, zero-padded to the member's padded_in."""
    return rotate_padded(x, m.seed, m.padded_in)


def reference_group(x: mx.array, members: tuple[Member, ...], prepared=None) -> list[mx.array]:
    """Each member on its own: rotate, GEMV or GEMM, cast, bias (`prepared` is unused)."""
    outs = []
    for m in members:
        y = dispatch.tq_linear(
            rotated_input(x, m), m.codes, m.scales, m.bits, m.group_size,
            m.out_features, m.padded_in,
        ).astype(x.dtype)
        outs.append(y if m.bias is None else y + m.bias)
    return outs


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
    return same and aligned and len(biased) == 1 and first.bits != "ternary"


dispatch.add_op("linear_group", reference_group)


def tq_linear_group(x: mx.array, members: tuple[Member, ...], prepared: dict | None = None
                    ) -> list[mx.array]:
    """[x W_i^T + b_i for each member], in x's dtype, on the device's best kernel.

    `prepared`: a dict the caller keeps with these members (and clears when their arrays
    change), where a backend keeps what it derived from them (kernel layouts, launches);
    without it the backend keeps them in a cache of its own, keyed on the arrays."""
    check_members(x, members)
    return dispatch.get("linear_group")(x, members, prepared)

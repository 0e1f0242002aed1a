"""CUDA kernels for the dispatch table; imported when MLX runs on an NVIDIA GPU.

- "linear_group": a TurboQuant linear, or several reading one input (q/k/v, gate/up), for
  a few tokens: `cuda_rotate` rotates x for every member in one launch, then one
  `cuda_gemv` launch runs over the members' stacked rows and writes each member's output
  in x's dtype, bias added. Two launches per group in place of ~8 MLX ops per linear.
- "matvec": the GEMV alone on activations the caller rotated (2, 3 and 4 bits).

Ternary, prefill (more than `dispatch.MATVEC_MAX_TOKENS` tokens) and gathered experts
fall back to the reference. The GEMV reads codes in its own layout (3-bit codes as two
planes, codes placed next to their activations), prepared once per weight (or group) on
first use and kept beside the stored codes.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from dataclasses import dataclass

import mlx.core as mx

from turboquant.stages import codebook_values, unpack_codes

from . import cuda_gemv, cuda_rotate, dispatch, group

# id(sources) -> (weak refs to the arrays it was built from, prepared value); an entry
# goes when any of its sources is freed, so a dropped model takes its layouts with it
_PREPARED: dict[tuple, tuple] = {}

def _padded64(padded_in: int) -> int:
    return math.ceil(padded_in / 64) * 64


def _repack_one(codes, scales, bits, group_size, padded_in):
    padded64 = _padded64(padded_in)
    low, high = cuda_gemv.repack(unpack_codes(codes, bits, padded_in), bits, padded64)
    groups = padded64 // group_size
    if scales.shape[-1] < groups:
        pad = mx.zeros((scales.shape[0], groups - scales.shape[-1]), dtype=scales.dtype)
        scales = mx.concatenate([scales, pad], axis=-1)
    return low, high, scales


def _cached(sources: tuple, build, evaluate=lambda v: v):
    key = tuple(id(a) for a in sources)
    hit = _PREPARED.get(key)
    if hit is None or any(ref() is not a for ref, a in zip(hit[0], sources)):
        value = build()
        if value is not None:
            mx.eval(evaluate(value))

        def forget(_, key=key):
            _PREPARED.pop(key, None)

        hit = (tuple(weakref.ref(a, forget) for a in sources), value)
        _PREPARED[key] = hit
    return hit[1]


def prepared(codes: mx.array, scales: mx.array, bits: int, group_size: int, padded_in: int):
    """The kernel's layout of one weight, built on first use."""
    return _cached((codes,), lambda: _repack_one(codes, scales, bits, group_size, padded_in))


def _repack_group(members):
    """The members' kernel layouts stacked by rows, and their biases (or None)."""
    parts = [_repack_one(m.codes, m.scales, m.bits, m.group_size, m.padded_in) for m in members]
    low = mx.concatenate([q[0] for q in parts])
    high = mx.concatenate([q[1] for q in parts]) if members[0].bits == 3 else parts[0][1]
    scales = mx.concatenate([q[2] for q in parts])
    bias = None
    if members[0].bias is not None:
        bias = mx.concatenate([m.bias.astype(mx.float32) for m in members])
    return low, high, scales, bias


@functools.lru_cache(maxsize=None)
def _levels(bits: int) -> mx.array:
    return mx.array(codebook_values(bits))


@functools.lru_cache(maxsize=64)
def _pair_arrays(rows: int) -> tuple[mx.array, mx.array]:
    """Expert 0 and x row p for every pair p: the dense GEMV's index arrays."""
    expert, row = mx.zeros((rows,), dtype=mx.int32), mx.arange(rows, dtype=mx.int32)
    mx.eval(expert, row)
    return expert, row


@dataclass(frozen=True)
class _GroupPlan:
    """What a group's kernels need besides x: built once per set of weights."""

    static: tuple  # (bits, group_size, n, width, a, p, ends, has_bias): the compile key
    operands: tuple  # signs, mix, low, high, scales, levels, bias


def _group_plan(members) -> _GroupPlan:
    def build():
        first = members[0]
        if not group.fusable(members):
            return None
        signs, mix, a, p = cuda_rotate.operands(tuple(m.seed for m in members),
                                                first.in_features)
        low, high, scales, bias = _repack_group(members)
        ends = tuple(itertools.accumulate(m.out_features for m in members))
        static = (first.bits, first.group_size, first.in_features, _padded64(first.padded_in),
                  a, p, ends, bias is not None)
        return _GroupPlan(static, (signs, mix, low, high, scales, _levels(first.bits),
                                   bias if bias is not None else cuda_gemv._no_bias()))

    return _cached(tuple(m.codes for m in members), build, evaluate=lambda v: v.operands)


@functools.lru_cache(maxsize=512)
def _compiled_group(static: tuple, out_dtype):
    """One compiled function per group shape: MLX replays the two launches without
    rebuilding them, which is most of a launch's host-side cost."""
    bits, group_size, n, width, a, p, ends, has_bias = static

    def run(x, signs, mix, low, high, scales, levels, bias, expert, row):
        xr = cuda_rotate.rotate_with(x, signs, mix, a, p, width)
        ys = cuda_gemv.gemv(
            xr if len(ends) > 1 else xr[0], low, high, scales, levels, expert, row,
            bits=bits, group_size=group_size, out_features=ends[-1], out_dtype=out_dtype,
            ends=ends if len(ends) > 1 else (), bias=bias, add_bias=has_bias,
            rows_per_warp=cuda_gemv.rows_per_warp_for(ends[-1]),
        )
        return ys if len(ends) > 1 else [ys]

    return mx.compile(run)


def linear_group(x, members):
    tokens = x.size // max(1, x.shape[-1])
    if tokens > dispatch.MATVEC_MAX_TOKENS:
        raise NotImplementedError
    plan = _group_plan(members)
    if plan is None:
        raise NotImplementedError
    out_dtype = x.dtype if x.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float32
    expert, row = _pair_arrays(tokens)
    x2 = x.reshape(tokens, x.shape[-1])
    ys = _compiled_group(plan.static, out_dtype)(x2, *plan.operands, expert, row)
    lead = x.shape[:-1]
    return [y.reshape(*lead, m.out_features) for y, m in zip(ys, members)]


def matvec(x_rot, codes, scales, bits, group_size, out_features, padded_in, **_):
    if bits == "ternary" or codes.ndim != 2:
        raise NotImplementedError
    low, high, scales64 = prepared(codes, scales, bits, group_size, padded_in)
    lead = x_rot.shape[:-1]
    x = x_rot.reshape(-1, padded_in).astype(mx.float16)
    padded64 = _padded64(padded_in)
    if padded64 > padded_in:
        x = mx.pad(x, [(0, 0), (0, padded64 - padded_in)])
    expert, row = _pair_arrays(x.shape[0])
    y = cuda_gemv.gemv(
        x, low, high, scales64, _levels(bits), expert, row,
        bits=bits, group_size=group_size, out_features=out_features, out_dtype=mx.float32,
    )
    return y.reshape(*lead, out_features)


dispatch.register("cuda", "matvec", matvec)
dispatch.register("cuda", "linear_group", linear_group)

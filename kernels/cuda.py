"""CUDA kernels for the dispatch table; imported when MLX runs on an NVIDIA GPU.

- "linear_group": a TurboQuant linear, or several reading one input (q/k/v, gate/up), for
  a few tokens, in one launch (`cuda_linear`: each block rotates x with its member's seed,
  then runs the GEMV over its rows of the members' stacked weights) that writes each
  member's output in x's dtype, bias added; the launch also does the call's
  `group.Extras` (RMSNorm or SwiGLU on the row, a residual on the output, RoPE on a
  q/k/v group's queries and keys when its rows are in pairs, `pair_order`). With
  TURBOQUANT_CUDA_FUSED=0 (for comparison) it is two launches, `cuda_rotate` for all
  members then one `cuda_gemv`, and the extras are MLX ops.
- "matvec": the GEMV alone on activations the caller rotated (2, 3 and 4 bits).
- "gather_matmul": a decode step's MoE experts, one GEMV launch over the (token, expert)
  pairs. Ternary codes run everywhere as 2-bit codes against a 4-entry codebook.

- "matmul": prefill (more than `dispatch.MATVEC_MAX_TOKENS` tokens): the stored codes
  decoded tile by tile to x's dtype (`cuda_dequant`), each tile multiplied by MLX's GEMM
  on tensor cores. A group's prefill (`prefill_group`) rotates the input for all its
  members in one `cuda_rotate` launch, in that dtype, then runs each member's product.

Prefill's experts (`prefill_gather`) decode the experts in use a run at a time for MLX's
`gather_mm` (`tiles.gathered_matmul`; `GATHER_MM` off: the reference's grouping by expert
with that tiled product for each expert in use). The GEMV reads codes in its own layout
(3-bit codes as two planes, codes placed next to their activations), prepared once per
weight (or group, or switch layer) on first use and kept beside the stored codes: in the
caller's `prepared` dict when it passes one (runtime layers do), else in a cache keyed on
what was built and the code arrays, freed with them.
The small operands every block reads (codebooks, pair indices, biases, norm weights, the
rotation's signs and mixes) are `cuda_memory.device_constant`s: pages of their own, on the
GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import weakref

import mlx.core as mx
import numpy as np

from turboquant.stages import codebook_values, unpack_codes

from . import cuda_attend  # noqa: F401 (registers "buffer_attention")
from . import (cuda_dequant, cuda_gemv, cuda_linear, cuda_memory, cuda_rotate, dispatch, group,
               reference, tiles)

# one launch per group (rotation inside the GEMV); "0" keeps the two-launch path
FUSED = os.environ.get("TURBOQUANT_CUDA_FUSED", "1") != "0"

# Extras modes (norm, gate, residual, rope) that `_Plan.bind` launches without a helper call
_PLAIN, _NORM = (False, False, False, False), (True, False, False, False)
_RESIDUAL, _GATE_RESIDUAL = (False, False, True, False), (False, True, True, False)
_NORM_ROPE = (True, False, False, True)

# id(sources) -> (weak refs to the arrays it was built from, prepared value); an entry
# goes when any of its sources is freed, so a dropped model takes its layouts with it
_PREPARED: dict[tuple, tuple] = {}


def _padded64(padded_in: int) -> int:
    return math.ceil(padded_in / 64) * 64


def kernel_bits(bits: int | str) -> int:
    """The GEMV width that runs codes of `bits`: ternary codes (0, 1, 2) run as 2-bit codes
    against a 4-entry codebook whose last entry no code uses."""
    return 2 if bits == "ternary" else bits


def _repack_one(codes, scales, bits, group_size, padded_in):
    padded64 = _padded64(padded_in)
    low, high = cuda_gemv.repack(unpack_codes(codes, bits, padded_in), kernel_bits(bits),
                                 padded64)
    groups = padded64 // group_size
    if scales.shape[-1] < groups:
        pad = mx.zeros((scales.shape[0], groups - scales.shape[-1]), dtype=scales.dtype)
        scales = mx.concatenate([scales, pad], axis=-1)
    return low, high, scales


def _cached(kind: str, sources: tuple, build):
    """build(), kept until one of `sources` is freed (or replaced under the same id);
    `kind` keeps apart what different callers build from the same arrays (a one-member
    group's plan and its weight's GEMV layout)."""
    key = (kind, *(id(a) for a in sources))
    hit = _PREPARED.get(key)
    if hit is None or any(ref() is not a for ref, a in zip(hit[0], sources)):

        def forget(_, key=key):
            _PREPARED.pop(key, None)

        hit = (tuple(weakref.ref(a, forget) for a in sources), build())
        _PREPARED[key] = hit
    return hit[1]


def prepared(codes: mx.array, scales: mx.array, bits: int, group_size: int, padded_in: int):
    """The kernel's layout of one weight, built on first use."""
    def build():
        layout = _repack_one(codes, scales, bits, group_size, padded_in)
        mx.eval(layout)
        return layout

    return _cached("matvec", (codes,), build)


def pair_order(ends: tuple[int, ...], head: int) -> np.ndarray:
    """The stacked rows in the order the fused kernel stores RoPE pairs from
    (`cuda_linear._PAIRED_STORE`): in the first two members (queries, keys), row 2i + h of
    each head of `head` rows is the head's row i + h * head / 2; the others in order."""
    rows = np.arange(ends[-1])
    for start, stop in ((0, ends[0]), (ends[0], ends[1])):
        local = np.arange(stop - start)
        j = local % head
        rows[start:stop] = start + local - j + j // 2 + (j % 2) * (head // 2)
    return rows


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
def _levels(bits: int | str) -> mx.array:
    levels = codebook_values(bits)
    if bits == "ternary":  # [-c, 0, +c] and an unused fourth entry for the 2-bit table
        levels = mx.concatenate([levels, mx.zeros((1,), dtype=levels.dtype)])
    return cuda_memory.device_constant(levels)


@functools.lru_cache(maxsize=64)
def _pair_arrays(rows: int) -> tuple[mx.array, mx.array]:
    """Expert 0 and x row p for every pair p: the dense GEMV's index arrays."""
    expert, row = mx.zeros((rows,), dtype=mx.int32), mx.arange(rows, dtype=mx.int32)
    return cuda_memory.device_constant(expert), cuda_memory.device_constant(row)


class _Plan:
    """A group's operands in the kernels' layout and its launches per input shape: what
    every token reuses, so a call is one kernel launch (two unfused) and a few lines of
    Python."""

    def __init__(self, members, pairs: int = 0):
        first = members[0]
        self.n = first.in_features
        seeds = tuple(m.seed for m in members)
        self.signs, self.mix, self.a, self.p = cuda_rotate.operands(seeds, self.n)
        self.low, self.high, self.scales, bias = _repack_group(members)
        self.levels = _levels(first.bits)
        self.bits, self.group_size = first.bits, first.group_size
        self.ends = tuple(itertools.accumulate(m.out_features for m in members))
        self.widths = tuple(m.out_features for m in members)
        self.width = _padded64(first.padded_in)
        self.fused = FUSED and cuda_linear.fits(self.n, self.width, self.a)
        # the head size whose RoPE pairs the first two members' rows are in (0: in order)
        self.pairs = pairs if self.fused and cuda_linear.pairable(
            self.ends, pairs, cuda_linear.rows_per_warp_for(self.ends)) else 0
        if self.pairs:
            rows = mx.array(pair_order(self.ends, self.pairs))
            self.low, self.scales = self.low[rows], self.scales[rows]
            if first.bits == 3:
                self.high = self.high[rows]
            bias = None if bias is None else bias[rows]
        self.has_bias = bias is not None
        self.bias = cuda_memory.device_constant(bias) if bias is not None else cuda_gemv._no_bias()
        self.launches: dict[tuple, object] = {}
        self.norms: dict[int, tuple] = {}  # id(norm weight) -> (weight, eps, kernel operand)
        mx.eval(self.signs, self.mix, self.low, self.high, self.scales, self.bias)

    def _launches(self, lead: tuple, dtype, mode: tuple[bool, bool, bool, bool]):
        tokens = math.prod(lead)
        grouped = len(self.ends) > 1
        out_dtype = dtype if dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float32
        if self.fused:
            return cuda_linear.launch(
                n=self.n, a=self.a, padded=self.width, bits=self.bits,
                group_size=self.group_size, ends=self.ends, lead=lead, in_dtype=dtype,
                out_dtype=out_dtype, add_bias=self.has_bias, mode=mode, pairs=self.pairs)
        rotate = cuda_rotate.launch(self.n, self.a, self.p, self.width, len(self.ends), tokens,
                                    dtype, squeeze=True)
        gemv = cuda_gemv.launch(
            bits=self.bits, group_size=self.group_size, out_features=self.ends[-1],
            padded=self.width, nscales=self.scales.shape[-1], pairs=tokens,
            out_dtype=out_dtype,
            ends=self.ends if grouped else (), x_rows=tokens if grouped else 0,
            add_bias=self.has_bias,
        )
        # outputs in the caller's leading shape: the kernel writes row-major either way
        gemv = dataclasses.replace(gemv, shapes=[(*lead, w) for w in self.widths])
        expert, row = _pair_arrays(tokens)
        return rotate, gemv, expert, row, grouped

    def _launch(self, lead: tuple, dtype, mode: tuple[bool, bool, bool, bool]):
        key = (lead, dtype, mode)
        hit = self.launches.get(key)
        if hit is None:
            hit = self.launches[key] = self._launches(*key)
        return hit

    def _weights(self) -> list[mx.array]:
        """The fused launch's inputs after the row's (`cuda_linear.WEIGHTS`' order)."""
        return [self.signs, self.mix, self.low, self.high, self.scales, self.levels, self.bias]

    def bind(self, lead: tuple, dtype, mode: tuple[bool, bool, bool, bool], views=None,
             given=None):
        """f(x, extras) for inputs of leading shape `lead` and `dtype`, extras of `mode`:
        the fused launch with the weights bound (the two-launch path: this plan's call).
        For the modes a fused decoder block uses, f reads the extras' arrays itself and
        launches: one Python call a token, where each costs the GPU's host time. Inputs
        in `cuda_linear.inputs(mode)`'s order: x, up, norm weight + eps, residual, RoPE's
        position and inverse frequencies, weights. `views`: the outputs' shapes
        (`group.bind_linear_group`), which the fused launch declares itself: the kernel
        writes each output row-major in either shape. RoPE needs the rows in pairs of its
        head size (NotImplementedError otherwise: the caller rotates with MLX's op). The
        fused launch reads x's row-contiguous memory whatever shape x is `given` in (the
        rows are `lead`'s); the two-launch path does not (NotImplementedError)."""
        if mode[3] and (views is None or any(v[-1] != self.pairs for v in views[:2])):
            raise NotImplementedError  # no pairs (0 unless fused) of the views' head size
        if not self.fused:
            if given is not None:
                raise NotImplementedError
            return group.viewed(self.__call__, views)
        launch = self._launch(lead, dtype, mode)
        if views is not None:
            launch = dataclasses.replace(launch, shapes=[tuple(v) for v in views])
        launch, weights = launch.bound(), self._weights()
        if mode == _PLAIN:
            return lambda x, extras: launch(inputs=[x, *weights])
        if mode == _NORM:  # q/k/v, gate/up
            return self._bind_norm(launch, weights)
        if mode == _NORM_ROPE:  # q/k/v with RoPE
            return self._bind_norm(launch, weights, rope=True)
        if mode == _RESIDUAL:  # o_proj
            return lambda x, extras: launch(inputs=[x, extras.residual, *weights])
        if mode == _GATE_RESIDUAL:  # down_proj
            return lambda x, extras: launch(inputs=[x, extras.up, extras.residual, *weights])
        extra_inputs, rope = self._extra_inputs, mode[3]
        return lambda x, extras: launch(inputs=[x, *extra_inputs(extras, rope), *weights])

    def _bind_norm(self, launch, weights: list[mx.array], rope: bool = False):
        """The normed launch (with `rope`, RoPE's position and inverse frequencies after the
        norm), its norm operand looked up again only when the extras bring another norm
        weight or eps than the last call's (a block brings the same one every token)."""
        seen = (None, None, None)  # the last call's norm weight, eps and operand

        def run(x: mx.array, extras: group.Extras) -> list[mx.array]:
            nonlocal seen
            if extras.norm is not seen[0] or extras.eps != seen[1]:
                seen = (extras.norm, extras.eps, self._norm_operand(extras.norm, extras.eps))
            if rope:
                r = extras.rope
                return launch(inputs=[x, seen[2], r.offset, r.inverse, *weights])
            return launch(inputs=[x, seen[2], *weights])

        return run

    def __call__(self, x: mx.array, extras: group.Extras = group.NO_EXTRAS) -> list[mx.array]:
        if not self.fused:  # the two-launch path does the extras with MLX's ops
            x, residual, extras = group.input_of(x, extras), extras, group.NO_EXTRAS
        hit = self._launch(x.shape[:-1], x.dtype, extras.mode)
        if self.fused:
            return hit(x, *self._extra_inputs(extras, extras.mode[3]), *self._weights())
        rotate, gemv, expert, row, grouped = hit
        xr = rotate(x, self.signs, self.mix)
        ys = gemv(xr, self.low, self.high, self.scales, self.levels, expert, row, self.bias)
        return group.with_residual(ys if grouped else [ys], residual)

    def _extra_inputs(self, extras: group.Extras, rope: bool = False) -> list[mx.array]:
        """The up row, norm weight + eps, residual and (with `rope`) RoPE inputs
        `cuda_linear.inputs` names."""
        arrays = [] if extras.up is None else [extras.up]
        if extras.norm is not None:
            arrays.append(self._norm_operand(extras.norm, extras.eps))
        if extras.residual is not None:
            arrays.append(extras.residual)
        if rope:
            arrays += [extras.rope.offset, extras.rope.inverse]
        return arrays

    def _norm_operand(self, weight: mx.array, eps: float) -> mx.array:
        """The norm's weight then eps, float32: built once per norm (a layer's own)."""
        hit = self.norms.get(id(weight))
        if hit is None or hit[0] is not weight or hit[1] != eps:
            packed = mx.concatenate([weight.astype(mx.float32), mx.array([eps], mx.float32)])
            packed = cuda_memory.device_constant(packed)
            hit = self.norms[id(weight)] = (weight, eps, packed)
        return hit[2]


_UNFUSABLE = object()  # members one stacked GEMV cannot serve: the reference runs them


def _plan(members, pairs: int = 0):
    if not group.fusable(members):
        return _UNFUSABLE
    try:
        return _Plan(members, pairs)
    except NotImplementedError:  # a rotation the kernel does not cover (cuda_rotate.operands)
        return _UNFUSABLE


def _group_plan(x, members, prepared):
    """The members' _Plan (NotImplementedError where the reference must run); its rows in
    RoPE pairs where the caller's `prepared` names the head size ("rope_dims")."""
    if x.size // max(1, x.shape[-1]) > dispatch.MATVEC_MAX_TOKENS:
        raise NotImplementedError  # prefill: the reference GEMM
    plan = None if prepared is None else prepared.get("cuda")
    if plan is None:
        if prepared is None:  # no caller-held cache: one per set of weights, freed with them
            plan = _cached("group", tuple(m.codes for m in members), lambda: _plan(members))
        else:
            plan = prepared["cuda"] = _plan(members, prepared.get("rope_dims", 0))
    if plan is _UNFUSABLE:
        raise NotImplementedError
    return plan


def linear_group(x, members, prepared=None, extras=group.NO_EXTRAS):
    if x.size // max(1, x.shape[-1]) > dispatch.MATVEC_MAX_TOKENS:
        return prefill_group(x, members, extras)
    return _group_plan(x, members, prepared)(x, extras)


def prefill_group(x, members, extras=group.NO_EXTRAS):
    """Prefill (more than `dispatch.MATVEC_MAX_TOKENS` rows): every member's rotation of
    the (normalised or gated) input in one launch, written in the dtype the products run
    in, then each member's tiled product ("matmul": `cuda_dequant.matmul`); the reference's
    results.
    NotImplementedError where one launch cannot rotate for all members (their padded
    widths differ, or the rotation is too large for a block): the reference runs."""
    widths = {m.padded_in for m in members}
    if len(widths) != 1:
        raise NotImplementedError
    row = group.input_of(x, extras)
    lead, n = row.shape[:-1], row.shape[-1]
    dtype = tiles.compute_dtype(row.dtype)
    rotated = cuda_rotate.rotate(row.reshape(-1, n), tuple(m.seed for m in members),
                                 widths.pop(), dtype)
    matmul = dispatch.get("matmul", "cuda")  # cuda_dequant's, unless a caller took it out
    outs = []
    for xr, m in zip(rotated, members):
        y = matmul(xr, m.codes, m.scales, m.bits, m.group_size, m.out_features,
                   m.padded_in).astype(x.dtype).reshape(*lead, m.out_features)
        outs.append(y if m.bias is None else y + m.bias)
    return group.with_residual(outs, extras)


def bind_linear_group(x, members, prepared=None, extras=group.NO_EXTRAS, views=None,
                      given=None):
    """`group.bind_linear_group` on CUDA: the plan's launch for x's shape and dtype and
    extras' mode, its weights bound, its outputs in the `views`' shapes if given; the
    fused launch reads x's memory in the shape it is `given` in (no reshape)."""
    return _group_plan(x, members, prepared).bind(x.shape[:-1], x.dtype, extras.mode, views,
                                                  given)


linear_group.bind = bind_linear_group


def _gemv_rows(x: mx.array, padded_in: int) -> mx.array:
    """Rotated rows (rows, padded_in) as the GEMV reads them: float16, zero-padded to whole
    64-code groups."""
    x = x.astype(mx.float16)
    padded64 = _padded64(padded_in)
    if padded64 > padded_in:
        x = mx.pad(x, [(0, 0), (0, padded64 - padded_in)])
    return x


def matvec(x_rot, codes, scales, bits, group_size, out_features, padded_in, **_):
    if codes.ndim != 2:
        raise NotImplementedError
    low, high, scales64 = prepared(codes, scales, bits, group_size, padded_in)
    lead = x_rot.shape[:-1]
    x = _gemv_rows(x_rot.reshape(-1, padded_in), padded_in)
    expert, row = _pair_arrays(x.shape[0])
    y = cuda_gemv.gemv(
        x, low, high, scales64, _levels(bits), expert, row,
        bits=kernel_bits(bits), group_size=group_size, out_features=out_features,
        out_dtype=mx.float32,
    )
    return y.reshape(*lead, out_features)


def prepared_experts(codes: mx.array, scales: mx.array, bits: int, group_size: int,
                     padded_in: int):
    """The kernel's layout of every expert of a switch layer, stacked by rows (expert e's
    rows at e * out), built on first use and kept with the (E, out, words) codes."""
    def build():
        e, out = codes.shape[:2]
        layout = _repack_one(codes.reshape(e * out, -1), scales.reshape(e * out, -1), bits,
                             group_size, padded_in)
        mx.eval(layout)
        return layout

    return _cached("experts", (codes,), build)


# a decode step's (token, expert) pairs x rows at or below this many: the GEMV kernel
GATHER_MAX_PAIR_ROWS = 64


# The 2026-11-29 run's host-op cut of a gathered call (`tools/host_ops.py --moe`: 68 MLX ops a
# Qwen3-30B-A3B layer instead of 79; affine-4: 54): x's own rows (no copy per pair; each
# pair reads its token's row through pair_row), the routing's indices as they come (uint32
# or int32), the output written in the caller's dtype. On since 2026-11-30 (its GPU tests
# passed; MoE decode 119.2 / 141.7 tok/s against 82.6 / 127.0 without, in alternating
# rounds of one process); TURBOQUANT_CUDA_COMPACT_GATHER=0 keeps the broadcast path.
COMPACT_GATHER = os.environ.get("TURBOQUANT_CUDA_COMPACT_GATHER", "1") == "1"


def gather(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, *,
           out_dtype=None, sorted_indices=False, **_):
    """Experts chosen per token (the reference's signature). A decode step's few pairs:
    one GEMV launch whose every (pair, row) reads its expert's rows of the stacked layout
    (ternary experts as 2-bit codes); prefill's many: `prefill_gather`."""
    if _gathered_rows(x_rot, indices) > GATHER_MAX_PAIR_ROWS:
        return prefill_gather(x_rot, codes, scales, indices, bits, group_size, out_features,
                              padded_in, out_dtype=out_dtype, sorted_indices=sorted_indices)
    if COMPACT_GATHER:  # the launch `bind_gather` settles, made for this one call
        return bind_gather(x_rot, codes, scales, indices, bits, group_size, out_features,
                           padded_in, out_dtype=out_dtype)(x_rot, codes, scales, indices)
    batch, m, pairs = reference.decode_pairs(x_rot, codes, indices, out_features, padded_in,
                                             GATHER_MAX_PAIR_ROWS)
    low, high, scales64 = prepared_experts(codes, scales, bits, group_size, padded_in)
    x = _gemv_rows(mx.broadcast_to(x_rot, (*batch, m, padded_in)).reshape(pairs * m, padded_in),
                   padded_in)
    experts = mx.broadcast_to(indices, batch).reshape(pairs, 1).astype(mx.int32)
    pair_expert = mx.broadcast_to(experts, (pairs, m)).reshape(-1)
    pair_row = _pair_rows(batch, batch, m)  # x broadcast to every pair: the identity
    y = cuda_gemv.gemv(
        x, low, high, scales64, _levels(bits), pair_expert, pair_row,
        bits=kernel_bits(bits), group_size=group_size, out_features=out_features,
        out_dtype=mx.float32,
    )
    return y.reshape(*batch, m, out_features).astype(out_dtype or x_rot.dtype)


def _gathered_rows(x_rot: mx.array, indices: mx.array) -> int:
    """(token, expert) pairs x activation rows of a gathered call (0 where the shapes do
    not broadcast: the reference names the error)."""
    if x_rot.ndim < 2:
        return 0
    try:
        batch = mx.broadcast_shapes(tuple(x_rot.shape[:-2]), tuple(indices.shape))
    except ValueError:
        return 0
    return math.prod(batch) * x_rot.shape[-2]


# Prefill's experts as one decode launch for the experts in use (runs of them up to
# `tiles.CHUNK` weights) and MLX's `gather_mm` over the pairs, instead of a tiled product
# per expert, which is bound by its launches (128 experts x 3 projections a layer). On
# the H200 (2026-12-01) a Qwen3-30B-A3B-shaped 2048-token prefill ran 14.2-17.5K prompt
# tok/s this way against 8.5-10.5K per expert (affine-4 5.2K), peak 10.2 against 8.8 GB.
# TURBOQUANT_CUDA_GATHER_MM=0 (decode.py -perexpert) for the product per expert.
GATHER_MM = os.environ.get("TURBOQUANT_CUDA_GATHER_MM", "1") == "1"


def prefill_gather(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in,
                   *, out_dtype=None, sorted_indices=False):
    """Prefill's experts, in the output's dtype (bf16 for a bf16 model: tensor cores). With
    `GATHER_MM` (the default) `cuda_dequant.gather_matmul`: the experts in use decoded a
    run at a time, then MLX's `gather_mm`. Otherwise the pairs grouped by expert as the
    reference groups them, each expert in use one tiled product ("matmul":
    `cuda_dequant.matmul`)."""
    out_dtype = out_dtype or x_rot.dtype
    x = x_rot.astype(tiles.compute_dtype(out_dtype))
    if GATHER_MM:
        y = cuda_dequant.gather_matmul(x, codes, scales, indices, bits, group_size,
                                       out_features, padded_in, sorted_indices=sorted_indices)
        return y.astype(out_dtype)
    return reference.tq_gather_matmul(
        x, codes, scales, indices, bits, group_size, out_features, padded_in,
        sorted_indices=sorted_indices, out_dtype=out_dtype, gemm=dispatch.get("matmul", "cuda"))


def bind_gather(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, *,
                out_dtype=None, **_):
    """`gather` for arguments of these shapes and dtypes, as f(x_rot, codes, scales,
    indices): the pair arrays, the launch and every branch on shapes are settled here,
    once, and the experts' layout looked up again only for other codes than the last
    call's (a switch layer brings its own every token). The compact path itself: `gather`
    runs it through here; NotImplementedError where the kernel does not cover a call.
    x's rows (no copy per pair; each pair reads its token's row through pair_row), the
    routing's indices as they come (uint32 or int32), the output in the caller's dtype."""
    batch, m, _ = reference.decode_pairs(x_rot, codes, indices, out_features, padded_in,
                                         GATHER_MAX_PAIR_ROWS)
    out_dtype = out_dtype or x_rot.dtype

    def unbound(x_rot, codes, scales, indices):
        return gather(x_rot, codes, scales, indices, bits, group_size, out_features,
                      padded_in, out_dtype=out_dtype)

    if not COMPACT_GATHER:  # the broadcast path, kept for comparison: called as is
        return unbound
    return _bind_pairs(x_rot, codes, scales, indices, bits, group_size, out_features,
                       padded_in, batch, m, out_dtype, unbound=unbound)


# A switch layer's decode step as one launch per projection: the fused kernel rotates each
# (pair, row)'s x in its blocks and runs the pair's expert's rows against it
# (`cuda_linear`, gather), instead of the rotation's MLX ops, a cast and the gathered GEMV.
# On since 2026-11-30 (its GPU tests passed; Qwen3-30B-A3B shape, 12 layers: TQ3 258.3
# tok/s, evaluating 2.64 ms a token, against 184.0 and 3.92 ms without);
# TURBOQUANT_CUDA_FUSED_GATHER=0 rotates with MLX ops, then the gathered GEMV.
FUSED_GATHER = os.environ.get("TURBOQUANT_CUDA_FUSED_GATHER", "1") == "1"


def bind_gather_linear(x, codes, scales, indices, bits, group_size, out_features, padded_in,
                       *, seed: int, out_dtype=None, **_):
    """f(x, codes, scales, indices) for arguments of these shapes and dtypes: `gather` on
    the *unrotated* x (last axis n), rotated with `seed` inside the launch, settled once as
    `bind_gather` settles its launch. NotImplementedError where the fused kernel does not
    cover the call (then rotate and `bind_gather`)."""
    if not FUSED_GATHER:
        raise NotImplementedError
    # the checks of the rotated call's, on x's own width (the kernel pads what it rotates)
    batch, m, _ = reference.decode_pairs(x, codes, indices, out_features, x.shape[-1],
                                         GATHER_MAX_PAIR_ROWS)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (mx.float16, mx.bfloat16, mx.float32):
        raise NotImplementedError
    return _bind_pairs(x, codes, scales, indices, bits, group_size, out_features, padded_in,
                       batch, m, out_dtype, seed=seed)


def _bind_pairs(x, codes, scales, indices, bits, group_size, out_features, padded_in, batch,
                m, out_dtype, *, seed: int | None = None, unbound=None):
    """The bound call of a decode step's (pair, row)s: with `seed`, the fused launch on the
    unrotated x (`bind_gather_linear`), else the GEMV on the rotated x (`bind_gather`,
    which runs `unbound` once TURBOQUANT_CUDA_COMPACT_GATHER is switched off)."""
    pairs = math.prod(batch)
    seen = (codes, prepared_experts(codes, scales, bits, group_size, padded_in))
    padded64 = _padded64(padded_in)
    if seed is not None:  # the rotation's operands, in the order of `cuda_linear.WEIGHTS`
        signs, mix, a, _ = cuda_rotate._cached_operands((seed,), x.shape[-1])
        if not cuda_linear.fits(x.shape[-1], padded64, a):
            raise NotImplementedError
        launch = cuda_linear.launch(
            n=x.shape[-1], a=a, padded=padded64, bits=kernel_bits(bits),
            group_size=group_size, ends=(out_features,), lead=(pairs * m,), in_dtype=x.dtype,
            out_dtype=out_dtype, add_bias=False, gather=True)
        rotation = (signs, mix)
    else:
        launch = cuda_gemv.launch(
            bits=kernel_bits(bits), group_size=group_size, out_features=out_features,
            padded=padded64, nscales=seen[1][2].shape[-1], pairs=pairs * m,
            out_dtype=out_dtype)
    shape = (*batch, m, out_features)
    # the output in the caller's shape, declared by the launch: the kernel writes the
    # (pair, row)s' rows in order either way, so no reshape follows
    launch = dataclasses.replace(launch, shapes=[shape]).bound()
    pad = [(0, 0), (0, padded64 - padded_in)] if padded64 > padded_in else None
    pair_row = _pair_rows(tuple(x.shape[:-2]), batch, m)
    levels, no_bias = _levels(bits), cuda_gemv._no_bias()
    broadcast = tuple(indices.shape) != batch
    cast = indices.dtype not in (mx.int32, mx.uint32)

    def run(x, codes, scales, indices):
        nonlocal seen
        if unbound is not None and not COMPACT_GATHER:
            return unbound(x, codes, scales, indices)
        if codes is not seen[0]:
            seen = (codes, prepared_experts(codes, scales, bits, group_size, padded_in))
        experts = mx.broadcast_to(indices, batch) if broadcast else indices
        if cast:
            experts = experts.astype(mx.int32)
        # the kernel reads the experts in row-major order whatever their shape (MLX makes
        # a broadcast contiguous); with m rows a pair each row reads its pair's expert
        pair_expert = experts if m == 1 else mx.repeat(experts, m)
        low, high, scales64 = seen[1]
        if seed is not None:  # x as it comes: the kernel rotates, casts and pads its rows
            y = launch(inputs=[x, *rotation, low, high, scales64, levels, no_bias,
                               pair_expert, pair_row])[0]
        else:
            x = x.reshape(-1, padded_in).astype(mx.float16)  # `_gemv_rows`, inline
            if pad is not None:
                x = mx.pad(x, pad)
            y = launch(inputs=[x, low, high, scales64, levels, pair_expert, pair_row,
                               no_bias])[0]
        return y  # in `shape` and out_dtype already, as the launch declared them

    return run


gather.bind = bind_gather
gather.bind_unrotated = bind_gather_linear


@functools.lru_cache(maxsize=256)
def _pair_rows(x_batch: tuple, batch: tuple, m: int) -> mx.array:
    """x's row for each (pair, row of the pair), pairs in `batch` order: the pair's token
    (its index in x's batch, broadcast to `batch`) times m, plus the row."""
    token = np.broadcast_to(np.arange(math.prod(x_batch)).reshape(x_batch), batch).reshape(-1)
    rows = (token[:, None] * m + np.arange(m)[None]).reshape(-1).astype(np.int32)
    return cuda_memory.device_constant(mx.array(rows))


dispatch.register("cuda", "matvec", matvec)
dispatch.register("cuda", "matmul", cuda_dequant.matmul)
dispatch.register("cuda", "linear_group", linear_group)
dispatch.register("cuda", "gather_matmul", gather)

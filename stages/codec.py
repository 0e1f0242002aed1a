"""Encode a 2-D weight into TurboQuant codes and scales, and decode it back.

encode: rotate rows along the input dim -> pad to a multiple of group_size -> per-group
RMS scale (fp16) -> nearest Lloyd-Max codes -> optional least-squares refit of the scales
-> pack. decode reverses it. Rows are independent, so both work on chunks of rows to keep
memory flat on huge matrices; the bytes do not depend on the chunking.

Where the bytes come from: encode runs on the host, in float32. The power-of-two Hadamard is
MLX's CPU kernel (hadamard_transform), whose rounding is part of the format; everything else
is numpy: the 12/20/28 and dense rotation factors and every group sum (energy, <x, q>,
<q, q>) are sums taken in order from 0.0, as MLX's CPU kernels take them, and the rest
(normalize, compare with thresholds, look up levels, pack) is exact. The steps after the
rotation work on groups laid out group-axis first, (group_size, groups), so each is one
contiguous op. Where numba is installed, stages/fast_hadamard.py (the rotation, and each
group's energy) and fast_quantize.py (normalize, codes, levels, refit sums, 2/3/4-bit
packing) do the same float32 operations in the same order as compiled loops, several times
faster. tests/test_stages_golden.py pins the bytes of both paths to those of the plain MLX
stages.

Two codes share the rotation, padding, scales and packed shapes: "scalar" (the Lloyd-Max
levels above, the default) and "trellis" (stages/trellis.py: a Viterbi over a bitshift
trellis with a computed codebook, docs/FORMAT.md "Trellis code"), chosen per tensor by
`QuantSpec.codec`. The trellis branch takes the same rotated rows (rotate_groups_np), as
(rows, padded_in), and replaces the nearest levels, the refit and the packing.

encode also returns the coding error without decoding: the rotation is orthogonal and the
padding is zero on both sides, so ||W - decode(qt)||^2 = sum over groups of
||x||^2 - 2 s <x, q> + s^2 <q, q>, from the sums the refit computes anyway.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import fast_quantize, trellis
from .pack import pack_codes_np, pack_groups_np, unpack_codes, words_per_row
from .quantize import code_tables_np, code_values, code_values_np, nearest_codes_np
from .rotate import rotate_groups_np, unrotate
from .scale import (
    check_group_size,
    refit_sums_np,
    rms_from_energy_np,
    scales_from_sums_np,
)

SUPPORTED_BITS = (2, 3, 4, "ternary")
CODECS = ("scalar", "trellis")
_COMPILED = fast_quantize.AVAILABLE  # per-group coding through numba (same bits); tests flip it
_CHUNK_ELEMENTS = 1 << 20  # rows per chunk ~ this many weights (4 MiB as float32: cache-friendly)


def check_bits(bits: int | str) -> int | str:
    """Normalise `bits` (2, 3, 4 or "ternary"); ValueError otherwise."""
    if bits == "ternary":
        return "ternary"
    if not isinstance(bits, (bool, str)):
        try:
            b = operator.index(bits)
        except TypeError:
            b = None
        if b in (2, 3, 4):
            return b
    raise ValueError(f"unsupported bits {bits!r}: use one of {SUPPORTED_BITS}")


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return int(seed)


@dataclass(frozen=True)
class QuantSpec:
    """How one weight was coded: everything decode needs besides the arrays."""

    bits: int | str
    group_size: int
    seed: int
    in_features: int
    padded_in: int
    refit: bool
    codec: str = "scalar"  # or "trellis": the trellis_* fields below then apply
    trellis_state_bits: int = trellis.STATE_BITS
    trellis_values: int = trellis.VALUES
    trellis_block: int = trellis.BLOCK
    trellis_version: int = trellis.VERSION

    def __post_init__(self):
        check_bits(self.bits)
        check_group_size(self.group_size)
        _check_seed(self.seed)
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}: use one of {CODECS}")
        if self.codec == "trellis":
            if self.bits == "ternary" or not self.refit:
                raise ValueError("the trellis code takes 2, 3 or 4 bits and refits its scales "
                                 f"(got bits={self.bits!r}, refit={self.refit})")
            self.trellis_code.check_block(self.trellis_block)
        if self.in_features < 1 or self.padded_in != _padded(self.in_features, self.group_size):
            raise ValueError(
                f"padded_in {self.padded_in} is not in_features {self.in_features} "
                f"rounded up to a multiple of group_size {self.group_size}"
            )

    @property
    def words_per_row(self) -> int:
        return words_per_row(self.padded_in, self.bits)

    @property
    def trellis_code(self) -> trellis.TrellisCode:
        return trellis.TrellisCode(self.trellis_state_bits, self.bits, self.trellis_values,
                                   self.trellis_version)

    @property
    def groups_per_row(self) -> int:
        return self.padded_in // self.group_size


@dataclass
class QuantizedTensor:
    """Packed codes (out, words) uint32 and scales (out, padded_in // group_size) float16.

    `row_sq_error` and `row_sq_norm` (float64, one per row) are ||w_r - decode(qt)_r||^2 and
    ||w_r||^2 as encode measured them (without decoding); None for a tensor built otherwise.
    """

    codes: mx.array
    scales: mx.array
    shape: tuple[int, int]
    spec: QuantSpec
    row_sq_error: np.ndarray | None = None
    row_sq_norm: np.ndarray | None = None
    in_scales: mx.array | None = None  # float16 (in,): W = decode(codes, scales) * in_scales

    def __post_init__(self):
        self.shape = tuple(int(d) for d in self.shape)
        out, n = self.shape
        if n != self.spec.in_features:
            raise ValueError(
                f"shape {self.shape} disagrees with in_features {self.spec.in_features}"
            )
        want = {"codes": (out, self.spec.words_per_row), "scales": (out, self.spec.groups_per_row)}
        for name, dtype in (("codes", mx.uint32), ("scales", mx.float16)):
            arr = getattr(self, name)
            if tuple(arr.shape) != want[name] or arr.dtype != dtype:
                raise ValueError(
                    f"{name} must be {dtype} of shape {want[name]} for a {self.shape} weight "
                    f"at bits={self.spec.bits!r}, group_size={self.spec.group_size}; "
                    f"got {arr.dtype} {tuple(arr.shape)}"
                )
        t = self.in_scales
        if t is not None and (tuple(t.shape) != (n,) or t.dtype != mx.float16):
            raise ValueError(f"in_scales must be float16 of shape ({n},) for a {self.shape} "
                             f"weight; got {t.dtype} {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        extra = 0 if self.in_scales is None else self.in_scales.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra

    @property
    def bits_per_weight(self) -> float:
        """Stored bits (codes, scales, padding) per logical weight."""
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    @property
    def rel_mse(self) -> float | None:
        """||W - decode(qt)||^2 / ||W||^2 from encode's by-products (None if not encoded here).

        With in_scales the sums are those of the equalised weight W / in_scales (what the
        codebook saw): each column's error relative to that column's size."""
        if self.row_sq_error is None or self.row_sq_norm is None:
            return None
        err, norm = math.fsum(self.row_sq_error), math.fsum(self.row_sq_norm)
        if norm == 0.0:
            return 0.0 if err == 0.0 else math.inf
        return err / norm


def _padded(n: int, group_size: int) -> int:
    return -(-n // group_size) * group_size


def _to_mlx(weight) -> mx.array:
    if isinstance(weight, mx.array):
        return weight
    arr = np.asarray(weight)
    if arr.dtype.name == "bfloat16":  # ml_dtypes / torch-style numpy bfloat16
        return mx.array(arr.view(np.uint16)).view(mx.bfloat16)
    return mx.array(arr)


def _host_rows(weight) -> tuple[tuple[int, int], object]:
    """(shape, rows(r0, r1) -> float32 numpy rows) of a checked weight; a float32 numpy
    weight is sliced as it is, anything else converted one chunk of rows at a time."""
    if isinstance(weight, np.ndarray) and weight.dtype == np.float32:
        _check_shape(weight.shape)
        return weight.shape, lambda r0, r1: weight[r0:r1]
    w = _to_mlx(weight)
    _check_weight(w)
    return tuple(w.shape), lambda r0, r1: np.asarray(w[r0:r1].astype(mx.float32))


def _check_shape(shape) -> None:
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(shape)}")
    if 0 in shape:
        raise ValueError(f"weight is empty (shape {tuple(shape)})")


def _check_weight(w: mx.array) -> None:
    _check_shape(w.shape)
    if not mx.issubdtype(w.dtype, mx.floating):
        raise ValueError(f"expected a floating-point weight, got dtype {w.dtype}")


def _raise_non_finite(w: mx.array) -> None:
    bad = mx.logical_not(mx.isfinite(w))
    first = mx.argmax(bad.reshape(-1)).item()
    row, col = divmod(first, w.shape[1])
    raise ValueError(
        f"weight has {bad.sum().item()} non-finite value(s) (NaN/Inf) of {w.size}; "
        f"first at [{row}, {col}] = {w[row, col].item()}"
    )


def _rows_per_chunk(n: int) -> int:
    return max(1, _CHUNK_ELEMENTS // n)


@dataclass
class _Rows:
    """One chunk of rows, coded: packed codes, scales, and per-row squared error and norm."""

    codes: np.ndarray
    scales: np.ndarray
    sq_error: np.ndarray
    sq_norm: np.ndarray


def _encode_rows(w: np.ndarray, spec: QuantSpec, trellis_rows=None,
                 times: np.ndarray | None = None) -> _Rows | None:
    """Code some rows (times `times`, float32 (in,), if given); None if a scale is not
    finite (a non-finite weight, or an overflow)."""
    with np.errstate(over="ignore", invalid="ignore"):  # both end in a non-finite scale
        if spec.codec == "trellis":
            return _encode_trellis_rows(w, spec, trellis_rows or trellis.encode_rows, times)
        return _encode_finite_rows(w, spec, times)


def _encode_trellis_rows(w: np.ndarray, spec: QuantSpec, encoder,
                         times: np.ndarray | None = None) -> _Rows | None:
    """The trellis branch: the same rotated groups, as rows (rows, padded_in), coded by
    `encoder` (trellis.encode_rows, or a GPU encoder that returns the same bytes)."""
    rows, n, gs = w.shape[0], spec.in_features, spec.group_size
    y, energy = rotate_groups_np(w, spec.seed, gs, energy=True, times=times)
    if not np.isfinite(rms_from_energy_np(energy, gs)).all():
        return None
    x = np.ascontiguousarray(y.transpose(3, 1, 2, 0).reshape(rows, spec.padded_in))
    del y
    out = encoder(spec.trellis_code, x, gs, spec.trellis_block, valid=n)
    if not np.isfinite(out.scales.astype(np.float32)).all():
        return None
    return _Rows(out.words, out.scales, out.sq_error, out.sq_norm)


def _encode_finite_rows(w: np.ndarray, spec: QuantSpec,
                        times: np.ndarray | None = None) -> _Rows | None:
    rows, n, gs = w.shape[0], spec.in_features, spec.group_size
    groups = spec.groups_per_row
    # group axis first, (gs, a, b, rows): every step below is one contiguous op over all
    # groups; per-group results come back to (rows, groups) order at the end
    y, energy = rotate_groups_np(w, spec.seed, gs, energy=True, times=times)
    xt = y.reshape(gs, -1)
    pad_g = n - (groups - 1) * gs  # padding decodes to zero (a = 1 where there is any)
    if _COMPILED and spec.bits != "ternary":  # the same values, the glue compiled too
        return _encode_compiled(xt, energy, spec, rows, pad_g)

    def per_row(v: np.ndarray) -> np.ndarray:  # one value a group -> (rows, groups, k)
        return _rows_first(v, rows, groups)

    energy = per_row(energy)[..., 0]
    rms = rms_from_energy_np(energy, gs, valid=n)
    if not np.isfinite(rms).all():  # NaN/Inf anywhere in a row makes its energies non-finite
        return None
    # normalize by the float16 scale; a group with scale 0 codes as 0.0
    s = rms.T.astype(np.float32).reshape(-1)
    if _COMPILED:  # the same values in one compiled pass (stages/fast_quantize.py)
        mids, levels = code_tables_np(spec.bits)
        codes, wq, qq = fast_quantize.code_groups(xt, s, mids, levels, pad_g,
                                                  (groups - 1) * rows, spec.bits)
    else:
        u = xt / np.where(s > 0, s, np.float32(1.0))
        if not rms.all():
            np.copyto(u, np.float32(0.0), where=s == 0)
        codes = nearest_codes_np(u, spec.bits)
        del u
        q = code_values_np(codes, spec.bits)
        if pad_g < gs:
            q.reshape(gs, groups, rows)[pad_g:, groups - 1] = 0.0
        wq, qq = refit_sums_np(xt, q)
    wq, qq = per_row(wq)[..., 0], per_row(qq)[..., 0]
    scales = scales_from_sums_np(wq, qq) if spec.refit else rms
    if spec.bits == "ternary":  # 20 trits a word: words straddle groups, pack the rows
        rowwise = codes.reshape(gs, groups, rows).transpose(2, 1, 0).reshape(rows, -1)
        packed = pack_codes_np(rowwise, "ternary")
    else:  # whole words per group
        packed = per_row(pack_groups_np(codes, spec.bits)).reshape(rows, -1)
    return _Rows(packed, scales, *_row_errors(energy, scales, wq, qq))


def _encode_compiled(xt: np.ndarray, energy: np.ndarray, spec: QuantSpec, rows: int,
                     pad_g: int) -> _Rows | None:
    """_encode_finite_rows' 2/3/4-bit steps in three compiled passes (stages/fast_quantize.py):
    the float16 RMS of each group, the codes and refit sums, the refitted float16 scales and
    the (rows, groups) order. The same float32 operations, so the same bytes."""
    groups, gs = spec.groups_per_row, spec.group_size
    scaled = fast_quantize.group_scales(energy, rows, groups, gs, spec.in_features)
    if scaled is None:
        return None
    s, rms = scaled
    mids, levels = code_tables_np(spec.bits)
    words, wq, qq = fast_quantize.code_groups(xt, s, mids, levels, pad_g, (groups - 1) * rows,
                                              spec.bits)
    scales, packed = fast_quantize.refit_rows(wq, qq, words, rows, groups,
                                              None if spec.refit else rms)
    if rows > 1:  # numpy's sums over a row's groups, in order (one row: numpy's are pairwise)
        return _Rows(packed, scales, *fast_quantize.row_errors(energy, scales, wq, qq, rows,
                                                                groups))
    energy, wq, qq = (_rows_first(v, rows, groups)[..., 0] for v in (energy, wq, qq))
    return _Rows(packed, scales, *_row_errors(energy, scales, wq, qq))


def _rows_first(v: np.ndarray, rows: int, groups: int) -> np.ndarray:
    """Group-major values (k a group, flat) as (rows, groups, k): a view, so numpy sums a
    row's groups in the order it always has (a C-ordered copy sums them pairwise)."""
    return v.reshape(groups, rows, -1).transpose(1, 0, 2)


def _row_errors(energy: np.ndarray, scales: np.ndarray, wq: np.ndarray, qq: np.ndarray):
    """(each row's ||x - s q||^2, ||x||^2), float64, from (rows, groups) group sums: per group
    ||x||^2 - 2 s <x, q> + s^2 <q, q>, summed over the row by numpy."""
    xx, sc, xq, q2 = (a64.astype(np.float64) for a64 in (energy, scales, wq, qq))
    return np.maximum((xx - 2.0 * sc * xq + sc * sc * q2).sum(axis=1), 0.0), xx.sum(axis=1)


@dataclass(frozen=True)
class CodedRows:
    """encode's result as numpy arrays, for a host that writes the bytes (the converter):
    the same fields as QuantizedTensor, with no MLX array made a chunk."""

    codes: np.ndarray  # uint32 (out, words)
    scales: np.ndarray  # float16 (out, padded_in // group_size)
    shape: tuple[int, int]
    spec: QuantSpec
    row_sq_error: np.ndarray
    row_sq_norm: np.ndarray
    in_scales: np.ndarray | None = None  # float16 (in,)


def encode(
    weight, bits: int | str, group_size: int = 64, seed: int = 0, refit: bool = True,
    in_scales=None, codec: str = "scalar", trellis_state_bits: int = trellis.STATE_BITS,
    trellis_values: int = trellis.VALUES, trellis_block: int = trellis.BLOCK,
    trellis_rows=None, trellis_version: int = trellis.VERSION,
) -> QuantizedTensor:
    """Code a 2-D weight (out, in) (mx or numpy, any float dtype) with TurboQuant.

    `seed` is the rotation seed (see rotate.tensor_seed). Computed in float32; the same
    inputs give the same bytes in any process. The result carries the coding error
    (`rel_mse`, `row_sq_error`), measured without decoding.

    `in_scales` (float16-representable, shape (in,), positive; see scale.column_scales)
    codes W / in_scales instead of W and keeps the vector: decode multiplies it back, and
    a layer computes W x as decode'(in_scales * x). Given for the whole tensor, so chunks
    of rows coded separately decode as one. None (the default) gives format-1 bytes.

    `codec` "trellis" codes the rotated rows with the trellis (`trellis_state_bits` L,
    `trellis_values` V, `trellis_block` T, `trellis_version` 1 or 2; docs/FORMAT.md) instead
    of the Lloyd-Max levels: same shapes and bits per weight. `trellis_rows`: an encoder with
    the signature and the results of stages.trellis.encode_rows (the default), e.g. a GPU
    one.
    """
    rows = encode_np(weight, bits, group_size, seed, refit, in_scales, codec,
                     trellis_state_bits, trellis_values, trellis_block, trellis_rows,
                     trellis_version)
    return QuantizedTensor(
        mx.array(rows.codes),
        mx.array(rows.scales),
        rows.shape,
        rows.spec,
        row_sq_error=rows.row_sq_error,
        row_sq_norm=rows.row_sq_norm,
        in_scales=None if rows.in_scales is None else mx.array(rows.in_scales),
    )


def encode_np(
    weight, bits: int | str, group_size: int = 64, seed: int = 0, refit: bool = True,
    in_scales=None, codec: str = "scalar", trellis_state_bits: int = trellis.STATE_BITS,
    trellis_values: int = trellis.VALUES, trellis_block: int = trellis.BLOCK,
    trellis_rows=None, trellis_version: int = trellis.VERSION,
) -> CodedRows:
    """encode, the codes and scales left as numpy arrays (CodedRows): the same bytes."""
    bits = check_bits(bits)
    group_size = check_group_size(group_size)
    (out, n), rows = _host_rows(weight)
    t16 = inv = None
    if in_scales is not None:  # W / t: each row times 1 / t (in the rotation's signs)
        checked = in_scales if isinstance(in_scales, InScales) else InScales.of(in_scales, n)
        if checked.t16.shape != (n,):
            raise ValueError(f"in_scales must have shape ({n},) (the input features), "
                             f"got {checked.t16.shape}")
        t16, inv = checked.t16, checked.inv
    spec = QuantSpec(bits, group_size, _check_seed(seed), n, _padded(n, group_size), bool(refit),
                     codec, trellis_state_bits, trellis_values, trellis_block, trellis_version)
    parts = []
    step = _rows_per_chunk(n)
    for r in range(0, out, step):
        part = _encode_rows(rows(r, r + step), spec, trellis_rows, inv)
        if part is None:
            w = _to_mlx(weight)
            if not mx.isfinite(w).all().item():
                _raise_non_finite(w)
            raise ValueError(
                f"a group RMS in rows {r}..{min(out, r + step) - 1} exceeds the float16 "
                "range of scales: this weight cannot be coded; keep it in 16 bits"
            )
        parts.append(part)

    def joined(name):
        arrays = [getattr(p, name) for p in parts]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    return CodedRows(joined("codes"), joined("scales"), (int(out), int(n)), spec,
                     joined("sq_error"), joined("sq_norm"), t16)


def _decode_rows(codes: mx.array, scales: mx.array, spec: QuantSpec, dtype) -> mx.array:
    rows, gs = codes.shape[0], spec.group_size
    if spec.codec == "trellis":
        q = trellis.decode_words_mx(spec.trellis_code, codes, spec.trellis_block)
    else:
        q = code_values(unpack_codes(codes, spec.bits, spec.padded_in), spec.bits)
    y = q.reshape(rows, -1, gs) * scales.astype(mx.float32)[..., None]
    y = y.reshape(rows, spec.padded_in)[:, : spec.in_features]
    return unrotate(y, spec.seed).astype(dtype)


def decode(qt: QuantizedTensor, dtype=mx.float32) -> mx.array:
    """The weight (out, in) in the original (unrotated) basis, as `dtype`."""
    out, n = qt.shape
    step = _rows_per_chunk(n)
    t = qt.in_scales
    rows_dtype = dtype if t is None else mx.float32
    parts = []
    for r in range(0, out, step):
        part = _decode_rows(qt.codes[r : r + step], qt.scales[r : r + step], qt.spec,
                            rows_dtype)
        if t is not None:
            part = (part * t.astype(mx.float32)).astype(dtype)
        if out > step:
            mx.eval(part)
        parts.append(part)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


@dataclass(frozen=True)
class InScales:
    """in_scales checked once for many encode calls (a tensor coded a chunk of rows at a
    time): the float16 vector and 1 / t in float32."""

    t16: np.ndarray
    inv: np.ndarray

    @classmethod
    def of(cls, in_scales, n: int) -> "InScales":
        t16 = check_in_scales(in_scales, n)
        return cls(t16, np.float32(1.0) / t16.astype(np.float32))


def check_in_scales(in_scales, n: int) -> np.ndarray:
    """`in_scales` as a float16 numpy vector of n positive finite values; ValueError if not."""
    t = np.asarray(in_scales.astype(mx.float32) if isinstance(in_scales, mx.array)
                   else in_scales, dtype=np.float32)
    if t.shape != (n,):
        raise ValueError(f"in_scales must have shape ({n},) (the input features), got {t.shape}")
    with np.errstate(over="ignore"):  # beyond float16: inf, refused below
        t16 = t.astype(np.float16)
    if not (np.isfinite(t16).all() and (t16 > 0).all()):
        raise ValueError("in_scales must be positive and finite in float16; "
                         "build them with turboquant.stages.column_scales")
    return t16

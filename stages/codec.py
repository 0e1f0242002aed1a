"""Encode a 2-D weight into TurboQuant codes and scales, and decode it back.

encode: rotate rows along the input dim -> pad to a multiple of group_size -> per-group
RMS scale (fp16) -> nearest Lloyd-Max codes -> optional least-squares refit of the scales
-> pack. decode reverses it. Rows are independent, so both work on chunks of rows to keep
memory flat on huge matrices; the bytes do not depend on the chunking.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .pack import pack_codes, unpack_codes, words_per_row
from .quantize import code_values, nearest_codes
from .rotate import rotate, unrotate
from .scale import check_group_size, group_rms, refit_scales

SUPPORTED_BITS = (2, 3, 4, "ternary")
_CHUNK_ELEMENTS = 1 << 21  # rows per chunk ~ this many weights (fastest on CPU caches)


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

    def __post_init__(self):
        check_bits(self.bits)
        check_group_size(self.group_size)
        _check_seed(self.seed)
        if self.in_features < 1 or self.padded_in != _padded(self.in_features, self.group_size):
            raise ValueError(
                f"padded_in {self.padded_in} is not in_features {self.in_features} "
                f"rounded up to a multiple of group_size {self.group_size}"
            )

    @property
    def words_per_row(self) -> int:
        return words_per_row(self.padded_in, self.bits)

    @property
    def groups_per_row(self) -> int:
        return self.padded_in // self.group_size


@dataclass
class QuantizedTensor:
    """Packed codes (out, words) uint32 and scales (out, padded_in // group_size) float16."""

    codes: mx.array
    scales: mx.array
    shape: tuple[int, int]
    spec: QuantSpec

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

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @property
    def bits_per_weight(self) -> float:
        """Stored bits (codes, scales, padding) per logical weight."""
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])


def _padded(n: int, group_size: int) -> int:
    return -(-n // group_size) * group_size


def _to_mlx(weight) -> mx.array:
    if isinstance(weight, mx.array):
        return weight
    arr = np.asarray(weight)
    if arr.dtype.name == "bfloat16":  # ml_dtypes / torch-style numpy bfloat16
        return mx.array(arr.view(np.uint16)).view(mx.bfloat16)
    return mx.array(arr)


def _check_weight(w: mx.array) -> None:
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    if w.size == 0:
        raise ValueError(f"weight is empty (shape {tuple(w.shape)})")
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


def _encode_rows(w: mx.array, spec: QuantSpec) -> tuple[mx.array, ...]:
    """(packed codes, scales, all finite?, a group RMS overflowed float16?) for some rows."""
    rows, n, gs = w.shape[0], spec.in_features, spec.group_size
    x = rotate(w.astype(mx.float32), spec.seed)
    if spec.padded_in > n:
        x = mx.pad(x, [(0, 0), (0, spec.padded_in - n)])
    scales = group_rms(x, gs, valid=n)
    overflow = mx.isinf(scales).any()
    s = scales.astype(mx.float32)[..., None]
    g = x.reshape(rows, -1, gs)
    codes = nearest_codes(mx.where(s > 0, g / mx.where(s > 0, s, 1.0), 0.0), spec.bits)
    codes = codes.reshape(rows, spec.padded_in)
    if spec.refit:
        q = code_values(codes, spec.bits)
        if spec.padded_in > n:
            q = q * (mx.arange(spec.padded_in) < n)
        scales = refit_scales(x, q, gs)
    return pack_codes(codes, spec.bits), scales, mx.isfinite(w).all(), overflow


def encode(
    weight, bits: int | str, group_size: int = 64, seed: int = 0, refit: bool = True
) -> QuantizedTensor:
    """Code a 2-D weight (out, in) (mx or numpy, any float dtype) with TurboQuant.

    `seed` is the rotation seed (see rotate.tensor_seed). Computed in float32; the same
    inputs give the same bytes in any process.
    """
    bits = check_bits(bits)
    group_size = check_group_size(group_size)
    w = _to_mlx(weight)
    _check_weight(w)
    out, n = w.shape
    spec = QuantSpec(bits, group_size, _check_seed(seed), n, _padded(n, group_size), bool(refit))
    codes, scales = [], []
    step = _rows_per_chunk(n)
    for r in range(0, out, step):
        c, s, finite, overflow = _encode_rows(w[r : r + step], spec)
        mx.eval(c, s, finite, overflow)
        if not finite.item():
            _raise_non_finite(w)
        if overflow.item():
            raise ValueError(
                f"a group RMS in rows {r}..{min(out, r + step) - 1} exceeds the float16 "
                "range of scales: this weight cannot be coded; keep it in 16 bits"
            )
        codes.append(c)
        scales.append(s)
    codes = codes[0] if len(codes) == 1 else mx.concatenate(codes)
    scales = scales[0] if len(scales) == 1 else mx.concatenate(scales)
    return QuantizedTensor(codes, scales, (out, n), spec)


def _decode_rows(codes: mx.array, scales: mx.array, spec: QuantSpec, dtype) -> mx.array:
    rows, gs = codes.shape[0], spec.group_size
    q = code_values(unpack_codes(codes, spec.bits, spec.padded_in), spec.bits)
    y = q.reshape(rows, -1, gs) * scales.astype(mx.float32)[..., None]
    y = y.reshape(rows, spec.padded_in)[:, : spec.in_features]
    return unrotate(y, spec.seed).astype(dtype)


def decode(qt: QuantizedTensor, dtype=mx.float32) -> mx.array:
    """The weight (out, in) in the original (unrotated) basis, as `dtype`."""
    out, n = qt.shape
    step = _rows_per_chunk(n)
    if out <= step:
        return _decode_rows(qt.codes, qt.scales, qt.spec, dtype)
    parts = []
    for r in range(0, out, step):
        part = _decode_rows(qt.codes[r : r + step], qt.scales[r : r + step], qt.spec, dtype)
        mx.eval(part)
        parts.append(part)
    return mx.concatenate(parts)

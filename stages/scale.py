"""Per-group scales: the RMS before coding, and the least-squares refit after it."""

from __future__ import annotations

import mlx.core as mx

SUPPORTED_GROUP_SIZES = (32, 64, 128)
_FP16_MAX = 65504.0


def check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"unsupported group size {group_size!r}: use one of {SUPPORTED_GROUP_SIZES}"
        )
    return int(group_size)


def _groups(w: mx.array, group_size: int) -> mx.array:
    check_group_size(group_size)
    if w.ndim != 2 or w.shape[1] % group_size:
        raise ValueError(
            f"expected (rows, padded_in) with padded_in a multiple of {group_size}, "
            f"got shape {tuple(w.shape)}"
        )
    return w.reshape(w.shape[0], w.shape[1] // group_size, group_size)


def group_rms(w: mx.array, group_size: int, valid: int | None = None) -> mx.array:
    """RMS of each group of `group_size` columns, float16, shape (rows, padded_in // group_size).

    `valid` is the number of real (unpadded) columns: a last, partly padded group takes
    its RMS over its real entries only.
    """
    g = _groups(w.astype(mx.float32), group_size)
    sq = mx.sum(g * g, axis=-1)
    counts = mx.full((g.shape[1],), group_size, dtype=mx.float32)
    if valid is not None and valid < w.shape[1]:
        starts = mx.arange(g.shape[1]) * group_size
        counts = mx.clip(valid - starts, 1, group_size).astype(mx.float32)
    return mx.sqrt(sq / counts).astype(mx.float16)


def refit_scales(w: mx.array, q: mx.array, group_size: int) -> mx.array:
    """Least-squares scales s* = <w, q> / <q, q> per group, float16.

    `q` holds the codebook values of the chosen codes (zero where `w` is padding); a group
    with <q, q> = 0 decodes to zero whatever its scale, and gets scale 0.
    """
    gw = _groups(w.astype(mx.float32), group_size)
    gq = _groups(q.astype(mx.float32), group_size)
    wq = mx.sum(gw * gq, axis=-1)
    qq = mx.sum(gq * gq, axis=-1)
    s = mx.where(qq > 0, wq / mx.maximum(qq, 1e-30), 0.0)
    return mx.clip(s, 0.0, _FP16_MAX).astype(mx.float16)

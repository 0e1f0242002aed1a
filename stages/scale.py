"""Per-group scales: the RMS before coding, and the least-squares refit after it.

The `_np` functions are the same computations on numpy arrays laid out group-axis first,
(group_size, groups): encode's path on the host. A group's sum is taken in order, from 0.0,
in float32, which is how MLX's CPU backend sums a row (tests pin the equality), so they give
the same scales bit for bit.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import fast_hadamard

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


def group_energy(w: mx.array, group_size: int) -> mx.array:
    """Sum of squares of each group, float32, shape (rows, padded_in // group_size)."""
    g = _groups(w.astype(mx.float32), group_size)
    return mx.sum(g * g, axis=-1)


def rms_from_energy(energy: mx.array, group_size: int, valid: int | None = None) -> mx.array:
    """float16 RMS of groups from their sums of squares (see group_rms for `valid`)."""
    groups = energy.shape[-1]
    counts = mx.full((groups,), group_size, dtype=mx.float32)
    if valid is not None and valid < groups * group_size:
        starts = mx.arange(groups) * group_size
        counts = mx.clip(valid - starts, 1, group_size).astype(mx.float32)
    return mx.sqrt(energy / counts).astype(mx.float16)


def group_rms(w: mx.array, group_size: int, valid: int | None = None) -> mx.array:
    """RMS of each group of `group_size` columns, float16, shape (rows, padded_in // group_size).

    `valid` is the number of real (unpadded) columns: a last, partly padded group takes
    its RMS over its real entries only.
    """
    return rms_from_energy(group_energy(w, group_size), group_size, valid)


def refit_sums(w: mx.array, q: mx.array, group_size: int) -> tuple[mx.array, mx.array]:
    """(<w, q>, <q, q>) of each group, float32: the sums the least-squares refit needs."""
    gw = _groups(w.astype(mx.float32), group_size)
    gq = _groups(q.astype(mx.float32), group_size)
    return mx.sum(gw * gq, axis=-1), mx.sum(gq * gq, axis=-1)


def scales_from_sums(wq: mx.array, qq: mx.array) -> mx.array:
    """float16 least-squares scales <w, q> / <q, q> (0 where <q, q> = 0), clipped to float16."""
    s = mx.where(qq > 0, wq / mx.maximum(qq, 1e-30), 0.0)
    return mx.clip(s, 0.0, _FP16_MAX).astype(mx.float16)


def refit_scales(w: mx.array, q: mx.array, group_size: int) -> mx.array:
    """Least-squares scales s* = <w, q> / <q, q> per group, float16.

    `q` holds the codebook values of the chosen codes (zero where `w` is padding); a group
    with <q, q> = 0 decodes to zero whatever its scale, and gets scale 0.
    """
    return scales_from_sums(*refit_sums(w, q, group_size))


# ---------------------------------------------------------------------- numpy, group axis first


def sum_in_order_np(a: np.ndarray) -> np.ndarray:
    """Sum of a (k, m) float32 array over k in order k = 0, 1, ..., from 0.0 (MLX's CPU sum).

    numpy adds whole rows into the result one after the other (no pairwise summation across
    the outer axis); the + 0.0 turns an all-zero sum of -0.0 terms into +0.0, as MLX's does.
    """
    return np.add.reduce(a, axis=0) + np.float32(0.0)


def group_energy_np(xt: np.ndarray) -> np.ndarray:
    """group_energy on a (group_size, groups) float32 array: sum of squares of each column."""
    return sum_in_order_np(np.square(xt))


def rms_from_energy_np(energy: np.ndarray, group_size: int, valid: int | None = None) -> np.ndarray:
    """rms_from_energy on numpy: energy (rows, groups) -> float16 RMS."""
    groups = energy.shape[-1]
    counts = np.full(groups, group_size, dtype=np.float32)
    if valid is not None and valid < groups * group_size:
        counts = np.clip(valid - np.arange(groups) * group_size, 1, group_size).astype(np.float32)
    return np.sqrt(energy / counts).astype(np.float16)


def refit_sums_np(xt: np.ndarray, qt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """refit_sums on (group_size, groups) arrays: (<w, q>, <q, q>) of each column, float32."""
    return sum_in_order_np(xt * qt), sum_in_order_np(np.square(qt))


def scales_from_sums_np(wq: np.ndarray, qq: np.ndarray) -> np.ndarray:
    """scales_from_sums on numpy: float16 <w, q> / <q, q> (0 where <q, q> = 0), clipped."""
    s = np.where(qq > 0, wq / np.maximum(qq, np.float32(1e-30)), np.float32(0.0))
    return np.clip(s, np.float32(0.0), np.float32(_FP16_MAX)).astype(np.float16)


# ---------------------------------------------------------------------- per input channel

COLUMN_POWER = 1.0  # in_scales = column RMS ** power; 1.0 measured best on SmolLM2 (quality.md)
_COLUMN_FLOOR = 1e-2  # a column's RMS counts as at least this fraction of the median's
SMALL_COLUMN_RATIO = 0.5  # equalise only a weight whose smallest column RMS is below this
# fraction of the median: trained LLMs' attention/MLP inputs (SmolLM2: 0.15-0.6), not the
# near-Gaussian reference models (0.67-0.85), where equalising only adds noise


def column_scales_from_sums(col_sq_sums: np.ndarray, rows: int, power: float = COLUMN_POWER,
                            min_ratio: float | None = None) -> np.ndarray | None:
    """float16 in_scales from each input column's sum of squares over `rows` rows.

    t_j = max(rms_j, floor) ** power, normalised to RMS 1: coding W / t gives every column
    the same size before the rotation, so each column's error lands in proportion to its
    own size (the error of a plain rotation is the same in every column). A trained
    model's small columns are where its large activations enter (see docs/quality.md).
    The sums can be accumulated over chunks of rows: the pipeline's pre-pass.
    With `min_ratio` (e.g. SMALL_COLUMN_RATIO), None when no column is that small against
    the median: the weight is coded plainly.
    """
    if not 0.0 < power <= 2.0:
        raise ValueError(f"column power must be in (0, 2], got {power}")
    rms = np.sqrt(np.asarray(col_sq_sums, dtype=np.float64) / max(int(rows), 1))
    med = float(np.median(rms))
    if not np.isfinite(rms).all() or med == 0.0:  # mostly-zero or broken weight: no scaling
        return None if min_ratio is not None else np.ones(rms.shape, dtype=np.float16)
    if min_ratio is not None and float(rms.min()) >= min_ratio * med:
        return None
    t = np.maximum(rms, _COLUMN_FLOOR * med) ** power
    t = t / math.sqrt(float(np.mean(t * t)))
    return t.astype(np.float16)


NEURON_RATIO = 8.0  # a down_proj whose largest neuron size is over this x the median


def neuron_sizes_from_sums(gate_row_sq: np.ndarray, up_row_sq: np.ndarray,
                           cols: int) -> np.ndarray:
    """Data-free size of each MLP neuron's activation from its gate and up rows' sums of
    squares over `cols` inputs: rms(gate_k) * rms(up_k), over the median (float64)."""
    g = np.asarray(gate_row_sq, dtype=np.float64) / max(int(cols), 1)
    u = np.asarray(up_row_sq, dtype=np.float64) / max(int(cols), 1)
    a = np.sqrt(g * u)
    med = float(np.median(a))
    return a / med if med > 0 and np.isfinite(a).all() else np.ones_like(a)


ROW_LANES = 16  # running sums a row: independent float64 adds (one chain is latency-bound);
# _lane_sums spells the 16 out


def row_square_sums(rows: np.ndarray, bf16: bool = False) -> np.ndarray:
    """Each row's sum of squares, float64 (rows, n) -> (rows,): the float32 values (bfloat16
    given as its raw uint16 bits, widened exactly) squared in float32; element j added in
    float64 to running sum j % ROW_LANES, in order, the lanes then added in order; the same
    with numba or without. The neuron rule's input (neuron_sizes_from_sums), read from the
    source bits with no float32 copy of the rows."""
    rows = np.ascontiguousarray(rows, dtype=np.uint16 if bf16 else np.float32)
    out = np.zeros(rows.shape[0], dtype=np.float64)
    if fast_hadamard.AVAILABLE:
        fast_hadamard.compile_kernels()
        _row_sums(rows, bf16, out)
        return out
    x = (rows.astype(np.uint32) << 16).view(np.float32) if bf16 else rows
    sq = (x * x).astype(np.float64)
    lanes = np.zeros((rows.shape[0], ROW_LANES))
    for j in range(sq.shape[1]):  # in order, as the kernel adds them
        lanes[:, j % ROW_LANES] += sq[:, j]
    for k in range(ROW_LANES):
        out += lanes[:, k]
    return out


@fast_hadamard._jit
def _row_as_float32(rows, i, bf16, word, value):
    """Row i into `value` (float32; `word` is the same buffer as uint32): bfloat16 bits
    shifted into place, or float32 copied."""
    if bf16:
        for j in range(rows.shape[1]):
            word[j] = np.uint32(rows[i, j]) << np.uint32(16)
    else:
        for j in range(rows.shape[1]):
            value[j] = rows[i, j]


@fast_hadamard._jit
def _row_sums(rows, bf16, out):
    count, n = rows.shape
    word = np.empty(n, dtype=np.uint32)
    value = word.view(np.float32)
    squares = np.empty(n, dtype=np.float32)
    for i in range(count):
        _row_as_float32(rows, i, bf16, word, value)
        for j in range(n):
            squares[j] = value[j] * value[j]
        out[i] = _lane_sums(squares)


@fast_hadamard._jit
def _lane_sums(squares):
    """float32 squares added in float64 to ROW_LANES = 16 running sums (element j to sum
    j % 16, in order), the sums then added in order. The sums are 16 local variables, not
    an array: the compiler keeps them in registers (a 16-array's updates it cannot tell
    apart from the loads, and leaves them in memory: 0.79 against 0.45 ns a weight)."""
    n = squares.shape[0]
    whole = n - n % 16
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = 0.0
    l8 = l9 = l10 = l11 = l12 = l13 = l14 = l15 = 0.0
    for j0 in range(0, whole, 16):
        s = squares[j0 : j0 + 16]
        l0 += np.float64(s[0])
        l1 += np.float64(s[1])
        l2 += np.float64(s[2])
        l3 += np.float64(s[3])
        l4 += np.float64(s[4])
        l5 += np.float64(s[5])
        l6 += np.float64(s[6])
        l7 += np.float64(s[7])
        l8 += np.float64(s[8])
        l9 += np.float64(s[9])
        l10 += np.float64(s[10])
        l11 += np.float64(s[11])
        l12 += np.float64(s[12])
        l13 += np.float64(s[13])
        l14 += np.float64(s[14])
        l15 += np.float64(s[15])
    lane = np.array([l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14, l15])
    for j in range(whole, n):
        lane[j % 16] += np.float64(squares[j])
    total = 0.0
    for k in range(16):
        total += lane[k]
    return total


def neuron_column_scales(col_sq_sums: np.ndarray, rows: int, sizes: np.ndarray,
                         ratio: float = NEURON_RATIO) -> np.ndarray | None:
    """float16 in_scales of a down_proj whose input has a massive neuron, else None.

    A trained MLP can have one or two neurons whose activation carries nearly all of
    down_proj's input energy (SmolLM2-135M: 99.8% in layer 11), and their gate and up rows
    are 11-56x the median size while their down_proj columns are not small, so the column
    rule gives them a large t and a large error. With a neuron over `ratio` x the median:
    t_k = (colRMS_k / a_k) ** 0.5, which minimises sum_k ||E_:,k||^2 a_k^2 when each
    column's error is t_k^2 times the same (a_k = `sizes`, neuron_sizes_from_sums).
    """
    a = np.asarray(sizes, dtype=np.float64)
    if a.size == 0 or float(a.max()) <= ratio:
        return None
    rms = np.sqrt(np.asarray(col_sq_sums, dtype=np.float64) / max(int(rows), 1))
    med = float(np.median(rms))
    if not np.isfinite(rms).all() or med == 0.0:
        return None
    t = np.sqrt(np.maximum(rms, _COLUMN_FLOOR * med) / np.maximum(a, _COLUMN_FLOOR))
    t = t / math.sqrt(float(np.mean(t * t)))
    return t.astype(np.float16)


def column_scales(w, power: float = COLUMN_POWER,
                  min_ratio: float | None = None) -> np.ndarray | None:
    """column_scales_from_sums of a whole 2-D weight (mx or numpy), float16 (in,)."""
    a = np.asarray(w.astype(mx.float32) if isinstance(w, mx.array) else w, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {a.shape}")
    sums = np.einsum("ij,ij->j", a, a)  # float32 sums: a scale needs no more
    return column_scales_from_sums(sums, a.shape[0], power, min_ratio)



class ColumnSums:
    """Each input column's sum of squares, over rows given a chunk at a time in order: the
    input of column_scales_from_sums (the pipeline's pre-pass). Blocks of BLOCK rows are
    summed in float32, the blocks in float64: the same sums however the rows are chunked,
    with numba or without (the same float32 operations, in the same order)."""

    BLOCK = 256

    def __init__(self, n: int):
        self.acc = np.zeros(n, dtype=np.float32)
        self.sums = np.zeros(n, dtype=np.float64)
        self.rows = 0

    def add(self, x: np.ndarray) -> None:
        """float32 rows (rows, n)."""
        self._add(np.ascontiguousarray(x, dtype=np.float32), False)

    def add_bf16(self, bits: np.ndarray) -> None:
        """bfloat16 rows given as their raw uint16 bits (rows, n): no float32 copy."""
        self._add(np.ascontiguousarray(bits, dtype=np.uint16), True)

    def add_with_row_sums(self, rows: np.ndarray, bf16: bool = False) -> np.ndarray:
        """Add rows (float32, or bfloat16 given as raw uint16 bits) and return each row's
        sum of squares exactly as row_square_sums gives it: one pass over the rows for
        both (a gate/up tensor read once for its own column scales and for down_proj's
        neuron sizes)."""
        rows = np.ascontiguousarray(rows, dtype=np.uint16 if bf16 else np.float32)
        if not fast_hadamard.AVAILABLE:
            out = row_square_sums(rows, bf16)
            self._add(rows, bf16)
            return out
        fast_hadamard.compile_kernels()
        out = np.zeros(rows.shape[0], dtype=np.float64)
        _column_and_row_sums(rows, bf16, self.rows, self.BLOCK, self.acc, self.sums, out)
        self.rows += rows.shape[0]
        return out

    def total(self) -> np.ndarray:
        """The float64 sums of every row added so far."""
        return self.sums + self.acc

    def _add(self, rows: np.ndarray, bf16: bool) -> None:
        if fast_hadamard.AVAILABLE:
            fast_hadamard.compile_kernels()
            _column_sums(rows, bf16, self.rows, self.BLOCK, self.acc, self.sums)
        else:  # the kernel's steps, a row at a time
            for i in range(rows.shape[0]):
                v = (rows[i].astype(np.uint32) << 16).view(np.float32) if bf16 else rows[i]
                self.acc += v * v
                if (self.rows + i + 1) % self.BLOCK == 0:
                    self.sums += self.acc
                    self.acc[:] = 0.0
        self.rows += rows.shape[0]


@fast_hadamard._jit
def _column_sums(rows, bf16, first, block, acc, sums):
    count, n = rows.shape
    word = np.empty(n, dtype=np.uint32)
    value = word.view(np.float32)
    for i in range(count):
        _row_as_float32(rows, i, bf16, word, value)
        for j in range(n):
            acc[j] += value[j] * value[j]
        if (first + i + 1) % block == 0:
            for j in range(n):
                sums[j] += acc[j]
                acc[j] = np.float32(0.0)


@fast_hadamard._jit
def _column_and_row_sums(rows, bf16, first, block, acc, sums, out):
    """_column_sums and _row_sums in one pass: the same float32 squares, added in the same
    order to the same sums (fastmath off: no contraction changes either)."""
    count, n = rows.shape
    word = np.empty(n, dtype=np.uint32)
    value = word.view(np.float32)
    squares = np.empty(n, dtype=np.float32)
    for i in range(count):
        _row_as_float32(rows, i, bf16, word, value)
        for j in range(n):
            v = value[j] * value[j]
            squares[j] = v
            acc[j] += v
        out[i] = _lane_sums(squares)
        if (first + i + 1) % block == 0:
            for j in range(n):
                sums[j] += acc[j]
                acc[j] = np.float32(0.0)

"""Trellis-coded quantization: a bitshift trellis with a computed codebook (numpy reference).

A second code for rotated, group-scaled rows (docs/FORMAT.md, "Trellis code", format 2):
stages.codec's `codec="trellis"` branch calls encode_rows; recipes choose it per role; the
runtime decodes it through kernels/reference.py (decode_words_mx) or kernels/cpu_gemv.py.

The code, for k bits per weight, V weights per step and a state of L bits:
- a row block of T weights (T % 32 == 0) is coded by a stream of T * k bits, k*V bits a step;
- the state of step t is the L-bit window of the stream that ends with step t's bits, read
  little-endian, so step t's own bits are its top k*V bits and a step shifts the state right:
  S_t = (S_{t-1} >> kV) | (b_t << (L - kV));
- the stream is tail-biting: it is read as a circle, so the first states take their low bits
  from the end of the block and the block costs exactly T * k bits (no start state stored);
- a state's V values are computed, not looked up: for value j,
  h = (S * MUL[j] + ADD[j]) mod 2^32; h ^= h >> 16; v = (bytesum(h) - 510) / BYTESUM_STD,
  the sum of four uniform bytes being close to a Gaussian (Irwin-Hall, variance 1, tails at
  +-3.45). On a GPU that is a multiply-add, a shift-xor and one dp4a. Version 2 (a
  candidate, `TrellisCode.version`) leaves out the shift-xor: h = S * MUL[j] + ADD[j].
- the values are scaled by the group's stored float16 scale: w = scale * v(S_t)_j.

Encode (Viterbi) minimises ||y / gain - v||^2 over tail-biting paths, y the rows divided by
their group RMS; `gain` (GAIN, by measurement) only steers the search: the stored scale is the
least-squares refit <x, v> / <v, v> of each group, so decode needs no gain. The tail-biting
path is found as QTIP does: a free Viterbi over the block rotated by half its length fixes
the L - kV bits where the circle closes, then a Viterbi constrained to them codes the block.
`exact=True` tries every closing instead (tests, tiny L).

decode_words_mx is the decoder as a fused kernel will run it (per weight: the state's bit
window from two words, then the integer steps), in MLX ops: the reference for those kernels.

Where it slots in: codec._encode_trellis_rows rotates a chunk of rows and takes each
group's energy (rotate_groups_np), as the scalar branch does before its nearest Lloyd-Max
levels; the same rotated rows, as (rows, padded_in), go to encode_rows, which takes
the RMS and the refit from scale.py's in-order float32 sums, as the scalar code does, and
returns words of the scalar code's shape (n * k / 32 a row), float16 scales and the
per-row squared error that QuantizedTensor carries. decode_rows (or decode_words_mx) then
replaces the level lookup before the inverse rotation.

Packing: bit p of a block's stream is bit p % 32 of word p // 32 (little-endian), the same
bit order as the scalar 3-bit packing; blocks are whole words and follow each other along
the row, so a row of n weights is n * k / 32 words, as for the scalar code.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import fast_trellis
from .scale import group_energy_np, refit_sums_np, rms_from_energy_np, scales_from_sums_np

_COMPILED = fast_trellis.AVAILABLE  # Viterbi through numba (the same paths); tests flip it

# value j of a state uses MUL[j], ADD[j]: the best of 40 random (odd multiplier, addend)
# pairs a value (`benchmarks/codec.py --trellis --trellis-search 40`; any well-mixed pair
# is within ~1%); tests check the values' distribution and pin them
MUL = (0xA4B9361B, 0x85EBCA77)
ADD = (0x5ADBDCC7, 0x165667B1)
BYTESUM_MEAN = 510.0  # 4 * 255 / 2
BYTESUM_STD = float(np.sqrt(4 * (256**2 - 1) / 12))  # 147.80...
# the Viterbi search codes y / GAIN[bits] (benchmarks/codec.py --trellis: at L = 12 and 16
# the MSE is flat within ~1% from 1.0 to 1.1, lowest near 1.0 at 2 bits and 1.1 at 3-4 bits)
GAIN = {1: 1.0, 2: 1.0, 3: 1.1, 4: 1.1}
VERSION = 1  # docs/FORMAT.md's trellis version: the constants above and the steps below
# version 2: the same without the shift-xor (h = S * MUL + ADD, then the byte sum): two GPU
# instructions a weight fewer; written where a recipe says `trellis_version = 2`, the default
# stays VERSION until a GPU run times both (trellis-candidates-cpu-2026-12.txt)
VERSIONS = (1, 2)
# the code the converter writes unless a recipe says otherwise (L, V, T)
STATE_BITS, VALUES, BLOCK = 16, 1, 256


@dataclass(frozen=True)
class TrellisCode:
    """A bitshift trellis: `state_bits` L, `bits` k per weight, `values` V weights per step."""

    state_bits: int
    bits: int
    values: int = 1
    version: int = VERSION  # 2: the codebook without the shift-xor

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise ValueError(f"trellis version must be one of {VERSIONS}, got {self.version}")
        if self.values not in (1, 2):
            raise ValueError(f"values per step must be 1 or 2, got {self.values}")
        if self.bits not in (1, 2, 3, 4):
            raise ValueError(f"bits per weight must be 1..4, got {self.bits}")
        if not self.step_bits < self.state_bits <= 20:
            raise ValueError(
                f"state_bits must exceed bits * values = {self.step_bits} and be <= 20, "
                f"got {self.state_bits}"
            )

    @property
    def step_bits(self) -> int:
        return self.bits * self.values

    @property
    def keep_bits(self) -> int:
        """Bits a state passes to the next one (L - kV): where a tail-biting circle closes."""
        return self.state_bits - self.step_bits

    @property
    def gain(self) -> float:
        return GAIN[self.bits]

    def check_block(self, block: int) -> int:
        if block % 32 or block * self.bits < self.state_bits or block % self.values:
            raise ValueError(
                f"block of {block} weights: use a multiple of 32 (and of {self.values} "
                f"values per step) with block * bits >= state_bits {self.state_bits}"
            )
        return block


@dataclass(frozen=True)
class TrellisBits:
    """A trellis-coded weight's code as the runtime and kernels pass it where a scalar
    code passes its bits (2, 3, 4, "ternary"): k bits a weight, the trellis (L, V) and the
    block. Codes have the scalar code's shape at `bits`; decode with decode_words_mx."""

    bits: int
    state_bits: int = STATE_BITS
    values: int = VALUES
    block: int = BLOCK
    version: int = VERSION

    def __post_init__(self):
        self.code.check_block(self.block)

    @property
    def code(self) -> TrellisCode:
        return TrellisCode(self.state_bits, self.bits, self.values, self.version)

    def __str__(self) -> str:
        v = f", version {self.version}" if self.version != VERSION else ""
        return f"trellis-{self.bits} (L={self.state_bits}, V={self.values}, T={self.block}{v})"


def state_values(code: TrellisCode, states, mul=MUL, add=ADD) -> np.ndarray:
    """The V computed values (float32, unit variance) of each state: shape (..., V).
    `mul`, `add`: other constants, for the benchmark that chose MUL and ADD."""
    s = np.asarray(states, dtype=np.uint32)
    out = np.empty(s.shape + (code.values,), dtype=np.float32)
    for j in range(code.values):
        h = s * np.uint32(mul[j]) + np.uint32(add[j])  # mod 2^32
        if code.version == 1:
            h ^= h >> np.uint32(16)
        total = (h & 0xFF) + ((h >> 8) & 0xFF) + ((h >> 16) & 0xFF) + (h >> 24)
        out[..., j] = (total.astype(np.float32) - np.float32(BYTESUM_MEAN)) / np.float32(
            BYTESUM_STD
        )
    return out


def codebook(code: TrellisCode, mul=MUL, add=ADD) -> np.ndarray:
    """Every state's values, (2^L, V) float32: what the encoder compares against."""
    return state_values(code, np.arange(1 << code.state_bits, dtype=np.uint32), mul, add)


def viterbi(code: TrellisCode, y: np.ndarray, table: np.ndarray, closing=None):
    """Best state path for each row of y (rows, steps, V) against `table` (2^L, V).

    `closing` None: any start state; else (rows,) ints c < 2^(L-kV): tail-biting paths whose
    first state's low L-kV bits and last state's high L-kV bits are both c.
    Returns (states (rows, steps) int64, cost (rows,) float64).
    """
    if _COMPILED:
        return fast_trellis.viterbi(code, y, table, closing)
    return _viterbi_np(code, y, table, closing)


def _viterbi_np(code: TrellisCode, y: np.ndarray, table: np.ndarray, closing=None):
    rows, steps, _ = y.shape
    n, kv, keep = 1 << code.state_bits, code.step_bits, code.keep_bits
    fan = 1 << kv
    states = np.arange(n)
    inf = np.float32(np.inf)

    def dist(t):  # (rows, n): squared distance of step t's values to every state's
        d = np.zeros((rows, n), dtype=np.float32)
        for j in range(code.values):
            diff = y[:, t, j, None] - table[None, :, j]
            d += diff * diff
        return d

    cost = dist(0)
    if closing is not None:
        closing = np.asarray(closing, dtype=np.int64)
        cost[(states[None, :] & ((1 << keep) - 1)) != closing[:, None]] = inf
    back = np.empty((steps, rows, n >> kv), dtype=np.uint8)
    for t in range(1, steps):
        # predecessors of S' share S' low keep bits as their high bits: S = (S' << kV | h)
        prev = cost.reshape(rows, n >> kv, fan)
        h = np.argmin(prev, axis=2)
        back[t] = h
        best = np.take_along_axis(prev, h[..., None], axis=2)[..., 0]  # (rows, n >> kV)
        cost = dist(t).reshape(rows, fan, n >> kv)
        cost += best[:, None, :]
        cost = cost.reshape(rows, n)
    if closing is not None:
        cost[(states[None, :] >> kv) != closing[:, None]] = inf
    last = np.argmin(cost, axis=1)
    total = cost[np.arange(rows), last].astype(np.float64)
    path = np.empty((rows, steps), dtype=np.int64)
    path[:, -1] = last
    r = np.arange(rows)
    low = (1 << keep) - 1
    for t in range(steps - 1, 0, -1):
        s = path[:, t]
        path[:, t - 1] = ((s & low) << kv) | back[t, r, s & low]
    return path, total


def _path_cost(y, table, path):
    q = table[path]
    return ((y - q) ** 2).sum(axis=(1, 2), dtype=np.float64)


def encode_block(code: TrellisCode, y: np.ndarray, table=None, exact: bool = False):
    """Tail-biting state paths (rows, T / V) of blocks y (rows, T) (already gain-divided).

    exact=False: the closing is the one a free Viterbi over the half-rotated block passes
    through; exact=True: the best of all 2^(L-kV) closings (tiny L only).
    """
    if table is None:
        table = codebook(code)
    rows, block = y.shape
    steps = block // code.values
    yv = np.ascontiguousarray(y, dtype=np.float32).reshape(rows, steps, code.values)
    kv = code.step_bits
    if exact:
        best_path, best_cost = None, np.full(rows, np.inf)
        for c in range(1 << code.keep_bits):
            path, cost = viterbi(code, yv, table, np.full(rows, c))
            if best_path is None:
                best_path = path
            better = cost < best_cost
            best_path[better], best_cost[better] = path[better], cost[better]
        return best_path
    half = steps // 2
    rolled, _ = viterbi(code, np.roll(yv, -half, axis=1), table)
    # rolled step steps-1-half is the block's last step: the circle closes on its high bits
    closing = rolled[:, steps - 1 - half] >> kv
    path, _ = viterbi(code, yv, table, closing)
    return path


def path_bits(code: TrellisCode, path: np.ndarray) -> np.ndarray:
    """The k*V new bits of each step (rows, steps): the top bits of its state."""
    return path >> code.keep_bits


def pack_bits(code: TrellisCode, bits: np.ndarray) -> np.ndarray:
    """Steps' k*V-bit fields (rows, steps) -> uint32 words (rows, steps * kV / 32)."""
    rows, steps = bits.shape
    kv = code.step_bits
    if (steps * kv) % 32:
        raise ValueError(f"{steps} steps of {kv} bits do not fill whole 32-bit words")
    shifts = np.arange(kv)
    stream = ((bits[..., None] >> shifts) & 1).astype(np.uint8).reshape(rows, -1)
    packed = np.packbits(stream, axis=1, bitorder="little")
    return packed.view("<u4").astype(np.uint32)


def unpack_bits(code: TrellisCode, words: np.ndarray) -> np.ndarray:
    """uint32 words (rows, w) -> the steps' k*V-bit fields (rows, w * 32 / kV) int64."""
    rows = words.shape[0]
    stream = np.unpackbits(
        np.ascontiguousarray(words, dtype="<u4").view(np.uint8), axis=1, bitorder="little"
    )
    kv = code.step_bits
    fields = stream.reshape(rows, -1, kv).astype(np.int64)
    return (fields << np.arange(kv)).sum(axis=2)


def states_from_bits(code: TrellisCode, bits: np.ndarray) -> np.ndarray:
    """Each step's state (rows, steps) from the steps' fields of tail-biting blocks."""
    kv, keep = code.step_bits, code.keep_bits
    state = np.zeros_like(bits, dtype=np.int64)
    # step t - j contributes its bits at keep - j*kV (shifted right once that is negative)
    for j in range(-(-code.state_bits // kv)):
        shift = keep - j * kv
        prev = np.roll(bits, j, axis=1)
        state |= (prev << shift) if shift >= 0 else (prev >> -shift)
    return state & ((1 << code.state_bits) - 1)


def decode_words(code: TrellisCode, words: np.ndarray, block: int) -> np.ndarray:
    """Unit-scale values (rows, n) of packed rows (rows, n * k / 32), blocks of `block`."""
    code.check_block(block)
    rows = words.shape[0]
    n = words.shape[1] * 32 // code.bits
    out = np.empty((rows, n), dtype=np.float32)
    for b0 in range(0, n, block):
        size = min(block, n - b0)
        w0 = b0 * code.bits // 32
        fields = unpack_bits(code, words[:, w0 : w0 + size * code.bits // 32])
        states = states_from_bits(code, fields)
        out[:, b0 : b0 + size] = state_values(code, states).reshape(rows, size)
    return out


def _windows(code: TrellisCode, n: int, block: int):
    """Per column of a row of n weights: the two words its state's bit window lies in (the
    second one circular within its block), the shift into the first, and its value index."""
    i = np.arange(n)
    b0 = (i // block) * block
    nbits = np.minimum(block, n - b0) * code.bits
    t = (i - b0) // code.values
    start = ((t + 1) * code.step_bits - code.state_bits) % nbits  # bit in the block's circle
    first = b0 * code.bits // 32
    word0 = first + start // 32
    word1 = first + (start // 32 + 1) % (nbits // 32)
    return word0, word1, (start % 32).astype(np.uint32), (i - b0) % code.values


def decode_words_mx(code: TrellisCode, words, block: int = 256):
    """decode_words in MLX, as a fused kernel does it: each weight reads its state's L-bit
    window from two words, then a multiply-add, a shift-xor and a byte sum (no table).
    words (rows, n * k / 32) uint32 -> (rows, n) float32, equal to decode_words."""
    code.check_block(block)
    w = mx.array(words) if not isinstance(words, mx.array) else words
    if w.ndim != 2:  # experts (E, rows, words) and the like: decode as rows
        lead = w.shape[:-1]
        return decode_words_mx(code, w.reshape(-1, w.shape[-1]), block).reshape(*lead, -1)
    n = w.shape[1] * 32 // code.bits
    word0, word1, shift, j = _windows(code, n, block)
    lo = mx.take(w, mx.array(word0), axis=1) >> mx.array(shift)
    up = mx.array(np.where(shift > 0, 32 - shift, 0).astype(np.uint32))
    hi = mx.where(mx.array(shift > 0), mx.take(w, mx.array(word1), axis=1) << up, 0)
    state = (lo | hi.astype(mx.uint32)) & mx.array((1 << code.state_bits) - 1, dtype=mx.uint32)
    mul = mx.array(np.array(MUL, dtype=np.uint32)[j])
    add = mx.array(np.array(ADD, dtype=np.uint32)[j])
    h = state * mul + add
    if code.version == 1:
        h = h ^ (h >> 16)
    total = (h & 0xFF) + ((h >> 8) & 0xFF) + ((h >> 16) & 0xFF) + (h >> 24)
    return (total.astype(mx.float32) - BYTESUM_MEAN) / mx.array(BYTESUM_STD, dtype=mx.float32)


@dataclass
class TrellisRows:
    """Rows coded with a trellis: packed words, float16 scales, per-row squared error."""

    words: np.ndarray  # (rows, n * k / 32) uint32
    scales: np.ndarray  # (rows, n / group_size) float16
    sq_error: np.ndarray  # (rows,) float64: ||x - scale * v||^2
    sq_norm: np.ndarray  # (rows,) float64: ||x||^2


def block_paths(code: TrellisCode, y: np.ndarray, block: int, table, exact: bool = False
                ) -> np.ndarray:
    """The states (rows, n / V) of every block of the normalised rows y, one block after
    another (the Viterbi here; a GPU encoder gives the same states)."""
    return np.concatenate([encode_block(code, y[:, b0 : b0 + block], table, exact)
                           for b0 in range(0, y.shape[1], block)], axis=1)


def encode_rows(code: TrellisCode, x: np.ndarray, group_size: int, block: int = 256,
                exact: bool = False, gain: float | None = None, table=None,
                valid: int | None = None, paths=None) -> TrellisRows:
    """Code rotated, padded rows x (rows, n) (n % group_size == 0): the trellis's step in
    place of the scalar code's nearest levels. Blocks of `block` weights (the last one may
    be shorter: any multiple of 32), group RMS -> Viterbi -> least-squares scale refit.
    `valid`: the real row length (the rest is padding: left out of the RMS, decoded as 0).
    Scales and refit sums are scale.py's float32 in-order sums, as the scalar code's.
    `gain`, `table`: other than the code's (the benchmark that chose them). `paths`: what
    computes the blocks' states (`block_paths`'s signature; a GPU Viterbi)."""
    code.check_block(block)
    x = np.asarray(x, dtype=np.float32)
    rows, n = x.shape
    if n % group_size or n % 32:
        raise ValueError(f"row length {n} is not a multiple of group_size {group_size} and 32")
    if not np.isfinite(x).all():
        raise ValueError("rows hold NaN/Inf: the trellis codes finite weights only; keep "
                         "this tensor in 16 bits or fix the checkpoint")
    g = x.reshape(rows, -1, group_size)
    xt = np.ascontiguousarray(g.reshape(-1, group_size).T)  # (group_size, groups), as scale.py
    energy = group_energy_np(xt).reshape(rows, -1)
    rms = rms_from_energy_np(energy, group_size, valid).astype(np.float32)
    gain = code.gain if gain is None else gain
    y = (g / np.where(rms > 0, rms, 1.0)[..., None]).reshape(rows, n) / np.float32(gain)
    table = codebook(code) if table is None else table
    steps = (paths or block_paths)(code, y, block, table, exact)
    parts, values = [], []
    for b0 in range(0, n, block):
        path = steps[:, b0 // code.values : (b0 + min(block, n - b0)) // code.values]
        parts.append(pack_bits(code, path_bits(code, path)))
        values.append(table[path].reshape(rows, -1))  # = decode_words of the words (tests)
    words = np.concatenate(parts, axis=1)
    v = np.concatenate(values, axis=1).reshape(rows, -1, group_size)
    if valid is not None and valid < n:
        v.reshape(rows, n)[:, valid:] = 0.0  # padding decodes to zero
    xq, qq = refit_sums_np(xt, np.ascontiguousarray(v.reshape(-1, group_size).T))
    scales = scales_from_sums_np(xq, qq).reshape(rows, -1)
    err = g.astype(np.float64) - scales.astype(np.float64)[..., None] * v
    return TrellisRows(words, scales, (err * err).sum(axis=(1, 2)),
                       (g.astype(np.float64) ** 2).sum(axis=(1, 2)))


def decode_rows(code: TrellisCode, words: np.ndarray, scales: np.ndarray, group_size: int,
                block: int = 256, valid: int | None = None) -> np.ndarray:
    """Rotated rows (rows, n) float32 from packed words and float16 scales; columns from
    `valid` on (padding) are 0."""
    v = decode_words(code, words, block)
    rows, n = v.shape
    s = np.asarray(scales).astype(np.float32)
    out = (v.reshape(rows, -1, group_size) * s[..., None]).reshape(rows, n)
    if valid is not None:
        out[:, valid:] = 0.0
    return out

"""A compiled CPU GEMV for TurboQuant weights (numba): decode and dot in one pass.

On MLX's CPU backend the pure-MLX reference decodes a whole weight matrix per token in a
dozen array ops (unpack, gather, multiply, two sums); this does, per row, the unpack into a
row of levels and the per-group dot products with every activation row, rows spread over
the cores (`numba.prange`). `gather_gemv` does the same for MoE experts: each (token,
expert) pair multiplies its own expert's rows, (pair, row block) tasks spread over the
cores. Same algorithm and layout as the reference (docs/FORMAT.md), for one token or a
prefill's many:

    y[m, r] = sum_g scale[r, g] * sum_j levels[code[r, g*gs + j]] * x[m, g*gs + j]

- 2/4 bits: code i of a word at bit width*i; 3 bits: 32 codes in 3 words, code k at bit 3k
  of the 96 (code 21 straddles words 1 and 2); ternary: 20 base-3 trits a word, least
  significant first;
- trellis codes (docs/FORMAT.md, "Trellis code"; width -1, the "codebook" then the code's
  [L, k, V, T, version]): each weight's value computed from the L-bit window of its block's
  bit circle (two words), a multiply-add, a shift-xor (version 1 only) and a byte sum, as
  decode_words_mx;
- float16 scales are read as their bits and widened in the kernel (no float32 copy kept);
- sums in float32; the dot products may be reordered (fast-math), so results equal the
  reference to float32 rounding, not bit for bit.

`available()` is False without numba (or with TURBOQUANT_NO_NUMBA=1): the reference runs.
Compiled on first use and cached on disk by numba.
"""

from __future__ import annotations

import threading

import numpy as np

from turboquant.stages import trellis
from turboquant.stages.fast_hadamard import AVAILABLE
from turboquant.stages.fast_trellis import state_value as _state_value  # the one hash

ROWS_PER_TASK = 16  # rows one parallel task decodes (one levels buffer each)
_MUL, _ADD = (np.array(trellis.MUL, dtype=np.uint64), np.array(trellis.ADD, dtype=np.uint64))
_BYTESUM_MEAN, _BYTESUM_STD = trellis.BYTESUM_MEAN, trellis.BYTESUM_STD
_LOCK = threading.Lock()
_KERNEL = []


def available() -> bool:
    return AVAILABLE


def _half_to_float(h):
    """An IEEE float16 given as its 16 bits, widened to float32 exactly."""
    sign = (h >> 15) & 1
    exp = (h >> 10) & 0x1F
    frac = h & 0x3FF
    if exp == 0:
        v = np.float32(frac) * np.float32(2.0**-24)
    elif exp == 31:
        v = np.float32(np.inf) if frac == 0 else np.float32(np.nan)
    else:
        v = np.float32(1.0 + frac / 1024.0) * np.float32(2.0 ** (exp - 15))
    return -v if sign else v


def _trellis_row(words, params, out):
    """Values of one trellis-coded row into out (padded_in,); params [L, k, V, T, version]
    (version 2: no shift-xor)."""
    n = out.shape[0]
    state_bits, k, v, block = int(params[0]), int(params[1]), int(params[2]), int(params[3])
    mix = int(params[4]) == 1
    kv = k * v
    mask = np.uint64((1 << state_bits) - 1)
    for b0 in range(0, n, block):
        size = min(block, n - b0)
        nbits = size * k
        nwords = nbits // 32
        first = b0 * k // 32
        for i in range(size):
            t = i // v
            start = ((t + 1) * kv - state_bits) % nbits
            shift = start % 32
            lo = np.uint64(words[first + start // 32]) >> np.uint64(shift)
            if shift > 0:
                hi = np.uint64(words[first + (start // 32 + 1) % nwords]) << np.uint64(32 - shift)
                lo = lo | hi
            j = i % v
            out[b0 + i] = _state_value(lo & mask, _MUL[j], _ADD[j], _BYTESUM_MEAN, _BYTESUM_STD,
                                       mix)


def _decode_row(words, bits, book, out):
    """Levels of one packed row into out (padded_in,); bits -1: a trellis row (book holds
    its [L, k, V, T, version])."""
    n = out.shape[0]
    if bits == -1:
        _trellis_row(words, book, out)
        return
    if bits == 3:
        for b in range(words.shape[0] // 3):
            lo = np.uint64(words[3 * b]) | (np.uint64(words[3 * b + 1]) << np.uint64(32))
            hi = np.uint64(words[3 * b + 2])
            j0 = 32 * b
            if j0 + 32 <= n:  # a whole block: fixed shifts, no branches
                for k in range(21):
                    out[j0 + k] = book[(lo >> np.uint64(3 * k)) & np.uint64(7)]
                out[j0 + 21] = book[((lo >> np.uint64(63)) | (hi << np.uint64(1)))
                                    & np.uint64(7)]
                for k in range(22, 32):
                    out[j0 + k] = book[(hi >> np.uint64(3 * k - 64)) & np.uint64(7)]
                continue
            for k in range(32):
                j = 32 * b + k
                if j >= n:
                    return
                bit = 3 * k
                if bit < 62:
                    c = (lo >> np.uint64(bit)) & np.uint64(7)
                elif bit == 63:
                    c = ((lo >> np.uint64(63)) | (hi << np.uint64(1))) & np.uint64(7)
                else:
                    c = (hi >> np.uint64(bit - 64)) & np.uint64(7)
                out[j] = book[c]
    elif bits == 0:  # ternary
        for w in range(words.shape[0]):
            v = words[w]
            for t in range(20):
                j = 20 * w + t
                if j >= n:
                    return
                out[j] = book[v % 3]
                v //= 3
    else:
        per = 32 // bits
        mask = (1 << bits) - 1
        whole = min(words.shape[0], n // per)  # words whose codes all fall in the row
        if bits == 4:  # literal counts and shifts: unrolled, no branches
            for w in range(whole):
                v = words[w]
                for i in range(8):
                    out[8 * w + i] = book[(v >> (4 * i)) & 15]
        else:  # 2 bits
            for w in range(whole):
                v = words[w]
                for i in range(16):
                    out[16 * w + i] = book[(v >> (2 * i)) & 3]
        for w in range(whole, words.shape[0]):
            v = words[w]
            for i in range(per):
                j = per * w + i
                if j >= n:
                    return
                out[j] = book[(v >> (bits * i)) & mask]


def _rows_times_x(x, codes, scales, book, bits, group_size, r0, count, levels, widened, out):
    """out[m, r0 + k] for k < count: rows r0.. of (codes, scales) decoded once into levels
    and widened, then every activation row of x (M, P) against all of them."""
    groups = x.shape[1] // group_size
    for k in range(count):
        _decode_row(codes[r0 + k], bits, book, levels[k])
        for g in range(groups):
            widened[k, g] = _half_to_float(scales[r0 + k, g])
    for m in range(x.shape[0]):
        xm = x[m]
        for k in range(count):
            lk = levels[k]
            acc = np.float32(0.0)
            for g in range(groups):
                s = np.float32(0.0)
                base = g * group_size
                for i in range(group_size):
                    s += lk[base + i] * xm[base + i]
                acc += s * widened[k, g]
            out[m, r0 + k] = acc


def _gemv(x, codes, scales, book, bits, group_size, out):
    """out (M, R) = TurboQuant rows (codes (R, W), scales (R, G) as uint16) times x (M, P)."""
    rows = codes.shape[0]
    padded = x.shape[1]
    tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in _prange(tasks):
        r0 = task * ROWS_PER_TASK
        # x is read once per task, whatever the number of tokens
        levels = np.empty((ROWS_PER_TASK, padded), dtype=np.float32)
        widened = np.empty((ROWS_PER_TASK, padded // group_size), dtype=np.float32)
        _rows_times_x(x, codes, scales, book, bits, group_size, r0,
                      min(rows, r0 + ROWS_PER_TASK) - r0, levels, widened, out)


def _gather_gemv(x, codes, scales, experts, book, bits, group_size, out):
    """out[t] (M, R) = expert experts[t]'s rows (codes (E, R, W), scales (E, R, G) as
    uint16) times x[t] (M, P), for every pair t: (pair, block of rows) tasks in parallel."""
    rows = codes.shape[1]
    padded = x.shape[2]
    per_pair = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in _prange(x.shape[0] * per_pair):
        t = task // per_pair
        r0 = (task % per_pair) * ROWS_PER_TASK
        e = experts[t]
        levels = np.empty((ROWS_PER_TASK, padded), dtype=np.float32)
        widened = np.empty((ROWS_PER_TASK, padded // group_size), dtype=np.float32)
        _rows_times_x(x[t], codes[e], scales[e], book, bits, group_size, r0,
                      min(rows, r0 + ROWS_PER_TASK) - r0, levels, widened, out[t])


def _prange(n):  # numba.prange once compiled
    return range(n)


def _compiled():
    with _LOCK:
        if not _KERNEL:
            import numba

            scope = globals()
            opts = dict(cache=True, nogil=True, error_model="numpy")
            scope["_half_to_float"] = numba.njit(**opts)(_half_to_float)
            scope["_state_value"] = numba.njit(**opts)(_state_value)
            scope["_trellis_row"] = numba.njit(**opts)(_trellis_row)
            scope["_decode_row"] = numba.njit(**opts)(_decode_row)
            scope["_rows_times_x"] = numba.njit(fastmath=True, **opts)(_rows_times_x)
            scope["_prange"] = numba.prange
            for kernel in (_gemv, _gather_gemv):
                _KERNEL.append(numba.njit(parallel=True, fastmath=True, **opts)(kernel))
    return _KERNEL


def gemv(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, book: np.ndarray, bits,
         group_size: int) -> np.ndarray:
    """(M, R) float32 for x (M, padded_in) float32, codes (R, words) uint32, scales (R,
    groups) float16, book the codebook (float32), bits 2/3/4 or "ternary"."""
    out = np.empty((x.shape[0], codes.shape[0]), dtype=np.float32)
    x, codes, scales = _operands(x, codes, scales)
    _compiled()[0](x, codes, scales, *_code_args(book, bits, group_size), out)
    return out


def _operands(x, codes, scales):
    """The kernels' views: float32 activations, codes, float16 scales as their bits."""
    return (np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(codes),
            np.ascontiguousarray(scales).view(np.uint16))


def _code_args(book, bits, group_size) -> tuple:
    """(codebook float32, width (0 for ternary), group size): the kernels' last inputs; for
    a trellis code (a TrellisBits) the "codebook" is its [L, k, V, T, version] and the
    width -1."""
    if hasattr(bits, "state_bits"):
        params = np.array([bits.state_bits, bits.bits, bits.values, bits.block, bits.version],
                          np.float32)
        return params, -1, int(group_size)
    return (np.ascontiguousarray(book, dtype=np.float32), 0 if bits == "ternary" else int(bits),
            int(group_size))


def gather_gemv(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, experts: np.ndarray,
                book: np.ndarray, bits, group_size: int) -> np.ndarray:
    """(T, M, R) float32: for each pair t, expert experts[t] of codes (E, R, words) and
    scales (E, R, groups) float16 times x[t] (M, padded_in) float32."""
    out = np.empty((x.shape[0], x.shape[1], codes.shape[1]), dtype=np.float32)
    x, codes, scales = _operands(x, codes, scales)
    _compiled()[1](x, codes, scales, np.ascontiguousarray(experts, dtype=np.int64),
                   *_code_args(book, bits, group_size), out)
    return out

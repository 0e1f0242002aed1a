"""The CUDA GEMV's bit tricks, emulated on the CPU.

The kernel looks codes up with `__byte_perm` in byte tables of the fp16 codebook and reads
3-bit codes from a repacked pair of planes. This emulates those instructions in Python on
the exact words `repack` produces, so the layout and selector arithmetic are checked in CI,
where no GPU exists. The kernel itself is checked against the reference on the GPU
(`python benchmarks/kernels.py --check`).
"""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.kernels import cuda_gemv
from turboquant.stages import codebook_values

MASK = 0xFFFFFFFF


def byte_perm(x: int, y: int, s: int) -> int:
    pool = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def tables(levels) -> list[int]:
    t = [0] * 8
    for i, level in enumerate(levels):
        h = int(np.float16(level).view(np.uint16))
        bank, j = (i // 8) * 4, i % 8
        t[bank + j // 4] |= (h & 0xFF) << (8 * (j % 4))
        t[bank + 2 + j // 4] |= (h >> 8) << (8 * (j % 4))
    return t


def halves(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16).astype(np.float32)


def lookup4(t, sel, bits):
    if bits == 4:
        s, merge = sel & 0x7777, 0x3210 | ((sel & 0x8888) >> 1)
        lo = byte_perm(byte_perm(t[0], t[1], s), byte_perm(t[4], t[5], s), merge)
        hi = byte_perm(byte_perm(t[2], t[3], s), byte_perm(t[6], t[7], s), merge)
    else:
        lo, hi = byte_perm(t[0], t[1], sel), byte_perm(t[2], t[3], sel)
    return halves(byte_perm(lo, hi, 0x5140)), halves(byte_perm(lo, hi, 0x7362))


def dot8(t, sel, xv, bits) -> float:
    total = 0.0
    for half, xs in ((sel & 0xFFFF, xv[:4]), (sel >> 16, xv[4:])):
        a, b = lookup4(t, half, bits)
        total += float((a * xs[:2]).sum() + (b * xs[2:]).sum())
    return total


def block_sums(bits, low, high, x_perm, levels) -> np.ndarray:
    """Per 16-code block, the sum of level * x exactly as the kernel forms it."""
    t, sums = tables(levels), []
    for g in range(x_perm.shape[0] // 64):
        xv = x_perm[g * 64:(g + 1) * 64].reshape(8, 8)
        for b in range(4):
            if bits == 3:
                lw, h = int(low[g * 4 + b]), int(high[g * 2 + (b >> 1)])
                he = (h << 2) & MASK if b & 1 else h
                ho = (h << 1) & MASK if b & 1 else h >> 1
                se = (lw & 0x33333333) | (he & 0x44444444)
                so = ((lw >> 2) & 0x33333333) | (ho & 0x44444444)
            elif bits == 2:
                lw = int(low[g * 4 + b])
                se, so = lw & 0x33333333, (lw >> 2) & 0x33333333
            else:
                se, so = int(low[g * 8 + 2 * b]), int(low[g * 8 + 2 * b + 1])
            sums.append(dot8(t, se, xv[2 * b], bits) + dot8(t, so, xv[2 * b + 1], bits))
    return np.array(sums)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [64, 192])
def test_repacked_lookup_matches_codebook(bits, n):
    rng = np.random.default_rng(bits * 100 + n)
    codes = rng.integers(0, 2**bits, size=(2, n), dtype=np.uint8)
    low, high = (np.array(a) for a in cuda_gemv.repack(mx.array(codes), bits, n))
    levels = np.array(codebook_values(bits))
    x = rng.standard_normal(n).astype(np.float32)
    for r in range(2):
        # activations in natural order: repack placed each code next to its activation
        got = block_sums(bits, low[r], high[r] if bits == 3 else None, x, levels)
        want = (levels[codes[r]].astype(np.float16).astype(np.float32) * x).reshape(-1, 16).sum(1)
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("n", [64, 200])
def test_ternary_codes_run_as_two_bit_codes(n):
    """Ternary weights on CUDA: the stored base-3 words unpacked, repacked as 2-bit codes,
    looked up in a 4-entry table [-c, 0, c, unused] (`cuda.kernel_bits`, `cuda._levels`)."""
    from turboquant.kernels import cuda
    from turboquant.stages import pack_codes, unpack_codes

    rng = np.random.default_rng(n)
    codes = rng.integers(0, 3, size=(2, n), dtype=np.uint8)
    stored = pack_codes(mx.array(codes), "ternary")
    padded = -(-n // 64) * 64
    unpacked = unpack_codes(stored, "ternary", n)
    low, _ = (np.array(a) for a in cuda_gemv.repack(unpacked, cuda.kernel_bits("ternary"), padded))
    levels = np.array(cuda._levels("ternary"))
    three = np.array(codebook_values("ternary"))
    assert levels.shape == (4,) and np.array_equal(levels[:3], three)
    x = np.zeros(padded, dtype=np.float32)
    x[:n] = rng.standard_normal(n)
    for r in range(2):
        got = block_sums(2, low[r], None, x, levels)
        full = np.zeros(padded, dtype=np.float32)
        full[:n] = three[codes[r]].astype(np.float16).astype(np.float32)
        want = (full * x).reshape(-1, 16).sum(1)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_repack_pads_rows_to_64_codes():
    codes = mx.zeros((3, 40), dtype=mx.uint8)
    low, high = cuda_gemv.repack(codes, 3, 64)
    assert low.shape == (3, 4) and high.shape == (3, 2)


def test_x_permutation_is_a_permutation():
    for bits in (2, 3, 4):
        p = cuda_gemv.x_permutation(bits, 128)
        assert sorted(p.tolist()) == list(range(128))

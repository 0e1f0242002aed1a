"""The trellis GEMV on Metal (`mx.fast.metal_kernel`), written as the CUDA one
(`kernels/cuda_trellis.py`): y = W x for trellis-coded W on rotated, padded activations.

One simdgroup per output row and token; lane l takes the chunks of 32 weights l, l + 32,
... of the row. A chunk's k words and the word before them (the block's last word for a
block's first chunk: the stream is a circle) hold every state of the chunk: per weight
the L-bit window at a known bit offset, a multiply-add, a shift-xor and the byte sum
(docs/FORMAT.md, "Trellis code"), centred, times the activation. A chunk lies in one group,
so its sum is scaled once; 1 / BYTESUM_STD is applied to the row's total after `simd_sum`.
Checked on Linux by compiling the source as C++ (`tests/test_kernels_metal_trellis.py`);
not yet run on a Mac.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from turboquant.stages import trellis
from turboquant.stages.trellis import TrellisCode

from .cuda_trellis import _check_operands, _float, check


def header() -> str:
    """The byte-sum function with the computed codebook's constants."""
    defs = "".join(f"#define TQ_{name}{j} {int(v)}u\n"
                   for name, values in (("MUL", trellis.MUL), ("ADD", trellis.ADD))
                   for j, v in enumerate(values))
    return defs + f"#define TQ_INV_STD {_float(1.0 / trellis.BYTESUM_STD)}\n" + """
// The byte sum of state s's value j (0 or 1): multiply-add, shift-xor (trellis version 1;
// version 2 has none), four bytes.
inline uint tq_trellis_sum(uint s, uint j, int version) {
    uint h = j ? s * TQ_MUL1 + TQ_ADD1 : s * TQ_MUL0 + TQ_ADD0;
    if (version == 1) {
        h ^= h >> 16;
    }
    return (h & 0xffu) + ((h >> 8) & 0xffu) + ((h >> 16) & 0xffu) + (h >> 24);
}
"""


# inputs x (tokens, KDIM) rotated and padded, codes (NROWS, NWORDS) uint32, scales
# (NROWS, KDIM / GSIZE) float16; output y (tokens, NROWS) in T
SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint row = threadgroup_position_in_grid.x;
    uint t = thread_position_in_grid.y;
    auto crow = codes + size_t(row) * NWORDS;
    auto srow = scales + size_t(row) * (KDIM / GSIZE);
    auto xrow = x + size_t(t) * KDIM;
    float acc = 0.0f;
    for (uint chunk = lane; chunk < uint(KDIM) / 32u; chunk += 32u) {
        uint col = chunk * 32u;
        uint b0 = col / uint(BLOCK) * uint(BLOCK);
        uint size = min(uint(BLOCK), uint(KDIM) - b0);
        uint w = chunk * uint(BITS);
        uint c[BITS + 1];
        c[0] = crow[col == b0 ? b0 * uint(BITS) / 32u + size * uint(BITS) / 32u - 1u : w - 1u];
        for (uint i = 0u; i < uint(BITS); ++i) {
            c[i + 1u] = crow[w + i];
        }
        float part = 0.0f;
        for (uint j = 0u; j < 32u; ++j) {
            // the state's L bits end with its step's: bit 32 + (j / V + 1) k V of c
            uint start = 32u + (j / uint(VALUES) + 1u) * uint(BITS * VALUES) - uint(STATE);
            uint wi = start >> 5u, sh = start & 31u;
            uint s = c[wi] >> sh;
            if (sh + uint(STATE) > 32u) {
                s |= c[wi + 1u] << (32u - sh);
            }
            s &= (1u << uint(STATE)) - 1u;
            float v = float(int(tq_trellis_sum(s, j % uint(VALUES), int(VERSION))) - 510);
            part += v * float(xrow[col + j]);
        }
        acc += float(srow[col / uint(GSIZE)]) * part;
    }
    acc = simd_sum(acc);
    if (lane == 0u) {
        y[size_t(t) * NROWS + row] = T(acc * TQ_INV_STD);
    }
"""


@functools.lru_cache(maxsize=None)
def _kernel():
    return mx.fast.metal_kernel(name="tq_trellis_gemv", input_names=["x", "codes", "scales"],
                                output_names=["y"], source=SOURCE, header=header())


def template(code: TrellisCode, block: int, group_size: int, padded_in: int,
             out_features: int, dtype) -> list:
    """The kernel's template arguments."""
    check(code, block, group_size, padded_in)
    return [("T", dtype), ("BITS", code.bits), ("STATE", code.state_bits),
            ("VALUES", code.values), ("VERSION", code.version), ("BLOCK", block), ("GSIZE", group_size),
            ("KDIM", padded_in), ("NROWS", out_features),
            ("NWORDS", padded_in * code.bits // 32)]


def matvec(x_rot: mx.array, codes: mx.array, scales: mx.array, code: TrellisCode, block: int,
           group_size: int, out_features: int, padded_in: int) -> mx.array:
    """`cuda_trellis.matvec` on Metal: x_rot (..., padded_in) -> (..., out_features) in
    x_rot's dtype."""
    _check_operands(x_rot, codes, scales, code, group_size, out_features, padded_in)
    lead = x_rot.shape[:-1]
    x = x_rot.reshape(-1, padded_in)
    (y,) = _kernel()(
        inputs=[x, codes, scales.astype(mx.float16)],
        template=template(code, block, group_size, padded_in, out_features, x.dtype),
        grid=(32 * out_features, x.shape[0], 1), threadgroup=(32, 1, 1),
        output_shapes=[(x.shape[0], out_features)], output_dtypes=[x.dtype])
    return y.reshape(*lead, out_features)


__all__ = ["header", "matvec", "SOURCE", "template"]

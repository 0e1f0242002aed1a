"""turboquant.stages: the TurboQuant codec as pure tensor transforms (no files, no Prefect).

Data flow of one 2-D weight W (out, in), row by row along the input dimension:
  rotate    y = T(s * w), s = ±1 signs and T orthogonal, seeded by tensor_seed(name)
  pad       zeros up to padded_in, a multiple of group_size (32, 64, 128)
  scale     per-group RMS as float16 (refit by least squares once codes are known)
  quantize  nearest Lloyd-Max level for N(0, 1) (2, 3, 4 bits) or a ternary trit
  pack      uint32 words exactly as docs/FORMAT.md: 2/4 dense, 3 bits in 3-word blocks, 20 trits
  decode    w = s * T^T(unpad(levels[codes] * scale))
  in_scales optional per-input-column scales t (float16): W / t is coded, decode multiplies t back

encode also returns its coding error (QuantizedTensor.rel_mse, per-row sums) without decoding:
the rotation is orthogonal, so the error is measured in the rotated domain from the refit's
sums. MLX ops (rotation, sums) fix the rounding; the exact elementwise steps run in numpy.
"""

from .codebook import codebook_values, lloyd_max_levels, lloyd_max_mse, ternary_levels, ternary_mse
from .codec import SUPPORTED_BITS, QuantizedTensor, QuantSpec, decode, encode
from .pack import pack_codes, unpack_codes, words_per_row
from .quantize import code_values, nearest_codes
from .rotate import rotate, rotation_key, tensor_seed, unrotate
from .scale import SUPPORTED_GROUP_SIZES, column_scales, column_scales_from_sums, group_rms, refit_scales

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "QuantSpec",
    "QuantizedTensor",
    "code_values",
    "column_scales",
    "column_scales_from_sums",
    "codebook_values",
    "decode",
    "encode",
    "group_rms",
    "lloyd_max_levels",
    "lloyd_max_mse",
    "nearest_codes",
    "pack_codes",
    "refit_scales",
    "rotate",
    "rotation_key",
    "tensor_seed",
    "ternary_levels",
    "ternary_mse",
    "unpack_codes",
    "unrotate",
    "words_per_row",
]

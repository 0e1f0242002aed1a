"""Golden bytes: encode's output may never change for the same input.

The digests below were computed with the codec before it was optimized (MLX only: rotation,
group RMS, nearest code, gathered levels, least-squares refit, pack). Any faster path has to
give the same codes and scales, bit for bit, at every width, group size and kind of size
(powers of two, 12/20/28 * 2^k, a dense factor, > 8192, padding, zero rows).
A mismatch means the format changed: find the step whose rounding differs, do not update
the digests. Every case runs twice: through the numba kernels (stages/fast_hadamard.py,
fast_quantize.py) and through the numpy/MLX path that is used without numba.
"""

import hashlib

import mlx.core as mx
import numpy as np
import pytest

from turboquant.stages import encode, fast_hadamard

PATHS = ["compiled", "host"]

WIDTHS = (2, 3, 4, "ternary")


def _matrix(rows, cols, seed, dist, scale=0.02):
    rng = np.random.default_rng(seed)
    if dist == "normal":
        w = rng.standard_normal((rows, cols), dtype=np.float32)
    elif dist == "t":
        w = rng.standard_t(4, size=(rows, cols)).astype(np.float32)
    else:  # a few input channels scaled 30x
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w[:, rng.choice(cols, size=max(1, cols // 64), replace=False)] *= 30
    return w * np.float32(scale)


# (name, rows, cols, group size, distribution, dtype, refit); the index is the matrix seed
CASES = [
    (f"n{n}-g{gs}", max(2, min(64, (1 << 18) // n)), n, gs, "normal", "f32", True)
    for n in (1, 3, 31, 100, 768, 1000, 1024, 1280, 1792, 4096, 5632, 11008, 16384, 24576)
    for gs in (32, 64, 128)
] + [
    ("t-2048-g64", 128, 2048, 64, "t", "bf16", True),
    ("outlier-2048-g64", 128, 2048, 64, "outlier", "bf16", True),
    ("norefit-1000-g64", 64, 1000, 64, "normal", "f32", False),
    ("norefit-4096-g128", 32, 4096, 128, "t", "f32", False),
    ("f16-1536-g64", 64, 1536, 64, "normal", "f16", True),
    ("big-4096x4096-g64", 4096, 4096, 64, "normal", "bf16", True),
    ("big-2048x5632-g64", 2048, 5632, 64, "t", "bf16", True),
]

GOLDEN = {  # sha256 over the four widths' digests (each: sha256(codes, scales)[:16])
    "n1-g32": "5c1cc329a59b43c8",
    "n1-g64": "fe33c1cab643572b",
    "n1-g128": "1866e3cd85a2bc76",
    "n3-g32": "bfa93316047d0ac8",
    "n3-g64": "300c233529040c2a",
    "n3-g128": "275e3d77a74662e9",
    "n31-g32": "f54a9051350cb180",
    "n31-g64": "cf1df3e4a8d7cf4d",
    "n31-g128": "c6059f1d4dd42304",
    "n100-g32": "43642cd7ccfaa389",
    "n100-g64": "073d4aa7c57cf196",
    "n100-g128": "42d0c0d2c573bfac",
    "n768-g32": "4730d6a9b47a066a",
    "n768-g64": "1db2fe89a96c0915",
    "n768-g128": "ceb2943d7fdc0223",
    "n1000-g32": "c1ba236fd0c5e43b",
    "n1000-g64": "132aeb4b4dcda69b",
    "n1000-g128": "7903ab86db4be7c4",
    "n1024-g32": "52d64a5bd2bb05e3",
    "n1024-g64": "4314a12b7d113892",
    "n1024-g128": "df963ccf77e11b6e",
    "n1280-g32": "deb4a2e7e0233d2a",
    "n1280-g64": "4f97838937a737a2",
    "n1280-g128": "f86b4cd401f75385",
    "n1792-g32": "e4b710989ef0144e",
    "n1792-g64": "09c8fc28dd861e8b",
    "n1792-g128": "d36ae2c72978703c",
    "n4096-g32": "c4e0a774ec9a6aa9",
    "n4096-g64": "2f3f6b5c08df4628",
    "n4096-g128": "19be7e45341472f5",
    "n5632-g32": "cc8f7dc1f2f2908b",
    "n5632-g64": "597013cdc3eae0c6",
    "n5632-g128": "0cb817eea1301217",
    "n11008-g32": "085520cd1e140fb8",
    "n11008-g64": "40ebf016084ad49e",
    "n11008-g128": "5efb0214ef0e3953",
    "n16384-g32": "211c5702e419f416",
    "n16384-g64": "10b5b738635d2e11",
    "n16384-g128": "8b21ec8e86c493df",
    "n24576-g32": "18181cc21438ec19",
    "n24576-g64": "e3b4868b4865751d",
    "n24576-g128": "996a9d2209af7e45",
    "t-2048-g64": "21f8e22713387671",
    "outlier-2048-g64": "8785c080a3ac5e66",
    "norefit-1000-g64": "6d4ac88a0d3a9140",
    "norefit-4096-g128": "c8e8436e22962d2e",
    "f16-1536-g64": "3c0ba26abb032ec4",
    "big-4096x4096-g64": "0248cbce725227c4",
    "big-2048x5632-g64": "e965ef9cd9bdc87a",
}


def _weight(index, name, rows, cols, dist, dtype):
    w = mx.array(_matrix(rows, cols, index, dist))
    if dtype != "f32":
        w = w.astype(mx.bfloat16 if dtype == "bf16" else mx.float16)
    if name.startswith("n"):  # the n* and norefit-* cases: a zero first row (zero scales)
        w = w.at[0].multiply(0.0)
    return w


@pytest.fixture(params=PATHS)
def codec_path(request, monkeypatch):
    """Encode through the numba kernels, or through the numpy/MLX path."""
    import importlib

    compiled = request.param == "compiled"
    if compiled and not fast_hadamard.AVAILABLE:
        pytest.skip("numba is not installed (or TURBOQUANT_NO_NUMBA is set)")
    for module in ("rotate", "codec"):
        monkeypatch.setattr(importlib.import_module(f"turboquant.stages.{module}"), "_COMPILED",
                            compiled)
    return request.param


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_golden_bytes(index, codec_path):
    name, rows, cols, gs, dist, dtype, refit = CASES[index]
    w = _weight(index, name, rows, cols, dist, dtype)
    digests = []
    for bits in WIDTHS:
        qt = encode(w, bits, group_size=gs, seed=1000 + index, refit=refit)
        h = hashlib.sha256(np.array(qt.codes).tobytes())
        h.update(np.array(qt.scales).tobytes())
        digests.append(h.hexdigest()[:16])
    assert hashlib.sha256("".join(digests).encode()).hexdigest()[:16] == GOLDEN[name]

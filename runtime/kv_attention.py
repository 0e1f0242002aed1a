"""Route mlx-lm's attention to the TurboQuant KV cache: the one hook into mlx-lm.

mlx-lm's attention modules call `mlx_lm.models.base.scaled_dot_product_attention(q, k, v,
cache=cache, ...)`, which sends any cache with a `bits` attribute to
`quantized_scaled_dot_product_attention`, looked up in `mlx_lm.models.base` at call time.
`install()` wraps that one function: when the keys are a `KVParts` view (what the
TurboQuant caches' `update_and_fetch` returns) it runs `turboquant_attention`, and
otherwise it calls mlx-lm's original (QuantizedKVCache keeps working). Model files are
untouched and K/V are never rebuilt.

`install(*cache_classes)` also makes the TurboQuant cache classes known to mlx-lm's
`load_prompt_cache` (it finds cache classes by name in `mlx_lm.models.cache`): those given,
and those given before. It is idempotent; `uninstall()` restores both. Importing
turboquant.runtime.kvcache installs it with that module's two classes (this module imports
nothing of the runtime: kvcache sits above it).

Limits of the route: attention with learned sinks (gpt-oss) raises in mlx-lm before the
hook, and models that call `mx.fast.scaled_dot_product_attention` themselves bypass it.

Kernels: `register_kernel(backend, fn)` installs a fused decode kernel ("cuda", "metal")
with `tq_attention`'s signature; it runs for single-token decode on that backend and may
raise NotImplementedError to fall back to the pure-MLX reference. The built-in CUDA kernel
(kernels/cuda_kv.py) is imported on the first decode step that runs on CUDA, unless a
kernel was registered (or unregistered) for that backend before; the Metal one
(kernels/metal_kv.py) likewise, with TURBOQUANT_METAL_KV=1 until it has run on a Mac.
`reference_only()` turns kernels off for a while (benchmarks, debugging).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Callable

import mlx.core as mx

from turboquant.kernels import dispatch
from turboquant.kernels.kv_reference import KVParts, tq_attention

_KERNELS: dict[str, Callable] = {}
_BUILTIN = {"cuda": ("turboquant.kernels.cuda_kv", "decode_attention")}  # loaded lazily
# the Metal kernel (kernels/metal_kv.py), written without a Mac: opt-in until it has run on one
_METAL = ("turboquant.kernels.metal_kv", "decode_attention")
_SETTLED: set[str] = set()  # backends whose kernel was loaded, registered or unregistered
_OFF = [0]  # reference_only() depth
_ORIGINAL = "_turboquant_original"
_CACHE_CLASSES: list[type] = []  # made known to mlx-lm by install() (runtime/kvcache.py's)


def register_kernel(backend: str, fn: Callable) -> None:
    """Use `fn(queries, parts, scale, mask)` for one-token decode on `backend`."""
    if backend not in ("cuda", "metal"):
        raise ValueError(f"unknown backend {backend!r}: use 'cuda' or 'metal'")
    _KERNELS[backend] = fn
    _SETTLED.add(backend)


def builtin_kernel(backend: str) -> Callable | None:
    """The kernel this package ships for `backend` (imported now), or None; Metal's only
    with TURBOQUANT_METAL_KV=1."""
    builtin = dict(_BUILTIN)
    if os.environ.get("TURBOQUANT_METAL_KV", "0") == "1":
        builtin["metal"] = _METAL
    if backend not in builtin:
        return None
    module, name = builtin[backend]
    return getattr(importlib.import_module(module), name)


def kernel_for(backend: str) -> Callable | None:
    """The decode kernel used on `backend`: registered, else the built-in one (loaded once)."""
    if backend not in _SETTLED:
        _SETTLED.add(backend)
        fn = builtin_kernel(backend)
        if fn is not None:
            _KERNELS.setdefault(backend, fn)
    return _KERNELS.get(backend)


def _decode_kernel() -> Callable | None:
    """The kernel one-token attention tries first on this backend now (None: the reference)."""
    backend = dispatch.backend()
    return None if backend == "cpu" or _OFF[0] else kernel_for(backend)


def decode_path() -> str:
    """What one-token attention over a TurboQuant cache runs on this backend, in words."""
    fn = _decode_kernel()
    if fn is None:
        return "the pure-MLX reference"
    return (f"{fn.__module__}.{fn.__qualname__} ({dispatch.backend()}; the reference where "
            "it does not fit)")


@contextlib.contextmanager
def reference_only():
    """Within this block, TurboQuant attention runs the pure-MLX reference everywhere."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


def turboquant_attention(queries: mx.array, parts: KVParts, scale: float, mask=None) -> mx.array:
    """Attention over a TurboQuant cache view: a decode kernel if one fits, else the reference."""
    if queries.shape[2] == 1 and not _OFF[0]:
        backend = dispatch.backend()  # `kernel_for` inline: this runs every decode step
        fn = _KERNELS.get(backend) if backend in _SETTLED else kernel_for(backend)
        if fn is not None:
            try:
                return fn(queries, parts, scale, mask)
            except NotImplementedError:
                pass
    return tq_attention(queries, parts, scale, mask)


def _routed(original: Callable) -> Callable:
    def quantized_scaled_dot_product_attention(
        queries, q_keys, q_values, scale, mask, group_size=64, bits=8
    ):
        if isinstance(q_keys, KVParts):
            return turboquant_attention(queries, q_keys, scale, mask)
        return original(queries, q_keys, q_values, scale=scale, mask=mask,
                        group_size=group_size, bits=bits)

    setattr(quantized_scaled_dot_product_attention, _ORIGINAL, original)
    return quantized_scaled_dot_product_attention


def installed() -> bool:
    from mlx_lm.models import base

    return hasattr(base.quantized_scaled_dot_product_attention, _ORIGINAL)


def install(*cache_classes: type) -> None:
    """Hook mlx-lm's quantized attention and register `cache_classes`, and the classes
    given before, with mlx-lm by name (idempotent)."""
    from mlx_lm.models import base, cache

    for cls in cache_classes:
        if cls not in _CACHE_CLASSES:
            _CACHE_CLASSES.append(cls)
    if not installed():
        base.quantized_scaled_dot_product_attention = _routed(
            base.quantized_scaled_dot_product_attention
        )
    for cls in _CACHE_CLASSES:
        setattr(cache, cls.__name__, cls)


def uninstall() -> None:
    """Undo install(): mlx-lm's own function back, the class names removed."""
    from mlx_lm.models import base, cache

    if installed():
        base.quantized_scaled_dot_product_attention = getattr(
            base.quantized_scaled_dot_product_attention, _ORIGINAL
        )
    for cls in _CACHE_CLASSES:
        if hasattr(cache, cls.__name__):
            delattr(cache, cls.__name__)


def unregister_kernel(backend: str) -> None:
    """No decode kernel on `backend` (the built-in one is not loaded again)."""
    _KERNELS.pop(backend, None)
    _SETTLED.add(backend)


__all__ = [
    "builtin_kernel",
    "install",
    "installed",
    "kernel_for",
    "reference_only",
    "register_kernel",
    "turboquant_attention",
    "uninstall",
    "unregister_kernel",
]

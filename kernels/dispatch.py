"""Pick a kernel implementation for the current device: CUDA, Metal, CPU, or the reference.

A backend module (`kernels/cuda.py`, `kernels/metal.py`, `kernels/cpu.py`) calls
`register(backend, op, fn)` for the ops it implements, with the reference's signature.
`get(op)` returns the backend's kernel for `mx.default_device()` (a GPU of that kind, or
the CPU) when one is registered, and the pure-MLX reference otherwise, so a backend may implement only some ops (say, the 4-bit GEMV) and
fall back for the rest by raising `NotImplementedError`.

Ops: "matvec" (GEMV), "matmul" (GEMM), "gather_matmul" (experts), "embedding" (row decode);
`add_op(op, reference_fn)` adds another (say, a KV-cache attention kernel) with its
reference, after which backends can register it too. Inside `graph_only()` a backend whose
kernels compute inside the call (`EAGER_BACKENDS`: the CPU's numba ones) gives way to the
reference, for results that may never be evaluated.

Trellis-coded weights (`reference.is_trellis(bits)`, docs/FORMAT.md) take their own table:
`register_trellis(backend, op, fn)` (the CPU's numba GEMV; a GPU's where one is written),
the reference otherwise. The entry points below choose by their `bits` (`get_for`), so a
backend written for the scalar code never sees a trellis weight.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Callable

import mlx.core as mx

from . import reference

MATVEC_MAX_TOKENS = 8  # at or below this many activation rows, use the GEMV path

_REFERENCE: dict[str, Callable] = {
    "matvec": reference.tq_matvec,
    "matmul": reference.tq_matmul,
    "gather_matmul": reference.tq_gather_matmul,
    "embedding": reference.tq_embedding,
}
_TABLE: dict[tuple[str, str], Callable] = {}
_WRAPPED: dict[tuple[str, str], Callable] = {}  # _TABLE's kernels with their fallback
_TRELLIS: dict[tuple[str, str], Callable] = {}  # kernels for trellis-coded weights
_LOADED: set[str] = set()


def ops() -> tuple[str, ...]:
    return tuple(_REFERENCE)


def add_op(op: str, reference_fn: Callable) -> None:
    """A new kernel op; `reference_fn` is its pure-MLX implementation (the CPU path)."""
    if op in _REFERENCE and _REFERENCE[op] is not reference_fn:
        raise ValueError(f"kernel op {op!r} already has a reference implementation")
    _REFERENCE[op] = reference_fn


BACKENDS = ("cpu", "cuda", "metal")


def register(backend: str, op: str, fn: Callable) -> None:
    """Make `fn` the `op` kernel on `backend` ("cpu", "cuda" or "metal")."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    if op not in _REFERENCE:
        raise ValueError(f"unknown kernel op {op!r}: one of {ops()} (add_op adds one)")
    _TABLE[(backend, op)] = fn
    _WRAPPED.pop((backend, op), None)
    _changed()


def unregister(backend: str, op: str) -> None:
    _TABLE.pop((backend, op), None)
    _WRAPPED.pop((backend, op), None)
    _changed()


def register_trellis(backend: str, op: str, fn: Callable) -> None:
    """Make `fn` the `op` kernel for trellis-coded weights on `backend` (the reference's
    signature; `bits` is then a TrellisBits; NotImplementedError falls back)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    if op not in _REFERENCE:
        raise ValueError(f"unknown kernel op {op!r}: one of {ops()} (add_op adds one)")
    _TRELLIS[(backend, op)] = _with_fallback(fn, _REFERENCE[op])
    _changed()


def unregister_trellis(backend: str, op: str) -> None:
    _TRELLIS.pop((backend, op), None)
    _changed()


def get_for(op: str, bits, device_backend: str | None = None) -> Callable:
    """`get(op)` for weights coded as `bits`: a trellis code's own kernel (or the
    reference) where `bits` is a TrellisBits."""
    if not reference.is_trellis(bits):
        return get(op, device_backend)
    name = _backend_for(op, device_backend)
    if name is None:
        return _REFERENCE[op]
    return _TRELLIS.get((name, op), _REFERENCE[op])


# `generation()`'s number, in a list that a decode step's hot path reads without a call
GENERATION = [0]


def _changed() -> None:
    GENERATION[0] += 1


def generation() -> int:
    """A number that changes whenever a kernel is registered or unregistered: callers that
    keep what `get` chose (say, a bound decode call) key it on this and on the device's
    type, `mx.default_device().type` (`backend()` is a function of it; a fake backend, as
    the benchmarks patch in, must be in place before anything is bound)."""
    return GENERATION[0]


def registered(backend: str, op: str) -> Callable | None:
    """The kernel `register` gave `op` on `backend`, or None (the reference runs)."""
    _load_backend(backend)
    return _TABLE.get((backend, op))


def backend() -> str:
    """'cuda', 'metal' or 'cpu': where kernels run for `mx.default_device()`."""
    if mx.default_device().type != mx.gpu:
        return "cpu"
    return _gpu_backend()


@functools.cache
def _gpu_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def _load_backend(name: str) -> None:
    """Import kernels/<name>.py once; it registers what it implements."""
    if name in _LOADED:
        return
    _LOADED.add(name)
    module = f"turboquant.kernels.{name}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # a backend that exists but cannot import is a real error
            raise


# backends whose kernels compute inside the call (numba on numpy views) instead of adding a
# node to MLX's graph: under `graph_only` they give way to the reference, whose result
# MLX computes only if something evaluates it
EAGER_BACKENDS = ("cpu",)


class _GraphOnly(threading.local):
    on = False  # each thread starts outside `graph_only`


_GRAPH_ONLY = _GraphOnly()


@contextlib.contextmanager
def graph_only():
    """While inside (this thread), `get` hands out only kernels that are nodes of MLX's
    graph: for a result that may never be evaluated, such as a prefill chunk's logits
    (mlx-lm evaluates only the cache), which an eager kernel would compute at once."""
    before = _GRAPH_ONLY.on
    _GRAPH_ONLY.on = True
    try:
        yield
    finally:
        _GRAPH_ONLY.on = before


def get(op: str, device_backend: str | None = None) -> Callable:
    """The kernel for `op` on the current (or given) backend, else the reference."""
    name = _backend_for(op, device_backend)
    if name is None:
        return _REFERENCE[op]
    wrapped = _WRAPPED.get((name, op))
    if wrapped is None:
        fn = _TABLE.get((name, op))
        if fn is None:
            return _REFERENCE[op]
        wrapped = _WRAPPED[(name, op)] = _with_fallback(fn, _REFERENCE[op])
    return wrapped


def _backend_for(op: str, device_backend: str | None) -> str | None:
    """`get`'s and `get_for`'s prologue: the backend whose kernels may serve `op`, loaded;
    None where the reference must run (an eager backend while a graph is being built)."""
    if op not in _REFERENCE:
        raise ValueError(f"unknown kernel op {op!r}: one of {ops()}")
    name = device_backend or backend()
    if name in EAGER_BACKENDS and _GRAPH_ONLY.on:
        return None
    _load_backend(name)
    return name


def _with_fallback(fn: Callable, ref: Callable) -> Callable:
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            # `after` orders a kernel's launch (MLX's CUDA graphs); the reference's
            # operations are ordered by their data
            kwargs.pop("after", None)
            return ref(*args, **kwargs)

    # the kernel's attributes too (`supports`, `stores_in_place`): callers ask them of
    # what `get` returns (until 2026-12-04 the whole step never saw `stores_in_place`)
    return functools.update_wrapper(call, fn)


def describe() -> dict[str, str]:
    """op -> 'backend' or 'reference' for the current device (for logs and docs)."""
    name = backend()
    _load_backend(name)
    return {op: (name if (name, op) in _TABLE else "reference") for op in _REFERENCE}


# ---------------------------------------------------------------------------- entry points


def tq_linear(x_rot, codes, scales, bits, group_size, out_features, padded_in):
    """x_rot (..., padded_in) -> (..., out_features): GEMV for few tokens, else GEMM."""
    tokens = x_rot.size // max(1, x_rot.shape[-1])
    op = "matvec" if tokens <= MATVEC_MAX_TOKENS else "matmul"
    return get_for(op, bits)(x_rot, codes, scales, bits, group_size, out_features, padded_in)


def tq_gather(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, **kw):
    """Gathered experts, like `mx.gather_mm`; see `reference.tq_gather_matmul`. The result
    is in `out_dtype` when given, whether or not the backend's kernel writes it."""
    fn = get_for("gather_matmul", bits)
    y = fn(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, **kw)
    out_dtype = kw.get("out_dtype")
    return y if out_dtype is None else y.astype(out_dtype)  # no op where already so


def binder_of(fn: Callable, name: str) -> Callable | None:
    """The binding a backend's kernel offers as its attribute `name` (seen through the
    fallback wrapper `get` puts around it), or None."""
    return getattr(getattr(fn, "__wrapped__", fn), name, None)


def bind_gather(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in,
                **kw) -> Callable:
    """`tq_gather` for arguments of these shapes and dtypes and these keywords, as
    f(x_rot, codes, scales, indices): the kernel is chosen here, once, so a decode step's
    switch layers pay little more than the launch every token. A backend's kernel may
    offer a `bind` of its own (CUDA's: the launch and pair arrays settled per shape);
    otherwise f calls the kernel as `tq_gather` would. Callers key what they keep on the
    arguments' shapes and dtypes, the device's type and `GENERATION`."""
    fn = get_for("gather_matmul", bits)
    binder = binder_of(fn, "bind")
    if binder is not None:
        try:
            return binder(x_rot, codes, scales, indices, bits, group_size, out_features,
                          padded_in, **kw)
        except NotImplementedError:  # the kernel does not cover these: it falls back per call
            pass
    out_dtype = kw.get("out_dtype")

    def run(x_rot, codes, scales, indices):
        y = fn(x_rot, codes, scales, indices, bits, group_size, out_features, padded_in, **kw)
        return y if out_dtype is None else y.astype(out_dtype)

    return run


def bind_gather_unrotated(x, codes, scales, indices, bits, group_size, out_features,
                          padded_in, *, seed: int, **kw) -> Callable | None:
    """`bind_gather` for the *unrotated* x, rotated with `seed` in the same launch, as
    f(x, codes, scales, indices); None where the backend's kernel has no such binding or
    does not cover these arguments (the caller rotates and calls `bind_gather`)."""
    binder = binder_of(get_for("gather_matmul", bits), "bind_unrotated")
    if binder is None:
        return None
    try:
        return binder(x, codes, scales, indices, bits, group_size, out_features, padded_in,
                      seed=seed, **kw)
    except NotImplementedError:
        return None


def tq_embed(ids, codes, scales, bits, group_size, padded_in):
    """Decoded rotated rows for token ids, (..., padded_in) float32."""
    return get_for("embedding", bits)(ids, codes, scales, bits, group_size, padded_in)

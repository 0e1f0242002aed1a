"""Expert streaming: run a Mixture-of-Experts model whose experts do not fit in memory.

    model, tokenizer = load("out/big-moe-tq4", expert_budget="25%")   # or "8GB", bytes
    ...generate...
    print(expert_stats(model).summary())

Each expert layer (mlx-lm's SwitchGLU, holding the gate/up/down TQSwitchLinear) becomes a
`StreamedExperts`. Per forward pass it

1. evaluates the router's indices (a sync point) and takes the unique experts they name;
2. asks the `ExpertCache` (runtime/experts_cache.py) for a slot per expert: hits cost
   nothing, misses are read from disk with one positioned read each into preallocated
   slot memory, evicting the least recently used unpinned experts;
3. runs the original SwitchGLU forward with the indices renamed to slot numbers, on the
   cache's slot pools, through `TQSwitchLinear.apply_experts` (the resident layer's own
   kernel call), so each expert sees the same rows and the same values as in the fully
   loaded model: the output is bit-identical;
4. evaluates its output, so no pending computation holds a slot when it is refilled.

When one step needs more experts than the budget holds (a long prompt at a small budget),
the experts are processed in chunks that fit: for each chunk, pairs routed elsewhere point
at an all-zero "other" slot (so every kernel call has the same pairs, shapes and
per-expert rows as the resident one), and the chunk's rows are selected into the result.
That costs one pass over the layer's tokens per chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .experts_cache import (
    Blob,
    ExpertBudgetError,
    ExpertCache,
    ExpertReadError,
    ExpertStats,
    Group,
    Layout,
    Part,
    fmt_bytes,
    minimum_budget,
    parse_budget,
    read_pins,
    segments_of,
)
from .layers import _SwitchBase
from .repo import Repo, RepoError, Row

log = logging.getLogger(__name__)

_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "experts_per_token", "n_activated_experts")
_CONFIG_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


@dataclass
class StreamingOptions:
    budget: object  # bytes, "2GB", "25%"
    pin: object = None  # JSON path or [[layer, expert], ...]
    prefetch: bool = False
    threads: int = 4


# ---------------------------------------------------------------------------- modules


class StreamedSwitchLinear(_SwitchBase):
    """A TQSwitchLinear whose experts live in the ExpertCache: spec and bias only.

    Its StreamedExperts calls `apply_experts` (TQSwitchLinear's) with the cache's slot
    pool per forward.
    """

    def __init__(self, input_dims, output_dims, num_experts, bias=False, *, bits=4,
                 group_size=64, seed=0, padded_in=None):
        super().__init__()
        self._set_spec(input_dims, output_dims, bits, group_size, seed, padded_in)
        self.num_experts = int(num_experts)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a streamed expert layer runs through its StreamedExperts module")

    def _extra_repr(self) -> str:
        return super()._extra_repr() + f", num_experts={self.num_experts}, streamed"


class _Bound:
    """One streamed projection bound to this step's slot pool."""

    def __init__(self, layer: StreamedSwitchLinear, codes, scales, slot_expert):
        self.layer, self.codes, self.scales, self.slot_expert = layer, codes, scales, slot_expert

    def __call__(self, x, indices, sorted_indices=False):
        bias = None
        if "bias" in self.layer:  # rows of the experts the slots hold: the resident values
            bias = self.layer["bias"][self.slot_expert[indices]]
        return self.layer.apply_experts(
            x, indices, self.codes, self.scales, sorted_indices=sorted_indices, bias=bias
        )


class _View:
    """`self` for the original SwitchGLU forward: bound projections, the rest as is."""

    def __init__(self, module: "StreamedExperts", bound: dict):
        self.__dict__["_bound"] = bound
        self.__dict__["_module"] = module

    def __getattr__(self, name):
        bound = self.__dict__["_bound"]
        if name in bound:
            return bound[name]
        module = self.__dict__["_module"]
        try:
            return getattr(module, name)
        except AttributeError:
            return getattr(module._original, name)


class StreamedExperts(nn.Module):
    """A SwitchGLU (or SwitchMLP) whose experts are read from disk on demand."""

    def __init__(self, original: nn.Module, projections: dict[str, StreamedSwitchLinear],
                 gid: int, layer: int, num_experts: int):
        super().__init__()
        for k, v in original.items():
            if k not in projections:
                self[k] = v
        for k, v in projections.items():
            self[k] = v
            if k in original:
                del original[k]  # the placeholder SwitchLinear and its (lazy) weights
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_forward", type(original).__call__)
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_next", None)  # (StreamedExperts, router) for prefetch
        object.__setattr__(self, "projections", tuple(projections))
        self.gid = gid
        self.layer = layer
        self.num_experts = num_experts

    def _extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, streamed"

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        cache: ExpertCache = self._cache
        if cache is None:
            raise RuntimeError("streamed experts without an expert cache")
        mx.eval(indices)  # the sync point: which experts this step needs
        idx = np.array(indices)
        chunks = cache.plan(self.gid, np.unique(idx).tolist())
        pool = cache.pool_of(self.gid)
        y = None
        for i, chunk in enumerate(chunks):
            slots = cache.acquire(self.gid, chunk)
            try:
                lut = np.full(self.num_experts, pool.dummy, dtype=np.int64)
                lut[chunk] = slots
                renamed = mx.array(lut[idx].astype(np.uint32)).astype(indices.dtype)
                if i == 0 and self._next is not None:
                    self._prefetch_next(x)
                out = self._forward(_View(self, self._bind(pool)), x, renamed)
                if len(chunks) > 1:
                    mask = mx.array(np.isin(idx, chunk))[..., None]
                    out = out if y is None else mx.where(mask, out, y)
                y = out
                mx.eval(y)  # nothing may hold a slot once it is released
            finally:
                cache.release(self.gid)
        return y

    def _bind(self, pool) -> dict:
        slot_expert = mx.array(pool.slot_expert)
        return {
            name: _Bound(self[name], pool.arrays[(name, "codes")],
                         pool.arrays[(name, "scales")], slot_expert)
            for name in self.projections
        }

    def _prefetch_next(self, x: mx.array) -> None:
        """Start reading the next layer's likely experts: its router on this layer's input."""
        nxt, router, top_k = self._next
        last = x.reshape(-1, x.shape[-1])[-1:][None]  # (1, 1, hidden): the latest token
        try:
            out = router(last)
        except Exception as e:  # noqa: BLE001 - a prediction only
            log.debug("prefetch: router of layer %d failed: %s", nxt.layer, e)
            object.__setattr__(self, "_next", None)
            return
        if isinstance(out, (tuple, list)):  # a gate module that returns (indices, scores)
            ints = [o for o in out
                    if isinstance(o, mx.array) and not mx.issubdtype(o.dtype, mx.floating)]
            if not ints:
                return
            experts = np.unique(np.array(ints[0])).tolist()
        else:
            logits = np.array(out.astype(mx.float32)).reshape(-1)
            experts = np.argsort(-logits, kind="stable")[:top_k].tolist()
        self._cache.prefetch(nxt.gid, sorted(experts))


# ---------------------------------------------------------------------------- loading


@dataclass
class StreamPlan:
    """What load_model streams: the expert layers (groups) and the cache's budget."""

    groups: list[Group]
    paths: list[str]  # per group: the SwitchGLU module path
    projections: list[dict[str, str]]  # per group: projection name -> switch layer path
    budget: int
    options: StreamingOptions

    @property
    def switch_paths(self) -> set[str]:
        return {p for proj in self.projections for p in proj.values()}


def plan_streaming(repo: Repo, model: nn.Module, tq: dict[str, list[Row]],
                   kinds: dict[str, str], options: StreamingOptions) -> StreamPlan:
    """Group the quantized expert layers by their SwitchGLU, lay out each expert's bytes
    from the shard headers, and check the budget, before any tensor is read."""
    switch = sorted(p for p, k in kinds.items() if k == "switch")
    if not switch:
        raise ExpertBudgetError(
            f"{repo.path}: --expert-budget: the model has no quantized expert layers to stream"
        )
    modules = dict(model.named_modules())
    by_parent: dict[str, dict[str, str]] = {}
    for path in switch:
        parent, _, name = path.rpartition(".")
        by_parent.setdefault(parent, {})[name] = path
    starts = {shard: _data_start(repo.path / shard) for shard in repo.headers}
    groups, paths, projections = [], [], []
    for parent, projs in sorted(by_parent.items(), key=lambda kv: _layer_sort_key(kv, tq)):
        rows = {name: tq[path] for name, path in projs.items()}
        n = {len(r) for r in rows.values()}
        if len(n) != 1:
            raise RepoError(f"{repo.path}: the projections of {parent} differ in expert count")
        blobs, layouts = [], set()
        for i in range(n.pop()):
            blob, layout = _blob(repo, parent, {name: r[i] for name, r in rows.items()}, starts)
            blobs.append(blob)
            layouts.add(layout)
        if len(layouts) != 1:
            raise RepoError(f"{repo.path}: experts of {parent} differ in shape")
        top_k = _top_k(modules, parent, repo.config)
        groups.append(Group(parent, layouts.pop(), blobs, top_k))
        paths.append(parent)
        projections.append(projs)
    total = sum(g.layout.nbytes * len(g.blobs) for g in groups)
    budget = parse_budget(options.budget, total)
    minimum = minimum_budget(groups)
    if budget < minimum:
        need: dict = {}  # layout -> experts one token needs at once (minimum_budget's sum)
        for g in groups:
            need[g.layout] = max(need.get(g.layout, 0), g.top_k)
        per = " + ".join(f"{k} x {fmt_bytes(lay.nbytes)}" for lay, k in need.items())
        kinds = "" if len(need) == 1 else f", for each of the {len(need)} expert sizes"
        raise ExpertBudgetError(
            f"expert budget {fmt_bytes(budget)} is too small for {repo.path.name}: one token "
            f"needs the experts it routes to in one layer in memory at once{kinds} ({per}), so "
            f"the minimum is {fmt_bytes(minimum)} ({minimum} bytes, "
            f"{100 * minimum / total:.1f}% of the {fmt_bytes(total)} of experts)"
        )
    return StreamPlan(groups, paths, projections, budget, options)


def _layer_sort_key(item, tq):
    parent, projs = item
    row = tq[next(iter(projs.values()))][0]
    return (row.layer if row.layer is not None else 1 << 30, parent)


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _blob(repo: Repo, parent: str, rows: dict[str, Row], starts: dict) -> tuple[Blob, Layout]:
    keys = {(r.layer, r.expert) for r in rows.values()}
    if len(keys) != 1 or None in next(iter(keys)):
        names = ", ".join(r.name for r in rows.values())
        raise RepoError(
            f"{repo.path}: {names} in {parent} do not name one (layer, expert) in the "
            "manifest; expert streaming needs the manifest's layer and expert columns"
        )
    layer, expert = keys.pop()
    parts, arrays = [], []
    stored = (("codes", "tq_codes", "uint32"), ("scales", "tq_scales", "float16"))
    for name, r in sorted(rows.items()):
        for kind, suffix, dtype in stored:
            tensor = f"{r.base}.{suffix}"
            meta = repo.headers[r.shard][tensor]
            a, b = meta["data_offsets"]
            shape = tuple(meta["shape"])
            if np.dtype(dtype).itemsize * int(np.prod(shape)) != b - a:
                raise RepoError(f"{repo.path}/{r.shard}: {tensor} has {b - a} bytes for {shape}")
            start = starts[r.shard] + a
            parts.append((r.shard, Part((name, kind), start, start + b - a)))
            arrays.append(((name, kind), shape, dtype))
    return Blob(layer, expert, segments_of(parts)), Layout(tuple(sorted(arrays)))


def _top_k(modules: dict, parent: str, config: dict) -> int:
    block = modules.get(parent.rpartition(".")[0])
    for obj in (block, getattr(block, "gate", None), getattr(block, "router", None)):
        for attr in _TOP_K_ATTRS:
            v = getattr(obj, attr, None) if obj is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    for source in (config, config.get("text_config") or {}):
        for key in _CONFIG_TOP_K:
            v = source.get(key)
            if isinstance(v, int) and v > 0:
                return v
    return 1


def wrap_modules(model: nn.Module, plan: StreamPlan, set_module) -> list[StreamedExperts]:
    """Replace each streamed SwitchGLU by a StreamedExperts (after the projections were
    swapped for StreamedSwitchLinear)."""
    modules = dict(model.named_modules())
    wrapped = []
    for gid, (path, projs, group) in enumerate(zip(plan.paths, plan.projections, plan.groups)):
        original = modules[path]
        layers = {name: modules[p] for name, p in projs.items()}
        layer = group.blobs[0].layer
        new = StreamedExperts(original, layers, gid, layer, len(group.blobs))
        set_module(model, path, new)
        wrapped.append(new)
    return wrapped


def start_cache(model: nn.Module, repo: Repo, plan: StreamPlan,
                wrapped: list[StreamedExperts]) -> ExpertCache:
    """Allocate the cache, hand it to the streamed layers, pin, and wire prefetch."""
    opts = plan.options
    cache = ExpertCache(repo.path, plan.groups, plan.budget, threads=opts.threads)
    for w in wrapped:
        object.__setattr__(w, "_cache", cache)
    pins = read_pins(opts.pin)
    if pins:
        cache.pin(pins)
    if opts.prefetch:
        modules = dict(model.named_modules())
        for w, nxt in zip(wrapped, wrapped[1:]):
            block = modules.get(plan.paths[nxt.gid].rpartition(".")[0])
            router = next((getattr(block, a) for a in ("gate", "router")
                           if isinstance(getattr(block, a, None), nn.Module)), None)
            if router is not None:
                object.__setattr__(w, "_next", (nxt, router, plan.groups[nxt.gid].top_k))
    object.__setattr__(model, "_tq_expert_cache", cache)
    log.info(
        "expert streaming: %d layers, budget %s of %s (%d slots), %d pinned, prefetch %s",
        len(wrapped), fmt_bytes(plan.budget), fmt_bytes(cache.expert_bytes), cache.slots,
        len(pins), "on" if opts.prefetch else "off",
    )
    return cache


def expert_cache(model) -> ExpertCache | None:
    """The ExpertCache of a model loaded with an expert budget, else None."""
    return getattr(model, "_tq_expert_cache", None)


def expert_stats(model) -> ExpertStats | None:
    """Hit rate, bytes read and read throughput so far (None without streaming)."""
    cache = expert_cache(model)
    return cache.stats() if cache is not None else None


__all__ = [
    "ExpertBudgetError",
    "ExpertCache",
    "ExpertReadError",
    "ExpertStats",
    "StreamedExperts",
    "StreamedSwitchLinear",
    "StreamingOptions",
    "expert_cache",
    "expert_stats",
    "parse_budget",
]

"""Load a TurboQuant repo into mlx-lm's own architecture for its `model_type`.

1. Find and check the repo (`runtime.repo`): config, index, manifest, shard sizes.
2. Build mlx-lm's model for config.json, exactly as `mlx_lm.load` would.
3. Run the model's `sanitize` on the raw tensors plus a small integer stand-in for every
   quantized weight. Where the stand-ins land says which module each quantized tensor
   fills, and in which expert order (`experts.{e}.up_proj` -> `switch_mlp.up_proj`), for
   any architecture whose sanitize renames or stacks.
4. Swap those modules for TQLinear / TQSwitchLinear / TQEmbedding, then load every tensor
   strictly: a tensor the model has no place for, or a parameter no tensor fills, is an
   error naming it.

With an expert budget, the quantized expert layers become StreamedExperts instead
(runtime/experts.py): their codes and scales are not loaded but read per step into a
byte-budgeted cache (docs/expert-streaming.md).
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from turboquant import kernels

from .layers import TQEmbedding, TQLinear, TQSwitchLinear
from .repo import (TOKENIZER_OPTIONS, Repo, RepoError, Row, check_tokenizer_code, open_repo,
                   resolve)

log = logging.getLogger(__name__)

_TAG = 1 << 30  # stand-ins hold _TAG + row number, as int32
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_SOURCE_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


def load(path_or_repo_id, *, dtype=None, lazy: bool = False, revision: str | None = None,
         expert_budget=None, expert_pin=None, expert_prefetch: bool = False,
         expert_threads: int = 4, fuse: bool = True):
    """(model, tokenizer) for a TurboQuant repo: a local folder or a Hub repo id.

    `dtype` ("float32", "bfloat16", "float16" or an mx.Dtype) casts the tensors kept in
    16 bits and sets the activation dtype; by default they keep their stored dtype,
    except that a Mixture-of-Experts model on the CPU runs in float32 (MLX's CPU
    `gather_mm` supports nothing else). The model works with `mlx_lm.generate`.

    `expert_budget` (bytes, "2GB", "25%" of all experts) streams the quantized experts
    from disk through a cache of that size instead of loading them (docs/expert-streaming.md):
    `expert_pin` (a JSON file or [[layer, expert], ...]) keeps some resident,
    `expert_prefetch` reads the next layer's likely experts ahead, `expert_threads` reads
    in parallel. Outputs are bit-identical to the fully loaded model.

    `fuse` (default) lets the device's kernels run the linears that share an input as one
    call, and, on CUDA, a decoder block's norms and residuals inside them
    (runtime/fuse.py); `fuse=False` keeps every layer on its own (for comparisons).
    """
    from mlx_lm.utils import load_tokenizer

    path = resolve(path_or_repo_id, revision=revision)
    check_tokenizer_code(path)  # before the weights: a refused repo costs nothing
    model, config = load_model(
        path, dtype=dtype, lazy=lazy, expert_budget=expert_budget, expert_pin=expert_pin,
        expert_prefetch=expert_prefetch, expert_threads=expert_threads, fuse=fuse,
    )
    tokenizer = load_tokenizer(path, tokenizer_config_extra=dict(TOKENIZER_OPTIONS),
                               eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer


def load_model(path: str | Path, *, dtype=None, lazy: bool = False, expert_budget=None,
               expert_pin=None, expert_prefetch: bool = False, expert_threads: int = 4,
               fuse: bool = True):
    """(model, config) for a local TurboQuant repo folder (options as in `load`)."""
    repo = open_repo(Path(path))
    config = _config(repo)
    model = _build(config)
    plan = _plan(repo, model)
    target = _target_dtype(dtype, plan)
    stream = None
    if expert_budget is not None:  # checked before any tensor is read
        from .experts import StreamingOptions, plan_streaming

        options = StreamingOptions(expert_budget, expert_pin, expert_prefetch, expert_threads)
        stream = plan_streaming(repo, model, plan.tq, plan.kinds, options)
    streamed = stream.switch_paths if stream else set()
    _swap_modules(model, plan, target, streamed)
    wrapped = []
    if stream:
        from .experts import wrap_modules

        wrapped = wrap_modules(model, stream, _set_module)
    weights = _weights(repo, plan, target, streamed)
    _check_complete(model, weights, repo)
    del plan  # drop the per-expert arrays: once stacked, each expert is held only once
    model.load_weights(list(weights.items()), strict=True)
    del weights
    _drop_unit_scales(model)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    if stream:
        from .experts import start_cache

        start_cache(model, repo, stream, wrapped)
    groups = blocks = whole = 0
    # where a kernel runs q/k/v (gate/up) as one call: CUDA, and the CPU with numba
    if fuse and kernels.describe()["linear_group"] != "reference":
        from . import fuse as fusing

        groups = fusing.group_linears(model)
        if fusing.BLOCKS and kernels.backend() == "cuda":  # norms and adds in its kernels
            blocks = fusing.fuse_blocks(model)
            from . import whole_step

            # a token's step as one compiled call (TURBOQUANT_WHOLE_STEP=0: per layer)
            whole = whole_step.enable(model) if whole_step.WHOLE_STEP else 0
    for name, module in model.named_modules():  # a head's prefill logits: no eager kernel
        if isinstance(module, TQLinear) and name.rsplit(".", 1)[-1] == "lm_head":
            module.group().lazy = True
    tq_types = (TQLinear, TQSwitchLinear, TQEmbedding)
    layers = [m for _, m in model.named_modules() if isinstance(m, tq_types)]
    log.info(
        "loaded %s (%s): %d TurboQuant layers, %d of them expert layers, %d kernel groups, "
        "%d fused decoder blocks%s, dtype %s", repo.path, config.get("model_type"), len(layers),
        sum(isinstance(m, TQSwitchLinear) for m in layers), groups, blocks,
        " (decode step compiled whole)" if whole else "", target or "as stored",
    )
    return model, config


# ---------------------------------------------------------------------------- model


def _config(repo: Repo) -> dict:
    from mlx_lm.utils import load_config

    return load_config(repo.path)  # adds generation_config's eos_token_id, like mlx_lm


def model_classes(config: dict):
    """(Model, ModelArgs) from mlx-lm for config's model_type (mlx-lm's own lookup)."""
    try:
        from mlx_lm.utils import _get_classes

        return _get_classes(config)
    except ImportError:  # a future mlx-lm without the private helper
        from mlx_lm.utils import MODEL_REMAPPING

        model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
        try:
            arch = importlib.import_module(f"mlx_lm.models.{model_type}")
        except ImportError as e:
            raise RepoError(f"mlx-lm has no architecture for model_type {model_type!r}") from e
        return arch.Model, arch.ModelArgs


def _build(config: dict) -> nn.Module:
    if "model_type" not in config:
        raise RepoError("config.json has no model_type")
    try:
        model_class, args_class = model_classes(config)
    except ValueError as e:
        raise RepoError(f"config.json: {e} (mlx-lm has no architecture for it)") from e
    return model_class(args_class.from_dict(config))


# ---------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """What goes where: raw tensors after sanitize, and the modules TQ layers replace."""

    raw: dict[str, mx.array]  # model parameter name -> tensor (after sanitize)
    tq: dict[str, list[Row]]  # module path -> rows (one, or one per expert in order)
    kinds: dict[str, str]  # module path -> "linear" | "switch" | "embedding"
    moe: bool  # has expert layers (quantized or not)
    arrays: dict[str, dict[str, mx.array]]  # shard -> lazy tensors


def _open_shards(repo: Repo) -> dict[str, dict[str, mx.array]]:
    """Lazy arrays per shard: nothing is read until evaluated."""
    return {shard: mx.load(str(repo.path / shard)) for shard in repo.headers}


def _plan(repo: Repo, model: nn.Module) -> Plan:
    shards = _open_shards(repo)
    quantized = [r for r in repo.rows if r.quantized]
    weights = {r.name: shards[r.shard][r.name] for r in repo.rows if not r.quantized}
    stand_ins, alive = {}, []  # alive: ids stay unique only while the objects live
    for i, r in enumerate(quantized):
        if r.name in weights:
            raise RepoError(f"{repo.path}: tensor {r.name} is both raw and quantized")
        weights[r.name] = mx.array([[_TAG + i]], dtype=mx.int32)
        stand_ins[id(weights[r.name])] = i
        alive.append(weights[r.name])
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)

    raw: dict[str, mx.array] = {}
    tq: dict[str, list[Row]] = {}
    for key, v in weights.items():
        rows = _traced_rows(key, v, stand_ins, quantized)
        if rows is None:
            raw[key] = v
            continue
        if not key.endswith(".weight"):
            names = ", ".join(r.name for r in rows)
            raise RepoError(
                f"{repo.path}: {config_type(repo)}'s sanitize moved quantized {names} "
                f"to {key}, which is not a layer weight; the runtime cannot load it"
            )
        tq[key[: -len(".weight")]] = rows

    modules = dict(model.named_modules())
    params = dict(tree_flatten(model.parameters()))
    _stack_experts(raw, tq, modules, params)
    kinds = {}
    for path, rows in tq.items():
        kinds[path] = _kind(repo, path, rows, modules.get(path))
    moe = any(_is_switch(m) for m in modules.values())
    return Plan(raw=raw, tq=tq, kinds=kinds, moe=moe, arrays=shards)


_EXPERT = re.compile(
    r"^(?P<pre>.*)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\.(?P<kind>weight|bias)$"
)
_MIXTRAL_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _switch_candidates(pre: str, proj: str) -> list[str]:
    names = [proj] + ([_MIXTRAL_NAMES[proj]] if proj in _MIXTRAL_NAMES else [])
    return [f"{pre}.{hub}.{n}" for n in names for hub in ("switch_mlp", "experts")]


def _stack_experts(raw: dict, tq: dict, modules: dict, params: dict) -> None:
    """Stack per-expert tensors that sanitize left alone into the model's expert layers.

    Some sanitize functions stack nothing when the names already look split (gpt_oss
    returns early when it sees `gate_proj.weight`): `X.experts.E.proj` goes to
    `X.switch_mlp.proj` or `X.experts.proj`, whichever is an expert layer of E experts.
    """
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    leftovers = [k for k in raw if k not in params]
    leftovers += [f"{p}.weight" for p in tq if p not in modules]
    for key in leftovers:
        m = _EXPERT.match(key)
        if m:
            groups.setdefault((m["pre"], m["proj"], m["kind"]), {})[int(m["e"])] = key
    for (pre, proj, kind), members in groups.items():
        n = len(members)
        if sorted(members) != list(range(n)):
            continue  # a gap: leave them to be reported as unexpected
        for path in _switch_candidates(pre, proj):
            module = modules.get(path)
            if module is None or not _is_switch(module) or module.num_experts != n:
                continue
            keys = [members[e] for e in range(n)]
            if kind == "weight" and keys[0][: -len(".weight")] in tq:
                tq[path] = [tq.pop(k[: -len(".weight")])[0] for k in keys]
            elif f"{path}.{kind}" in params:
                raw[f"{path}.{kind}"] = mx.stack([raw.pop(k) for k in keys])
            break


def config_type(repo: Repo) -> str:
    return repo.config.get("model_type", "this model")


def _traced_rows(key, v, stand_ins, quantized) -> list[Row] | None:
    """The quantized rows a sanitized tensor stands for, in order, or None if it is raw."""
    if id(v) in stand_ins:
        i = stand_ins[id(v)]
        if v.dtype != mx.int32 or v.size != 1 or v.item() != _TAG + i:
            raise RepoError(
                f"sanitize changed the values of quantized {quantized[i].name} in place "
                f"(it folds a multiplier into {key}): convert that tensor raw (the generic "
                "recipe does)"
            )
        return [quantized[i]]
    if v.dtype != mx.int32 or v.size > 1 << 20:
        return None
    flat = v.reshape(-1).tolist()
    if not flat or min(flat) < _TAG:
        return None
    if v.shape[-2:] != (1, 1) or v.ndim > 3:
        names = ", ".join(quantized[i - _TAG].name for i in flat[:4])
        raise RepoError(
            f"sanitize combined quantized tensors ({names}, ...) into {key} with shape "
            f"{tuple(v.shape)}: only renaming and stacking experts can be loaded"
        )
    return [quantized[i - _TAG] for i in flat]


def _is_switch(m) -> bool:
    """mlx-lm's SwitchLinear (what SwitchGLU / SwitchMLP hold), unquantized."""
    from mlx_lm.models.switch_layers import SwitchLinear

    return isinstance(m, SwitchLinear)


def _kind(repo: Repo, path: str, rows: list[Row], module) -> str:
    names = rows[0].name if len(rows) == 1 else f"{rows[0].name} ... ({len(rows)} experts)"
    if module is None:
        raise RepoError(
            f"{repo.path}: unexpected tensor {names}: the {config_type(repo)} model has "
            f"no module {path}"
        )
    w = module.get("weight") if isinstance(module, nn.Module) else None
    shape = tuple(rows[0].shape)
    if _is_switch(module):
        want = tuple(w.shape)
        got = (len(rows), *shape)
        if want != got:
            raise RepoError(f"{repo.path}: {names} stack to {got}, {path} expects {want}")
        specs = {(r.bits, r.group_size, r.seed, r.padded_in, tuple(r.shape)) for r in rows}
        if len(specs) != 1:
            raise RepoError(
                f"{repo.path}: experts of {path} differ in bits/group size/seed/shape; "
                "one stacked layer needs one spec"
            )
        _check_in_scales(repo, path, rows, "switch")
        return "switch"
    if len(rows) != 1:
        raise RepoError(
            f"{repo.path}: {names} were stacked into {path}, which is not an expert layer"
        )
    # exact layer types: a custom module with a `weight` (a router, MultiLinear) has its
    # own forward that a quantized layer would silently change
    if isinstance(module, nn.Embedding):
        kind = "embedding"
    elif isinstance(module, nn.Linear):
        kind = "linear"
    else:
        raise RepoError(
            f"{repo.path}: quantized {names} maps to {path}, a {type(module).__name__}; "
            "only Linear, SwitchLinear and Embedding layers can be quantized"
        )
    if tuple(w.shape) != shape:
        raise RepoError(
            f"{repo.path}: {names} has shape {shape}, {path} expects {tuple(w.shape)}"
        )
    _check_in_scales(repo, path, rows, kind)
    return kind


def _check_in_scales(repo: Repo, path: str, rows: list[Row], kind: str) -> None:
    scaled = next((r.name for r in rows if r.in_scales), None)
    if scaled is not None and kind != "linear":
        raise RepoError(f"{repo.path}: tensor {scaled} has in_scales, which this runtime "
                        f"reads for Linear layers only, not {path} (a {kind} layer); convert "
                        "it with [quant] column_scales = \"off\"")


# ---------------------------------------------------------------------------- dtype


def _target_dtype(dtype, plan: Plan):
    if dtype is None:
        from turboquant.kernels import backend

        return mx.float32 if plan.moe and backend() == "cpu" else None
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return dtype


# ---------------------------------------------------------------------------- modules


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    *parents, last = path.split(".")
    parent = model
    for p in parents:
        parent = parent[int(p)] if isinstance(parent, list) else getattr(parent, p)
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        setattr(parent, last, new)


def _swap_modules(model: nn.Module, plan: Plan, dtype, streamed=frozenset()) -> None:
    modules = dict(model.named_modules())
    for path, rows in plan.tq.items():
        old, r, kind = modules[path], rows[0], plan.kinds[path]
        spec = dict(bits=r.bits, group_size=r.group_size, seed=r.seed, padded_in=r.padded_in)
        out, inp = r.shape
        if path in streamed:
            from .experts import StreamedSwitchLinear

            new = StreamedSwitchLinear(inp, out, len(rows), "bias" in old, **spec)
        elif kind == "switch":
            new = TQSwitchLinear(inp, out, len(rows), "bias" in old, **spec)
        elif kind == "linear":
            new = TQLinear(inp, out, "bias" in old, in_scales=r.in_scales, **spec)
        else:
            emb_dtype = dtype or _SOURCE_DTYPES.get(r.source_dtype, mx.float32)
            new = TQEmbedding(out, inp, dtype=emb_dtype, **spec)
        _set_module(model, path, new)


def _weights(repo: Repo, plan: Plan, dtype, streamed=frozenset()) -> dict[str, mx.array]:
    arrays = plan.arrays
    weights = {}
    for k, v in plan.raw.items():
        if dtype is not None and mx.issubdtype(v.dtype, mx.floating):
            v = v.astype(dtype)
        weights[k] = v
    for path, rows in plan.tq.items():
        if path in streamed:
            continue  # read per step by the expert cache
        codes = [arrays[r.shard][f"{r.base}.tq_codes"] for r in rows]
        scales = [arrays[r.shard][f"{r.base}.tq_scales"] for r in rows]
        if plan.kinds[path] == "switch":
            weights[f"{path}.codes"] = mx.stack(codes)
            weights[f"{path}.scales"] = mx.stack(scales)
        else:
            weights[f"{path}.codes"], weights[f"{path}.scales"] = codes[0], scales[0]
            if rows[0].in_scales:
                weights[f"{path}.in_scales"] = arrays[rows[0].shard][f"{rows[0].base}.tq_in_scales"]
    return weights


def _drop_unit_scales(model: nn.Module) -> None:
    """A layer whose in_scales are all 1 (no column was small: the converter stored ones)
    computes without them: the same values, no multiply."""
    for _, m in model.named_modules():
        if isinstance(m, TQLinear) and "in_scales" in m and bool(mx.all(m["in_scales"] == 1)):
            del m["in_scales"]


def _check_complete(model: nn.Module, weights: dict, repo: Repo) -> None:
    """Name the first missing or unexpected tensor before mlx's generic strict check."""
    params = dict(tree_flatten(model.parameters()))
    kind = config_type(repo)
    for names, what, why in (
        (set(weights) - set(params), "unexpected", f"the {kind} model has no such parameter"),
        (set(params) - set(weights), "missing",
         f"the {kind} model needs it and the repo does not have it"),
    ):
        if names:
            first, more = sorted(names)[0], len(names) - 1
            raise RepoError(f"{repo.path}: {what} tensor {first}"
                            + (f" (and {more} more)" if more else "") + f": {why}")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(params[k].shape):
            raise RepoError(
                f"{repo.path}: tensor {k} has shape {tuple(v.shape)}, the model expects "
                f"{tuple(params[k].shape)}"
            )

"""What each source tensor is, learned from mlx-lm's own model class for the config.

The generic recipe (manifests/recipes/default.toml) has no per-family rules: for a
checkpoint's config.json and tensor names and shapes, `derive` builds mlx-lm's model for
that `model_type` without weights (MLX arrays are lazy: a 1T-parameter skeleton costs
nothing until evaluated), runs the model's own `sanitize` on stand-ins, and sees where each
source tensor lands:

- alone or stacked with its sibling experts into the `weight` of a Linear, SwitchLinear or
  Embedding of the same shape, which mlx-lm's own predicate would quantize: coded, with a
  role (attention, mlp, expert, shared_expert, embeddings, lm_head) that the recipe's
  policy turns into bits;
- anywhere else (norms, biases, convolutions, SSM parameters, sinks, routers, tensors that
  sanitize transposes, splits or fuses): kept raw, and sanitize does its work on the real
  values at load time;
- removed by sanitize and past the last layer (multi-token-prediction layers) or a rotary
  buffer: dropped.

The runtime loader (runtime/loader.py) runs the same `sanitize` on the same stand-ins, so
what is coded here is what it can load.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from . import mlx_lm_models

_TAG = 1 << 30  # stand-ins hold _TAG + index, as int32 (the loader's convention)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"^(?P<pre>.*)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\.(?P<kind>weight|bias)$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ATTENTION = {"self_attn", "attention", "attn", "self_attention", "cross_attn", "mixer",
              "linear_attn", "temporal_block", "mamba", "ssm", "time_mixer", "token_mixer"}
_DOWN = {"down_proj", "w2", "fc2", "dense_4h_to_h", "c_proj", "out_proj", "wo", "proj_out"}
_ROUTERS = {"gate", "router", "shared_expert_gate", "gating", "router_proj", "expert_bias"}
_SHARED = ("shared_expert", "shared_experts", "shared_mlp")
# Source dtypes a lazy placeholder can take (FP8 and packed formats are read as bytes).
_MX_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float32",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "U16": "uint16", "U32": "uint32", "BOOL": "bool_"}
_CODABLE = ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2")
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
_STACKED_SCALE_SUFFIXES = ("_scale_inv", "_scale")  # X_scale_inv of stacked FP8 experts X


def _stacked_fp8(info) -> bool:
    return info is not None and len(info[0]) == 3 and info[1] in ("F8_E4M3", "F8_E5M2")


VANISHED = "not among the tensors mlx-lm's sanitize returns"
SCALES_WHY = "the FP8 scales of "


class ArchitectureError(ValueError):
    """mlx-lm has no class for the config, or its sanitize cannot read these tensors."""


@dataclass(frozen=True)
class Decision:
    action: str  # "quantize", "keep", "drop", or "unknown" (the model has no place for it)
    role: str | None = None
    down_proj: bool = False
    target: str | None = None  # the mlx-lm module a coded tensor fills
    why: str = ""
    split: str | None = None  # a stacked (E, out, in) tensor: each expert's name, "{e}"
    fused: tuple | None = None  # experts fused or turned: (part names "{e}", interleaved,
    #                             transposed)


@dataclass
class ArchitectureMap:
    """Per source tensor name: what it is. `digest` identifies the decisions (resume)."""

    model_type: str
    mlx_lm_version: str
    decisions: dict[str, Decision] = field(default_factory=dict)

    def digest(self) -> str:
        """Over the decisions that shape the output: a published weight's scales are read
        with it and leave no trace, so FP8 and its float32 copy have one digest."""
        blob = json.dumps({k: [d.action, d.role, d.down_proj, d.target]
                           for k, d in sorted(self.decisions.items())
                           if not d.why.startswith(SCALES_WHY)},
                          separators=(",", ":"))
        return hashlib.sha256(f"{self.model_type}/{blob}".encode()).hexdigest()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.decisions.values():
            out[d.action] = out.get(d.action, 0) + 1
        return out


# ---------------------------------------------------------------------------- mlx-lm


def model_module(config: dict):
    """mlx-lm's module for config's model_type (its own lookup), or ArchitectureError."""
    model_type = config.get("model_type")
    if not model_type:
        raise ArchitectureError("config.json has no model_type")
    try:  # the model's own module, without mlx-lm's package __init__ (transformers)
        return mlx_lm_models.model_module(config)
    except (ImportError, ValueError) as e:
        raise ArchitectureError(
            f"unknown architecture model_type={model_type!r}: mlx-lm has no model for it ({e})"
        ) from None


def supports(model_type: str | None) -> bool:
    """Whether mlx-lm has a text model for `model_type`."""
    try:
        model_module({"model_type": model_type})
        return True
    except ArchitectureError:
        return False


def build_skeleton(config: dict):
    """mlx-lm's model for `config`, with lazy (never evaluated) parameters."""
    mod = model_module(config)
    try:
        return mod.Model(mod.ModelArgs.from_dict(config))
    except Exception as e:  # mlx-lm's constructors raise anything on a config they lack
        raise ArchitectureError(
            f"config.json: mlx-lm's {mod.__name__.rsplit('.', 1)[-1]} model cannot be built "
            f"from this config ({type(e).__name__}: {e})"
        ) from None


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------------- derive


def derive(config: dict, tensors: dict[str, tuple[tuple[int, ...], str]],
           where: str = "config.json", split_stacked: bool = True) -> ArchitectureMap:
    """Decide every source tensor from mlx-lm's skeleton for `config`.

    `tensors` maps a source name to (shape, safetensors dtype). Nothing is read or
    evaluated: stand-ins are 1x1 int32 tags, and the other tensors lazy zeros.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = build_skeleton(config)
    modules = dict(model.named_modules())
    params = {k for k, _ in tree_flatten(model.parameters())}
    predicate = getattr(model, "quant_predicate", None)
    num_layers = num_layers_of(config)

    # FP8 scales belong to their weight: it is dequantized in the stream, then coded
    scales = {n: f"{n.rsplit('.', 1)[0]}.weight" for n in tensors
              if n.endswith(_SCALE_SUFFIXES) and f"{n.rsplit('.', 1)[0]}.weight" in tensors}
    scales.update({n: n.rsplit("_", 1 + n.endswith("_inv"))[0] for n in tensors
                   if n.endswith(_STACKED_SCALE_SUFFIXES) and n not in scales
                   and _stacked_fp8(tensors.get(n.rsplit("_", 1 + n.endswith("_inv"))[0]))})
    tensors = {n: v for n, v in tensors.items() if n not in scales}
    candidates = [n for n, (shape, dtype) in tensors.items()
                  if len(shape) == 2 and dtype in _CODABLE and 0 not in shape]
    demoted: set[str] = set()
    unreadable: set[str] = set()  # sanitize cannot take their stand-ins (reshapes them)
    for _ in range(4):  # demote what lands nowhere codable, until sanitize agrees
        coded = [n for n in candidates if n not in demoted]
        out, traced, placeholders = _sanitized(model, tensors, coded, where, demoted,
                                               unreadable)
        landed = _landed(out, traced, modules, params)
        again = set()
        coded = [n for n in coded if n not in demoted]  # sanitize may have demoted groups
        stacked: dict[str, int] = {}
        for p in landed.values():
            stacked[p] = stacked.get(p, 0) + 1
        verdicts: dict[tuple, bool] = {}
        for name in coded:
            target = landed.get(name)
            if target is None:
                again.add(name)
                continue
            key = (target, tensors[name][0])
            if key not in verdicts:
                verdicts[key] = _codable(target, modules, predicate, key[1], stacked[target])
            if not verdicts[key]:
                again.add(name)
        if not again:
            break
        demoted |= again
    else:
        raise ArchitectureError(f"{where}: the {config.get('model_type')} model's sanitize does "
                                "not settle on a set of codable tensors")

    present = _present_ids(out)
    decisions: dict[str, Decision] = {}
    for name in tensors:
        if name in landed and name not in demoted:
            path = landed[name]
            role = _role(path, modules[path])
            down = role in ("mlp", "expert", "shared_expert") and \
                path.rsplit(".", 1)[-1] in _DOWN
            decisions[name] = Decision("quantize", role, down, path)
            continue
        layer = layer_of(name)
        vanished = name not in out and id(placeholders.get(name)) not in present
        if vanished and (name.endswith("rotary_emb.inv_freq") or
                         (layer is not None and num_layers is not None and layer >= num_layers)):
            decisions[name] = Decision("drop", why="removed by mlx-lm's sanitize")
        elif name in out and name not in params and out[name] is placeholders.get(name):
            # left as it is by sanitize, and no parameter of the model: a strict load fails
            decisions[name] = Decision("unknown", why="mlx-lm's model has no parameter for it")
        elif name in unreadable:
            decisions[name] = Decision("keep", why="mlx-lm's sanitize reshapes or combines it")
        elif vanished:  # removed, or consumed into another tensor: kept, sanitize decides
            decisions[name] = Decision("keep", why=VANISHED)
        else:
            decisions[name] = Decision("keep", why=_why_raw(name, tensors[name]))
    if split_stacked:
        stacked = _stacked_plans(tensors, decisions, out, modules, placeholders)
        fused = _fused_plans(model, tensors, decisions, modules)
        if stacked or fused:
            _verify_splits(config, tensors, decisions, where, stacked, fused)
    for n, owner in scales.items():
        decisions[n] = Decision("drop", why=f"{SCALES_WHY}{owner}, applied when it is "
                                            "dequantized")
    return ArchitectureMap(config.get("model_type"), _mlx_lm_version(), decisions)


def _stacked_plans(tensors, decisions, out, modules, placeholders) -> dict:
    """Experts stacked in the source (E, out, in), as mlx-lm's own layout keeps them.

    A raw 3-D tensor that sanitize leaves in place as a SwitchLinear's weight is coded one
    expert at a time, written as `<block>.experts.{e}.<proj>.weight`: the names of the
    published layout, which sanitize (or the loader) stacks again. A second reading of
    those names must put every expert back in the same layer, or the tensor stays raw.
    """
    where_is = {id(v): k for k, v in out.items() if k != "\0alive"}
    plans = {}
    for name, (shape, dtype) in tensors.items():
        if decisions[name].action != "keep" or len(shape) != 3 or dtype not in _CODABLE:
            continue
        key = where_is.get(id(placeholders.get(name)))
        if key is None or not key.endswith(".weight"):
            continue
        path = key[: -len(".weight")]
        m = modules.get(path)
        if m is None or not _is_switch(m) or tuple(m["weight"].shape) != tuple(shape):
            continue
        block, _, proj = path.rpartition(".")
        block = block.rpartition(".")[0]  # drop switch_mlp / experts
        plans[name] = (path, f"{block}.experts.{{e}}.{proj}.weight", shape)
    return plans


_FUSED_TAG = 1 << 29
_FUSED_ROWS = 4  # a fused stand-in is 4 x 4: how sanitize cuts and turns it says the layout


def _fused_plans(model, tensors, decisions, modules) -> dict:
    """Experts fused or turned in one stacked tensor, which sanitize cuts (and transposes)
    into SwitchLinear weights: Qwen3.5-MoE's `experts.gate_up_proj` (E, 2 x I, H), Llama 4's
    (E, H, 2 x I) and `down_proj` (E, I, H), Granite-MoE's `input_linear` (E, 2 x I, H).
    Each such raw tensor is a (1, 4, 4) integer stand-in (one tag per row and column) that
    sanitize cuts as it would the real one: where the rows and columns land says which part
    goes to which layer, contiguous or interleaved, transposed or not. The parts are then
    coded per expert as `<block>.experts.{e}.<proj>.weight`, after a second reading of
    those names puts every expert back in the same layer.
    """
    import mlx.core as mx

    counts = {m.num_experts for m in modules.values() if _is_switch(m)}
    fused = [n for n, (shape, dtype) in tensors.items()
             if decisions[n].action == "keep" and len(shape) == 3 and dtype in _CODABLE
             and not decisions[n].split and shape[0] in counts]
    if not fused:
        return {}
    n_tags = _FUSED_ROWS * _FUSED_ROWS
    weights, alive = {}, []
    for i, n in enumerate(fused):
        v = mx.array([[[_FUSED_TAG + n_tags * i + _FUSED_ROWS * r + c for c in range(_FUSED_ROWS)]
                       for r in range(_FUSED_ROWS)]], dtype=mx.int32)
        weights[n] = v
        alive.append(v)
    for n, (shape, dtype) in tensors.items():
        if n not in weights:
            weights[n] = mx.zeros(shape, getattr(mx, _MX_DTYPES.get(dtype, "uint8")))
    try:
        out = model.sanitize(weights)
    except Exception:
        return {}  # sanitize needs their real shapes: they stay raw
    parts: dict[str, list[tuple[tuple, str, bool]]] = {}
    for key, v in out.items():
        if not isinstance(v, mx.array) or v.dtype != mx.int32 or v.ndim != 3 or v.size > 64:
            continue
        if v.shape[0] != 1 or v.shape[2] != _FUSED_ROWS or not key.endswith(".weight"):
            continue
        tags = [[t - _FUSED_TAG for t in row] for row in v[0].tolist()]
        if min(min(r) for r in tags) < 0 or max(max(r) for r in tags) >= n_tags * len(fused):
            continue
        src = {t // n_tags for row in tags for t in row}
        path = key[: -len(".weight")]
        if len(src) != 1 or path not in modules or not _is_switch(modules[path]):
            continue
        rc = [[divmod(t % n_tags, _FUSED_ROWS) for t in row] for row in tags]
        if all(c == k for row in rc for k, (_, c) in enumerate(row)):  # rows cut, as stored
            got = (tuple(row[0][0] for row in rc), path, False)
        elif all(r == k for row in rc for k, (r, _) in enumerate(row)):  # turned: (in, out)
            got = (tuple(row[0][1] for row in rc), path, True)
        else:
            continue
        parts.setdefault(fused[src.pop()], []).append(got)
    plans = {}
    for name, got in parts.items():
        got.sort()
        k = len(got)
        contiguous = [tuple(range(j * _FUSED_ROWS // k, (j + 1) * _FUSED_ROWS // k))
                      for j in range(k)]
        interleaved = [tuple(range(j, _FUSED_ROWS, k)) for j in range(k)]
        rows = [r for r, _, _ in got]
        turned = {t for _, _, t in got}
        if len(turned) != 1 or rows not in (contiguous, interleaved) or (k < 2 and not any(turned)):
            continue
        block = _expert_block(name)
        into = tuple(f"{block}{{e}}.{p.rsplit('.', 1)[-1]}.weight" for _, p, _ in got)
        plans[name] = (into, rows == interleaved and rows != contiguous, [p for _, p, _ in got],
                       turned.pop())
    return plans


def _expert_block(name: str) -> str:
    """`<block>.experts.` of a stacked source tensor: its own `.experts.` if it has one
    (Qwen3.5, Llama 4), else its module's parent (Granite's `block_sparse_moe.input_linear`)."""
    i = name.rfind(".experts.")
    if i >= 0:
        return name[: i + len(".experts.")]
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return base.rsplit(".", 1)[0] + ".experts."


def _verify_splits(config, tensors, decisions, where, stacked: dict, fused: dict) -> None:
    """Read the per-expert names once more: a split is kept only if every expert lands back
    in the same layer (as the loader will stack them); otherwise the tensor stays raw."""
    split = {n: v for n, v in tensors.items() if n not in stacked and n not in fused}
    expected: dict[str, dict[str, str]] = {}  # source -> {per-expert name: layer}
    for name, (path, template, (e_count, o, i)) in stacked.items():
        expected[name] = {template.format(e=e): path for e in range(e_count)}
        for n in expected[name]:
            split[n] = ((o, i), tensors[name][1])
    for name, (into, _, paths, turned) in fused.items():
        e_count, o, i = tensors[name][0]
        expected[name] = {part.format(e=e): path for e in range(e_count)
                          for part, path in zip(into, paths)}
        for n in expected[name]:
            split[n] = ((i // len(into), o) if turned else (o // len(into), i),
                        tensors[name][1])
    try:
        again = derive(config, split, where, split_stacked=False).decisions
    except ArchitectureError:
        return  # sanitize cannot read them per expert: they stay raw
    coded = {name for name, each in expected.items()
             if all(again.get(n) is not None and again[n].action == "quantize"
                    and again[n].target == path for n, path in each.items())}
    blocks = {_expert_block(n) for n in coded}
    for name, each in expected.items():
        if name not in coded:
            if name in stacked and _expert_block(stacked[name][1]) in blocks:
                # a sibling is split, so sanitize no longer sees the fused layout and would
                # leave this one unread: raw too, but per expert (the loader stacks them)
                why = "mlx-lm keeps it unquantized; raw, per expert beside its coded siblings"
                decisions[name] = Decision("keep", why=why, split=stacked[name][1])
                for n in each:
                    decisions[n] = Decision("keep", why=why)
            continue
        d = again[next(iter(each))]
        if name in stacked:
            path, template, _ = stacked[name]
            decisions[name] = Decision("quantize", d.role, d.down_proj, path, split=template)
        else:
            into, inter, paths, turned = fused[name]
            decisions[name] = Decision("quantize", d.role, d.down_proj, paths[0],
                                       fused=(into, inter, turned))
        for n in each:
            decisions[n] = again[n]


def _sanitized(model, tensors, coded, where, demoted, unreadable):
    """Run sanitize on stand-ins for `coded` and lazy zeros for the rest.

    If sanitize cannot read the stand-ins, whole groups of similar tensors are demoted to
    raw (their real shapes) until it can: the loader would fail the same way on them.
    """
    import mlx.core as mx

    groups: dict[str, list[str]] = {}
    for n in coded:
        groups.setdefault(_group_key(n), []).append(n)
    tried: list[set[str]] = [set()] + [set(g) for g in groups.values()] + [set(coded)]
    first_error = None
    for drop in tried:
        use = [n for n in coded if n not in drop]
        weights, stand_ins = {}, {}
        placeholders = {}  # source name -> its lazy zeros (identity tracing of raws)
        for i, n in enumerate(use):
            weights[n] = mx.array([[_TAG + i]], dtype=mx.int32)
            stand_ins[id(weights[n])] = n
        keep_alive = list(weights.values())
        for n, (shape, dtype) in tensors.items():
            if n not in weights:
                weights[n] = mx.zeros(shape, getattr(mx, _MX_DTYPES.get(dtype, "uint8")))
                placeholders[n] = weights[n]
        try:
            out = model.sanitize(weights) if hasattr(model, "sanitize") else weights
        except Exception as e:  # mlx-lm's sanitize functions raise anything
            first_error = first_error or e
            continue
        demoted |= drop
        unreadable |= drop
        out = dict(out)
        out["\0alive"] = keep_alive  # the stand-ins' ids stay unique while they live
        return out, (use, stand_ins), placeholders
    raise ArchitectureError(
        f"{where}: mlx-lm's sanitize for this model cannot read the checkpoint's tensor names "
        f"({type(first_error).__name__}: {first_error}); is it a checkpoint of this model_type?"
    )


def _present_ids(out: dict) -> set[int]:
    return {id(v) for k, v in out.items() if k != "\0alive"}


def _landed(out: dict, traced, modules: dict, params: set) -> dict[str, str]:
    """source name -> module path whose weight it fills (directly or stacked)."""
    import mlx.core as mx

    use, stand_ins = traced
    position = {n: i for i, n in enumerate(use)}
    landed: dict[str, str] = {}
    leftovers: dict[str, list[str]] = {}
    for key, v in out.items():
        if key == "\0alive" or not isinstance(v, mx.array):
            continue
        if id(v) in stand_ins:
            if not _holds_tag(v, position[stand_ins[id(v)]]):
                continue  # sanitize changed its values in place (folded a multiplier)
            rows = [stand_ins[id(v)]]
        elif v.dtype == mx.int32 and v.size <= 1 << 20 and v.ndim in (2, 3) \
                and tuple(v.shape[-2:]) == (1, 1):
            flat = v.reshape(-1).tolist()
            if not flat or min(flat) < _TAG or max(flat) - _TAG >= len(use):
                continue
            rows = [use[i - _TAG] for i in flat]
        else:
            continue
        if not key.endswith(".weight"):
            continue
        path = key[: -len(".weight")]
        if key in params and path in modules:
            for r in rows:
                landed[r] = path
        elif len(rows) == 1:
            leftovers[key] = rows
    # per-expert names that sanitize left alone: the loader stacks them (its _stack_experts)
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key, rows in leftovers.items():
        m = _EXPERT.match(key)
        if m and m["kind"] == "weight":
            groups.setdefault((m["pre"], m["proj"]), {})[int(m["e"])] = rows[0]
    for (pre, proj), members in groups.items():
        n = len(members)
        if sorted(members) != list(range(n)):
            continue
        names = [proj] + ([_MIXTRAL_NAMES[proj]] if proj in _MIXTRAL_NAMES else [])
        for path in (f"{pre}.{hub}.{p}" for p in names for hub in ("switch_mlp", "experts")):
            m = modules.get(path)
            if m is not None and _is_switch(m) and m.num_experts == n:
                for e in range(n):
                    landed[members[e]] = path
                break
    return landed


def _holds_tag(v, index: int) -> bool:
    import mlx.core as mx

    return v.dtype == mx.int32 and v.size == 1 and v.item() == _TAG + index


def _is_switch(m) -> bool:
    from mlx_lm.models.switch_layers import SwitchLinear

    return type(m) is SwitchLinear


def _codable(path: str, modules: dict, predicate, shape, stacked: int) -> bool:
    """mlx-lm would quantize this layer, and the runtime has a TurboQuant layer for it."""
    import mlx.nn as nn

    module = modules[path]
    w = module.get("weight") if isinstance(module, nn.Module) else None
    if w is None:
        return False
    if _is_switch(module):
        if stacked != module.num_experts or tuple(w.shape) != (stacked, *shape):
            return False
    elif type(module) in (nn.Linear, nn.Embedding):  # exact: custom forwards stay raw
        if tuple(w.shape) != tuple(shape):
            return False
    else:
        return False
    last = path.rsplit(".", 1)[-1]
    if last in _ROUTERS or (type(module) is nn.Linear and w.shape[0] <= 4
                            and "lm_head" not in path):
        return False  # routers and tiny gates stay in full precision
    if predicate is not None:
        try:
            verdict = predicate(path, module)
        except Exception:
            verdict = True
        if verdict is False or isinstance(verdict, dict):
            return False  # mlx-lm leaves it unquantized, or asks for more bits: keep it
    return True


def _role(path: str, module) -> str:
    import mlx.nn as nn

    parts = path.split(".")
    if type(module) is nn.Embedding:
        return "embeddings"
    if parts[-1] == "lm_head" or parts[-1] == "output":
        return "lm_head"
    if _is_switch(module):
        return "expert"
    if any(s in parts for s in _SHARED):
        return "shared_expert"
    if any(p in _ATTENTION for p in parts):
        return "attention"
    return "mlp"


def _group_key(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (None: outside the layers)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def num_layers_of(config: dict) -> int | None:
    """num_hidden_layers of a config (or of its text_config)."""
    n = config.get("num_hidden_layers")
    if n is None and isinstance(config.get("text_config"), dict):
        n = config["text_config"].get("num_hidden_layers")
    return n if isinstance(n, int) else None


def _why_raw(name: str, info) -> str:
    shape, dtype = info
    if len(shape) != 2:
        return f"{len(shape)}-D"
    if dtype not in _CODABLE:
        return f"dtype {dtype}"
    return "not a quantizable layer weight in mlx-lm"

"""Per-family conversion recipes: TOML data files in manifests/recipes/, and their loader.

A recipe says, for every tensor name of a model family, whether it is coded (and at how
many bits), kept in its source dtype, dropped, or split first (fused expert layouts).
`load_recipe` validates a file and names the bad key; `Recipe.resolve` answers for one
tensor; `Recipe.with_overrides` applies command-line options; `Recipe.hash` identifies the
resolved recipe (with the format version) for resume and caching. See docs/recipes.md.

A generic recipe (`generic = true`, recipes/default.toml) has no rules of its own: bound
to a checkpoint with `Recipe.bind` (manifests/architecture.py derives what each tensor is
from mlx-lm's model for the config), it supplies only the policy: bits per role,
protected layers, group size.

The code of a quantized weight is "scalar" (Lloyd-Max levels, the default) or "trellis"
(docs/FORMAT.md): `[quant] codec`, a `[codec]` table per role, or `codec` in a rule; the
trellis's parameters are `[quant] trellis_state_bits`, `trellis_values`, `trellis_block`,
`trellis_version`.

`[tensor_bits]` (optional; what `turboquant allocate` writes) gives exact bits to coded
tensors by their full output name: it wins over the role's bits, `bits.down_proj` and
`[protect]`, and every name in it must be a tensor the recipe codes (the plan checks).
These keys are stored only where a recipe gives them, so recipes without them hash as
they always did.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .architecture import VANISHED
from .schema import FORMAT_VERSION

RECIPES_DIR = Path(__file__).parent / "recipes"
GENERIC = "default"  # the generic recipe's name
ROLES = ("attention", "mlp", "expert", "shared_expert", "embeddings", "lm_head")
LAYER_ROLES = ("attention", "mlp", "expert", "shared_expert")
BITS = (2, 3, 4, "ternary")
GROUP_SIZES = (32, 64, 128)
CODECS = ("scalar", "trellis")
# the trellis a recipe gets unless its [quant] says otherwise (stages.trellis's defaults)
TRELLIS_DEFAULTS = {"trellis_state_bits": 16, "trellis_values": 1, "trellis_block": 256,
                    "trellis_version": 1}
# each trellis key's range (a recipe's [quant] and the convert flags)
TRELLIS_RANGES = {"trellis_state_bits": (8, 20), "trellis_values": (1, 2),
                  "trellis_block": (32, 1 << 16), "trellis_version": (1, 2)}
# [quant] column_scales = "auto": the roles whose weights get per-input-column scales (the
# layers whose input a runtime multiplies by t: TQLinear; not embeddings, not routed experts)
COLUMN_ROLES = ("attention", "mlp", "shared_expert", "lm_head")
COLUMN_MIN_RATIO = 0.5  # stages.scale.SMALL_COLUMN_RATIO, measured on SmolLM2 (quality.md)
# precision order, for "at least this many bits"
_RANK = {"ternary": 1, 2: 2, 3: 3, 4: 4, "raw": 99}


class RecipeError(ValueError):
    """A recipe file (or override) is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class Resolution:
    """What happens to one tensor: codec "turboquant" / "ternary" / "raw", or dropped."""

    action: str  # "quantize", "keep", "drop"
    role: str | None = None
    bits: int | str | None = None  # 2, 3, 4, "ternary"; None unless quantized
    group_size: int | None = None
    rule: str | None = None  # the pattern that decided it
    # (state bits, values, block, version): a trellis code
    trellis: tuple[int, int, int, int] | None = None
    # per-input-column scales: the smallest-column ratio under which the job codes W / t
    # (stages.column_scales_from_sums); None: the tensor stores no in_scales (format 1)
    column_min_ratio: float | None = None
    # a down projection with column scales: its in_scales from the gate/up neuron sizes when
    # one neuron is over this x the median (stages.neuron_column_scales); None: off
    neuron_ratio: float | None = None

    @property
    def codec(self) -> str:
        if self.action != "quantize":
            return "raw"
        if self.bits == "ternary":
            return "ternary"
        return "trellis" if self.trellis is not None else "turboquant"


@dataclass(frozen=True)
class Split:
    """A fused stacked tensor `<prefix>.experts.<suffix>` (E, ...) split per expert."""

    match: str
    into: tuple[str, ...]
    interleaved: bool
    transpose: bool
    names: str | None = None  # each expert's output name ("{e}"), instead of `into`


class Recipe:
    """A validated recipe. `data` is the plain dict (what gets hashed and recorded)."""

    def __init__(self, data: dict, source: str, architecture=None):
        self.data = data
        self.source = source
        self.architecture = architecture  # an ArchitectureMap once bound (generic recipes)
        self._keep = [re.compile(p) for p in data["keep"]]
        self._drop = [re.compile(p) for p in data["drop"]]
        self._rules = [(re.compile(r["match"]), r) for r in data["rules"]]
        self._unsupported = [(re.compile(u["match"]), u["reason"]) for u in data["unsupported"]]
        self.splits = [
            (re.compile(s["match"]), Split(s["match"], tuple(s["into"]), s["interleaved"],
                                           s["transpose"]))
            for s in data["split"]
        ]

    # --- identity -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def model_types(self) -> list[str]:
        return self.data["model_types"]

    @property
    def bits(self) -> int | str:
        return self.data["quant"]["bits"]

    @property
    def group_size(self) -> int:
        return self.data["quant"]["group_size"]

    @property
    def model_seed(self) -> int:
        return self.data["quant"]["model_seed"]

    @property
    def refit(self) -> bool:
        return self.data["quant"]["refit"]

    @property
    def column_min_ratio(self) -> float | None:
        """The [quant] column_scales policy: the smallest-column ratio (of the median) under
        which a linear layer's weight is coded with in_scales, or None ("off")."""
        q = self.data["quant"]
        if q.get("column_scales", "off") == "off":
            return None
        return q.get("column_min_ratio", COLUMN_MIN_RATIO)

    @property
    def neuron_ratio(self) -> float | None:
        """The [quant] neuron_ratio: a down projection's in_scales come from its MLP's gate
        and up rows when a neuron is over this x the median size (None: off)."""
        if self.column_min_ratio is None:
            return None
        return self.data["quant"].get("neuron_ratio")

    @property
    def drop_extra_layers(self) -> bool:
        return self.data["drop_extra_layers"]

    @property
    def generic(self) -> bool:
        return self.data.get("generic", False)

    def bind(self, architecture) -> "Recipe":
        """This recipe, deciding tensors its rules do not match from `architecture`."""
        return Recipe(self.data, self.source, architecture)

    def hash(self) -> str:
        """sha256 of the resolved recipe and the format version (hex)."""
        what = {"format_version": FORMAT_VERSION, "recipe": self.data}
        if self.architecture is not None and self.generic:
            what["architecture"] = self.architecture.digest()
        blob = json.dumps(what, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    # --- decisions ------------------------------------------------------------------
    def unsupported(self, name: str) -> str | None:
        for rx, reason in self._unsupported:
            if rx.search(name):
                return reason
        return None

    def split_for(self, name: str) -> Split | None:
        for rx, split in self.splits:
            if rx.search(name):
                return split
        if self.architecture is not None:
            d = self.architecture.decisions.get(name)
            if d is not None and d.split:
                return Split(name, (d.split,), False, False, names=d.split)
            if d is not None and d.fused:
                return Split(name, tuple(d.fused[0]), d.fused[1], d.fused[2])
        return None

    def resolve(self, name: str, layer: int | None = None, num_layers: int | None = None
                ) -> Resolution | None:
        """The decision for tensor `name` (None: no pattern matches it)."""
        for rx in self._drop:
            if rx.search(name):
                return Resolution("drop", rule=rx.pattern)
        for rx in self._keep:
            if rx.search(name):
                return Resolution("keep", rule=rx.pattern)
        exact = self.data.get("tensor_bits", {}).get(name)
        for rx, rule in self._rules:
            if rx.search(name):
                res = self._quantize(rule, layer, num_layers, exact)
                d = self.architecture.decisions.get(name) if self.architecture else None
                if res.action == "quantize" and d is not None and d.action == "keep" \
                        and d.why != VANISHED and not d.why.startswith("dtype "):
                    # (an unused tied head, or a dtype the plan refuses by name: the rules
                    # decide)
                    # mlx-lm's model has no quantizable layer for it (sanitize reshapes
                    # it, or it is a router): coded, it could not be loaded
                    return Resolution("keep", role=res.role, rule=f"mlx-lm:keep ({d.why})")
                return res
        if self.architecture is not None:  # generic, or a name no family rule knows
            d = self.architecture.decisions.get(name)
            if d is None or d.action == "unknown":
                return None
            rule = f"mlx-lm:{d.target or d.action}"
            if d.action != "quantize":
                return Resolution(d.action, rule=rule)
            return self._quantize({"match": rule, "role": d.role, "down_proj": d.down_proj},
                                  layer, num_layers, exact)
        return None

    def _quantize(self, rule: dict, layer: int | None, num_layers: int | None,
                  exact: int | str | None = None) -> Resolution:
        """The rule's decision; `exact`: the tensor's [tensor_bits] entry, which wins."""
        role = rule["role"]
        table = self.data["bits"]
        bits = rule.get("bits", table.get(role, self.bits))
        if rule.get("down_proj") and "down_proj" in table and "bits" not in rule:
            bits = table["down_proj"]
        protect = self.data["protect"]
        if exact is not None:
            bits = exact
        elif (
            bits != "raw"
            and layer is not None
            and num_layers
            and role in protect["roles"]
            and (layer < protect["first_layers"] or layer >= num_layers - protect["last_layers"])
            and _RANK[protect["bits"]] > _RANK[bits]
        ):
            bits = protect["bits"]
        if bits == "raw":
            return Resolution("keep", role=role, rule=rule["match"])
        group = rule.get("group_size", self.group_size)
        quant = self.data["quant"]
        codec = rule.get("codec", self.data.get("codec", {}).get(role, quant.get("codec")))
        trellis = None
        if codec == "trellis" and bits != "ternary":  # ternary weights have no trellis
            trellis = tuple(quant.get(k, v) for k, v in TRELLIS_DEFAULTS.items())
            if trellis[0] <= bits * trellis[1]:  # a state holds more than one step's bits
                raise RecipeError(
                    f"{self.source}: role {role} at {bits} bits with trellis_values "
                    f"{trellis[1]} needs trellis_state_bits > {bits * trellis[1]}, got "
                    f"{trellis[0]}: raise trellis_state_bits or lower trellis_values")
        ratio = self.column_min_ratio if role in COLUMN_ROLES and bits != "ternary" else None
        neuron = self.neuron_ratio if ratio is not None and rule.get("down_proj") else None
        return Resolution("quantize", role=role, bits=bits, group_size=group, rule=rule["match"],
                          trellis=trellis, column_min_ratio=ratio, neuron_ratio=neuron)

    # --- overrides ------------------------------------------------------------------
    def with_overrides(self, **overrides) -> "Recipe":
        """A new recipe with command-line overrides applied (None values are ignored).

        bits: default bits of attention, dense MLP and shared experts (clears their
        per-role entries); expert_bits, down_proj_bits, embeddings_bits, lm_head_bits;
        group_size; model_seed; protect_layers (first and last N); protect_bits;
        codec ("scalar" or "trellis": every coded role, clearing the per-role and per-rule
        codecs); trellis_state_bits (L), trellis_values (V) and trellis_version of the
        trellis-coded weights.
        """
        data = copy.deepcopy(self.data)
        where = f"{self.source} (command-line override)"
        ov = {k: v for k, v in overrides.items() if v is not None}
        known = {"bits", "expert_bits", "down_proj_bits", "embeddings_bits", "lm_head_bits",
                 "group_size", "model_seed", "protect_layers", "protect_bits", "refit",
                 "column_scales", "codec", "trellis_state_bits", "trellis_values",
                 "trellis_version"}
        for k in ov:
            if k not in known:
                raise RecipeError(f"{where}: unknown override {k!r}")
        if "bits" in ov:
            data["quant"]["bits"] = _check_bits(ov["bits"], "--bits", where)
            for role in ("attention", "mlp", "shared_expert"):
                data["bits"].pop(role, None)
        for key, role in (("expert_bits", "expert"), ("down_proj_bits", "down_proj"),
                          ("embeddings_bits", "embeddings"), ("lm_head_bits", "lm_head")):
            if key in ov:
                data["bits"][role] = _check_bits(ov[key], "--" + key.replace("_", "-"), where,
                                                 allow_raw=True)
        if "group_size" in ov:
            data["quant"]["group_size"] = _check_group(ov["group_size"], "--group-size", where)
        if "model_seed" in ov:
            data["quant"]["model_seed"] = _check_int(ov["model_seed"], "--model-seed", where,
                                                     0, 2**64 - 1)
        if "refit" in ov:
            data["quant"]["refit"] = bool(ov["refit"])
        if "column_scales" in ov:
            data["quant"]["column_scales"] = ov["column_scales"]  # validate() checks it
        if "codec" in ov:
            _override_codec(data, _check_codec(ov["codec"], "--codec", where))
        for key in ("trellis_state_bits", "trellis_values", "trellis_version"):
            if key not in ov:
                continue
            flag = "--" + key.replace("_", "-")
            if "trellis" not in _codecs_named(data):
                raise RecipeError(f"{where}: {flag} sets the trellis-coded weights' code and "
                                  "this recipe codes none: add --codec trellis")
            data["quant"][key] = _check_int(ov[key], flag, where, *TRELLIS_RANGES[key])
        if "protect_layers" in ov:
            n = _check_int(ov["protect_layers"], "--protect-layers", where, 0, 1 << 20)
            data["protect"]["first_layers"] = data["protect"]["last_layers"] = n
        if "protect_bits" in ov:
            data["protect"]["bits"] = _check_bits(ov["protect_bits"], "--protect-bits", where)
        return Recipe(validate(data, where), self.source, self.architecture)


def _override_codec(data: dict, codec: str) -> None:
    """`--codec`: one code for every coded role. Scalar leaves no codec key at all (and no
    trellis parameter), so the recipe hashes as one that never named a codec."""
    data.pop("codec", None)
    for rule in data["rules"]:
        rule.pop("codec", None)
    if codec == "trellis":
        data["quant"]["codec"] = "trellis"
        return
    data["quant"].pop("codec", None)
    for key in TRELLIS_DEFAULTS:
        data["quant"].pop(key, None)


# ------------------------------------------------------------------------ loading


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a bundled recipe by name (e.g. "llama") or a TOML file by path."""
    p = Path(name_or_path)
    if p.suffix != ".toml" and not p.exists():
        p = RECIPES_DIR / f"{name_or_path}.toml"
        if not p.exists():
            raise RecipeError(
                f"unknown recipe {str(name_or_path)!r}: bundled recipes are "
                f"{', '.join(list_recipes())}, or pass the path of a .toml file"
            )
    try:
        with open(p, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{p}: not valid TOML ({e})") from None
    return Recipe(validate(raw, str(p)), str(p))


def recipe_for_model_type(model_type: str | None, config_file: str = "config.json") -> Recipe:
    """The bundled recipe whose `model_types` lists `model_type`, else the generic
    `default` recipe when mlx-lm has a model for it."""
    for name in list_recipes():
        r = load_recipe(name)
        if model_type in r.model_types:
            return r
    from .architecture import supports

    if supports(model_type):
        return load_recipe(GENERIC)
    known = sorted(t for n in list_recipes() for t in load_recipe(n).model_types if t != "*")
    raise RecipeError(
        f"{config_file}: unknown architecture model_type={model_type!r}: mlx-lm has no model "
        f"for it and no bundled recipe covers it (recipes: {', '.join(known)}); pass "
        "--recipe NAME or --recipe path/to.toml"
    )


def bind_architecture(recipe: Recipe, config: dict, tensors: dict, where: str = "config.json"
                      ) -> Recipe:
    """A recipe bound to mlx-lm's reading of these tensors.

    A generic recipe takes every decision from it; a family recipe's rules decide, except
    that a tensor mlx-lm's model could not load coded is kept raw.

    `tensors`: source name -> (shape, safetensors dtype). Raises RecipeError when mlx-lm
    has no model for the config or its sanitize cannot read the names.
    """
    if recipe.architecture is not None:
        return recipe
    from .architecture import ArchitectureError, derive

    try:
        return recipe.bind(derive(config, tensors, where))
    except ArchitectureError as e:
        if not recipe.generic:
            return recipe  # a family recipe's rules stand alone
        raise RecipeError(str(e)) from None


# ------------------------------------------------------------------------ validation

_TOP = {"name", "description", "model_types", "keep", "drop", "quant", "bits", "protect",
        "rules", "split", "unsupported", "drop_extra_layers", "generic", "codec",
        "tensor_bits"}
_QUANT = {"bits", "group_size", "model_seed", "refit", "codec", *TRELLIS_DEFAULTS,
          "column_scales", "column_min_ratio", "neuron_ratio"}
_PROTECT = {"first_layers", "last_layers", "bits", "roles"}
_RULE = {"match", "role", "bits", "group_size", "down_proj", "codec"}
_SPLIT = {"match", "into", "interleaved", "transpose"}
_UNSUPPORTED = {"match", "reason"}


def validate(raw: Any, where: str) -> dict:
    """Check a recipe's structure and values; return it with defaults filled in."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: a recipe is a table of keys")
    _unknown(raw, _TOP, where, "")
    data: dict = {}
    data["name"] = _check_str(raw.get("name"), "name", where)
    data["description"] = raw.get("description", "")
    if not isinstance(data["description"], str):
        raise RecipeError(f"{where}: key 'description' must be a string")
    mt = raw.get("model_types")
    if not isinstance(mt, list) or not mt or not all(isinstance(x, str) and x for x in mt):
        raise RecipeError(f"{where}: key 'model_types' must be a non-empty list of strings")
    data["model_types"] = list(mt)
    if _check_bool(raw.get("generic", False), "generic", where):
        data["generic"] = True  # absent otherwise: family recipes hash as they always did
    data["drop_extra_layers"] = raw.get("drop_extra_layers", False)
    if not isinstance(data["drop_extra_layers"], bool):
        raise RecipeError(f"{where}: key 'drop_extra_layers' must be true or false")
    for key in ("keep", "drop"):
        data[key] = [_check_regex(p, f"{key}[{i}]", where)
                     for i, p in enumerate(_check_list(raw.get(key, []), key, where))]

    quant = raw.get("quant")
    if not isinstance(quant, dict):
        raise RecipeError(f"{where}: missing table [quant] (bits, group_size)")
    _unknown(quant, _QUANT, where, "quant.")
    data["quant"] = {
        "bits": _check_bits(quant.get("bits"), "quant.bits", where),
        "group_size": _check_group(quant.get("group_size", 64), "quant.group_size", where),
        "model_seed": _check_int(quant.get("model_seed", 0), "quant.model_seed", where, 0,
                                 2**64 - 1),
        "refit": _check_bool(quant.get("refit", True), "quant.refit", where),
    }
    # codec keys only where given: a recipe without them keeps its hash
    if "codec" in quant:
        data["quant"]["codec"] = _check_codec(quant["codec"], "quant.codec", where)
    for key, (lo, hi) in TRELLIS_RANGES.items():
        if key in quant:
            data["quant"][key] = _check_int(quant[key], "quant." + key, where, lo, hi)
    block = data["quant"].get("trellis_block", TRELLIS_DEFAULTS["trellis_block"])
    if block % 32:
        raise RecipeError(f"{where}: key 'quant.trellis_block' must be a multiple of 32, "
                          f"got {block}")
    if data["quant"].get("refit") is False and "trellis" in _codecs_named(raw):
        raise RecipeError(f"{where}: the trellis code refits its scales: remove "
                          "'quant.refit = false' or the trellis codec")
    codecs = raw.get("codec", {})
    if not isinstance(codecs, dict):
        raise RecipeError(f"{where}: key 'codec' must be a table (role = \"scalar\" or "
                          "\"trellis\")")
    _unknown(codecs, set(ROLES), where, "codec.")
    if codecs:
        data["codec"] = {k: _check_codec(v, f"codec.{k}", where) for k, v in codecs.items()}
    if "column_scales" in quant:  # only when given: recipes without it keep their hash
        mode = quant["column_scales"]
        if mode not in ("auto", "off"):
            raise RecipeError(f"{where}: key 'quant.column_scales' must be \"auto\" or "
                              f"\"off\", got {mode!r}")
        data["quant"]["column_scales"] = mode
    if "column_min_ratio" in quant:
        r = quant["column_min_ratio"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= 1.0:
            raise RecipeError(f"{where}: key 'quant.column_min_ratio' must be a number in "
                              f"(0, 1] (a fraction of the median column RMS), got {r!r}")
        data["quant"]["column_min_ratio"] = float(r)
    if "neuron_ratio" in quant:  # only when given: recipes without it keep their hash
        r = quant["neuron_ratio"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 1.0:
            raise RecipeError(f"{where}: key 'quant.neuron_ratio' must be a number above 1 "
                              f"(a multiple of the median neuron size), got {r!r}")
        data["quant"]["neuron_ratio"] = float(r)

    bits = raw.get("bits", {})
    if not isinstance(bits, dict):
        raise RecipeError(f"{where}: key 'bits' must be a table")
    _unknown(bits, set(ROLES) | {"down_proj"}, where, "bits.")
    data["bits"] = {k: _check_bits(v, f"bits.{k}", where, allow_raw=True)
                    for k, v in bits.items()}

    exact = raw.get("tensor_bits", {})
    if not isinstance(exact, dict):
        raise RecipeError(f"{where}: key 'tensor_bits' must be a table (tensor name = bits)")
    if exact:  # only when given: recipes without it keep their hash
        data["tensor_bits"] = {k: _check_bits(v, f"tensor_bits.{k!r}", where)
                               for k, v in exact.items()}

    protect = raw.get("protect", {})
    if not isinstance(protect, dict):
        raise RecipeError(f"{where}: key 'protect' must be a table")
    _unknown(protect, _PROTECT, where, "protect.")
    roles = _check_list(protect.get("roles", list(LAYER_ROLES)), "protect.roles", where)
    for r in roles:
        if r not in LAYER_ROLES:
            raise RecipeError(f"{where}: key 'protect.roles': unknown role {r!r} "
                              f"(use {', '.join(LAYER_ROLES)})")
    data["protect"] = {
        "first_layers": _check_int(protect.get("first_layers", 0), "protect.first_layers",
                                   where, 0, 1 << 20),
        "last_layers": _check_int(protect.get("last_layers", 0), "protect.last_layers",
                                  where, 0, 1 << 20),
        "bits": _check_bits(protect.get("bits", 4), "protect.bits", where),
        "roles": list(roles),
    }

    data["rules"] = []
    for i, rule in enumerate(_check_list(raw.get("rules", []), "rules", where)):
        key = f"rules[{i}]"
        if not isinstance(rule, dict):
            raise RecipeError(f"{where}: {key} must be a table")
        _unknown(rule, _RULE, where, key + ".")
        r = {"match": _check_regex(rule.get("match"), key + ".match", where)}
        role = rule.get("role")
        if role not in ROLES:
            raise RecipeError(f"{where}: key '{key}.role' must be one of {', '.join(ROLES)}, "
                              f"got {role!r}")
        r["role"] = role
        if "bits" in rule:
            r["bits"] = _check_bits(rule["bits"], key + ".bits", where, allow_raw=True)
        if "group_size" in rule:
            r["group_size"] = _check_group(rule["group_size"], key + ".group_size", where)
        r["down_proj"] = _check_bool(rule.get("down_proj", False), key + ".down_proj", where)
        if "codec" in rule:
            r["codec"] = _check_codec(rule["codec"], key + ".codec", where)
        data["rules"].append(r)
    if not data["rules"] and not data.get("generic"):
        raise RecipeError(f"{where}: key 'rules' must list at least one [[rules]] table "
                          "(or set generic = true to classify tensors from mlx-lm's model)")

    data["split"] = []
    for i, s in enumerate(_check_list(raw.get("split", []), "split", where)):
        key = f"split[{i}]"
        if not isinstance(s, dict):
            raise RecipeError(f"{where}: {key} must be a table")
        _unknown(s, _SPLIT, where, key + ".")
        into = _check_list(s.get("into"), key + ".into", where)
        if not into or not all(isinstance(x, str) and x for x in into):
            raise RecipeError(f"{where}: key '{key}.into' must be a non-empty list of names")
        data["split"].append({
            "match": _check_regex(s.get("match"), key + ".match", where),
            "into": list(into),
            "interleaved": _check_bool(s.get("interleaved", False), key + ".interleaved", where),
            "transpose": _check_bool(s.get("transpose", False), key + ".transpose", where),
        })

    data["unsupported"] = []
    for i, u in enumerate(_check_list(raw.get("unsupported", []), "unsupported", where)):
        key = f"unsupported[{i}]"
        if not isinstance(u, dict):
            raise RecipeError(f"{where}: {key} must be a table")
        _unknown(u, _UNSUPPORTED, where, key + ".")
        data["unsupported"].append({
            "match": _check_regex(u.get("match"), key + ".match", where),
            "reason": _check_str(u.get("reason"), key + ".reason", where),
        })
    return data


def _unknown(table: dict, allowed: set, where: str, prefix: str) -> None:
    for k in table:
        if k not in allowed:
            raise RecipeError(f"{where}: unknown key '{prefix}{k}' (allowed: "
                              f"{', '.join(sorted(allowed))})")


def _check_str(v, key, where) -> str:
    if not isinstance(v, str) or not v:
        raise RecipeError(f"{where}: key '{key}' must be a non-empty string, got {v!r}")
    return v


def _check_list(v, key, where) -> list:
    if not isinstance(v, list):
        raise RecipeError(f"{where}: key '{key}' must be a list, got {v!r}")
    return v


def _check_regex(v, key, where) -> str:
    _check_str(v, key, where)
    try:
        re.compile(v)
    except re.error as e:
        raise RecipeError(f"{where}: key '{key}': bad regular expression {v!r} ({e})") from None
    return v


def _check_bool(v, key, where) -> bool:
    if not isinstance(v, bool):
        raise RecipeError(f"{where}: key '{key}' must be true or false, got {v!r}")
    return v


def _check_int(v, key, where, lo, hi) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RecipeError(f"{where}: key '{key}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _check_bits(v, key, where, allow_raw: bool = False):
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    ok = (v in BITS and not isinstance(v, bool)) or (allow_raw and v == "raw")
    if not ok:
        allowed = "2, 3, 4, \"ternary\"" + (' or "raw"' if allow_raw else "")
        raise RecipeError(f"{where}: key '{key}' must be one of {allowed}, got {v!r}")
    return v


def _check_codec(v, key, where) -> str:
    if v not in CODECS:
        raise RecipeError(f"{where}: key '{key}' must be \"scalar\" or \"trellis\", got {v!r}")
    return v


def _codecs_named(raw: dict) -> set:
    """Every codec a raw recipe names ([quant], [codec], rules)."""
    names = {raw.get("quant", {}).get("codec")} | set(raw.get("codec", {}).values())
    return names | {r.get("codec") for r in raw.get("rules", []) if isinstance(r, dict)}


def _check_group(v, key, where) -> int:
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if isinstance(v, bool) or v not in GROUP_SIZES:
        raise RecipeError(f"{where}: key '{key}' must be one of 32, 64, 128, got {v!r}")
    return v

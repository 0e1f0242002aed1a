"""Every weight's bytes at run time, from config.json and safetensors headers only.

For a source checkpoint the recipe is projected tensor by tensor with the same decisions
the conversion plan makes (`Recipe.resolve`, `Recipe.split_for`, `coded_shapes`): a coded
weight costs its packed codes (uint32) plus fp16 scales, a kept tensor its own bytes. For
a converted TurboQuant repo the shard headers already hold the stored sizes. Either way no
tensor data is read: a local folder's headers are read from disk, a Hub repo's through
HTTP range requests (`HubSource.header`), several at a time.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from turboquant.manifests.schema import (CODES_SUFFIX, IN_SCALES_SUFFIX, QUANT_METHOD,
                                         SCALES_SUFFIX)

from . import published
from .errors import ConversionError, SourceError
from .plan import bind_to_tensors, choose_recipe, coded_shapes, expert_of, layer_of, num_layers_of
from .safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, SafetensorsHeader
from .sources import Source

HEADER_THREADS = 8  # parallel range requests for a Hub repo's headers
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class Weight:
    """One weight as the runtime holds it.

    A coded weight (`bits` set) occupies `nbytes` (codes + scales) and decodes `weights`
    values (rows x padded input) in the kernels; a raw tensor holds `numel` values of
    `dtype` and is cast with the activations when the runtime casts them.
    """

    name: str
    nbytes: int
    dtype: str  # "TQ" for a coded weight, else the stored dtype
    numel: int
    weights: int = 0
    bits: int | str | None = None
    layer: int | None = None
    expert: int | None = None

    @property
    def group(self) -> str:
        """The name with its expert index replaced by `*`: one layer's projection."""
        return _EXPERT_INDEX.sub(".experts.*.", self.name) if self.expert is not None \
            else self.name

    @property
    def coded(self) -> bool:
        return self.bits is not None

    @property
    def is_expert(self) -> bool:
        return self.expert is not None

    def resident(self, act_size: int | None) -> int:
        """Bytes in memory; raw floats are cast to `act_size` bytes when it is given."""
        if self.coded or act_size is None or self.dtype not in FLOAT_DTYPES:
            return self.nbytes
        return self.numel * act_size


@dataclass
class Inventory:
    """What `plan` knows about a checkpoint before reading any tensor."""

    source: str  # folder or repo@commit
    kind: str  # "source" (projected through a recipe) or "repo" (converted)
    config: dict = field(repr=False)
    weights: list[Weight] = field(repr=False)
    recipe: str | None = None  # recipe name and summary ("qwen_moe: 4-bit, experts 3-bit")
    recipe_args: dict = field(default_factory=dict)  # overrides given on the command line
    problems: list[str] = field(default_factory=list)  # the conversion would refuse these
    files: int = 0
    tensors: int = 0
    recipe_arg: str | None = None  # --recipe as given
    headers: dict = field(default_factory=dict, repr=False)  # file -> SafetensorsHeader
    source_parameters: int = 0  # the model's weights (FP8 / MXFP4 / int4 scales not counted)
    source_bytes: int = 0  # tensor data in the source shards
    pairing: published.Pairing | None = field(default=None, repr=False)
    # (mlx-lm's reading of the tensors, or None,) once derived: it depends on the config and
    # the tensors only, so `reproject` reuses it (a 1T release's takes ~7 s each time)
    architecture: tuple | None = field(default=None, repr=False)

    @property
    def dtype(self) -> str:
        """The stored dtype of the 16-bit tensors (BF16 unless everything is F16/F32)."""
        seen = {w.dtype for w in self.weights if w.dtype in FLOAT_DTYPES}
        for d in ("BF16", "F16", "F32"):
            if d in seen:
                return d
        return "BF16"


def read_headers(source: Source) -> dict[str, SafetensorsHeader]:
    files = source.shard_files()
    threads = HEADER_THREADS if source.kind == "hub" and len(files) > 1 else 1
    if threads == 1:
        return {f: source.header(f) for f in files}
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(files, pool.map(source.header, files)))


def inventory(source: Source, recipe: str | None = None, overrides: dict | None = None
              ) -> Inventory:
    """Weights of a source checkpoint (recipe projected) or of a converted repo."""
    config = source.config()
    headers = read_headers(source)
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") == QUANT_METHOD:
        if recipe or overrides:
            raise ConversionError(f"{source.description} is already a TurboQuant repo: "
                                  "--recipe and bit options apply to source checkpoints only")
        inv = _repo_weights(source.description, config, headers)
    else:
        inv = _projected(source.description, config, headers, recipe, overrides or {})
    inv.files = len(headers)
    inv.tensors = sum(len(h.tensors) for h in headers.values())
    inv.headers = headers
    inv.source_parameters = inv.pairing.source_parameters(headers) if inv.pairing else \
        published.pair(headers, config).source_parameters(headers)
    inv.source_bytes = sum(h.data_size for h in headers.values())
    return inv


def reproject(inv: Inventory, **overrides) -> Inventory:
    """The same source checkpoint under other recipe options (no new reads)."""
    if inv.kind != "source":
        raise ConversionError("only a source checkpoint can be projected through a recipe")
    args = {**inv.recipe_args, **overrides}
    out = _projected(inv.source, inv.config, inv.headers, inv.recipe_arg, args,
                     inv.architecture, inv.pairing)
    out.files, out.tensors, out.headers = inv.files, inv.tensors, inv.headers
    out.source_parameters, out.source_bytes = inv.source_parameters, inv.source_bytes
    return out


# ------------------------------------------------------------------------ converted repo


def _repo_weights(where: str, config: dict, headers) -> Inventory:
    qc = config["quantization_config"]
    bits0, group0 = qc.get("bits"), qc.get("group_size")
    overrides = qc.get("overrides") or {}
    tensors = {name: info for h in headers.values() for name, info in h.tensors.items()}
    out: list[Weight] = []
    for name, info in tensors.items():
        if name.endswith((SCALES_SUFFIX, IN_SCALES_SUFFIX)):
            continue
        if not name.endswith(CODES_SUFFIX):
            out.append(Weight(name, info.nbytes, info.dtype, info.numel, layer=layer_of(name),
                              expert=expert_of(name)))
            continue
        base = name[: -len(CODES_SUFFIX)]
        scales = tensors.get(base + SCALES_SUFFIX)
        if scales is None:
            raise SourceError(name, f"has no {base + SCALES_SUFFIX} next to it: the repo is "
                              "incomplete (run `turboquant doctor` on it)")
        ov = overrides.get(base, {})
        bits = "ternary" if ov.get("codec") == "ternary" else ov.get("bits", bits0)
        group = ov.get("group_size", group0) or 64
        decoded = math.prod(scales.shape) * group  # rows x padded input
        t = tensors.get(base + IN_SCALES_SUFFIX)  # format 2: the in_scales vector
        out.append(Weight(base + ".weight", info.nbytes + scales.nbytes + (t.nbytes if t else 0),
                          "TQ", decoded, decoded, bits, layer_of(name), expert_of(name)))
    summary = _recipe_summary(qc.get("recipe"), bits0, _expert_bits(out))
    return Inventory(where, "repo", config, out, recipe=summary)


# ------------------------------------------------------------------------ source projection


def _projected(where: str, config: dict, headers, recipe: str | None, overrides: dict,
               architecture: tuple | None = None,
               pairing: published.Pairing | None = None) -> Inventory:
    """The conversion plan's per-tensor decisions (pipeline/plan.py), sizes only;
    `architecture` and `pairing`: what an earlier projection of these headers derived."""
    rec = choose_recipe(config, recipe, overrides)
    if architecture is None:
        rec = bind_to_tensors(rec, config, headers)
    elif rec.architecture is None and architecture[0] is not None:
        rec = rec.bind(architecture[0])
    num_layers = num_layers_of(config)
    problems: list[str] = []
    out: list[Weight] = []
    seen: set[str] = set()
    coded_bytes: dict[tuple, int] = {}
    decided: dict[tuple, Weight | str | None] = {}
    pairing = pairing or published.pair(headers, config)
    problems += pairing.problems
    for f, h in headers.items():
        for info in pairing.tensors(f, h):
            if info.name in seen:
                continue
            seen.add(info.name)
            reason = rec.unsupported(info.name)
            if reason:
                problems.append(f"{f}: tensor {info.name!r}: {reason}")
                continue
            layer = layer_of(info.name)
            if rec.drop_extra_layers and layer is not None and num_layers is not None \
                    and layer >= num_layers:
                continue
            split = rec.split_for(info.name)
            pieces = _split(info, split, f, problems) if split else [(info.name, info.shape)]
            for name, shape in pieces:
                # all experts of one layer and projection share one spec (docs/run.md), so
                # one decision serves them all
                key = (_EXPERT_INDEX.sub(".experts.*.", name), layer, shape, info.dtype)
                w = decided.get(key)
                if w is None:
                    w = decided[key] = _weight(rec, name, shape, info.dtype, layer,
                                               num_layers, coded_bytes)
                if isinstance(w, str):
                    problems.append(f"{f}: tensor {info.name!r}: {w}")
                elif w is not None:
                    out.append(w if w.name == name else
                               Weight(name, w.nbytes, w.dtype, w.numel, w.weights, w.bits,
                                      w.layer, expert_of(name)))
    summary = _recipe_summary(rec.name, rec.bits, _expert_bits(out))
    return Inventory(where, "source", config, out, recipe=summary, recipe_args=overrides,
                     problems=problems, recipe_arg=recipe, pairing=pairing,
                     architecture=(rec.architecture,))


def _split(info, split, f: str, problems: list[str]) -> list[tuple[str, tuple]]:
    """Per-expert (name, shape) of a stacked tensor, as the plan's [[split]] cuts it."""
    if split.names:  # (E, out, in) stacked in the source (mlx-lm's layout)
        return [(split.names.format(e=e), tuple(info.shape[1:])) for e in range(info.shape[0])]
    marker = ".experts."
    i = info.name.rfind(marker)
    k = len(split.into)
    shape = info.shape
    templates = all("{e}" in into for into in split.into)  # the generic recipe's full names
    if (i < 0 and not templates) or len(shape) not in (2, 3) or \
            (len(shape) == 2 and split.transpose):
        problems.append(f"{f}: tensor {info.name!r} shape {list(shape)} does not fit its "
                        "[[split]] rule")
        return []
    prefix = info.name[: i + len(marker)]
    if len(shape) == 3:
        e_count, a, b = shape
        new = (b // k, a) if split.transpose else (a // k, b)
    else:
        e_count, n = shape
        new = (n // k,)
    return [(into.format(e=e) if templates else f"{prefix}{e}.{into}", new)
            for e in range(e_count) for into in split.into]


def _weight(rec, name, shape, dtype, layer, num_layers, cache) -> Weight | str | None:
    """One output tensor; a string says why the conversion would refuse it."""
    res = rec.resolve(name, layer, num_layers)
    if res is None:
        return (f"matches no rule of recipe {rec.name!r}; add a [[rules]] entry, a keep or a "
                "drop pattern, or pick another --recipe")
    if res.action == "drop":
        return None
    numel = math.prod(shape)
    expert = expert_of(name)
    raw = Weight(name, numel * DTYPE_SIZES[dtype], dtype, numel, layer=layer, expert=expert)
    if res.action == "keep":
        return raw
    if dtype not in FLOAT_DTYPES:
        return (f"dtype {dtype} cannot be coded (BF16, F16, F32 and the published formats of "
                f"{published.GUIDE} are read)")
    if len(shape) == 1 or (len(shape) == 2 and shape[1] < res.group_size) or 0 in shape:
        return raw
    if len(shape) != 2:
        return f"shape {list(shape)}: a quantize rule needs a 2-D weight (out, in)"
    out_f, in_f = shape
    gs = res.group_size
    padded = -(-in_f // gs) * gs
    key = (out_f, padded, res.bits, gs)
    if key not in cache:
        codes, scales = coded_shapes(out_f, padded, res.bits, gs)
        cache[key] = math.prod(codes) * 4 + math.prod(scales) * 2
    # the plan's in_scales (F16, (in,)), for the roles its column_scales policy covers
    t_bytes = 2 * in_f if res.column_min_ratio is not None and expert is None else 0
    return Weight(name, cache[key] + t_bytes, "TQ", numel, out_f * padded, res.bits, layer,
                  expert)


# ------------------------------------------------------------------------ summaries


def _expert_bits(weights: list[Weight]):
    """The bits most experts are coded at (the first and last layers may differ)."""
    seen = Counter(w.bits for w in weights if w.is_expert and w.coded)
    rank = {"ternary": 1, 2: 2, 3: 3, 4: 4}
    return max(seen, key=lambda b: (seen[b], -rank.get(b, 9))) if seen else None


def _recipe_summary(name, bits, expert_bits) -> str:
    text = f"{name or 'unknown recipe'}: {bits}-bit"
    if expert_bits is not None and expert_bits != bits:
        text += f", experts {expert_bits}" + ("-bit" if isinstance(expert_bits, int) else "")
    return text

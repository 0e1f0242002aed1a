"""The metadata-only validation pass: config.json + safetensors headers + recipe -> a plan.

A plan is a list of jobs (one per source shard, or per group of shards of a target size;
a shard bigger than the maximum is split), each owning a list of output units. A unit is
one tensor, or one expert of one layer (all of its projections, possibly read from other
shards, written consecutively). Every output tensor's codec, shapes and byte range in its
output shard are fixed here, before any tensor data is read, so a bad recipe or a lying
header fails in seconds and the output layout is known exactly (disk check, resume).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field

from turboquant.manifests.architecture import layer_of, num_layers_of
from turboquant.manifests.recipe import (Recipe, RecipeError, bind_architecture, load_recipe,
                                         recipe_for_model_type)
from turboquant.manifests.schema import FORMAT_VERSION, QUANT_METHOD, format_version, stored_names
from turboquant.stages import rotation_key, tensor_seed, words_per_row

from . import published
from .errors import ConversionError, PlanError, SourceError
from .published import Published
from .safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, SafetensorsHeader
from .sources import INDEX_FILE, Source

GB = 1000**3
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Piece:
    """Where one output tensor's values come from in the source.

    The whole tensor, or for a stacked (E, ...) tensor the slice of expert `expert`, cut
    into `parts` along its output axis (`interleaved`: every parts-th column), transposed
    from (in, out) to (out, in) when `transpose`.
    """

    file: str
    tensor: str
    expert: int | None = None
    part: int = 0
    parts: int = 1
    interleaved: bool = False
    transpose: bool = False


@dataclass(frozen=True)
class Stored:
    """One tensor in an output shard: absolute byte range [start, end) in the shard file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Item:
    """One manifest row: an output tensor (raw), or a coded weight (codes + scales)."""

    name: str
    piece: Piece
    source_dtype: str
    shape: tuple[int, ...]
    codec: str  # "turboquant", "ternary", "trellis", "raw"
    bits: int | str | None
    group_size: int | None
    seed: int | None
    padded_in: int | None
    layer: int | None
    expert: int | None
    stored: tuple[Stored, ...]
    read_bytes: int  # source bytes this item accounts for (progress, throughput)
    role: str | None = None
    published: Published | None = None  # read from FP8 / MXFP4 / int4 codes (published.py)
    # trellis code: (state bits, values, block, version)
    trellis: tuple[int, int, int, int] | None = None
    # stores in_scales (a third tensor, F16 (in,)): the job codes W / t, t from the whole
    # tensor's column sums, ones where no column is under this ratio of the median
    column_min_ratio: float | None = None
    # a down projection: in_scales from its MLP's gate/up rows when a neuron is over this x
    # the median size (stages.neuron_column_scales); else the column rule
    neuron_ratio: float | None = None

    @property
    def in_scales(self) -> bool:
        return self.column_min_ratio is not None

    @property
    def byte_start(self) -> int:
        return self.stored[0].start

    @property
    def byte_end(self) -> int:
        return self.stored[-1].end

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    key: str
    items: tuple[Item, ...]
    anchor: tuple[int, int]  # (source file position, byte offset): ownership and order

    @property
    def read_bytes(self) -> int:
        return sum(i.read_bytes for i in self.items)

    @property
    def byte_start(self) -> int:
        return self.items[0].byte_start

    @property
    def byte_end(self) -> int:
        return self.items[-1].byte_end


@dataclass(frozen=True)
class Job:
    """One task: the units whose anchor lies in `files[0..]`, written to `shard`."""

    index: int
    name: str  # job-00001
    shard: str  # model-00001-of-0000N.safetensors
    units: tuple[Unit, ...]
    files: tuple[str, ...]  # every source file it reads
    header: bytes  # the shard's safetensors header (length + JSON), fixed by the plan

    @property
    def read_bytes(self) -> int:
        return sum(u.read_bytes for u in self.units)

    @property
    def size(self) -> int:
        return self.units[-1].byte_end if self.units else len(self.header)


@dataclass
class Plan:
    source: str
    config: dict
    recipe: Recipe
    recipe_hash: str
    jobs: list[Job]
    identities: dict[str, dict]  # source file -> identity
    headers: dict[str, SafetensorsHeader]
    dropped: list[str] = field(default_factory=list)
    kept_small: list[str] = field(default_factory=list)  # quantize rule, too small: raw

    @property
    def items(self):
        for job in self.jobs:
            for unit in job.units:
                yield from unit.items

    @property
    def read_bytes(self) -> int:
        return sum(j.read_bytes for j in self.jobs)

    @property
    def out_bytes(self) -> int:
        return sum(j.size for j in self.jobs)

    @property
    def format_version(self) -> int:
        """2 where a tensor is trellis-coded or stores in_scales, else 1 (docs/FORMAT.md)."""
        return format_version((it.codec for it in self.items),
                              any(it.in_scales for it in self.items))

    def plan_hash(self) -> str:
        """sha256 over everything that decides the output bytes (layout and codecs) but the
        source's contents, which run.json binds shard by shard (`identities`)."""
        h = hashlib.sha256()
        h.update(f"{QUANT_METHOD}/{FORMAT_VERSION}/{self.recipe_hash}".encode())
        for job in self.jobs:
            h.update(job.shard.encode() + job.header)
            for unit in job.units:
                for it in unit.items:
                    h.update(repr((it.name, it.piece, it.codec, it.bits, it.group_size,
                                   it.seed, it.shape)).encode())
                    if it.published is not None:
                        h.update(repr(it.published).encode())
                    if it.trellis is not None:  # version 1 hashes as before it was a field
                        t = it.trellis if it.trellis[3] != 1 else it.trellis[:3]
                        h.update(repr(t).encode())
                    if it.in_scales:
                        h.update(repr(("in_scales", it.column_min_ratio)).encode())
                    if it.neuron_ratio is not None:
                        h.update(repr(("neuron_ratio", it.neuron_ratio)).encode())
        return h.hexdigest()

    def readers(self) -> dict[str, set[str]]:
        """source file -> names of the jobs that read it (for deleting source shards)."""
        out: dict[str, set[str]] = {}
        for job in self.jobs:
            for f in job.files:
                out.setdefault(f, set()).add(job.name)
        return out


def cut_piece(a, piece: Piece):
    """One expert's slice `a` (in, out) / (out, in) / (n,) -> the piece's (out, in) / (n,)."""
    import numpy as np

    k = piece.parts
    if a.ndim == 1:
        a = a[piece.part::k] if piece.interleaved else np.split(a, k)[piece.part]
    else:
        axis = 1 if piece.transpose else 0
        if k > 1:
            if piece.interleaved:
                a = a[:, piece.part::k] if axis == 1 else a[piece.part::k]
            else:
                a = np.split(a, k, axis=axis)[piece.part]
        if piece.transpose:
            a = a.T
    return np.ascontiguousarray(a)


def split_piece_of(recipe: Recipe, file: str, source_name: str, name: str, expert: int
                   ) -> Piece | None:
    """The Piece a split output tensor `name` was cut from (None if no split rule matches)."""
    split = recipe.split_for(source_name)
    if split is None:
        return None
    if split.names:  # experts stacked (E, out, in) in the source, named per expert
        ok = name == split.names.format(e=expert)
        return Piece(file, source_name, expert) if ok else None
    if all("{e}" in into for into in split.into):  # the generic recipe's full names
        names = [into.format(e=expert) for into in split.into]
        if name not in names:
            return None
        part = names.index(name)
    else:
        marker = ".experts."
        prefix = source_name[: source_name.rfind(marker) + len(marker)] + f"{expert}."
        if not name.startswith(prefix) or name[len(prefix):] not in split.into:
            return None
        part = split.into.index(name[len(prefix):])
    return Piece(file, source_name, expert, part, len(split.into), split.interleaved,
                 split.transpose)


def expert_of(name: str) -> int | None:
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def choose_recipe(config: dict, recipe: str | None, overrides: dict) -> Recipe:
    try:
        r = load_recipe(recipe) if recipe else recipe_for_model_type(config.get("model_type"))
        return r.with_overrides(**overrides)
    except RecipeError as e:
        raise ConversionError(str(e)) from None


def bind_to_tensors(rec: Recipe, config: dict, headers: dict) -> Recipe:
    """The recipe bound to what mlx-lm's model makes of these tensors (recipe.bind_architecture)."""
    tensors = {}
    for h in headers.values():
        for info in h.tensors.values():
            tensors.setdefault(info.name, (tuple(info.shape), info.dtype))
    # int4 pack-quantized weights by their logical names (X.weight, stacked X), as mlx-lm's
    # model names them; FP8 and MXFP4 keep their names and the architecture reads their
    # scales (which keeps the digests, hence the recipe hashes, of their conversions)
    packed = any(n.endswith("_packed") for n in tensors)  # pairing 1M tensors costs ~2 s
    for name, pub in (published.pair(headers, config).published.items() if packed else ()):
        if pub.format == "int4":
            for t in (pub.tensor, *(q.tensor for q in pub.partners)):
                tensors.pop(t, None)
            tensors[name] = (pub.shape, "F32")
    try:
        return bind_architecture(rec, config, tensors)
    except RecipeError as e:
        raise ConversionError(str(e)) from None


def coded_shapes(out: int, padded_in: int, bits, group_size: int) -> tuple[tuple, tuple]:
    """Shapes of (codes, scales) for a coded (out, in) weight: FORMAT.md, steps 3 and 5."""
    return (out, words_per_row(padded_in, bits)), (out, padded_in // group_size)


def build_plan(
    source: Source,
    recipe: str | None = None,
    overrides: dict | None = None,
    min_job_bytes: int = 1 * GB,
    max_job_bytes: int = 5 * GB,
) -> Plan:
    """Validate everything that can be checked without tensor data, and lay out the output.

    Raises PlanError listing every problem found (each names the file and the tensor).
    """
    config = source.config()
    rec = choose_recipe(config, recipe, overrides or {})
    files = source.shard_files()
    problems: list[str] = []
    headers: dict[str, SafetensorsHeader] = {}
    for f in files:
        try:
            headers[f] = source.header(f)
        except SourceError as e:
            problems.append(str(e))
    problems += _check_index(source.index(), headers)
    if problems:
        raise PlanError(problems)
    rec = bind_to_tensors(rec, config, headers)

    num_layers = num_layers_of(config)
    items: list[tuple[tuple[int, int], Item]] = []
    dropped, kept_small = [], []
    file_pos = {f: i for i, f in enumerate(files)}
    seen: dict[str, str] = {}
    pairing = published.pair(headers, config)
    problems += pairing.problems
    for f in files:
        for info in pairing.tensors(f, headers[f]):
            if info.name in seen:
                continue  # reported by _check_index when an index exists
            seen[info.name] = f
            reason = rec.unsupported(info.name)
            if reason:
                problems.append(f"{f}: tensor {info.name!r} ({info.dtype} {list(info.shape)}): "
                                f"{reason}")
                continue
            layer = layer_of(info.name)
            if rec.drop_extra_layers and layer is not None and num_layers is not None \
                    and layer >= num_layers:
                dropped.append(info.name)
                continue
            split = rec.split_for(info.name)
            pieces = _split_pieces(f, info, split, problems) if split else \
                [(info.name, Piece(f, info.name), info.shape, info.nbytes)]
            for out_name, piece, shape, read in pieces:
                anchor = (file_pos[f], info.start + (piece.expert or 0))
                it = _item(rec, out_name, piece, info.dtype, shape, read, layer, num_layers,
                           f, info.name, problems, dropped, kept_small)
                pub = pairing.published.get(info.name)
                if it is not None and pub is not None:
                    it = published.attach(it, pub)
                if it is not None:
                    items.append((anchor, it))
    problems += _unused_tensor_bits(rec, [it for _, it in items])
    if problems:
        raise PlanError(problems)
    units = _units(items)
    jobs = _jobs(units, files, headers, min_job_bytes, max_job_bytes)
    identities = {f: source.identity(f) for f in files}
    return Plan(source.description, config, rec, rec.hash(), jobs, identities, headers,
                dropped, kept_small)


def _check_index(index: dict | None, headers: dict[str, SafetensorsHeader]) -> list[str]:
    problems = []
    where: dict[str, str] = {}
    for f, h in headers.items():
        for t in h.tensors:
            if t in where:
                problems.append(f"{f}: tensor {t!r} is also in {where[t]}: two shards hold it")
            where.setdefault(t, f)
    if index is None:
        return problems
    wm = index["weight_map"]
    for t, f in wm.items():
        if f in headers and t not in headers[f].tensors:
            other = where.get(t)
            hint = f" (it is in {other})" if other else ""
            problems.append(f"{INDEX_FILE}: tensor {t!r} is mapped to {f} but {f} has no such "
                            f"tensor{hint}")
    for t, f in where.items():
        if t not in wm:
            problems.append(f"{f}: tensor {t!r} is missing from {INDEX_FILE} (missing index "
                            "entry): the index and the shards disagree")
    return problems


def _unused_tensor_bits(rec: Recipe, items: list[Item]) -> list[str]:
    """A problem for each [tensor_bits] name that is not a tensor this plan codes (a
    recipe allocated for another model, or a tensor the recipe keeps or drops)."""
    coded = {it.name for it in items if it.codec != "raw"}
    missing = sorted(set(rec.data.get("tensor_bits", {})) - coded)
    if not missing:
        return []
    return [f"{rec.source}: [tensor_bits] names {len(missing)} tensor(s) this checkpoint does "
            f"not code, e.g. {missing[0]!r}: was the recipe allocated for another model? "
            "(turboquant allocate REPO writes one for the model REPO was converted from)"]


def _split_pieces(f: str, info, split, problems: list[str]):
    """Per-expert pieces of a stacked tensor (E, in, out) or (E, out, in) or (E, n)."""
    if split.names:  # (E, out, in) stacked, as mlx-lm keeps experts: one name per expert
        e_count, a, b = info.shape
        per = info.nbytes // max(e_count, 1)
        return [(split.names.format(e=e), Piece(f, info.name, e), (a, b), per)
                for e in range(e_count)]
    k = len(split.into)
    marker = ".experts."
    i = info.name.rfind(marker)
    templates = all("{e}" in into for into in split.into)  # the generic recipe's full names
    if i < 0 and not templates:
        problems.append(f"{f}: tensor {info.name!r}: a [[split]] rule needs a name containing "
                        f"'{marker}'")
        return []
    prefix = info.name[: i + len(marker)]
    shape = info.shape
    if len(shape) == 3:
        e_count, a, b = shape
        axis_len = b if split.transpose else a
    elif len(shape) == 2 and not split.transpose:
        e_count, axis_len = shape
    else:
        problems.append(f"{f}: tensor {info.name!r} has shape {list(shape)}; a [[split]] rule "
                        "needs (experts, in, out) with transpose, (experts, out, in), or "
                        "(experts, n)")
        return []
    if axis_len % k:
        problems.append(f"{f}: tensor {info.name!r} shape {list(shape)}: output axis "
                        f"{axis_len} does not split into {k} parts")
        return []
    per_expert = info.nbytes // max(e_count, 1)
    out = []
    for e in range(e_count):
        for p, into in enumerate(split.into):
            if len(shape) == 3:
                new = (b // k, a) if split.transpose else (a // k, b)
            else:
                new = (axis_len // k,)
            piece = Piece(f, info.name, e, p, k, split.interleaved, split.transpose)
            name = into.format(e=e) if templates else f"{prefix}{e}.{into}"
            out.append((name, piece, new, per_expert if p == 0 else 0))
    return out


# What the generic recipe keeps raw without being told: floats and FP8 (a published
# format's other tensors are read with their weight, pipeline/published.py).
RAW_DTYPES = (*FLOAT_DTYPES, "F64", *published.FP8)


def _item(rec: Recipe, name, piece, dtype, shape, read, layer, num_layers, f, src_name,
          problems, dropped, kept_small) -> Item | None:
    res = rec.resolve(name, layer, num_layers)
    what = f"{f}: tensor {src_name!r}" + (f" (as {name!r})" if name != src_name else "")
    if res is None:
        problems.append(f"{what} matches no rule of recipe {rec.name!r} ({rec.source}); add "
                        "a [[rules]] entry, a keep or a drop pattern, or pick another --recipe")
        return None
    if res.action == "drop":
        dropped.append(name)
        return None
    expert = expert_of(name)
    raw = Item(name, piece, dtype, tuple(shape), "raw", None, None, None, None, layer, expert,
               (Stored(name, dtype, tuple(shape)),), read, res.role)
    if res.action == "keep":
        if rec.generic and (res.rule or "").startswith("mlx-lm:") and dtype not in RAW_DTYPES:
            problems.append(f"{what}: dtype {dtype} is neither a float nor a published format "
                            f"({published.GUIDE}), so the generic recipe cannot tell what it "
                            "holds; give it a keep (or drop) pattern in a recipe of your own "
                            "(docs/recipes.md) or convert a BF16 copy of the model")
            return None
        return raw
    if dtype not in FLOAT_DTYPES:
        problems.append(f"{what}: dtype {dtype} cannot be coded (BF16, F16, F32 and the "
                        f"published formats of {published.GUIDE} are read); keep it with a "
                        "keep pattern or convert a BF16 copy of the model")
        return None
    if len(shape) == 1 or (len(shape) == 2 and shape[1] < res.group_size) or 0 in shape:
        kept_small.append(name)
        return raw
    if len(shape) != 2:
        problems.append(f"{what} has shape {list(shape)}: a quantize rule needs a 2-D weight "
                        "(out, in); add a [[split]] rule for stacked experts")
        return None
    out_f, in_f = shape
    gs = res.group_size
    padded = -(-in_f // gs) * gs
    codes, scales = coded_shapes(out_f, padded, res.bits, gs)
    ratio = res.column_min_ratio if expert is None else None  # experts: TQSwitchLinear
    names = stored_names(name, res.codec, ratio is not None)
    stored = (Stored(names[0], "U32", codes), Stored(names[1], "F16", scales))
    if ratio is not None:
        stored += (Stored(names[2], "F16", (in_f,)),)
    seed = tensor_seed(rec.model_seed, rotation_key(name))
    return Item(name, piece, dtype, tuple(shape), res.codec, res.bits, gs, seed, padded, layer,
                expert, stored, read, res.role, trellis=res.trellis, column_min_ratio=ratio,
                neuron_ratio=res.neuron_ratio if ratio is not None else None)


def _units(items: list[tuple[tuple[int, int], Item]]) -> list[Unit]:
    groups: dict[str, list[tuple[tuple[int, int], Item]]] = {}
    for anchor, it in items:
        m = _EXPERT.search(it.name)
        key = it.name[: m.end()] if m else it.name
        groups.setdefault(key, []).append((anchor, it))
    units = []
    for key, members in groups.items():
        anchor = min(a for a, _ in members)
        units.append(Unit(key, tuple(sorted((it for _, it in members), key=lambda i: i.name)),
                          anchor))
    units.sort(key=lambda u: (u.anchor, u.key))
    return units


def _jobs(units: list[Unit], files: list[str], headers, min_bytes: int, max_bytes: int
          ) -> list[Job]:
    by_file: dict[int, list[Unit]] = {}
    for u in units:
        by_file.setdefault(u.anchor[0], []).append(u)
    groups: list[list[Unit]] = []
    current: list[Unit] = []
    for fi in range(len(files)):
        mine = by_file.get(fi, [])
        if not mine:
            continue
        size = sum(u.read_bytes for u in mine)
        if size > max_bytes:  # split a big shard into consecutive pieces
            if current:
                groups.append(current)
                current = []
            piece: list[Unit] = []
            acc = 0
            target = size / math.ceil(size / max_bytes)
            for u in mine:
                if piece and acc + u.read_bytes > target * 1.0001:
                    groups.append(piece)
                    piece, acc = [], 0
                piece.append(u)
                acc += u.read_bytes
            if piece:
                groups.append(piece)
            continue
        current += mine
        if sum(u.read_bytes for u in current) >= min_bytes:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    n = len(groups)
    items = [it for g in groups for u in g for it in u.items]
    version = format_version((it.codec for it in items), any(it.in_scales for it in items))
    jobs = []
    for i, g in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        laid, header = _layout(g, version)
        used = sorted({f for u in laid for it in u.items for f in published.files_of(it)},
                      key=files.index)
        jobs.append(Job(i, f"job-{i + 1:05d}", shard, tuple(laid), tuple(used), header))
    return jobs


def _layout(units: list[Unit], version: int = FORMAT_VERSION) -> tuple[list[Unit], bytes]:
    """Fix every stored tensor's absolute byte range; return the units and the header."""
    entries = [s for u in units for it in u.items for s in it.stored]
    meta = {"format": QUANT_METHOD, "format_version": str(version)}
    header: dict = {"__metadata__": meta}
    off = 0
    for s in entries:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape),
                          "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    blob = struct.pack("<Q", len(raw)) + raw
    pos = len(blob)
    laid = []
    for u in units:
        its = []
        for it in u.items:
            stored = []
            for s in it.stored:
                stored.append(Stored(s.name, s.dtype, s.shape, pos, pos + s.nbytes))
                pos += s.nbytes
            its.append(_replace_stored(it, tuple(stored)))
        laid.append(Unit(u.key, tuple(its), u.anchor))
    return laid, blob


def _replace_stored(it: Item, stored) -> Item:
    from dataclasses import replace

    return replace(it, stored=stored)

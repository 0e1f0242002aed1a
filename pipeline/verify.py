"""Re-open a TurboQuant repo and check it: structure, checksums, and decoded errors.

1. config.json's quantization_config, the index and the manifest agree with each other and
   with every shard's safetensors header (names, dtypes, shapes, byte ranges);
2. every manifest row's sha256 over its byte range matches;
3. a sample of coded tensors (or all, with `full`) is decoded: finite, and its error is
   compared with the recorded `rel_mse` - recomputed against the source weights when the
   source checkpoint is given (within `match_tolerance`), else checked against the codec's
   bounds;
4. with the source given and the conversion's ledger in the repo (`.turboquant/jobs/`), the
   CRC-32 the job recorded of each tensor's source bytes (`source_crc32`) is compared with
   the given source's: the sampled tensors and as many kept raw ones (every tensor with
   `full`). Published FP8 / MXFP4 / int4 tensors record none (their errors are checked).

How close a recomputation can be. The converter records rel_mse from encode's per-group
float32 sums (||x||^2, <x, q>, <q, q> over `group_size` rotated weights, in order) combined in
float64 as ||x||^2 - 2 s <x, q> + s^2 <q, q>; verify decodes the codes (float32, as the runtime
does) and sums (x - w)^2 and x^2 in float64. The two differ only by float32 rounding, which is
bounded (unit roundoff u = 2^-24; Higham, "Accuracy and Stability of Numerical Algorithms",
eq. 3.5, |error of an in-order sum of k terms| <= gamma_k * sum of |terms|, gamma_k ~ k u):

- each group's three sums err by at most gamma_(gs+1) times ||x||^2, 2 s |<x, q>| and
  s^2 <q, q>, which add up (Cauchy-Schwarz, s <q, q> ~ <x, q>) to at most 4 ||x||^2 per group,
  and ||x||^2 itself (the denominator) by gamma_(gs+1): 4 + rel_mse times gamma_(gs+1) in all;
- each float32 rotation (encode's forward one, decode's inverse) moves the weights by at most
  r = (log2 n + a^1.5 + 2) u in norm (log2 n butterfly stages, one sum of a terms for the
  12/20/28 or dense odd factor, bounded by a^1.5 here with a <= 4 * odd part of n, and the
  scale), which moves ||x - w||^2 / ||x||^2 by at most 2 sqrt(rel_mse) r + r^2; decode's s * q
  products add u.

On clean conversions (dense and MoE, numba and numpy encode paths, the bundled model) the
measured gap is 100-1000x below this bound (tests/test_verify_source.py prints it); a
different source of the same shapes moves rel_mse by about ||W' - W||^2 / ||W||^2, far more
unless W' is within a fraction of a percent of W.
"""

from __future__ import annotations

import json
import os
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from turboquant.manifests.schema import (INDEX_FILE, QUANT_METHOD, READ_VERSIONS, TRELLIS_VERSIONS,
                                         read_manifest, stored_names)

from . import published
from .checksum import crc32
from .ledger import WORK, sha256_file_range
from .plan import cut_piece, split_piece_of
from .errors import SourceError
from .safetensors_io import read_header, read_raw, to_float32

# Upper bounds on rel_mse for Gaussian-like weights: the Lloyd-Max MSE of each codebook
# (0.1175, 0.0345, 0.0095; ternary 0.190) with head-room for fp16 scales and small groups.
REL_MSE_BOUND = {2: 0.16, 3: 0.05, 4: 0.015, "ternary": 0.25}
UNIT_ROUNDOFF = 2.0**-24  # float32


def match_tolerance(group_size: int, in_features: int, rel_mse: float) -> float:
    """The largest |recomputed - recorded| rel_mse float32 rounding can explain (module notes)."""
    u, k = UNIT_ROUNDOFF, group_size + 1
    gamma = k * u / (1 - k * u)
    odd = in_features // (in_features & -in_features)
    r = (math.log2(in_features) + (4 * odd) ** 1.5 + 2) * u
    root = math.sqrt(max(rel_mse, 0.0))
    return (4 + rel_mse) * gamma + 2 * (2 * root * r + r * r) + 2 * root * u


@dataclass
class VerifyReport:
    repo: str
    rows: int = 0
    shards: int = 0
    checksums_ok: int = 0
    source_crcs: int | None = None  # source CRCs compared (None: no source or no ledger)
    decoded: list[tuple[str, float, float | None]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # (name, out_error, out_error_from): "text" (--input-stats), "weights", "ones" or None
    out_errors: list[tuple[str, float, str | None]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        lines = [f"{self.repo}: {self.rows} tensors in {self.shards} shards, "
                 f"{self.checksums_ok} checksums ok, {len(self.decoded)} decoded"]
        if self.source_crcs is not None:
            lines.append(f"  source CRC-32 compared for {self.source_crcs} tensors")
        for name, recorded, measured in self.decoded[:10]:
            m = "" if measured is None else f", recomputed {measured:.6f}"
            lines.append(f"  {name}: rel_mse recorded {recorded:.6f}{m}")
        if len(self.decoded) > 10:
            lines.append(f"  ... {len(self.decoded) - 10} more decoded")
        lines += out_error_summary(self.out_errors)
        if self.problems:
            lines.append(f"FAILED: {len(self.problems)} problem(s)")
            lines += [f"  {p}" for p in self.problems[:50]]
        else:
            lines.append("OK")
        return "\n".join(lines)


def out_error_summary(out_errors: list[tuple[str, float, str | None]],
                      top: int = 5) -> list[str]:
    """Lines on a repo's out_error: its total, how many tensors each estimate weighted
    (out_error_from) and the tensors with the largest (docs/quality.md: they order tensors
    by the loss they cause)."""
    if not out_errors:
        return []
    ranked = sorted(out_errors, key=lambda x: -x[1])
    total = math.fsum(v for _, v, _ in out_errors)
    kinds = {}
    for _, _, k in out_errors:
        kinds[k or "text"] = kinds.get(k or "text", 0) + 1
    how = ", ".join(f"{n} from {k}" for k, n in sorted(kinds.items()))
    lines = [f"  out_error ({how}): total {total:.4g}; largest:"]
    lines += [f"    {name}: {v:.4g} ({100 * v / total:.1f}%)" for name, v, _ in ranked[:top]]
    return lines


def verify_repo(repo: str | Path, source: str | Path | None = None, full: bool = False,
                sample: int = 8, seed: int = 0) -> VerifyReport:
    repo = Path(repo)
    rep = VerifyReport(str(repo))
    try:
        config = json.loads((repo / "config.json").read_text())
        index = json.loads((repo / INDEX_FILE).read_text())
        table = read_manifest(repo)
    except (OSError, ValueError) as e:
        rep.problems.append(f"cannot read the repo files: {e}")
        return rep
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != QUANT_METHOD or q.get("format_version") not in READ_VERSIONS:
        rep.problems.append(f"config.json: quantization_config is not {QUANT_METHOD} format "
                            f"version {' or '.join(map(str, READ_VERSIONS))}: "
                            f"{q.get('quant_method')!r} "
                            f"{q.get('format_version')!r}")
    rows = table.to_pylist()
    rep.rows = len(rows)
    rep.out_errors = [(r["name"], r["out_error"], r.get("out_error_from")) for r in rows
                      if r.get("out_error") is not None]
    weight_map = index.get("weight_map", {})
    headers = {}
    for shard in sorted({r["shard"] for r in rows}):
        try:
            headers[shard] = read_header(repo / shard, shard)
        except Exception as e:  # noqa: BLE001 - report every broken shard
            rep.problems.append(str(e))
    rep.shards = len(headers)
    listed = set()
    for r in rows:
        h = headers.get(r["shard"])
        if h is None:
            continue
        names = stored_names(r["name"], r["codec"], bool(r.get("in_scales")))
        listed.update(names)
        infos = [h.tensors.get(n) for n in names]
        if any(i is None for i in infos):
            rep.problems.append(f"{r['shard']}: tensor {r['name']!r}: stored tensors {names} "
                                "are not all in the shard's header")
            continue
        if infos[0].start != r["byte_start"] or infos[-1].end != r["byte_end"]:
            rep.problems.append(f"{r['shard']}: tensor {r['name']!r}: manifest byte range "
                                f"[{r['byte_start']}, {r['byte_end']}) disagrees with the header")
        for n in names:
            if weight_map.get(n) != r["shard"]:
                rep.problems.append(f"{INDEX_FILE}: {n!r} maps to {weight_map.get(n)!r}, the "
                                    f"manifest says {r['shard']!r}")
        if sha256_file_range(repo / r["shard"], r["byte_start"], r["byte_end"]) == r["checksum"]:
            rep.checksums_ok += 1
        else:
            rep.problems.append(f"{r['shard']}: tensor {r['name']!r}: checksum mismatch (bytes "
                                f"[{r['byte_start']}, {r['byte_end']}) changed or are corrupt)")
    extra = set(weight_map) - listed
    if extra:
        rep.problems.append(f"{INDEX_FILE}: {len(extra)} tensors not in the manifest, e.g. "
                            f"{sorted(extra)[0]!r}")
    if rep.problems:
        return rep
    coded = [r for r in rows if r["codec"] != "raw"]
    chosen = coded if full else random.Random(seed).sample(coded, min(sample, len(coded)))
    src = _SourceReader(Path(source), q.get("recipe")) if source else None
    for r in chosen:
        _check_decode(repo, r, headers[r["shard"]], src, rep)
    if src is not None:
        raw = [r for r in rows if r["codec"] == "raw"]
        kept = raw if full else random.Random(seed).sample(raw, min(sample, len(raw)))
        _check_source_crcs(repo, chosen + kept, src, rep)
    return rep


def recorded_source_crcs(repo: Path) -> dict[str, str] | None:
    """Each tensor's `source_crc32` from the repo's job ledgers (None: no ledger there, e.g.
    a repo downloaded from the Hub)."""
    ledgers = sorted((repo / WORK / "jobs").glob("*.ledger.jsonl"))
    if not ledgers:
        return None
    crcs = {}
    for path in ledgers:
        for line in path.read_bytes().split(b"\n")[:-1]:  # a torn last line is not a record
            for item in json.loads(line).get("items", []):
                if "source_crc32" in item:
                    crcs[item["name"]] = item["source_crc32"]
    return crcs


def _check_source_crcs(repo: Path, rows: list[dict], src: "_SourceReader",
                       rep: VerifyReport) -> None:
    try:
        recorded = recorded_source_crcs(repo)
    except (OSError, ValueError) as e:
        rep.problems.append(f"{repo / WORK / 'jobs'}: cannot read the job ledgers: {e}")
        return
    if recorded is None:
        return
    rep.source_crcs = 0
    for r in rows:
        want = recorded.get(r["name"])
        if want is None or (want == UNRECORDED_CRC and r.get("source_dtype") in published.LABELS):
            continue  # older releases recorded no CRC of a published tensor (zeros)
        try:
            got = src.crc32(r)
        except SourceError as e:
            if f"source {src.folder}: {e}" not in rep.problems:  # once per broken file
                rep.problems.append(f"source {src.folder}: {e}")
            continue
        if got is None:
            if not any(r["name"] in p for p in rep.problems):
                rep.problems.append(f"{r['name']!r}: cannot locate {r['source_name']!r} in the "
                                    f"source {src.folder} (another model?)")
            continue
        rep.source_crcs += 1
        if got != want:
            rep.problems.append(f"{src.folder / r['source_shard']}: tensor {r['source_name']!r}: "
                                f"CRC-32 {got}, the ledger recorded {want} when {r['name']!r} "
                                "was converted: the repo was not converted from this source "
                                "(or the source changed since); give the source it was "
                                "converted from, or convert again with --fresh")


UNRECORDED_CRC = "00000000"


def _crc_hex(data, crc: int = 0) -> str:
    """CRC-32 of `data` (continuing `crc`) as the ledger writes it (job._SourceCrc)."""
    return f"{crc32(data, crc):08x}"


def trellis_spec(row: dict) -> dict:
    """QuantSpec's codec fields of a manifest row (empty for the scalar code)."""
    if row["codec"] != "trellis":
        return {}
    version = row.get("trellis_version")
    if version not in TRELLIS_VERSIONS:
        raise ValueError(f"tensor {row['name']!r}: trellis version {version!r}, this "
                         f"turboquant reads versions {', '.join(map(str, TRELLIS_VERSIONS))}: "
                         "upgrade turboquant")
    return {"codec": "trellis", "trellis_state_bits": row["trellis_state_bits"],
            "trellis_values": row["trellis_values"], "trellis_block": row["trellis_block"],
            "trellis_version": int(version)}


def load_coded(repo: Path, row: dict, header):
    """The QuantizedTensor of a manifest row, read from its shard."""
    import mlx.core as mx

    from turboquant.stages import QuantizedTensor, QuantSpec

    names = stored_names(row["name"], row["codec"], bool(row.get("in_scales")))
    ci, si = header.tensors[names[0]], header.tensors[names[1]]
    t = None
    with open(repo / row["shard"], "rb") as f:
        f.seek(ci.start)
        codes = np.frombuffer(f.read(ci.nbytes), dtype="<u4").reshape(ci.shape)
        f.seek(si.start)
        scales = np.frombuffer(f.read(si.nbytes), dtype="<f2").reshape(si.shape)
        if len(names) == 3:
            ti = header.tensors[names[2]]
            f.seek(ti.start)
            t = mx.array(np.frombuffer(f.read(ti.nbytes), dtype="<f2").reshape(ti.shape))
    bits = "ternary" if row["codec"] == "ternary" else row["bits"]
    out_f, in_f = row["shape"]
    spec = QuantSpec(bits, row["group_size"], int(row["seed"]), in_f, row["padded_in"],
                     True, **trellis_spec(row))
    return QuantizedTensor(mx.array(codes), mx.array(scales), (out_f, in_f), spec, in_scales=t)


class _SourceReader:
    """Reads the original weights of a manifest row from a local source folder."""

    def __init__(self, folder: Path, recipe_name: str | None):
        self.folder = folder
        self.headers = {}
        self.recipe = None
        self.published = None
        self._bound = False
        self.crcs: dict[str, str] = {}  # row name -> CRC of what `weight` read (read once)
        if recipe_name:
            from turboquant.manifests.recipe import RecipeError, load_recipe

            try:
                self.recipe = load_recipe(recipe_name)
            except RecipeError:
                self.recipe = None

    def _split_recipe(self):
        """The recipe bound to mlx-lm's reading of the source, as the plan bound it: the
        generic recipe's splits (stacked or fused experts) come from that reading."""
        if self.recipe is not None and not self._bound:
            self._bound = True
            from .errors import ConversionError
            from .plan import bind_to_tensors

            try:
                config = json.loads((self.folder / "config.json").read_text())
                headers = {p.name: self._header(p.name)
                           for p in sorted(self.folder.glob("*.safetensors"))}
                self.recipe = bind_to_tensors(self.recipe, config, headers)
            except (OSError, ValueError, ConversionError):
                pass  # the family recipe's own split rules stand alone
        return self.recipe

    def _header(self, f: str):
        if f not in self.headers:
            self.headers[f] = read_header(self.folder / f, f)
        return self.headers[f]

    def weight(self, row: dict) -> np.ndarray | None:
        """The source weight (out, in) as float32, or None if it cannot be located; the
        CRC of what it read is kept for `crc32` (one read of the source for both)."""
        if row.get("source_dtype") in published.LABELS:
            w = self._published_weight(row)
            if w is not None:
                self.crcs[row["name"]] = _crc_hex(np.ascontiguousarray(w, dtype="<f4"))
            return w
        found = self._located(row)
        if found is None:
            return None
        f, info, piece = found
        fd = os.open(self.folder / f, os.O_RDONLY)
        try:
            if piece is None:
                raw = read_raw(fd, info, 0, info.numel, f)
                self.crcs[row["name"]] = _crc_hex(raw)
                return to_float32(raw, info.dtype).reshape(info.shape)
            per = info.numel // info.shape[0]
            raw = read_raw(fd, info, piece.expert * per, per, f)
            bits = raw.view({1: np.uint8, 2: "<u2", 4: "<u4", 8: "<u8"}[info.itemsize])
            cut = np.ascontiguousarray(cut_piece(bits.reshape(info.shape[1:]), piece))
            self.crcs[row["name"]] = _crc_hex(cut)
            x = to_float32(raw, info.dtype).reshape(info.shape[1:])
            return cut_piece(x, piece)
        finally:
            os.close(fd)

    def _located(self, row: dict):
        """(shard, header entry, split piece or None for a whole tensor) of a row's source,
        or None when the source does not hold it."""
        f = row["source_shard"]
        info = self._header(f).tensors.get(row["source_name"])
        if info is None:
            return None
        if row["source_name"] == row["name"]:
            return f, info, None
        recipe = self._split_recipe()
        if recipe is None or row["expert"] is None:
            return None
        piece = split_piece_of(recipe, f, row["source_name"], row["name"], row["expert"])
        return None if piece is None else (f, info, piece)

    def crc32(self, row: dict) -> str | None:
        """CRC-32 of the source bytes a row was converted from, as the job read them (a
        whole tensor: its byte range; a split piece: its raw values, cut; an FP8 / MXFP4 /
        int4 tensor: its dequantized float32 values); None if absent. A whole source tensor
        is read a chunk at a time; anything else through `weight` (one expert, one published
        tensor), unless `weight` read it already."""
        if row["name"] not in self.crcs:
            found = None if row.get("source_dtype") in published.LABELS else self._located(row)
            if found is not None and found[2] is None:  # a whole tensor, kept raw maybe: big
                f, info, _ = found
                fd = os.open(self.folder / f, os.O_RDONLY)
                try:
                    crc, step = 0, max(1, (1 << 24) // info.itemsize)
                    for start in range(0, info.numel, step):
                        crc = crc32(read_raw(fd, info, start,
                                                  min(step, info.numel - start), f), crc)
                    return _crc_hex(b"", crc)
                finally:
                    os.close(fd)
            if self.weight(row) is None:
                return None
        return self.crcs.pop(row["name"])

    def _published_weight(self, row: dict) -> np.ndarray | None:
        """An FP8 / MXFP4 / int4 source weight, dequantized (pipeline/published.py)."""
        if self.published is None:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            headers = {f: self._header(f) for f in files}
            config = json.loads((self.folder / "config.json").read_text())
            self.published = published.PublishedFolder(self.folder, headers, config)
        if row["expert"] is None or row["name"] == row["source_name"]:
            return self.published.tensor(row["source_name"])
        recipe = self._split_recipe()
        piece = split_piece_of(recipe, row["source_shard"], row["source_name"],
                               row["name"], row["expert"]) if recipe else None
        if piece is None:
            return None
        return cut_piece(self.published.tensor(row["source_name"], piece.expert), piece)


def _check_decode(repo: Path, row: dict, header, src: _SourceReader | None,
                  rep: VerifyReport) -> None:
    import mlx.core as mx

    from turboquant.stages import decode

    name = row["name"]
    qt = load_coded(repo, row, header)
    w = decode(qt)
    mx.eval(w)
    if not bool(mx.all(mx.isfinite(w)).item()):
        rep.problems.append(f"{row['shard']}: tensor {name!r}: decodes to non-finite values")
        return
    recorded = row["rel_mse"]
    bits = "ternary" if row["codec"] == "ternary" else row["bits"]
    if recorded is None or not math.isfinite(recorded):
        rep.problems.append(f"{name!r}: recorded rel_mse is {recorded!r}")
        return
    measured = None
    if src is not None:
        try:
            ref = src.weight(row)
        except SourceError as e:
            rep.problems.append(f"source {src.folder}: {e}")
            return
        if ref is None:
            rep.problems.append(f"{name!r}: cannot locate {row['source_name']!r} in the source "
                                f"{src.folder} (another model?)")
            return
        if tuple(ref.shape) != tuple(w.shape):
            rep.problems.append(f"{name!r}: the source's {row['source_name']!r} has shape "
                                f"{tuple(ref.shape)}, the repo's {tuple(w.shape)} (another "
                                "model?)")
            return
        if qt.in_scales is not None:  # rel_mse is of W / t, what the codebook saw
            t = np.asarray(qt.in_scales.astype(mx.float32))
            ref, w = ref / t, w / mx.array(t)
        measured = _relative_error(ref, w)
        tol = match_tolerance(row["group_size"], row["shape"][1], recorded)
        if not abs(measured - recorded) <= tol:
            rep.problems.append(f"{name!r}: rel_mse recomputed from the source is {measured:.8g}, "
                                f"the manifest records {recorded:.8g} (they may differ by "
                                f"{tol:.2g} at most): the repo was not converted from this "
                                "source, or its codes were changed")
    elif recorded > REL_MSE_BOUND[bits]:
        rep.problems.append(f"{name!r}: recorded rel_mse {recorded:.4g} is above the bound "
                            f"{REL_MSE_BOUND[bits]} for {bits}-bit codes")
    rep.decoded.append((name, recorded, measured))


def _relative_error(ref: np.ndarray, w) -> float:
    """||ref - w||^2 / ||ref||^2 in float64, a block of rows at a time."""
    ref = ref.reshape(ref.shape[0], -1)
    step = max(1, (1 << 20) // max(1, ref.shape[1]))
    e2 = n2 = 0.0
    for r0 in range(0, ref.shape[0], step):
        x = ref[r0:r0 + step].astype(np.float64)
        d = x - np.asarray(w[r0:r0 + step]).astype(np.float64)
        e2 += float(np.einsum("ij,ij->", d, d))
        n2 += float(np.einsum("ij,ij->", x, x))
    if n2 == 0.0:
        return 0.0 if e2 == 0.0 else math.inf
    return e2 / n2

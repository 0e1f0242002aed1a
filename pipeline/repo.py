"""The repo-level files of a TurboQuant repo, written once every shard is final.

`manifest.parquet` (one row per output tensor), `model.safetensors.index.json`,
`config.json` (source config + `quantization_config`), the tokenizer files copied from
the source, and the model card `README.md`. Every file is written through a temporary
file and an atomic rename, and depends only on the plan and the ledgers, so a rerun after
a kill writes the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from turboquant.manifests.schema import INDEX_FILE, MANIFEST_FILE, QUANT_METHOD, write_manifest

from .card import model_card
from .errors import LedgerError
from .ledger import WorkDir, atomic_copy, atomic_write, crash_point, read_ledger_records
from .plan import Plan
from .sources import Source


@dataclass
class RepoSummary:
    tensors: int
    coded_tensors: int
    coded_weights: int
    coded_bytes: int
    total_weights: int
    total_bytes: int  # tensor data in the shards
    files_bytes: int  # shard files on disk (headers included)
    shards: int

    @property
    def coded_bits_per_weight(self) -> float:
        return 8 * self.coded_bytes / self.coded_weights if self.coded_weights else 0.0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.total_weights if self.total_weights else 0.0


def manifest_rows(plan: Plan, work: WorkDir, stats=None) -> list[dict]:
    """One row per output tensor, from the plan and the jobs' ledgers, with each coded
    tensor's `out_error` and `out_error_from`: weighted by `stats` (calibrate.InputStats,
    "text") where given, else by the input energies the job estimated from the layer's
    own tensors ("weights", or "ones" where it knew none)."""
    rows = []
    for job in plan.jobs:
        records = read_ledger_records(work, job)
        if len(records) != len(job.units):
            raise LedgerError(f"{job.name}: ledger has {len(records)} of {len(job.units)} units; "
                              "the job is not finished")
        for unit, rec in zip(job.units, records):
            by_name = {r["name"]: r for r in rec["items"]}
            for it in unit.items:
                r = by_name[it.name]
                rows.append({
                    "name": it.name,
                    "source_name": it.piece.tensor,
                    "source_shard": it.piece.file,
                    "shape": list(it.shape),
                    "source_dtype": it.source_dtype,
                    "codec": it.codec,
                    "bits": it.bits if isinstance(it.bits, int) else None,
                    "group_size": it.group_size,
                    "seed": it.seed,
                    "padded_in": it.padded_in,
                    "shard": job.shard,
                    "byte_start": it.byte_start,
                    "byte_end": it.byte_end,
                    "checksum": r["checksum"],
                    "rel_mse": r["rel_mse"],
                    "bits_per_weight": 8 * (it.byte_end - it.byte_start) / max(it.numel, 1),
                    "layer": it.layer,
                    "expert": it.expert,
                    **trellis_fields(it.trellis),
                    "in_scales": it.in_scales,
                })
                if stats is not None:
                    value = out_error(it, r, stats, work.output / job.shard)
                    rows[-1].update(out_error=value,
                                    out_error_from=None if value is None else "text")
                else:
                    rows[-1].update(weights_out_error(it, r))
    return rows


def weights_out_error(it, record: dict) -> dict:
    """The data-free out_error of a coded item: ||E'||^2 times the ledger's in_energy
    (mean(t^2 a), job._input_energy); nulls for a raw item or a ledger that predates it."""
    energy = record.get("in_energy")
    if it.codec == "raw" or record.get("sq_error") is None or energy is None:
        return {"out_error": None, "out_error_from": None}
    source = "ones" if record.get("in_energy_from") == "ones" else "weights"
    return {"out_error": record["sq_error"] * energy, "out_error_from": source}


def out_error(it, record: dict, stats, shard) -> float | None:
    """The manifest's `out_error` of a coded item (docs/FORMAT.md): its coded error weighted
    by the input statistics (stages.proxy.output_error); None where the statistics
    do not name it or the ledger predates `sq_error`."""
    import numpy as np

    from turboquant.stages.proxy import output_error

    if it.codec == "raw" or record.get("sq_error") is None or len(it.shape) != 2:
        return None
    found = stats.get(it.name, it.shape[1])
    if found is None:
        return None
    t = None
    if it.in_scales:  # the stored float16 t, the item's third tensor
        s = it.stored[2]
        with open(shard, "rb") as f:
            f.seek(s.start)
            t = np.frombuffer(f.read(s.end - s.start), dtype="<f2").astype(np.float64)
    return output_error(record["sq_error"], found[0], t)


def manifest_bytes(rows: list[dict]) -> bytes:
    """manifest.parquet's bytes, built in memory (a few hundred bytes a tensor), so that
    its write is one atomic_write: the file is named, with its size, if the disk is full."""
    import pyarrow as pa

    buf = pa.BufferOutputStream()
    write_manifest(rows, buf)
    return buf.getvalue().to_pybytes()


def trellis_fields(trellis: tuple[int, int, int, int] | None) -> dict:
    """The manifest's (and an override's) trellis columns: null unless trellis-coded."""
    if trellis is None:
        return dict.fromkeys(("trellis_state_bits", "trellis_values", "trellis_block",
                              "trellis_version"))
    state_bits, values, block, version = trellis
    return {"trellis_state_bits": state_bits, "trellis_values": values,
            "trellis_block": block, "trellis_version": version}


def quantization_config(plan: Plan) -> dict:
    """FORMAT.md's quantization_config: the recipe's default bits and group size, and an
    override for every tensor coded otherwise (or kept raw)."""
    bits, group = plan.recipe.bits, plan.recipe.group_size
    overrides = {}
    for it in plan.items:
        key = it.name[: -len(".weight")] if it.name.endswith(".weight") else it.name
        if it.codec == "raw":
            overrides[key] = {"codec": "raw"}
        elif (it.bits, it.group_size) != (bits, group) or it.codec == "trellis":
            entry = {"bits": it.bits, "group_size": it.group_size}
            if it.codec == "ternary":
                entry = {"codec": "ternary", **entry}
            if it.codec == "trellis":
                entry = {"codec": "trellis", **entry, **trellis_fields(it.trellis)}
            overrides[key] = entry
    in_scales = any(it.in_scales for it in plan.items)
    extra = {"in_scales": True, "column_min_ratio": plan.recipe.column_min_ratio} \
        if in_scales else {}
    return {
        "quant_method": QUANT_METHOD,
        "format_version": plan.format_version,
        "recipe": plan.recipe.name,
        "recipe_hash": plan.recipe_hash,
        "model_seed": plan.recipe.model_seed,
        "bits": bits,
        "group_size": group,
        "refit": plan.recipe.refit,
        "overrides": overrides,
        **extra,
    }


def summarize(plan: Plan, rows: list[dict] | None = None) -> RepoSummary:
    coded = [it for it in plan.items if it.codec != "raw"]
    all_items = list(plan.items)
    return RepoSummary(
        tensors=len(all_items),
        coded_tensors=len(coded),
        coded_weights=sum(it.numel for it in coded),
        coded_bytes=sum(it.byte_end - it.byte_start for it in coded),
        total_weights=sum(it.numel for it in all_items),
        total_bytes=sum(it.byte_end - it.byte_start for it in all_items),
        files_bytes=plan.out_bytes,
        shards=len(plan.jobs),
    )


def write_repo_files(plan: Plan, work: WorkDir, source: Source, stats=None) -> RepoSummary:
    """Write manifest, index, config, tokenizer files and model card; mark complete. With
    `stats` (convert --input-stats) the manifest records each coded tensor's out_error."""
    out = work.output
    rows = manifest_rows(plan, work, stats)
    atomic_write(out / MANIFEST_FILE, manifest_bytes(rows))  # a full disk: named, one line
    crash_point("repo_manifest")

    weight_map = {s.name: job.shard for job in plan.jobs for u in job.units for it in u.items
                  for s in it.stored}
    total = sum(s.end - s.start for job in plan.jobs for u in job.units for it in u.items
                for s in it.stored)
    index = {"metadata": {"total_size": total, "format": QUANT_METHOD,
                          "format_version": plan.format_version},
             "weight_map": weight_map}
    atomic_write(out / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())

    config = dict(plan.config)
    config.pop("quantization", None)  # an mlx-lm affine config would mislead a loader
    config.pop("compression_config", None)  # older compressed-tensors' name for the source's
    config["quantization_config"] = quantization_config(plan)
    atomic_write(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    crash_point("repo_config")

    for name in source.aux_files():
        atomic_copy(source.aux_path(name), out / name)

    summary = summarize(plan, rows)
    card = model_card(plan, rows, summary, source.base_model())
    atomic_write(out / "README.md", card.encode())
    atomic_write(work.complete_file, json.dumps({"tensors": summary.tensors,
                                                 "shards": summary.shards}).encode())
    return summary

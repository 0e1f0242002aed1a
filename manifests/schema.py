"""The schema of a TurboQuant repo's `manifest.parquet` (docs/FORMAT.md), shared by the
pipeline (writer) and the runtime (reader). No Prefect, no MLX: pyarrow only."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1  # a repo without in_scales (and the version recipe hashes carry)
IN_SCALES_VERSION = 2  # a repo with per-input-column scales (`<prefix>.tq_in_scales`)
READ_VERSIONS = (1, 2)  # what this turboquant reads
QUANT_METHOD = "turboquant"
MANIFEST_FILE = "manifest.parquet"
INDEX_FILE = "model.safetensors.index.json"
CODES_SUFFIX = ".tq_codes"
SCALES_SUFFIX = ".tq_scales"
IN_SCALES_SUFFIX = ".tq_in_scales"

MANIFEST_SCHEMA = pa.schema(
    [
        ("name", pa.string()),
        ("source_name", pa.string()),
        ("source_shard", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("source_dtype", pa.string()),
        ("codec", pa.string()),
        ("bits", pa.int8()),
        ("group_size", pa.int32()),
        ("seed", pa.uint64()),
        ("padded_in", pa.int64()),
        ("shard", pa.string()),
        ("byte_start", pa.int64()),
        ("byte_end", pa.int64()),
        ("checksum", pa.string()),
        ("rel_mse", pa.float64()),
        ("bits_per_weight", pa.float64()),
        ("layer", pa.int32()),
        ("expert", pa.int32()),
    ],
    metadata={"format": QUANT_METHOD, "format_version": str(FORMAT_VERSION)},
)
COLUMNS = MANIFEST_SCHEMA.names
# version 2: whether the row stores `<prefix>.tq_in_scales` (written only when some row does,
# so a version-1 manifest is unchanged; a reader takes a missing column as all false)
IN_SCALES_COLUMN = pa.field("in_scales", pa.bool_())


def format_version(in_scales: bool) -> int:
    """The format version of a repo that stores in_scales (2) or not (1)."""
    return IN_SCALES_VERSION if in_scales else FORMAT_VERSION


def stored_names(name: str, codec: str, in_scales: bool = False) -> list[str]:
    """Tensor names in the shards for a manifest row's `name` (codes+scales, and the
    in_scales vector where the row has one; or the name itself)."""
    if codec == "raw":
        return [name]
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    names = [base + CODES_SUFFIX, base + SCALES_SUFFIX]
    return names + [base + IN_SCALES_SUFFIX] if in_scales else names


def write_manifest(rows: list[dict], path: str | os.PathLike) -> None:
    """Write rows (dicts with every column) as manifest.parquet, deterministically."""
    missing = [c for c in COLUMNS if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"manifest rows lack columns {missing}")
    schema, columns = MANIFEST_SCHEMA, COLUMNS
    if any(r.get("in_scales") for r in rows):
        schema = MANIFEST_SCHEMA.append(IN_SCALES_COLUMN).with_metadata(
            {"format": QUANT_METHOD, "format_version": str(IN_SCALES_VERSION)})
        columns = schema.names
    table = pa.Table.from_pylist([{c: bool(r.get(c)) if c == "in_scales" else r[c]
                                   for c in columns} for r in rows], schema=schema)
    pq.write_table(table, str(path), compression="zstd", write_statistics=False)


def read_manifest(repo: str | os.PathLike) -> pa.Table:
    """manifest.parquet of a repo folder (or the file itself), checked against the schema."""
    p = Path(repo)
    if p.is_dir():
        p = p / MANIFEST_FILE
    table = pq.read_table(str(p))
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{p}: manifest lacks columns {missing}")
    return table

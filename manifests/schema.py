"""The schema of a TurboQuant repo's `manifest.parquet` (docs/FORMAT.md), shared by the
pipeline (writer) and the runtime (reader). No Prefect, no MLX: pyarrow only."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1
# a repo holding trellis-coded tensors (docs/FORMAT.md, "Trellis code") is format 2: a
# version-1 reader refuses it rather than decode trellis codes as Lloyd-Max levels
TRELLIS_FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # what this turboquant reads
TRELLIS_VERSION = 1  # the trellis's constants and steps (stages/trellis.py VERSION)
CODECS = ("turboquant", "ternary", "trellis", "raw")  # the manifest's codec column
QUANT_METHOD = "turboquant"
MANIFEST_FILE = "manifest.parquet"
INDEX_FILE = "model.safetensors.index.json"
CODES_SUFFIX = ".tq_codes"
SCALES_SUFFIX = ".tq_scales"

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
# a format-2 manifest (trellis tensors) adds these, null on rows of other codecs
TRELLIS_FIELDS = [
    ("trellis_state_bits", pa.int8()),
    ("trellis_values", pa.int8()),
    ("trellis_block", pa.int32()),
    ("trellis_version", pa.int16()),
]
TRELLIS_COLUMNS = [name for name, _ in TRELLIS_FIELDS]
MANIFEST_SCHEMA_TRELLIS = pa.schema(
    list(MANIFEST_SCHEMA) + [pa.field(n, t) for n, t in TRELLIS_FIELDS],
    metadata={"format": QUANT_METHOD, "format_version": str(TRELLIS_FORMAT_VERSION)},
)


def format_version(codecs) -> int:
    """The format version of a repo whose tensors have these codecs."""
    return TRELLIS_FORMAT_VERSION if "trellis" in set(codecs) else FORMAT_VERSION


def stored_names(name: str, codec: str) -> list[str]:
    """Tensor names in the shards for a manifest row's `name` (codes+scales, or itself)."""
    if codec == "raw":
        return [name]
    if codec not in CODECS:
        raise ValueError(f"tensor {name!r} has codec {codec!r}, which this turboquant does not "
                         f"read ({', '.join(CODECS)}): upgrade turboquant")
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return [base + CODES_SUFFIX, base + SCALES_SUFFIX]


def write_manifest(rows: list[dict], path: str | os.PathLike) -> None:
    """Write rows (dicts with every column) as manifest.parquet, deterministically; with
    the trellis columns where a row is trellis-coded (format 2)."""
    trellis = format_version(r["codec"] for r in rows) == TRELLIS_FORMAT_VERSION
    schema = MANIFEST_SCHEMA_TRELLIS if trellis else MANIFEST_SCHEMA
    missing = [c for c in schema.names if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"manifest rows lack columns {missing}")
    table = pa.Table.from_pylist([{c: r[c] for c in schema.names} for r in rows],
                                 schema=schema)
    pq.write_table(table, str(path), compression="zstd", write_statistics=False)


def read_manifest(repo: str | os.PathLike) -> pa.Table:
    """manifest.parquet of a repo folder (or the file itself), checked against the schema."""
    p = Path(repo)
    if p.is_dir():
        p = p / MANIFEST_FILE
    table = pq.read_table(str(p))
    missing = [c for c in COLUMNS if c not in table.column_names]
    if "trellis" in table.column("codec").to_pylist() if "codec" in table.column_names else ():
        missing += [c for c in TRELLIS_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{p}: manifest lacks columns {missing}")
    return table

"""The schema of a TurboQuant repo's `manifest.parquet` (docs/FORMAT.md), shared by the
pipeline (writer) and the runtime (reader). No Prefect, no MLX: pyarrow only."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1  # a repo of scalar codes only, no in_scales (and what recipe hashes carry)
# version 2 (docs/FORMAT.md): a repo with trellis-coded tensors ("Trellis code") or with
# per-input-column scales (`<prefix>.tq_in_scales`); a version-1 reader refuses it rather
# than decode trellis codes as Lloyd-Max levels or compute without t
VERSION_2 = 2
READ_VERSIONS = (1, 2)  # what this turboquant reads
TRELLIS_VERSION = 1  # the trellis's constants and steps (stages/trellis.py VERSION): the default
# the trellis versions this turboquant writes (recipe key trellis_version) and reads
TRELLIS_VERSIONS = (1, 2)
CODECS = ("turboquant", "ternary", "trellis", "raw")  # the manifest's codec column
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
# a format-2 manifest with trellis tensors adds these, null on rows of other codecs
TRELLIS_FIELDS = [
    ("trellis_state_bits", pa.int8()),
    ("trellis_values", pa.int8()),
    ("trellis_block", pa.int32()),
    ("trellis_version", pa.int16()),
]
TRELLIS_COLUMNS = [name for name, _ in TRELLIS_FIELDS]
# and one with in_scales this column: whether the row stores `<prefix>.tq_in_scales` (a reader takes
# a missing column as all false)
IN_SCALES_COLUMN = pa.field("in_scales", pa.bool_())
# each coded tensor's output error (any format version; a reader that does not know them
# ignores them): under the calibration text's inputs with `convert --input-stats`, else
# under input energies from the layer's own tensors; out_error_from says which ("text",
# "weights", or "ones": no input known, a = 1). Repos converted before have neither, or
# out_error alone (--input-stats)
OUT_ERROR_COLUMN = pa.field("out_error", pa.float64())
OUT_ERROR_FROM_COLUMN = pa.field("out_error_from", pa.string())


def format_version(codecs=(), in_scales: bool = False) -> int:
    """The format version of a repo whose tensors have these codecs, storing in_scales or
    not: 2 with any trellis tensor or any in_scales, else 1."""
    return VERSION_2 if in_scales or "trellis" in set(codecs) else FORMAT_VERSION


def manifest_schema(trellis: bool, in_scales: bool) -> pa.Schema:
    """The manifest's schema: version 1's columns, then the trellis columns and the
    in_scales column where the repo has them (version 2)."""
    if not (trellis or in_scales):
        return MANIFEST_SCHEMA
    fields = list(MANIFEST_SCHEMA) + [pa.field(n, t) for n, t in TRELLIS_FIELDS if trellis]
    fields += [IN_SCALES_COLUMN] if in_scales else []
    return pa.schema(fields, metadata={"format": QUANT_METHOD,
                                       "format_version": str(VERSION_2)})


def stored_names(name: str, codec: str, in_scales: bool = False) -> list[str]:
    """Tensor names in the shards for a manifest row's `name` (codes+scales, and the
    in_scales vector where the row has one; or the name itself)."""
    if codec == "raw":
        return [name]
    if codec not in CODECS:
        raise ValueError(f"tensor {name!r} has codec {codec!r}, which this turboquant does not "
                         f"read ({', '.join(CODECS)}): upgrade turboquant")
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    names = [base + CODES_SUFFIX, base + SCALES_SUFFIX]
    return names + [base + IN_SCALES_SUFFIX] if in_scales else names


def write_manifest(rows: list[dict], path: str | os.PathLike | pa.NativeFile) -> None:
    """Write rows (dicts with every column) as manifest.parquet (a path, or a pyarrow
    stream such as a BufferOutputStream), deterministically; with
    the trellis columns where a row is trellis-coded and the in_scales column where a row
    stores in_scales (format 2)."""
    trellis = any(r["codec"] == "trellis" for r in rows)
    in_scales = any(r.get("in_scales") for r in rows)
    schema = manifest_schema(trellis, in_scales)
    if rows and "out_error" in rows[0]:
        schema = schema.append(OUT_ERROR_COLUMN)
    if rows and "out_error_from" in rows[0]:
        schema = schema.append(OUT_ERROR_FROM_COLUMN)
    missing = [c for c in schema.names if rows and c != "in_scales" and c not in rows[0]]
    if missing:
        raise ValueError(f"manifest rows lack columns {missing}")
    table = pa.Table.from_pylist([{c: bool(r.get(c)) if c == "in_scales" else r[c]
                                   for c in schema.names} for r in rows], schema=schema)
    where = path if isinstance(path, pa.NativeFile) else str(path)
    pq.write_table(table, where, compression="zstd", write_statistics=False)


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

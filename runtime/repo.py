"""Find a TurboQuant repo (a local folder or a Hub repo id) and check it is whole.

`open_repo` reads `config.json`, `model.safetensors.index.json` and `manifest.parquet`
(docs/FORMAT.md) and checks, before any tensor is read, that every shard is present and
as long as its own safetensors header says, and that the index and the manifest name the
same tensors. A partial download fails here with the name of the file to fetch again.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from turboquant.manifests.schema import (
    INDEX_FILE,
    MANIFEST_FILE,
    QUANT_METHOD,
    READ_VERSIONS,
    TRELLIS_VERSIONS,
    VERSION_2,
    stored_names,
)
from turboquant.manifests.schema import read_manifest as read_manifest_table

QUANT_CODECS = ("turboquant", "ternary", "trellis")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RepoError(ValueError):
    """A TurboQuant repo that is missing, incomplete or inconsistent."""


@dataclass
class Row:
    """One manifest row: a source tensor as stored in the repo."""

    name: str
    codec: str
    shape: tuple[int, ...]
    shard: str
    source_dtype: str = "BF16"
    bits: int | str | None = None
    group_size: int | None = None
    seed: int | None = None
    padded_in: int | None = None
    layer: int | None = None
    expert: int | None = None
    byte_start: int | None = None
    byte_end: int | None = None
    in_scales: bool = False  # stores `P.tq_in_scales` (format version 2)

    @property
    def quantized(self) -> bool:
        return self.codec in QUANT_CODECS

    @property
    def base(self) -> str:
        """`P` for a quantized `P.weight`: its tensors are `P.tq_codes` and `P.tq_scales`."""
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name

    @property
    def stored(self) -> tuple[str, ...]:
        """The tensor names this row occupies in the shards (codes, scales, in_scales; or
        itself)."""
        return tuple(stored_names(self.name, self.codec, self.in_scales))


@dataclass
class Repo:
    path: Path
    config: dict
    index: dict
    rows: list[Row]
    headers: dict[str, dict] = field(default_factory=dict)  # shard -> safetensors header

    @property
    def weight_map(self) -> dict[str, str]:
        return self.index["weight_map"]

    @property
    def quantization(self) -> dict:
        return self.config["quantization_config"]


def is_hub_id(text: str) -> bool:
    """`text` names no local file or folder and reads as a Hub repo id ('owner/name' whose
    owner is not a folder here)."""
    text = str(text)
    return (not Path(text).expanduser().exists() and bool(_REPO_ID.match(text))
            and not text.startswith((".", "~")) and not Path(text.split("/", 1)[0]).is_dir())


def resolve(path_or_repo_id: str | Path, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, fetched with snapshot_download.

    `HF_ENDPOINT` and `HF_HUB_OFFLINE` are honoured by huggingface_hub itself.
    """
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_repo_id)
    if path.exists():
        raise RepoError(f"{text} is a file, not a model folder")
    if not _REPO_ID.match(text):
        raise RepoError(
            f"model folder {text} does not exist (and it is not a Hub repo id "
            "like 'owner/name')"
        )
    first = text.split("/", 1)[0]
    if text.startswith((".", "~")) or Path(first).is_dir():
        raise RepoError(f"model folder {text} does not exist (read as a local path, not a Hub "
                        f"repo id: {first}/ is a folder here); check the path")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, revision=revision))
    except Exception as e:  # the client's errors are many; say what was tried
        detail = (str(e).strip().splitlines() or [""])[0]
        raise RepoError(
            f"{text} is not a local folder, and downloading it as a Hub repo failed: "
            f"{type(e).__name__}: {detail}"
        ) from e


# Tokenizers load with this, whatever transformers' default: a model folder's own Python code
# never runs (a repo whose tokenizer needs it is refused by `check_tokenizer_code`).
TOKENIZER_OPTIONS = {"trust_remote_code": False}


def tokenizer_code(path: Path) -> str | None:
    """What in `path` asks for a tokenizer written in the repo's own Python code (an
    `auto_map` in tokenizer_config.json, or an AutoTokenizer entry in config.json's), or None."""
    for name, key in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map and (key is None or (isinstance(auto_map, dict) and key in auto_map)):
            entry = auto_map.get(key or "AutoTokenizer", auto_map) if isinstance(auto_map, dict) \
                else auto_map
            return f"{name} has auto_map {json.dumps(entry)}"
    return None


def check_tokenizer_code(path: Path) -> None:
    """RepoError when the tokenizer would need code from the repo (see TOKENIZER_OPTIONS)."""
    found = tokenizer_code(Path(path))
    if found is not None:
        raise RepoError(f"{path}: {found}: its tokenizer is Python code shipped in the repo, "
                        "which turboquant never runs; use a tokenizer.json-only tokenizer "
                        "(copy one in, or convert it with transformers yourself)")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise RepoError(f"{path.parent}: missing {path.name}; is this a TurboQuant repo?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RepoError(f"{path}: not valid JSON ({e})") from e


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor header, expected file size) of a safetensors file, without reading data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise RepoError(f"{path}: truncated ({size} bytes); download it again")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise RepoError(
                f"{path}: truncated ({size} bytes, header alone is {n + 8}); download it again"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RepoError(f"{path}: not a safetensors file ({e})") from e
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    return header, 8 + n + end


def _none(v):
    return None if v is None or (isinstance(v, float) and v != v) else v


def read_manifest(path: Path) -> list[Row]:
    if not path.is_file():
        raise RepoError(f"{path.parent}: missing {MANIFEST_FILE}; is this a TurboQuant repo?")
    try:
        table = read_manifest_table(path)
    except ValueError as e:
        raise RepoError(str(e)) from e
    rows = []
    for r in table.to_pylist():
        codec = r["codec"]
        if codec not in (*QUANT_CODECS, "raw"):
            raise RepoError(f"{path}: tensor {r['name']} has unknown codec {codec!r}")
        bits = "ternary" if codec == "ternary" else _none(r["bits"])
        if codec == "trellis":
            bits = _trellis_bits(path, r)
        rows.append(
            Row(
                name=r["name"],
                codec=codec,
                shape=tuple(int(s) for s in r["shape"]),
                shard=r["shard"],
                source_dtype=r.get("source_dtype") or "BF16",
                bits=None if bits is None else (bits if codec != "turboquant" else int(bits)),
                group_size=_none(r["group_size"]),
                seed=_none(r["seed"]),
                padded_in=_none(r["padded_in"]),
                layer=_none(r.get("layer")),
                expert=_none(r.get("expert")),
                byte_start=_none(r.get("byte_start")),
                byte_end=_none(r.get("byte_end")),
                in_scales=bool(r.get("in_scales")),
            )
        )
        if rows[-1].in_scales and not rows[-1].quantized:
            raise RepoError(f"{path}: tensor {r['name']} is kept raw but marked in_scales")
        if rows[-1].quantized and None in (rows[-1].bits, rows[-1].group_size,
                                           rows[-1].seed, rows[-1].padded_in):
            raise RepoError(
                f"{path}: quantized tensor {r['name']} lacks bits/group_size/seed/padded_in"
            )
    return rows


def _trellis_bits(path: Path, r: dict):
    """A trellis row's code (stages.trellis.TrellisBits); RepoError naming the tensor if its
    trellis version or parameters are not ones this runtime reads."""
    from turboquant.stages.trellis import TrellisBits

    version = r.get("trellis_version")
    if version not in TRELLIS_VERSIONS:
        raise RepoError(f"{path}: tensor {r['name']} is trellis version {version!r}, this "
                        f"runtime reads versions {', '.join(map(str, TRELLIS_VERSIONS))}; "
                        "upgrade turboquant")
    try:
        return TrellisBits(int(r["bits"]), int(r["trellis_state_bits"]),
                           int(r["trellis_values"]), int(r["trellis_block"]), int(version))
    except (TypeError, ValueError) as e:
        raise RepoError(f"{path}: tensor {r['name']}: bad trellis parameters ({e})") from None


def open_repo(path: Path) -> Repo:
    """Read and cross-check config, index, manifest and shard headers."""
    path = Path(path)
    if not path.is_dir():
        raise RepoError(f"model folder {path} does not exist")
    config = _read_json(path / "config.json")
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        raise RepoError(
            f"{path}/config.json: quantization_config.quant_method is "
            f"{qc.get('quant_method')!r}, not 'turboquant'; load it with mlx_lm.load instead"
        )
    version = qc.get("format_version")
    if version not in READ_VERSIONS:
        raise RepoError(
            f"{path}: TurboQuant format_version {version}, this runtime reads "
            f"{' and '.join(map(str, READ_VERSIONS))}; upgrade turboquant"
        )
    index = _read_json(path / INDEX_FILE)
    if "weight_map" not in index:
        raise RepoError(f"{path}/{INDEX_FILE} has no weight_map")
    rows = read_manifest(path / MANIFEST_FILE)
    scaled = next((r.name for r in rows if r.in_scales), None)
    if scaled is not None and version < VERSION_2:
        raise RepoError(f"{path}: tensor {scaled} has in_scales, which format_version "
                        f"{version} does not have (config.json says {version}, the manifest "
                        f"needs {VERSION_2}): the repo was edited; convert it again")
    repo = Repo(path=path, config=config, index=index, rows=rows)
    _check_shards(repo)
    _check_names(repo)
    return repo


def _check_shards(repo: Repo) -> None:
    shards = sorted(set(repo.weight_map.values()) | {r.shard for r in repo.rows})
    for shard in shards:
        f = repo.path / shard
        if not f.is_file():
            raise RepoError(
                f"{repo.path}: shard {shard} is missing (partial download?); fetch it again"
            )
        header, want = read_header(f)
        size = f.stat().st_size
        if size != want:
            raise RepoError(
                f"{f}: {size} bytes, its header says {want} (partial download?); "
                "fetch it again"
            )
        repo.headers[shard] = header
    for r in repo.rows:
        if r.byte_end is not None and r.byte_end > (repo.path / r.shard).stat().st_size:
            raise RepoError(f"{r.shard}: manifest row {r.name} ends past the end of the file")


def _check_names(repo: Repo) -> None:
    seen: dict[str, str] = {}
    for r in repo.rows:
        for t in r.stored:
            if t in seen:
                raise RepoError(f"{repo.path}: tensor {t} is listed twice in the manifest")
            seen[t] = r.shard
    wm = repo.weight_map
    for t, shard in seen.items():
        if t not in wm:
            raise RepoError(f"{repo.path}: tensor {t} is in the manifest but not in the index")
        if wm[t] != shard:
            raise RepoError(
                f"{repo.path}: tensor {t} is in {wm[t]} per the index, {shard} per the manifest"
            )
        if t not in repo.headers[shard]:
            raise RepoError(f"{repo.path}/{shard}: missing tensor {t} (index and manifest list it)")
    for t, shard in wm.items():
        if t not in seen:
            raise RepoError(f"{repo.path}: unexpected tensor {t} in {shard}: not in the manifest")
    for shard, header in repo.headers.items():
        for t in header:
            if wm.get(t) != shard:
                raise RepoError(f"{repo.path}/{shard}: unexpected tensor {t}: not in the index")

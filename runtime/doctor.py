"""Read-only health checks of a TurboQuant repo folder and of this machine.

    checks = check_folder("out/llama-tq4") + check_machine(memory=my_memory_check)
    exit_code(checks)   # 0 all pass, 1 warnings only, 2 any failure

Every check has a stable id and name (the table below, and docs/bigger-than-memory.md) so
scripts can grep for them. A check whose input an earlier check found broken is SKIP, not a
second failure. Nothing here writes: files are opened read-only, and the folder's
`.turboquant` work folder is only looked at.

    D001 config-present        config.json exists, is a JSON object, names a model_type
    D002 quant-config          quantization_config: turboquant, a format version we read
    D003 index-matches-shards  the index's shards exist and hold exactly the tensors it maps
    D004 shard-sizes           every shard is as long as its safetensors header says
    D005 manifest-rows         manifest.parquet rows agree with the index and the headers
    D006 checksums             sha256 of every row's byte range (skipped with quick=True)
    D007 tokenizer             tokenizer files present and readable, no code (auto_map)
    D008 architecture          mlx-lm has an architecture for the model_type
    D009 conversion-complete   no unfinished conversion left in the folder
    M001 mlx-backend           MLX and mlx-lm import; which backend and device
    M002 memory-fit            the model fits this machine's memory (`turboquant plan`)
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from turboquant.manifests.schema import (
    INDEX_FILE,
    MANIFEST_FILE,
    QUANT_METHOD,
    READ_VERSIONS,
    stored_names,
)

CHECKS = {
    "D001": "config-present",
    "D002": "quant-config",
    "D003": "index-matches-shards",
    "D004": "shard-sizes",
    "D005": "manifest-rows",
    "D006": "checksums",
    "D007": "tokenizer",
    "D008": "architecture",
    "D009": "conversion-complete",
    "M001": "mlx-backend",
    "M002": "memory-fit",
}
STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
WORK_DIR = ".turboquant"  # the conversion's work folder (pipeline/ledger.py)
_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
                "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
_MAX_LISTED = 3  # problems named per check; the rest are counted


@dataclass
class Check:
    id: str
    status: str
    detail: str

    @property
    def name(self) -> str:
        return CHECKS[self.id]

    def line(self) -> str:
        return f"{self.status:<4}  {self.id} {self.name:<21} {self.detail}"

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "status": self.status, "detail": self.detail}


def exit_code(checks: list[Check]) -> int:
    """0 when everything passed (or was skipped), 1 for warnings only, 2 for any failure."""
    statuses = {c.status for c in checks}
    return 2 if "FAIL" in statuses else 1 if "WARN" in statuses else 0


def _listing(problems: list[str]) -> str:
    text = "; ".join(problems[:_MAX_LISTED])
    if len(problems) > _MAX_LISTED:
        text += f"; and {len(problems) - _MAX_LISTED} more"
    return text


# ------------------------------------------------------------------------ the folder


@dataclass
class _Folder:
    """What the checks learned so far (later checks build on earlier ones)."""

    path: Path
    config: dict | None = None
    index: dict | None = None
    headers: dict[str, tuple[dict, int, int]] = field(default_factory=dict)  # shard -> (tensors,
    #                                                 data start, expected file size)
    rows: list[dict] | None = None
    shards_ok: bool = False


def check_folder(path: str | Path, quick: bool = False) -> list[Check]:
    """D001-D009 on a local folder; reads, never writes."""
    f = _Folder(Path(path))
    if not f.path.is_dir():
        return [Check("D001", "FAIL", f"{f.path} is not a folder")]
    out = [_config(f), _quant_config(f)]
    out += _index_and_shards(f)
    out.append(_manifest(f))
    out.append(_checksums(f, quick))
    out.append(_tokenizer(f))
    out.append(_architecture(f))
    out.append(_work_dir(f))
    return out


def _read_json(p: Path):
    with open(p, "rb") as fh:
        return json.loads(fh.read())


def _config(f: _Folder) -> Check:
    p = f.path / "config.json"
    if not p.is_file():
        return Check("D001", "FAIL", f"no config.json in {f.path}")
    try:
        cfg = _read_json(p)
    except (OSError, ValueError) as e:
        return Check("D001", "FAIL", f"config.json is not valid JSON ({e})")
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        return Check("D001", "FAIL", "config.json has no model_type")
    f.config = cfg
    return Check("D001", "PASS", f"config.json: model_type {cfg['model_type']}")


def _quant_config(f: _Folder) -> Check:
    if f.config is None:
        return Check("D002", "SKIP", "needs config.json (D001)")
    qc = f.config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        return Check("D002", "FAIL", f"quantization_config.quant_method is {method!r}, not "
                     f"{QUANT_METHOD!r}: not a TurboQuant repo (a source checkpoint? "
                     "`turboquant plan` or `turboquant convert` it)")
    version = qc.get("format_version")
    if version not in READ_VERSIONS:
        newest = max(READ_VERSIONS)
        hint = "upgrade turboquant" if isinstance(version, int) and version > newest \
            else "the repo is damaged or not written by turboquant"
        return Check("D002", "FAIL", f"format_version {version!r}, this turboquant reads "
                     f"{' and '.join(map(str, READ_VERSIONS))}: {hint}")
    missing = [k for k in ("bits", "group_size", "recipe") if k not in qc]
    if missing:
        return Check("D002", "FAIL", f"quantization_config lacks {', '.join(missing)}")
    return Check("D002", "PASS", f"format {version}, recipe {qc['recipe']}, {qc['bits']}-bit, "
                 f"group {qc['group_size']}, {len(qc.get('overrides') or {})} overrides")


def read_header(path: Path) -> tuple[dict, int, int]:
    """(tensors, data start, expected file size) of a safetensors file, checked."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes: truncated before its header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"header length field says {n} bytes, but only {size - 8} bytes "
                             f"follow it (the file has {size} bytes): truncated")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, t in header.items():
        try:
            a, b = t["data_offsets"]
            want = math.prod(t["shape"]) * _DTYPE_SIZES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"bad header entry for {name}") from None
        if b - a != want:
            raise ValueError(f"{name}: {t['dtype']} {t['shape']} is {want} bytes but its "
                             f"offsets span {b - a}")
        end = max(end, b)
    return header, 8 + n, 8 + n + end


def _index_and_shards(f: _Folder) -> list[Check]:
    p = f.path / INDEX_FILE
    if not p.is_file():
        return [Check("D003", "FAIL", f"no {INDEX_FILE}"),
                Check("D004", "SKIP", f"needs {INDEX_FILE} (D003)")]
    try:
        index = _read_json(p)
        wm = index["weight_map"]
        if not isinstance(wm, dict) or not wm:
            raise ValueError("empty weight_map")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Check("D003", "FAIL", f"{INDEX_FILE} is unreadable or has no weight_map ({e})"),
                Check("D004", "SKIP", f"needs {INDEX_FILE} (D003)")]
    f.index = index
    shards = sorted(set(wm.values()))
    on_disk = sorted(x.name for x in f.path.glob("*.safetensors"))
    missing = [s for s in shards if not (f.path / s).is_file()]
    size_problems, unreadable = [], []
    for s in shards:
        if s in missing:
            continue
        try:
            header, start, want = read_header(f.path / s)
        except (OSError, ValueError) as e:
            unreadable.append(f"{s}: {e}")
            continue
        f.headers[s] = (header, start, want)
        have = (f.path / s).stat().st_size
        if have != want:
            what = "truncated (partial download?)" if have < want else "has bytes past its data"
            size_problems.append(f"{s}: {have} bytes, its header says {want}: {what}; fetch it "
                                 "again")
    if unreadable or size_problems:
        d004 = Check("D004", "FAIL", _listing(unreadable + size_problems))
    else:
        total = sum(v[2] for v in f.headers.values())
        d004 = Check("D004", "PASS", f"{len(f.headers)} shards, {_gb(total)}")

    problems = [f"shard {s} is missing (partial download?)" for s in missing]
    extra = [s for s in on_disk if s not in shards]
    if extra:
        problems.append(f"{len(extra)} shard(s) not in the index, e.g. {extra[0]}")
    where: dict[str, str] = {}
    for s, (header, _, _) in f.headers.items():
        for t in header:
            if t in where:
                problems.append(f"tensor {t} is in both {where[t]} and {s}")
            where[t] = s
    wrong = [t for t, s in wm.items() if s in f.headers and where.get(t) != s]
    for t in wrong[:_MAX_LISTED]:
        problems.append(f"index maps {t} to {wm[t]}, " +
                        (f"it is in {where[t]}" if t in where else "no shard has it"))
    if len(wrong) > _MAX_LISTED:
        problems.append(f"{len(wrong) - _MAX_LISTED} more tensors mapped wrongly")
    unlisted = [t for t in where if t not in wm]
    if unlisted:
        problems.append(f"{len(unlisted)} tensor(s) in the shards are not in the index, e.g. "
                        f"{unlisted[0]}")
    f.shards_ok = not problems and not unreadable and not size_problems
    d003 = Check("D003", "FAIL", _listing(problems)) if problems else \
        Check("D003", "PASS", f"{len(wm)} tensors in {len(shards)} shards")
    return [d003, d004]


def _manifest(f: _Folder) -> Check:
    p = f.path / MANIFEST_FILE
    if not p.is_file():
        return Check("D005", "FAIL", f"no {MANIFEST_FILE}")
    try:
        import pyarrow.parquet as pq

        from turboquant.manifests.schema import COLUMNS

        table = pq.read_table(str(p))
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            return Check("D005", "FAIL", f"{MANIFEST_FILE} lacks columns {missing}")
        rows = table.to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds for a damaged file
        return Check("D005", "FAIL", f"{MANIFEST_FILE} is unreadable ({type(e).__name__}: {e})")
    f.rows = rows
    if f.index is None or not f.headers:
        return Check("D005", "SKIP", f"{len(rows)} rows; needs the index and shards (D003)")
    from turboquant.stages import words_per_row

    wm = f.index["weight_map"]
    problems, listed = [], set()
    for r in rows:
        name, codec, shard = r["name"], r["codec"], r["shard"]
        if codec not in ("turboquant", "ternary", "raw"):
            problems.append(f"{name}: unknown codec {codec!r}")
            continue
        names = stored_names(name, codec, bool(r.get("in_scales")))
        listed.update(names)
        for n in names:
            if wm.get(n) != shard:
                problems.append(f"{n}: manifest says {shard}, index says {wm.get(n)}")
        if shard not in f.headers:
            continue
        header, start, _ = f.headers[shard]
        ts = [header.get(n) for n in names]
        if any(t is None for t in ts):
            problems.append(f"{name}: {shard} lacks {[n for n, t in zip(names, ts) if t is None]}")
            continue
        lo, hi = start + ts[0]["data_offsets"][0], start + ts[-1]["data_offsets"][1]
        if (r["byte_start"], r["byte_end"]) != (lo, hi):
            problems.append(f"{name}: byte range [{r['byte_start']}, {r['byte_end']}) but the "
                            f"header puts it at [{lo}, {hi})")
        if codec != "raw":
            bits = "ternary" if codec == "ternary" else r["bits"]
            gs, padded, shape = r["group_size"], r["padded_in"], r["shape"]
            if None in (bits, gs, padded, r["seed"]) or len(shape) != 2:
                problems.append(f"{name}: coded row lacks bits/group_size/padded_in/seed")
                continue
            want = [[shape[0], words_per_row(padded, bits)], [shape[0], padded // gs]]
            got = [ts[0]["shape"], ts[1]["shape"]]
            if got != want:
                problems.append(f"{name}: codes/scales shapes {got}, the row implies {want}")
        elif list(ts[0]["shape"]) != list(r["shape"]):
            problems.append(f"{name}: shape {r['shape']} but the shard has {ts[0]['shape']}")
    unlisted = [t for t in wm if t not in listed]
    if unlisted:
        problems.append(f"{len(unlisted)} index tensor(s) have no manifest row, e.g. "
                        f"{unlisted[0]}")
    if problems:
        return Check("D005", "FAIL", _listing(problems))
    coded = sum(r["codec"] != "raw" for r in rows)
    return Check("D005", "PASS", f"{len(rows)} rows ({coded} coded) match the index and headers")


def _checksums(f: _Folder, quick: bool) -> Check:
    if quick:
        return Check("D006", "SKIP", "--quick")
    if f.rows is None:
        return Check("D006", "SKIP", f"needs {MANIFEST_FILE} (D005)")
    bad, checked, total = [], 0, 0
    for r in f.rows:
        p = f.path / r["shard"]
        if not p.is_file():
            continue
        try:
            digest = _sha256(p, r["byte_start"], r["byte_end"])
        except OSError as e:
            bad.append(f"{r['name']}: {e}")
            continue
        checked += 1
        total += r["byte_end"] - r["byte_start"]
        if digest != r["checksum"]:
            bad.append(f"{r['name']} in {r['shard']} [{r['byte_start']}, {r['byte_end']})")
    if bad:
        return Check("D006", "FAIL", f"{len(bad)} of {len(f.rows)} checksums differ (corrupt "
                     f"bytes; fetch the shard again): {_listing(bad)}")
    skipped = len(f.rows) - checked
    note = f"; {skipped} rows in missing shards not checked" if skipped else ""
    status = "WARN" if skipped else "PASS"
    return Check("D006", status, f"{checked} checksums ok over {_gb(total)}{note}")


def _sha256(path: Path, start: int, end: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(start)
        left = end - start
        while left > 0:
            block = fh.read(min(1 << 22, left))
            if not block:
                raise OSError(f"{path.name} ends before byte {end}")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _tokenizer(f: _Folder) -> Check:
    tj, tm = f.path / "tokenizer.json", f.path / "tokenizer.model"
    if not tj.is_file() and not tm.is_file() and not list(f.path.glob("vocab.*")):
        return Check("D007", "FAIL", "no tokenizer.json, tokenizer.model or vocab file: copy the "
                     "tokenizer files from the source checkpoint")
    if tj.is_file():
        try:
            _read_json(tj)
        except (OSError, ValueError) as e:
            return Check("D007", "FAIL", f"tokenizer.json is not valid JSON ({e})")
    if not (f.path / "tokenizer_config.json").is_file():
        return Check("D007", "WARN", "no tokenizer_config.json (special tokens and chat "
                     "template may be missing)")
    from .repo import tokenizer_code

    code = tokenizer_code(f.path)
    if code is not None:
        return Check("D007", "FAIL", f"{code}: a tokenizer in the repo's own Python code, "
                     "which turboquant never runs (generate and serve refuse it)")
    present = [n for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
               if (f.path / n).is_file()]
    return Check("D007", "PASS", ", ".join(present))


def _architecture(f: _Folder) -> Check:
    if f.config is None:
        return Check("D008", "SKIP", "needs config.json (D001)")
    try:
        from .loader import model_classes

        model_class, _ = model_classes(f.config)
    except ImportError as e:
        return Check("D008", "FAIL", f"mlx-lm is not importable ({e})")
    except Exception as e:  # noqa: BLE001 - mlx-lm says "not supported" in a ValueError
        return Check("D008", "FAIL", f"mlx-lm has no architecture for model_type "
                     f"{f.config.get('model_type')!r} ({e})")
    return Check("D008", "PASS", f"mlx-lm {model_class.__module__}")


def _work_dir(f: _Folder) -> Check:
    work = f.path / WORK_DIR
    if not work.is_dir():
        return Check("D009", "PASS", "no conversion work folder")
    if (work / "complete").is_file():
        return Check("D009", "PASS", f"{WORK_DIR}/complete: the conversion finished")
    return Check("D009", "WARN", f"{WORK_DIR}/ holds a conversion that did not finish: rerun "
                 "the same `turboquant convert` to resume it")


# ------------------------------------------------------------------------ the machine


def check_machine(memory: Callable[[], Check] | None = None) -> list[Check]:
    """M001, and M002 through `memory` (the CLI passes `turboquant plan`'s projection)."""
    out = [_mlx()]
    if memory is not None:
        out.append(memory())
    return out


def _mlx() -> Check:
    try:
        import mlx.core as mx
    except ImportError as e:
        return Check("M001", "FAIL", f"MLX is not importable ({e}); install turboquant with "
                     "its MLX extra (docs/getting-started.md)")
    try:
        import mlx_lm

        lm = f"mlx-lm {mlx_lm.__version__}"
    except ImportError as e:
        return Check("M001", "FAIL", f"mlx-lm is not importable ({e})")
    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        backend = "Metal" if mx.metal.is_available() else "CUDA"
        note = ""
    else:
        backend, note = "CPU", " (correctness, not speed: use a GPU for throughput)"
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # noqa: BLE001 - informative only
        name = ""
    return Check("M001", "PASS", f"mlx {mx.__version__}, {lm}, {backend} backend"
                 + (f" on {name}" if name else "") + note)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


__all__ = ["CHECKS", "Check", "check_folder", "check_machine", "exit_code", "read_header"]

"""The output folder: what a run may do with it, decided before anything is written.

`decide` looks at the folder and the record of the conversion it holds
(`.turboquant/run.json`) and answers one of: start a new conversion, resume this one,
or (`--fresh`) delete a previous conversion's files first. Every refusal is raised by
`decide`, before a byte is written or deleted; only then does the caller lock the folder
and act. The rules (docs/convert.md, "The output folder"):

- a folder that no conversion made, and is not empty, is never written to (also with
  `--fresh`), nor is the source folder itself;
- a conversion is resumed only with the same recipe, the same layout and the same source
  contents: each source shard's identity (size, header hash and a hash of sampled bytes
  for a local file; the commit and LFS sha256 for a Hub file) is recorded in run.json
  and compared, and a shard that differs is named;
- `--fresh` deletes only what a conversion wrote (the files run.json or the repo's index
  names, the repo files, and the work folder); other files in the folder stay, and the
  new conversion is written next to them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from turboquant.manifests.schema import INDEX_FILE, MANIFEST_FILE, QUANT_METHOD

from .errors import OutputError
from .ledger import WORK
from .plan import Plan
from .sources import Source, is_aux_file

REPO_FILES = ("config.json", "README.md", MANIFEST_FILE, INDEX_FILE)
LOCK_NAME = "run.lock"


def run_record(plan: Plan, source: Source) -> dict:
    """What run.json says of a conversion: its recipe, layout, source and output files."""
    shards = [job.shard for job in plan.jobs]
    return {
        "quant_method": QUANT_METHOD,
        "format_version": plan.format_version,
        "recipe": plan.recipe.name,
        "recipe_hash": plan.recipe_hash,
        "plan_hash": plan.plan_hash(),
        "source": plan.source,
        "sources": plan.identities,
        "files": sorted(set(shards) | set(REPO_FILES) | set(source.aux_files())),
        "jobs": len(plan.jobs),
        "resolved_recipe": plan.recipe.data,
    }


@dataclass
class Decision:
    """What a run does with its output folder (made by `decide`, which refuses instead)."""

    out: Path
    resume: bool = False  # the folder holds this conversion: go on with it
    delete: list[Path] = field(default_factory=list)  # --fresh: a previous conversion's files


def read_record(out: Path) -> dict | None:
    """The folder's run.json, or None when it has none; a damaged one is an error."""
    path = out / WORK / "run.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise OutputError(f"{path} cannot be read ({e}); add --fresh to start over") from None
    if not isinstance(record, dict):
        raise OutputError(f"{path} is not a conversion record; add --fresh to start over")
    return record


def made_elsewhere(out: Path) -> bool:
    """A TurboQuant repo without this project's work folder (copied, or downloaded)."""
    try:
        q = json.loads((out / "config.json").read_text()).get("quantization_config", {})
        return q.get("quant_method") == QUANT_METHOD
    except (OSError, ValueError, AttributeError):
        return False


def _listing(out: Path) -> list[str]:
    return sorted(f.name for f in out.iterdir() if f.name != WORK)


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def decide(out: Path, record: dict, fresh: bool, source_folder: Path | None = None) -> Decision:
    """What this run may do with `out` (see the module's rules); raises OutputError
    instead. Reads only."""
    if source_folder is not None and out == source_folder:
        raise OutputError(f"{out} is the source folder; choose another output folder")
    if not out.exists():
        return Decision(out)
    if not out.is_dir():
        raise OutputError(f"{out} is a file, not a folder; choose an output path that is a "
                          "folder or does not exist yet")
    old = read_record(out)
    others = _listing(out)
    if old is None and not made_elsewhere(out):
        if others:
            raise OutputError(f"{out} is not empty and is not a TurboQuant conversion "
                              f"({_names(others)}); choose an empty or new output folder "
                              "(--fresh only deletes a conversion's own files)")
        return Decision(out, delete=_work_files(out) if fresh else [])
    if fresh:
        return Decision(out, delete=conversion_files(out, old))
    if old is None:
        raise OutputError(f"{out} already holds a TurboQuant repo made elsewhere "
                          f"({_names(others)}); add --fresh to replace it, or choose an empty "
                          "folder")
    check_same_conversion(out, old, record)
    return Decision(out, resume=True)


def check_same_conversion(out: Path, old: dict, new: dict) -> None:
    """A conversion is resumed (or found finished) only with the same recipe, source
    contents and layout; the first difference is raised, in one line (a source shard of
    other shapes is named as such, before the layout it changes)."""
    if old.get("recipe_hash") != new["recipe_hash"]:
        diff = recipe_diff(old.get("resolved_recipe") or {}, new["resolved_recipe"])
        what = f" ({'; '.join(diff[:4])})" if diff else ""
        raise OutputError(
            f"{out} was made with recipe {old.get('recipe')!r} (hash "
            f"{str(old.get('recipe_hash'))[:12]}), this command resolves to recipe "
            f"{new['recipe']!r} (hash {new['recipe_hash'][:12]}){what}: outputs of "
            "different recipes are never mixed. Rerun with the same options, add --fresh "
            "to start over, or choose another output folder.")
    problem = source_difference(old.get("sources"), new["sources"])
    if problem:
        raise OutputError(f"{out} was converted from {old.get('source')}, and {problem}: "
                          "outputs of different sources are never mixed. Add --fresh to start "
                          "over, or choose another output folder.")
    if old.get("plan_hash") != new["plan_hash"]:
        raise OutputError(
            f"{out} was made from another source or layout ({old.get('source')}, "
            f"{old.get('jobs')} jobs; now {new['source']}, {new['jobs']} jobs): "
            "add --fresh to start over, or choose another output folder.")


def same_shard(old: dict, new: dict) -> bool:
    """Whether two identities of a source shard name the same contents."""
    if old.get("sha256") and new.get("sha256"):  # Hub LFS files: their content hash
        return (old["sha256"], old.get("size")) == (new["sha256"], new.get("size"))
    if old.get("sample_sha256") and new.get("sample_sha256"):  # local files, sampled
        keys = ("size", "header_sha256", "sample_sha256")
        return all(old.get(k) == new.get(k) for k in keys)
    return old == new  # no content hash on one side: only an identical record passes


def source_difference(old: dict | None, new: dict) -> str | None:
    """Why the source shards `new` are not those of `old` (None: they are), in words."""
    if old is None:
        return ("its run.json does not record the source's contents (an older version made "
                "it), so they cannot be compared")
    for file in sorted(set(old) | set(new)):
        a, b = old.get(file), new.get(file)
        if a is None or b is None:
            return f"shard {file} is {'new' if a is None else 'missing'} in this source"
        if same_shard(a, b):
            continue
        if a.get("size") != b.get("size"):
            why = f"{a.get('size')} bytes then, {b.get('size')} now"
        elif a.get("header_sha256") != b.get("header_sha256"):
            why = "its header differs"
        elif a.get("sha256") or b.get("sha256"):
            why = "its content hash differs"
        else:
            why = "its sampled bytes differ: other weights of the same shapes, e.g. a fine-tune"
        return f"shard {file} of this source is not the one converted ({why})"
    return None


def recipe_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two resolved recipes, as 'key: old -> new'."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += recipe_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def _work_files(out: Path) -> list[Path]:
    """The work folder's contents, but the run's lock (held while they are deleted)."""
    root = out / WORK
    return sorted(f for f in root.iterdir() if f.name != LOCK_NAME) if root.is_dir() else []


def conversion_files(out: Path, old: dict | None) -> list[Path]:
    """What a previous conversion wrote in `out`: the files its run.json names (or, for a
    repo made elsewhere or by an older version, its index's shards, the repo files and the
    tokenizer files), their temporary files, and the work folder."""
    names = set(REPO_FILES)
    if old is not None and isinstance(old.get("files"), list):
        names |= {n for n in old["files"] if isinstance(n, str)}
    else:
        names |= {f.name for f in out.iterdir() if f.is_file() and is_aux_file(f.name)}
        if old is not None:  # an older version's record: its shards by their names
            names |= {f.name for f in out.iterdir()
                      if f.name.startswith("model") and f.name.endswith(".safetensors")}
        try:
            index = json.loads((out / INDEX_FILE).read_text())
            names |= {n for n in index.get("weight_map", {}).values() if isinstance(n, str)}
        except (OSError, ValueError, AttributeError):
            pass
    names = {n for n in names if n and "/" not in n and n not in (".", "..", WORK)}
    files = [out / n for n in sorted(names)] + [out / f"{n}.tmp" for n in sorted(names)]
    return [f for f in files if f.is_file()] + _work_files(out)


def delete(decision: Decision) -> None:
    """--fresh: delete what `decide` listed (files only, and the work folder's contents)."""
    for f in decision.delete:
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f)
        elif f.exists() or f.is_symlink():
            f.unlink()

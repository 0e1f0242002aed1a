"""`turboquant allocate`: per-tensor bits for a bits-per-weight target, from a converted
repo's manifest, written as a recipe that `turboquant convert --recipe` accepts.

Each coded tensor's `out_error` (docs/quality.md: it orders tensors by the loss they cause)
is known at the bits the repo was coded with; at another width it is predicted with the
codec's distortion on a rotated Gaussian (stages.allocate.gaussian_distortion), the bytes
at each width come from the row's shape (codes) and its stored bytes (scales, in_scales),
and stages.allocate.choose_bits picks the bits. The recipe is the repo's own resolved
recipe (its run.json, else the bundled recipe of that name) plus a `[tensor_bits]` table.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from turboquant.manifests.schema import read_manifest
from turboquant.stages.allocate import (Candidate, choose_bits, gaussian_distortion,
                                        predict_errors, total_bytes)
from turboquant.stages.pack import words_per_row


class AllocateError(ValueError):
    """The repo cannot be allocated (no out_error, a target out of reach); names the file."""


@dataclass
class Allocation:
    candidates: list[Candidate]
    chosen: dict[str, int]  # name -> bits
    fixed_bytes: int  # raw tensors and coded ones left as they are (no out_error, trellis)
    total_weights: int
    source_bits: dict[str, int]  # name -> bits the repo was coded with
    recipe: dict  # the resolved recipe with [tensor_bits]

    @property
    def bits_per_weight(self) -> float:
        return 8 * (self.fixed_bytes + total_bytes(self.candidates, self.chosen)) \
            / self.total_weights


def numel(shape) -> int:
    return math.prod(shape)


def codes_bytes(shape, padded_in: int, bits: int) -> int:
    """Bytes of a coded tensor's packed codes (FORMAT.md): rows x words_per_row x 4."""
    return (numel(shape) // shape[-1]) * words_per_row(padded_in, bits) * 4


def row_bytes(row: dict, bits: int) -> int:
    """A coded manifest row's stored bytes at `bits`: its scales and in_scales as stored,
    its codes at the new width."""
    stored = row["byte_end"] - row["byte_start"]
    return stored - codes_bytes(row["shape"], row["padded_in"], row["bits"]) \
        + codes_bytes(row["shape"], row["padded_in"], bits)


def allocatable(row: dict) -> bool:
    """A row whose bits allocate chooses: scalar-coded at 2-4 bits, with an out_error."""
    return row["codec"] == "turboquant" and row["bits"] in (2, 3, 4) \
        and row.get("out_error") is not None


def candidates_from_rows(rows: list[dict], choices, ratio) -> list[Candidate]:
    """One Candidate per allocatable row; `ratio(bits, group_size)`: the codec's relative
    error at that width (gaussian_distortion)."""
    out = []
    for r in rows:
        if not allocatable(r):
            continue
        ratios = {b: ratio(b, r["group_size"]) for b in {*choices, r["bits"]}}
        out.append(Candidate(r["name"], predict_errors(r["out_error"], r["bits"], choices,
                                                       ratios),
                             {b: row_bytes(r, b) for b in choices}))
    return out


def allocate_rows(rows: list[dict], recipe: dict, target_bits: float, choices,
                  ratio=gaussian_distortion) -> Allocation:
    """The allocation of a repo's manifest rows for `target_bits` bits/w (every stored byte
    over every weight, as the convert summary and verify count them)."""
    choices = sorted(set(choices))
    cands = candidates_from_rows(rows, choices, ratio)
    if not cands:
        raise AllocateError("no coded tensor has an out_error (a repo converted before the "
                            "manifest recorded it?): convert it again, then allocate")
    names = {c.name for c in cands}
    fixed = sum(r["byte_end"] - r["byte_start"] for r in rows if r["name"] not in names)
    weights = sum(numel(r["shape"]) for r in rows)
    budget = math.floor(target_bits * weights / 8) - fixed
    try:
        chosen = choose_bits(cands, budget)
    except ValueError:
        low = 8 * (fixed + sum(c.nbytes[choices[0]] for c in cands)) / weights
        raise AllocateError(f"--target-bits {target_bits} is below what the fewest choice "
                            f"({choices[0]} bits) takes: {low:.3f} bits/w") from None
    data = json.loads(json.dumps(recipe))  # a copy
    data["tensor_bits"] = dict(sorted(chosen.items()))
    src = {r["name"]: r["bits"] for r in rows if r["name"] in names}
    return Allocation(cands, chosen, fixed, weights, src, data)


def repo_recipe(repo: Path) -> dict:
    """The resolved recipe a repo was converted with: its run.json's, else (a repo without
    the work folder) the bundled recipe config.json names."""
    from turboquant.manifests.recipe import RecipeError, load_recipe

    run = repo / ".turboquant" / "run.json"
    if run.exists():
        data = json.loads(run.read_text()).get("resolved_recipe")
        if data:
            return data
    config = repo / "config.json"
    try:
        name = json.loads(config.read_text())["quantization_config"]["recipe"]
        return load_recipe(name).data
    except (OSError, ValueError, KeyError, TypeError, RecipeError) as e:
        raise AllocateError(f"{repo}: no .turboquant/run.json and {config} names no bundled "
                            f"recipe ({e}): allocate a repo converted here") from None


def allocate_repo(repo: str | Path, target_bits: float, choices=(3, 4)) -> Allocation:
    repo = Path(repo)
    try:
        rows = read_manifest(repo).to_pylist()
    except OSError as e:
        raise AllocateError(f"{repo}: cannot read its manifest ({e})") from None
    return allocate_rows(rows, repo_recipe(repo), target_bits, choices)


# ----------------------------------------------------------------------------- report

_LAYER = re.compile(r"\.layers\.\d+\.")


def tensor_class(name: str) -> str:
    """"model.layers.3.self_attn.q_proj.weight" -> "self_attn.q_proj"; others by name."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    m = _LAYER.search(base)
    return base[m.end():] if m else base


def class_table(a: Allocation) -> list[str]:
    """Lines: per tensor class, how many tensors got each width, and the predicted
    out_error at the repo's own bits and after the allocation."""
    choices = sorted({b for c in a.candidates for b in c.bits})
    rows: dict[str, dict] = {}
    for c in a.candidates:
        r = rows.setdefault(tensor_class(c.name), {"n": {b: 0 for b in choices},
                                                   "before": 0.0, "after": 0.0})
        r["n"][a.chosen[c.name]] += 1
        r["before"] += c.errors.get(a.source_bits[c.name], math.nan)
        r["after"] += c.errors[a.chosen[c.name]]
    width = max(len(k) for k in rows) if rows else 5
    head = "".join(f"{f'{b} bits':>8}" for b in choices)
    lines = [f"  {'class':<{width}}{head}  {'out_error now':>14}  {'predicted':>11}"]
    for k in sorted(rows):
        r = rows[k]
        cols = "".join(f"{r['n'][b]:>8}" for b in choices)
        lines.append(f"  {k:<{width}}{cols}  {r['before']:14.4g}  {r['after']:11.4g}")
    before = sum(r["before"] for r in rows.values())
    after = sum(r["after"] for r in rows.values())
    cols = "".join(f"{sum(r['n'][b] for r in rows.values()):>8}" for b in choices)
    lines.append(f"  {'total':<{width}}{cols}  {before:14.4g}  {after:11.4g}")
    return lines


# ----------------------------------------------------------------------------- TOML

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list) and not any(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as a TOML value")


def to_toml(data: dict) -> str:
    """A recipe dict as TOML (scalars, lists, tables, arrays of tables: what recipes hold)."""
    plain = {k: v for k, v in data.items() if not isinstance(v, (dict, list))
             or (isinstance(v, list) and not any(isinstance(x, dict) for x in v))}
    lines = [f"{_key(k)} = {_value(v)}" for k, v in plain.items()]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{_key(k)}]"] + [f"{_key(a)} = {_value(b)}" for a, b in v.items()]
    for k, v in data.items():
        if isinstance(v, list) and any(isinstance(x, dict) for x in v):
            for item in v:
                lines += ["", f"[[{_key(k)}]]"]
                lines += [f"{_key(a)} = {_value(b)}" for a, b in item.items()]
    return "\n".join(lines) + "\n"

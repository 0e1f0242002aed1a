"""The model card (README.md) of a TurboQuant repo: Hub metadata, recipe, bits, errors.

Deterministic: no dates, no timings, so a resumed conversion writes the same bytes.
"""

from __future__ import annotations

from collections import defaultdict



def _label(row: dict) -> str:
    if row["codec"] == "raw":
        return "kept (source dtype)"
    if row["codec"] == "ternary":
        return f"ternary, group {row['group_size']}"
    if row["codec"] == "trellis":
        return f"{row['bits']}-bit trellis ({_trellis_params(row)}), group {row['group_size']}"
    return f"{row['bits']}-bit, group {row['group_size']}"


def _trellis_params(row: dict) -> str:
    """L, and V and the trellis version where they are not 1 (the cards written before
    those could change keep their bytes)."""
    params = [f"L={row['trellis_state_bits']}"]
    if (row.get("trellis_values") or 1) != 1:
        params.append(f"V={row['trellis_values']}")
    if (row.get("trellis_version") or 1) != 1:
        params.append(f"version {row['trellis_version']}")
    return ", ".join(params)


def model_card(plan, rows: list[dict], summary, base_model: str | None) -> str:
    name = plan.config.get("_name_or_path") or base_model or plan.config.get("model_type", "model")
    title = (base_model or str(name)).split("/")[-1]
    front = ["---", "library_name: mlx", "tags:", "- turboquant", "- mlx", "- quantized"]
    if base_model:
        front += [f"base_model: {base_model}", "base_model_relation: quantized"]
    front += ["pipeline_tag: text-generation", "---", ""]

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_label(r)].append(r)
    table = ["| codec | tensors | weights | bits/weight | mean rel. MSE | max rel. MSE |",
             "|---|---:|---:|---:|---:|---:|"]
    for label in sorted(groups):
        rs = groups[label]
        weights = sum(_numel(r) for r in rs)
        stored = sum(r["byte_end"] - r["byte_start"] for r in rs)
        errs = [r["rel_mse"] for r in rs if r["rel_mse"] is not None]
        mean = f"{sum(errs) / len(errs):.5f}" if errs else "-"
        worst = f"{max(errs):.5f}" if errs else "-"
        table.append(f"| {label} | {len(rs)} | {weights:,} | {8 * stored / max(weights, 1):.3f} "
                     f"| {mean} | {worst} |")

    recipe = plan.recipe
    body = [
        f"# {title} (TurboQuant)",
        "",
        f"{'[' + base_model + '](https://huggingface.co/' + base_model + ')' if base_model else title}"
        " compressed with TurboQuant: a seeded randomized Hadamard rotation per weight, one "
        "fp16 scale per group, and the Lloyd-Max codebook for a Gaussian. Data-free: no "
        "calibration set was used.",
        "",
        f"- **Real bits per weight**: {summary.coded_bits_per_weight:.3f} over the coded "
        f"weights, {summary.bits_per_weight:.3f} over all weights (scales and 16-bit tensors "
        "included)",
        f"- **Size**: {summary.files_bytes / 1e9:.3f} GB in {summary.shards} shard"
        f"{'s' if summary.shards != 1 else ''}, {summary.tensors} tensors "
        f"({summary.coded_tensors} coded)",
        f"- **Recipe**: `{recipe.name}` (sha256 `{plan.recipe_hash[:16]}`), default "
        f"{recipe.bits} bits, group size {recipe.group_size}, model seed {recipe.model_seed}",
        f"- **Format**: TurboQuant repo format version {plan.format_version} (see "
        "`quantization_config` in config.json and `manifest.parquet`)",
        "",
        "## Error by codec",
        "",
        "Relative MSE is ‖W − decode(W)‖² / ‖W‖², measured on every tensor at conversion.",
        "",
        *table,
        "",
        "## Use",
        "",
        "```bash",
        "pip install turboquant",
        "turboquant generate --model <this repo or folder> --prompt \"Hello\"",
        "turboquant verify <folder>      # checksums and a decode sample",
        "```",
        "",
    ]
    return "\n".join(front + body)


def _numel(r: dict) -> int:
    n = 1
    for d in r["shape"]:
        n *= d
    return n

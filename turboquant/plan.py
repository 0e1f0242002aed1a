"""`turboquant plan SOURCE`: will this model run here, resident or with expert streaming?

    turboquant plan Qwen/Qwen3-235B-A22B --context 8192
    turboquant plan ./out/llama-tq4 --memory-gb 16 --kv-bits 4/3

Reads config.json and the safetensors headers only (a Hub repo through HTTP range
requests), projects weights, KV cache, workspace and a reserve against this machine's
memory (or --memory-gb), and prints RESIDENT, STREAM (with the expert budget) or WON'T
FIT, and the commands to run it. Exit status: 0 it runs (RESIDENT or STREAM), 1 WON'T
FIT, 2 an error (or a recipe that would refuse the checkpoint). See
docs/bigger-than-memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from turboquant.convert import parse_bits, parse_main_bits

PROG = "turboquant plan"
DEFAULT_CONTEXT = 4096
GUIDE = "docs/bigger-than-memory.md"


def model_max_context(config: dict) -> int | None:
    """The context the model was built for (max_position_embeddings), if config says."""
    for c in (config, config.get("text_config") or {}):
        n = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def default_context(config: dict) -> int:
    """DEFAULT_CONTEXT, or the model's own maximum where that is smaller."""
    n = model_max_context(config)
    return min(DEFAULT_CONTEXT, n) if n else DEFAULT_CONTEXT


def parse_kv_bits(text: str) -> tuple[int, int]:
    """"4/3" (keys/values) or "4" (both)."""
    parts = text.replace(",", "/").split("/")
    try:
        bits = tuple(int(p) for p in parts)
    except ValueError:
        bits = ()
    if len(bits) == 1:
        bits = bits * 2
    if len(bits) != 2 or any(b not in (2, 3, 4, 8) for b in bits):
        raise argparse.ArgumentTypeError(f"--kv-bits takes K/V bits in 2, 3, 4, 8 (e.g. 4/3), "
                                         f"got {text!r}")
    return bits  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Project a model's memory at run time from config.json and safetensors "
        "headers (no tensor is read), and say whether it runs resident, with expert "
        "streaming, or not at all on this machine.",
    )
    p.add_argument("source", help="source checkpoint or TurboQuant repo: a local folder or a "
                   "Hub repo id (org/name)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help=f"tokens of context: prompt + generated (default {DEFAULT_CONTEXT}, or "
                   "the model's max_position_embeddings where smaller)")
    p.add_argument("--memory-gb", type=float, metavar="G",
                   help="memory to plan for, in GB (default: this machine's)")
    p.add_argument("--backend", choices=("cpu", "metal", "cuda"),
                   help="MLX backend to plan for (default: this machine's)")
    p.add_argument("--kv-bits", type=parse_kv_bits, metavar="K/V",
                   help="TurboQuant-compressed KV cache, e.g. 4/3 (default: fp16 cache)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="activation dtype (default: the runtime's: stored dtype; float32 for "
                   "MoE on the CPU)")
    p.add_argument("--prefill-step", type=int, default=2048, metavar="N",
                   help="prompt tokens per prefill step (default 2048, as mlx-lm)")
    p.add_argument("--revision", help="Hub branch, tag or commit")
    p.add_argument("--json", action="store_true", help="print the projection as JSON")
    r = p.add_argument_group("recipe (source checkpoints: what `turboquant convert` would "
                             "write)")
    r.add_argument("--recipe", help="bundled recipe name or .toml path (default: by model_type)")
    r.add_argument("--bits", type=parse_main_bits, help="attention and dense MLP bits (2, 3, 4 "
                   "or ternary)")
    r.add_argument("--expert-bits", type=parse_bits, help="MoE expert bits (2, 3, 4, ternary or raw)")
    r.add_argument("--down-proj-bits", type=parse_bits, help="down projection bits")
    r.add_argument("--embeddings-bits", type=parse_bits, help="embedding bits, or raw")
    r.add_argument("--lm-head-bits", type=parse_bits, help="lm_head bits, or raw")
    r.add_argument("--group-size", type=int, choices=(32, 64, 128), help="weights per scale")
    r.add_argument("--protect-layers", type=int, metavar="N",
                   help="first and last N layers at no fewer than 4 bits")
    return p


_OVERRIDES = ("bits", "expert_bits", "down_proj_bits", "embeddings_bits", "lm_head_bits",
              "group_size", "protect_layers")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.context is not None and args.context < 1) or args.prefill_step < 1:
        print(f"{PROG}: --context and --prefill-step must be at least 1", file=sys.stderr)
        return 2
    if args.memory_gb is not None and args.memory_gb <= 0:
        print(f"{PROG}: --memory-gb must be positive", file=sys.stderr)
        return 2
    from turboquant.manifests.recipe import RecipeError
    from turboquant.pipeline.errors import (ConversionError, HubUnreachable, SourceError,
                                            hub_unreachable, network_reason)
    from turboquant.pipeline.fit import project, this_machine
    from turboquant.pipeline.fit_model import ShapeError
    from turboquant.pipeline.fit_weights import inventory
    from turboquant.pipeline.sources import open_source

    overrides = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    t0 = time.perf_counter()
    try:
        source = open_source(args.source, revision=args.revision)
        inv = inventory(source, args.recipe, overrides)
        machine = this_machine(args.memory_gb, args.backend)
        if args.context is None:
            args.context = default_context(inv.config)
        proj = project(inv, args.context, machine, dtype=args.dtype, kv_bits=args.kv_bits,
                       prefill_step=args.prefill_step)
    except HubUnreachable as e:  # the same line as the other commands' network errors
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (ConversionError, SourceError, RecipeError, ShapeError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the Hub client's network errors are many
        reason = network_reason(e)
        if reason is None:
            raise
        print(f"{PROG}: error: {hub_unreachable(reason)}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    alternatives = suggestions(proj, args.dtype) if proj.verdict != "RESIDENT" else []
    if args.json:
        d = proj.to_dict()
        d["seconds"] = round(seconds, 3)
        if inv.kind == "source":
            d["source"] = {"parameters": inv.source_parameters, "bytes": inv.source_bytes}
        d["max_context"] = {"resident": proj.max_context("RESIDENT"),
                            "stream": proj.max_context("STREAM")}
        d["commands"] = commands(proj, args)
        d["alternatives"] = [{"change": c, "verdict": v} for c, v in alternatives]
        print(json.dumps(d, indent=2))
    else:
        print(report(proj, args, seconds, alternatives))
    if proj.inventory.problems:
        return 2
    return 1 if proj.verdict == "WON'T FIT" else 0


# ------------------------------------------------------------------------ suggestions


def suggestions(proj, dtype: str | None = None) -> list[tuple[str, str]]:
    """(change, verdict) for what would fit better: a smaller recipe, a compressed KV cache,
    a shorter context. Only changes that improve the verdict are listed."""
    from turboquant.pipeline.fit import VERDICTS, project
    from turboquant.pipeline.fit_weights import reproject

    rank = {v: i for i, v in enumerate(VERDICTS)}
    now = rank[proj.verdict]
    out = []

    def again(inv, kv_bits):
        return project(inv, proj.context, proj.machine, dtype=dtype, kv_bits=kv_bits,
                       prefill_step=proj.prefill_step)

    inv = proj.inventory
    if inv.kind == "source" and not inv.problems:
        moe = any(w.is_expert for w in inv.weights)
        options = ([{"expert_bits": 2}, {"expert_bits": "ternary"},
                    {"bits": 3, "expert_bits": 2}, {"bits": 3, "expert_bits": "ternary"}]
                   if moe else [{"bits": 3}, {"bits": 2}])
        for opt in options:
            if all(inv.recipe_args.get(k) == v for k, v in opt.items()):
                continue
            alt = again(reproject(inv, **opt), proj.kv_bits)
            if rank[alt.verdict] < now and not alt.inventory.problems:
                out.append((" ".join(_flag(k, v) for k, v in opt.items()), alt.verdict))
                break
    if proj.kv_bits is None and proj.shape.model_type != "gpt_oss" and proj.shape.kv_layers:
        alt = again(inv, (4, 3))
        if rank[alt.verdict] < now:
            out.append(("--kv-bits 4/3", alt.verdict))
    for mode in ("RESIDENT", "STREAM"):
        if rank[mode] < now:
            n = proj.max_context(mode)
            if n:
                out.append((f"--context {n}", mode))
                break
    return out


def _flag(key: str, value) -> str:
    return f"--{key.replace('_', '-')} {value}"


# ------------------------------------------------------------------------ commands


def _out_name(proj, args) -> str:
    base = os.path.basename(os.path.normpath(args.source.split("@")[0])) or "model"
    return f"{base}-tq"


def commands(proj, args) -> list[str]:
    """The commands that run the model as planned."""
    inv = proj.inventory
    model = args.source
    cmds = []
    if inv.kind == "source":
        model = _out_name(proj, args)
        conv = f"turboquant convert {args.source} {model}"
        if args.recipe:
            conv += f" --recipe {args.recipe}"
        conv += "".join(f" {_flag(k, v)}" for k, v in inv.recipe_args.items())
        cmds.append(conv)
    if proj.verdict == "WON'T FIT":
        return cmds
    extra = f" --dtype {args.dtype}" if args.dtype else ""
    if proj.verdict == "STREAM":
        extra += f" --expert-budget {proj.expert_budget / 1e9:.1f}GB"
    if proj.kv_bits:
        k, v = proj.kv_bits
        cmds.append(f"turboquant serve --model {model}{extra} --kv-bits-k {k} --kv-bits-v {v}")
    else:
        cmds.append(f'turboquant generate --model {model}{extra} --prompt "..."')
    return cmds


# ------------------------------------------------------------------------ report


def _gb(n: float) -> str:
    from turboquant.pipeline.fit import bytes_text

    return bytes_text(n)


def report(proj, args, seconds: float, alternatives) -> str:
    inv, shape, m = proj.inventory, proj.shape, proj.machine
    what = "source checkpoint" if inv.kind == "source" else "TurboQuant repo"
    lines = [f"{PROG}: {inv.source}", f"  {what}, recipe {inv.recipe}; {inv.files} files, "
             f"{inv.tensors:,} tensors (planned in {seconds:.2f} s)"]
    if inv.kind == "source":
        lines.append(f"  {inv.source_parameters / 1e9:,.3f}B parameters in "
                     f"{_gb(inv.source_bytes)} of tensors")
    kinds = ", ".join(f"{shape.count(k)} {label}" for k, label in
                      (("full", "full attention"), ("sliding", "sliding window"),
                       ("linear", "linear attention")) if shape.count(k))
    model = f"  {shape.model_type}: {shape.layers} layers ({kinds})"
    if shape.moe:
        model += f", {shape.experts} experts ({shape.top_k} per token)"
    lines.append(model)
    kv = "fp16 KV cache" if not proj.kv_bits else \
        f"TurboQuant KV cache K{proj.kv_bits[0]}/V{proj.kv_bits[1]}"
    top = model_max_context(proj.inventory.config)
    note = "" if not top else (" (the model's maximum)" if proj.context == top else
                               f" (more than the model's maximum, {top:,})"
                               if proj.context > top else "")
    lines.append(f"  {proj.dtype} activations, {kv}, context {proj.context:,} tokens{note}, "
                 f"{m.backend} backend")
    lines.append("")
    rows = [("weights", proj.weights, "")]
    if proj.experts:
        rows.append(("  routed experts", proj.experts,
                     f"{proj.moe_layers} layers x {shape.experts} experts, up to "
                     f"{_gb(proj.expert_unit)} each"))
        rows.append(("  everything else", proj.nonexpert, ""))
    rows.append(("KV cache", proj.kv, _kv_text(proj)))
    ph = proj.phases
    rows.append(("workspace", proj.workspace,
                 f"prefill {min(proj.prefill_step, proj.context):,} tokens at a time: attention "
                 f"{_gb(ph['prefill_attention'])}, MLP {_gb(ph['prefill_mlp'])}; decode "
                 f"{_gb(ph['decode'])}"))
    rows.append(("reserve", proj.reserve, "1 GB + 5% of memory"))
    rows.append(("total", proj.need, ""))
    rows.append(("memory", m.memory, m.description))
    for label, n, note in rows:
        lines.append(f"  {label:<18}{_gb(n):>12}" + (f"   ({note})" if note else ""))
    lines.append("")
    lines += _verdict_lines(proj)
    if inv.problems:
        lines.append("")
        lines.append(f"the conversion would refuse {len(inv.problems)} tensor(s); fix the "
                     "recipe first:")
        lines += [f"  {p}" for p in inv.problems[:5]]
        if len(inv.problems) > 5:
            lines.append(f"  ... {len(inv.problems) - 5} more")
    for note in proj.notes:
        lines.append(f"note: {note}")
    cmds = commands(proj, args)
    if cmds:
        lines.append("")
        lines.append("to run it:" if proj.verdict != "WON'T FIT" else "to convert it anyway:")
        lines += [f"  {c}" for c in cmds]
        if proj.verdict == "STREAM":
            lines.append(f"  (expert streaming: see {GUIDE})")
    if alternatives:
        lines.append("")
        lines.append("what would fit better:")
        base = f"turboquant plan {args.source}"
        for change, verdict in alternatives:
            lines.append(f"  {base} {change}   -> {verdict}")
    return "\n".join(lines)


def _kv_text(proj) -> str:
    shape = proj.shape
    parts = []
    if shape.count("full"):
        parts.append(f"{shape.count('full')} full-attention layers")
    if shape.count("sliding"):
        parts.append(f"{shape.count('sliding')} sliding-window layers of "
                     f"{shape.sliding_window} tokens")
    if shape.count("linear"):
        parts.append(f"{shape.count('linear')} linear layers, constant state")
    per = proj.kv / max(proj.context, 1)
    return ", ".join(parts) + f"; {per / 1e3:.1f} KB per token"


def _verdict_lines(proj) -> list[str]:
    v = proj.verdict
    m = proj.machine.memory
    if v == "RESIDENT":
        left = m - proj.need
        out = [f"verdict: RESIDENT: everything fits, {_gb(left)} to spare"]
    elif v == "STREAM":
        budget = proj.expert_budget
        share = 100 * budget / proj.experts
        out = [
            "verdict: STREAM: the routed experts do not all fit; everything else does",
            f"  expert budget {budget / 1e9:.1f} GB ({share:.0f}% of the experts); one token "
            f"needs at least {_gb(proj.min_expert_budget)} ({proj.shape.top_k or 1} experts x "
            f"{proj.moe_layers} layers)",
        ]
    else:
        short = proj.need - m if not proj.experts else proj.fixed + proj.min_expert_budget - m
        out = [f"verdict: WON'T FIT: {_gb(short)} short"
               + (" even with expert streaming" if proj.experts else "")]
    res, stream = proj.max_context("RESIDENT"), proj.max_context("STREAM")
    ctx = [f"resident up to {res:,} tokens" if res else "not resident at any context"]
    if proj.experts:
        ctx.append(f"streaming up to {stream:,} tokens" if stream else
                   "not streaming at any context")
    out.append("  context: " + ", ".join(ctx))
    return out


if __name__ == "__main__":
    sys.exit(main())

"""Model quality: held-out perplexity and KL to bf16, TurboQuant vs MLX affine, same run.

For each reference model (reference/models/pystd-dense, reference/models/pystd-moe):

- bf16: the shipped weights (math in float32, the reference of every KL).
- affine-b (b = 2, 3, 4, group 64): mlx-lm's own quantization path on the same bf16
  model (`mlx_lm.utils.quantize_model`, what `mlx_lm.convert -q --q-bits b
  --q-group-size 64` runs, including the model's own `quant_predicate`: Qwen3-MoE's
  router at 8 bits). Every Linear, SwitchLinear and the (tied) embedding at b bits.
- tq-b matched: this project's `turboquant convert` with the same tensors at the same
  bits as affine-b: `--bits b --expert-bits b --embeddings-bits b --lm-head-bits b
  --protect-layers 0` (norms and the MoE router stay bf16, as the recipes keep them).
- tq-b recipe: the family recipe's defaults at b bits: `--bits b` (and `--expert-bits b`
  on the MoE): embeddings at 4 bits, first and last decoder layer at 4 bits.
- MoE only, ternary experts: `--expert-bits ternary --protect-layers 0` (attention and
  embeddings at the recipe's 4 bits), and the same with `--down-proj-bits 4`.

TurboQuant models are converted by the real pipeline (in process, without Prefect; the
same steps) into --work (reused: a finished conversion resumes as a no-op) and loaded with
`turboquant.runtime.load`. Every model runs in float32 on the same held-out windows:
--windows rows of 512 tokens spread evenly over reference/heldout.txt (the rows of
reference/mlx_eval.py's protocol: tokenizer.json, no special tokens, consecutive rows of
512, each row an independent sequence). Per method: perplexity (exp of mean NLL), KL(bf16
|| method) per next-token position in float32, averaged over the same positions, and
top-1 agreement with bf16. Real bits per weight = every stored byte of the model (codes,
scales, affine biases, tensors kept in 16 bits) * 8 / the source model's parameter count
(tied embeddings counted once), the same rule for both; affine is counted as mlx-lm stores
it (uint32 codes, bf16 scales and biases, as the source dtype), TurboQuant from its
safetensors files.

    .venv/bin/python benchmarks/quality.py | tee benchmarks/results/quality.txt
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import platform
import shlex
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "reference"
MODELS = {"dense": REFERENCE / "models" / "pystd-dense", "moe": REFERENCE / "models" / "pystd-moe"}
SEQ = 512
GROUP = 64


# --------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str
    kind: str  # "bf16" | "affine" | "tq"
    bits: int | str | None = None  # nominal bits of the bulk of the weights
    peer: int | None = None  # affine bits to compare against (ratio column)
    flags: list[str] = field(default_factory=list)  # turboquant convert flags
    note: str = ""


def methods_for(model: str, bits: list[int], ternary: bool, equal_bpw: bool = False
                ) -> list[Method]:
    ms = [Method("bf16", "bf16", 16)]
    for b in bits:
        ms.append(Method(f"affine-{b}", "affine", b, note=f"mlx_lm quantize_model, group {GROUP}"))
    for b in bits:
        flags = ["--bits", str(b), "--group-size", str(GROUP), "--embeddings-bits", str(b),
                 "--lm-head-bits", str(b), "--protect-layers", "0"]
        if model == "moe":
            flags += ["--expert-bits", str(b)]
        ms.append(Method(f"tq-{b} matched", "tq", b, b, flags, "same tensors/bits as affine"))
        if equal_bpw:  # group 32: b + 0.5 bits/w, what affine pays at group 64
            g32 = [f if f != str(GROUP) else "32" for f in flags]
            ms.append(Method(f"tq-{b} g32 match", "tq", b, b, g32,
                             "as matched, group 32 (= affine's bits/w)"))
    for b in bits:
        flags = ["--bits", str(b), "--group-size", str(GROUP)]
        if model == "moe":
            flags += ["--expert-bits", str(b)]
        ms.append(Method(f"tq-{b} recipe", "tq", b, b, flags,
                         "embeddings 4-bit, first/last layer 4-bit"))
    if model == "moe" and ternary:
        base = ["--bits", "4", "--group-size", str(GROUP), "--expert-bits", "ternary",
                "--protect-layers", "0"]
        peer = min(bits)
        ms.append(Method("tq tern-experts", "tq", "tern", peer, base,
                         "experts ternary; attention, embeddings 4-bit"))
        ms.append(Method("tq tern+down4", "tq", "tern", peer, base + ["--down-proj-bits", "4"],
                         "experts ternary, expert down_proj 4-bit"))
    return ms


def folder_name(model: str, m: Method) -> str:
    return model + "-" + "".join(f.lstrip("-").replace("-bits", "").replace("group-size", "g")
                                 .replace("protect-layers", "p").replace("-", "")
                                 for f in m.flags)


# --------------------------------------------------------------------------- bits


def safetensors_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of all tensor data, number of elements of all tensors) over *.safetensors."""
    total, elements = 0, 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            total += b - a
            elements += math.prod(v["shape"])
    return total, elements


def affine_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# --------------------------------------------------------------------------- models


def load_bf16(path: Path):
    from mlx_lm import load

    model, _ = load(str(path))
    return model


def to_f32(model: nn.Module) -> nn.Module:
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def convert(src: Path, out: Path, flags: list[str]) -> float:
    """Run `turboquant convert` (the real pipeline, in process, no Prefect); seconds."""
    from turboquant.convert import main as convert_main

    t0 = time.perf_counter()
    argv = [str(src), str(out), *flags, "--no-prefect", "--in-process", "-q"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = convert_main(argv)
    if rc != 0:
        sys.stderr.write(buf.getvalue())
        raise SystemExit(f"turboquant convert {' '.join(argv)} failed ({rc})")
    return time.perf_counter() - t0


def build(model_key: str, m: Method, work: Path, n_params: int):
    """(model in float32, real bits per weight, seconds spent converting)."""
    src = MODELS[model_key]
    if m.kind == "bf16":
        model = load_bf16(src)
        bpw = 8 * affine_bytes(model) / n_params  # as stored (bf16), before the cast
        return to_f32(model), bpw, 0.0
    if m.kind == "affine":
        from mlx_lm.utils import quantize_model

        model = load_bf16(src)
        config = json.loads((src / "config.json").read_text())
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
            quantize_model(model, config, GROUP, m.bits)
        mx.eval(model.parameters())
        bpw = 8 * affine_bytes(model) / n_params  # as stored: uint32 codes, bf16 scales/biases
        return to_f32(model), bpw, 0.0
    from turboquant.runtime import load

    out = work / folder_name(model_key, m)
    secs = convert(src, out, m.flags)
    nbytes, _ = safetensors_bytes(out)
    model, _ = load(str(out), dtype="float32")
    return model, 8 * nbytes / n_params, secs


# --------------------------------------------------------------------------- measuring


def windows(model_key: str, count: int) -> mx.array:
    sys.path.insert(0, str(REFERENCE))
    from mlx_eval import heldout_ids

    ids = heldout_ids(MODELS[model_key])
    rows = np.array(ids[: len(ids) // SEQ * SEQ], dtype=np.int32).reshape(-1, SEQ)
    n = len(rows)
    count = min(count, n)
    pick = [i * n // count for i in range(count)]  # spread evenly over the file
    return mx.array(rows[pick]), n


def logprobs(model, x: mx.array) -> mx.array:
    logits = model(x[:, :-1]).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def measure(model, rows: mx.array, ref: list[mx.array] | None, batch: int):
    """Per-row mean NLL and KL(ref || model), top-1 agreement, and (without ref) log-probs."""
    nll, kl, agree, count, out = [], [], 0, 0, []
    for j, i in enumerate(range(0, rows.shape[0], batch)):
        x = rows[i : i + batch]
        lp = logprobs(model, x)
        y = x[:, 1:]
        nll_b = -mx.take_along_axis(lp, y[..., None], axis=-1)[..., 0]
        if ref is not None:
            p = ref[j]
            kl_b = (mx.exp(p) * (p - lp)).sum(axis=-1)  # per position, float32
            ag_b = (mx.argmax(p, -1) == mx.argmax(lp, -1)).sum()
            mx.eval(nll_b, kl_b, ag_b)
            kl += np.asarray(kl_b, dtype=np.float64).mean(axis=-1).tolist()
            agree += ag_b.item()
        else:
            mx.eval(nll_b, lp)
            out.append(lp)
            kl += [0.0] * x.shape[0]
            agree += y.size
        nll += np.asarray(nll_b, dtype=np.float64).mean(axis=-1).tolist()
        count += y.size
    return np.array(nll), np.array(kl), agree / count, out


# --------------------------------------------------------------------------- report


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}"


def run_model(key: str, args) -> tuple[list[dict], str]:
    src = MODELS[key]
    from mlx.utils import tree_flatten

    n_params = sum(v.size for _, v in tree_flatten(load_bf16(src).parameters()))
    rows, n_rows = windows(key, args.windows)
    ms = methods_for(key, args.bits, not args.no_ternary, args.equal_bpw)
    results, ref = [], None
    for m in ms:
        t0 = time.perf_counter()
        model, bpw, conv = build(key, m, args.work, n_params)
        t1 = time.perf_counter()
        row_nll, row_kl, agree, lp = measure(model, rows, ref, args.batch)
        if m.kind == "bf16":
            ref, base_rows = lp, row_nll
        nll, kl = float(row_nll.mean()), float(row_kl.mean())  # rows have equal lengths
        # paired standard error of dppl over windows (delta method: d ppl = ppl * d nll)
        d = row_nll - base_rows
        se = math.exp(nll) * float(d.std(ddof=1)) / math.sqrt(len(d)) if len(d) > 1 else 0.0
        del model
        gc.collect()
        r = dict(model=key, method=m.name, kind=m.kind, bits=m.bits, peer=m.peer, bpw=bpw,
                 nll=nll, ppl=math.exp(nll), se=se, kl=kl, top1=agree, note=m.note,
                 flags=" ".join(m.flags), convert_s=conv, eval_s=time.perf_counter() - t1,
                 load_s=t1 - t0)
        results.append(r)
        print(f"  [{key}] {m.name:<16} bpw {bpw:6.3f}  ppl {r['ppl']:8.4f}  KL {kl:.5f}  "
              f"(build {t1 - t0:.1f} s, eval {r['eval_s']:.1f} s)", file=sys.stderr, flush=True)
    base = results[0]["ppl"]
    aff = {r["bits"]: r for r in results if r["kind"] == "affine"}
    for r in results:
        r["dppl"] = r["ppl"] - base
        peer = aff.get(r["peer"]) if r["kind"] == "tq" else None
        r["ratio"] = r["dppl"] / peer["dppl"] if peer and peer["dppl"] > 0 else None
        r["peer_name"] = f"affine-{r['peer']}" if peer else ""
    tokens = rows.shape[0] * (SEQ - 1)
    header = (f"{key}: {src.relative_to(ROOT)}, {n_params:,} parameters; {rows.shape[0]} "
              f"windows of {SEQ} tokens (of {n_rows}) = {tokens:,} predicted tokens")
    return results, header


def table(results: list[dict], header: str) -> str:
    lines = [header,
             f"  {'method':<16} {'bits/w':>7} {'ppl':>8} {'dppl':>8} {'+-se':>6} {'dppl/aff':>9} {'vs':>9} "
             f"{'KL nats':>8} {'top1':>6}  notes"]
    for r in results:
        lines.append(
            f"  {r['method']:<16} {r['bpw']:7.3f} {r['ppl']:8.4f} {r['dppl']:+8.4f} {r['se']:6.4f} "
            f"{fmt_ratio(r['ratio']):>9} {r['peer_name']:>9} {r['kl']:8.5f} "
            f"{100 * r['top1']:5.1f}%  {r['note']}")
    return "\n".join(lines)


def bar_checks(results: list[dict]) -> list[str]:
    by = {r["method"]: r for r in results}
    out = []
    for variant in ("matched", "recipe"):
        if "affine-3" in by and f"tq-3 {variant}" in by:
            tq, af = by[f"tq-3 {variant}"], by["affine-3"]
            ok = tq["dppl"] <= 0.5 * af["dppl"]
            out.append(f"  3-bit ({variant}): TQ dppl {tq['dppl']:+.4f} <= 0.5 x affine-3 dppl "
                       f"{0.5 * af['dppl']:+.4f} (ratio {fmt_ratio(tq['ratio'])}): "
                       f"{'PASS' if ok else 'FAIL'}")
        if "affine-4" in by and f"tq-4 {variant}" in by:
            tq, af = by[f"tq-4 {variant}"], by["affine-4"]
            ok1, ok2 = tq["dppl"] <= af["dppl"], tq["bpw"] < af["bpw"]
            out.append(f"  4-bit ({variant}): TQ dppl {tq['dppl']:+.4f} <= affine-4 dppl "
                       f"{af['dppl']:+.4f} [{'yes' if ok1 else 'no'}] and TQ bpw {tq['bpw']:.3f} "
                       f"< affine-4 bpw {af['bpw']:.3f} [{'yes' if ok2 else 'no'}]: "
                       f"{'PASS' if ok1 and ok2 else 'FAIL'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="dense,moe", help="comma list of dense, moe")
    ap.add_argument("--bits", default="2,3,4", help="comma list of 2, 3, 4")
    ap.add_argument("--windows", type=int, default=8, help="held-out rows of 512 tokens")
    ap.add_argument("--batch", type=int, default=4, help="rows per forward pass")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "quality",
                    help="where the TurboQuant conversions go (reused)")
    ap.add_argument("--no-ternary", action="store_true", help="skip the MoE ternary rows")
    ap.add_argument("--equal-bpw", action="store_true", help="add TurboQuant rows at group "
                    "32 (b + 0.5 bits/w, the same as affine-b at group 64)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    args.bits = [int(b) for b in args.bits.split(",")]
    keys = [k.strip() for k in args.models.split(",")]
    for k in keys:
        if k not in MODELS:
            ap.error(f"unknown model {k!r}")
    args.work.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)

    import mlx_lm

    t0 = time.perf_counter()
    print(f"TurboQuant vs MLX affine: held-out quality ({platform.machine()}, "
          f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, device {mx.default_device()}, "
          f"math in float32)")
    print("ppl: exp(mean next-token NLL); dppl: ppl - bf16 ppl; dppl/aff: dppl over the same-bits "
          "affine's dppl (column 'vs'); KL: mean KL(bf16 || method) per token, nats; top1: "
          "argmax agreement with bf16; bits/w: every stored byte (codes, scales, biases, "
          "16-bit tensors) * 8 / source parameters")
    all_rows = []
    for k in keys:
        results, header = run_model(k, args)
        all_rows += results
        print()
        print(table(results, header))
        print("bar (3-bit: TQ dppl <= 0.5 x affine-3 dppl; 4-bit: TQ dppl <= affine-4 dppl and "
              "fewer bits/w):")
        for line in bar_checks(results):
            print(line)
    print()
    print("TurboQuant flags per row (turboquant convert SRC OUT ... --no-prefect --in-process):")
    seen = set()
    for r in all_rows:
        if r["kind"] == "tq" and (r["model"], r["method"]) not in seen:
            seen.add((r["model"], r["method"]))
            print(f"  {r['model']:<5} {r['method']:<16} {r['flags']}")
    print()
    cmd = ".venv/bin/python benchmarks/quality.py" + "".join(
        f" {a}" for a in map(shlex.quote, sys.argv[1:] if argv is None else argv))
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(f"reproduce: {cmd}")
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

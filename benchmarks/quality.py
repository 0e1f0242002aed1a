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
- affine-b recipe (b < 4): its like-for-like peer, mlx-lm's quantize_model with a
  quant_predicate giving each tensor the recipe's bits.
- with --equal-bpw, tq-b at group 32 (b + 0.5 bits/w, what affine-b pays at group 64).
- with --trellis, tq-b trellis: as matched, every coded weight trellis-coded (docs/FORMAT.md,
  "Trellis code": the family recipe with `codec = "trellis"`, L=16, V=1), same bytes.
- MoE only, ternary experts: `--expert-bits ternary --protect-layers 0` (attention and
  embeddings at the recipe's 4 bits), and the same with `--down-proj-bits 4`.

TurboQuant models are converted by the real pipeline (in process, without Prefect; the
same steps) into --work (reused: a finished conversion resumes as a no-op) and loaded with
`turboquant.runtime.load`. Every model runs in float32 on the same held-out windows:
--windows rows of 512 tokens spread evenly over reference/heldout.txt (the rows of
reference/mlx_eval.py's protocol: tokenizer.json, no special tokens, consecutive rows of
512, each row an independent sequence). Per method: perplexity (exp of mean NLL), KL(bf16
|| method) per next-token position in float32, averaged over the same positions, and
top-1 agreement with bf16; then the aim's checks against each row's like-for-like affine
peer, and (seconds, no model run) the relative weight error of both codecs. Real bits per
weight = every stored byte of the model (codes, scales, affine biases, tensors kept in 16
bits) * 8 / the source model's parameter count (tied embeddings counted once), the same
rule for both; affine is counted as mlx-lm stores it (uint32 codes, bf16 scales and
biases, as the source dtype), TurboQuant from its safetensors files. See docs/quality.md.

    .venv/bin/python benchmarks/quality.py | tee benchmarks/results/quality.txt

On any other HF folder (SmolLM2-135M from tools/smollm2_folder.py), with the pydoc held-out
text, per-class and mechanism tables: `benchmarks/quality.py --model PATH` (quality_hf.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import json
import math
import platform
import re
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
RECIPE_BITS = 4  # llama / qwen_moe recipes: embeddings and first/last decoder layer at 4 bits


# --------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str
    kind: str  # "bf16" | "affine" | "tq"
    bits: int | str | None = None  # nominal bits of the bulk of the weights
    peer: str | None = None  # the affine row to compare against (ratio column)
    flags: list[str] = field(default_factory=list)  # turboquant convert flags
    note: str = ""
    recipe_bits: bool = False  # affine: the recipe's per-tensor bits (embeddings, protect)


def methods_for(model: str, bits: list[int], ternary: bool, equal_bpw: bool = False,
                trellis: Path | None = None) -> list[Method]:
    ms = [Method("bf16", "bf16", 16)]
    for b in bits:
        ms.append(Method(f"affine-{b}", "affine", b, note=f"mlx_lm quantize_model, group {GROUP}"))
    for b in bits:
        flags = ["--bits", str(b), "--group-size", str(GROUP), "--embeddings-bits", str(b),
                 "--lm-head-bits", str(b), "--protect-layers", "0"]
        if model == "moe":
            flags += ["--expert-bits", str(b)]
        ms.append(Method(f"tq-{b} matched", "tq", b, f"affine-{b}", flags,
                         "same tensors/bits as affine"))
        if equal_bpw:  # group 32: b + 0.5 bits/w, what affine pays at group 64
            g32 = [f if f != str(GROUP) else "32" for f in flags]
            ms.append(Method(f"tq-{b} g32 match", "tq", b, f"affine-{b}", g32,
                             "as matched, group 32 (= affine's bits/w)"))
        if trellis is not None:
            ms.append(Method(f"tq-{b} trellis", "tq", b, f"affine-{b}",
                             flags + ["--recipe", str(trellis)],
                             "as matched, trellis-coded (L=16, V=1)"))
    for b in bits:
        if b < RECIPE_BITS:  # at 4 bits the recipe's per-tensor bits are affine-4's
            ms.append(Method(f"affine-{b} recipe", "affine", b, note=f"mlx_lm quantize_model, "
                             f"tq-{b} recipe's bits per tensor", recipe_bits=True))
    for b in bits:
        flags = ["--bits", str(b), "--group-size", str(GROUP)]
        if model == "moe":
            flags += ["--expert-bits", str(b)]
        peer = f"affine-{b} recipe" if b < RECIPE_BITS else f"affine-{b}"
        ms.append(Method(f"tq-{b} recipe", "tq", b, peer, flags,
                         "embeddings 4-bit, first/last layer 4-bit"))
    if model == "moe" and ternary:
        base = ["--bits", "4", "--group-size", str(GROUP), "--expert-bits", "ternary",
                "--protect-layers", "0"]
        peer = f"affine-{min(bits)}"
        ms.append(Method("tq tern-experts", "tq", "tern", peer, base,
                         "experts ternary; attention, embeddings 4-bit"))
        ms.append(Method("tq tern+down4", "tq", "tern", peer, base + ["--down-proj-bits", "4"],
                         "experts ternary, expert down_proj 4-bit"))
    return ms


def folder_name(model: str, m: Method) -> str:
    flags = [Path(f).stem if "/" in f else f for f in m.flags]  # a recipe file: its name
    return model + "-" + "".join(f.lstrip("-").replace("-bits", "").replace("group-size", "g")
                                 .replace("protect-layers", "p").replace("-", "")
                                 for f in flags)


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


def recipe_predicate(model: nn.Module, config: dict, bits: int):
    """mlx-lm quant_predicate giving affine the bits the TurboQuant recipe gives each tensor:
    embeddings (and so the tied head) and the first and last decoder layer at 4 bits, the
    rest at `bits`; the model's own predicate first (Qwen3-MoE: router at 8 bits)."""
    own = getattr(model, "quant_predicate", None)
    last = config["num_hidden_layers"] - 1
    layer = re.compile(r"(?:^|\.)layers\.(\d+)\.")

    def predicate(path, module):
        if own is not None:
            decided = own(path, module)
            if decided is not True:
                return decided
        m = layer.search(path)
        if path.endswith("embed_tokens") or path.endswith("lm_head") or (
                m and int(m.group(1)) in (0, last)):
            return {"group_size": GROUP, "bits": RECIPE_BITS, "mode": "affine"}
        return {"group_size": GROUP, "bits": bits, "mode": "affine"}

    return predicate


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


def digest(folder: Path) -> str:
    """sha256 of the repo's tensor files: two flag sets that give the same repo."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def build(model_key: str, m: Method, work: Path, n_params: int, seen: dict):
    """(model in float32 or the name of an identical earlier row, real bits per weight,
    seconds spent converting)."""
    src = MODELS[model_key]
    if m.kind == "bf16":
        model = load_bf16(src)
        bpw = 8 * affine_bytes(model) / n_params  # as stored (bf16), before the cast
        return to_f32(model), bpw, 0.0
    if m.kind == "affine":
        from mlx_lm.utils import quantize_model

        model = load_bf16(src)
        config = json.loads((src / "config.json").read_text())
        predicate = recipe_predicate(model, config, m.bits) if m.recipe_bits else None
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
            quantize_model(model, config, GROUP, m.bits, quant_predicate=predicate)
        mx.eval(model.parameters())
        bpw = 8 * affine_bytes(model) / n_params  # as stored: uint32 codes, bf16 scales/biases
        return to_f32(model), bpw, 0.0
    from turboquant.runtime import load

    out = work / folder_name(model_key, m)
    secs = convert(src, out, m.flags)
    nbytes, _ = safetensors_bytes(out)
    key = digest(out)
    if key in seen:  # e.g. the recipe at 4 bits is the matched 4-bit repo, byte for byte
        return seen[key], 8 * nbytes / n_params, secs
    seen[key] = m.name
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


def weight_error(key: str, bits: list[int]) -> str:
    """Diagnostic: relative weight error sum||W - W_hat||^2 / sum||W||^2 over every matrix
    the matched rows quantize (linear layers, experts, embeddings; not the MoE router),
    affine (mx.quantize, group 64, bf16 scales/biases) vs TurboQuant (turboquant.stages,
    group 64, rotation seed from the tensor's name as the pipeline derives it)."""
    from turboquant.stages import decode, encode, tensor_seed

    src = MODELS[key]
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    names = [n for n, w in sorted(weights.items())
             if w.ndim == 2 and not n.endswith("mlp.gate.weight")]
    lines = [f"{key}: relative weight error over {len(names)} matrices "
             f"({sum(weights[n].size for n in names):,} weights), group {GROUP}"]
    for b in bits:
        err_a = err_t = energy = 0.0
        for n in names:
            w = weights[n]
            w32 = w.astype(mx.float32)
            q = mx.quantize(w, group_size=GROUP, bits=b)
            wa = mx.dequantize(*q, group_size=GROUP, bits=b).astype(mx.float32)
            wt = decode(encode(w, b, group_size=GROUP, seed=tensor_seed(0, n))).astype(mx.float32)
            ea, et, e = (mx.sum((w32 - wa) ** 2), mx.sum((w32 - wt) ** 2), mx.sum(w32 * w32))
            mx.eval(ea, et, e)
            err_a, err_t, energy = err_a + ea.item(), err_t + et.item(), energy + e.item()
        lines.append(f"  {b} bits: affine {err_a / energy:.5f}  turboquant {err_t / energy:.5f}"
                     f"  ratio {err_t / err_a:.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- report


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}"


def run_model(key: str, args) -> tuple[list[dict], str]:
    src = MODELS[key]
    from mlx.utils import tree_flatten

    n_params = sum(v.size for _, v in tree_flatten(load_bf16(src).parameters()))
    rows, n_rows = windows(key, args.windows)
    trellis = None
    if args.trellis:  # the family recipe, trellis-coded
        from turboquant.manifests.recipe import recipe_for_model_type

        config = json.loads((src / "config.json").read_text())
        family = recipe_for_model_type(config.get("model_type"))
        trellis = args.work / f"trellis-{family.name}.toml"
        text = Path(family.source).read_text().replace("[quant]\n", '[quant]\ncodec = "trellis"\n', 1)
        trellis.write_text(text)
    ms = methods_for(key, args.bits, not args.no_ternary, args.equal_bpw, trellis)
    results, ref, seen = [], None, {}
    for m in ms:
        t0 = time.perf_counter()
        model, bpw, conv = build(key, m, args.work, n_params, seen)
        t1 = time.perf_counter()
        if isinstance(model, str):  # the same repo as an earlier row: the same numbers
            same = next(r for r in results if r["method"] == model)
            r = dict(same, method=m.name, bits=m.bits, peer=m.peer, flags=" ".join(m.flags),
                     note=f"{m.note} (the same repo as {model})", convert_s=conv, eval_s=0.0)
            results.append(r)
            print(f"  [{key}] {m.name:<16} = {model} (identical repo)", file=sys.stderr)
            continue
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
                 nll=nll, ppl=math.exp(nll), se=se, kl=kl, row_nll=row_nll.tolist(), top1=agree,
                 note=m.note,
                 flags=" ".join(m.flags), convert_s=conv, eval_s=time.perf_counter() - t1,
                 load_s=t1 - t0)
        results.append(r)
        print(f"  [{key}] {m.name:<16} bpw {bpw:6.3f}  ppl {r['ppl']:8.4f}  KL {kl:.5f}  "
              f"(build {t1 - t0:.1f} s, eval {r['eval_s']:.1f} s)", file=sys.stderr, flush=True)
    base = results[0]["ppl"]
    aff = {r["method"]: r for r in results if r["kind"] == "affine"}
    for r in results:
        r["dppl"] = r["ppl"] - base
        peer = aff.get(r["peer"]) if r["kind"] == "tq" else None
        r["ratio"] = r["dppl"] / peer["dppl"] if peer and peer["dppl"] > 0 else None
        r["peer_name"] = r["peer"] if peer else ""
    tokens = rows.shape[0] * (SEQ - 1)
    header = (f"{key}: {src.relative_to(ROOT)}, {n_params:,} parameters; {rows.shape[0]} "
              f"windows of {SEQ} tokens (of {n_rows}) = {tokens:,} predicted tokens")
    return results, header


def table(results: list[dict], header: str) -> str:
    lines = [header,
             f"  {'method':<16} {'bits/w':>7} {'ppl':>8} {'dppl':>8} {'+-se':>6} {'dppl/aff':>9} "
             f"{'vs':<15} {'KL nats':>8} {'top1':>6}  notes"]
    for r in results:
        lines.append(
            f"  {r['method']:<16} {r['bpw']:7.3f} {r['ppl']:8.4f} {r['dppl']:+8.4f} {r['se']:6.4f} "
            f"{fmt_ratio(r['ratio']):>9} {r['peer_name']:<15} {r['kl']:8.5f} "
            f"{100 * r['top1']:5.1f}%  {r['note']}")
    return "\n".join(lines)


def paired_se(a: dict, b: dict) -> float:
    """Standard error of ppl(a) - ppl(b) over the windows, paired (delta method)."""
    d = np.array(a["row_nll"]) - np.array(b["row_nll"])
    if len(d) < 2:
        return 0.0
    return math.exp(b["nll"]) * float(d.std(ddof=1)) / math.sqrt(len(d))


def bar_checks(results: list[dict]) -> list[str]:
    """The aim, each TurboQuant row against its like-for-like affine peer (the 'vs' column):
    3 bits: dppl <= 0.5 x the peer's; 4 bits: dppl <= the peer's at fewer bits/w."""
    by = {r["method"]: r for r in results}
    out = []
    for variant in ("matched", "recipe"):
        for b in (3, 4):
            tq = by.get(f"tq-{b} {variant}")
            af = by.get(tq["peer"]) if tq else None
            if af is None:
                continue
            facts = (f"TQ - {af['method']} ppl {tq['ppl'] - af['ppl']:+.4f} +- "
                     f"{paired_se(tq, af):.4f}; bits/w {tq['bpw']:.3f} vs {af['bpw']:.3f}; "
                     f"KL {tq['kl']:.4f} vs {af['kl']:.4f}")
            if b == 3:
                ok = tq["dppl"] <= 0.5 * af["dppl"]
                more = f"  [MORE bits/w than {af['method']}]" if tq["bpw"] >= af["bpw"] else ""
                out.append(f"  3-bit ({variant}): dppl {tq['dppl']:+.4f} <= 0.5 x {af['method']} "
                           f"{0.5 * af['dppl']:+.4f}? ratio {fmt_ratio(tq['ratio'])}; {facts}: "
                           f"{'PASS' if ok else 'FAIL'}{more}")
            else:
                ok1, ok2 = tq["dppl"] <= af["dppl"], tq["bpw"] < af["bpw"]
                out.append(f"  4-bit ({variant}): dppl {tq['dppl']:+.4f} <= {af['method']} "
                           f"{af['dppl']:+.4f}? [{'yes' if ok1 else 'no'}] and fewer bits/w? "
                           f"[{'yes' if ok2 else 'no'}]; {facts}: "
                           f"{'PASS' if ok1 and ok2 else 'FAIL'}")
    return out


def main(argv=None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--model" or a.startswith("--model=") for a in given):
        # any HF folder (e.g. SmolLM2 from tools/smollm2_folder.py): benchmarks/quality_hf.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from quality_hf import main as hf_main

        return hf_main(given)
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
    ap.add_argument("--no-weight-error", action="store_true", help="skip the diagnostic: "
                    "relative weight error of both codecs on each model's matrices (seconds)")
    ap.add_argument("--trellis", action="store_true", help="add trellis-coded rows (tq-b "
                    "trellis: the matched rows' tensors and bits, codec trellis)")
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
    print("ppl: exp(mean next-token NLL); dppl: ppl - bf16 ppl; dppl/aff: dppl over the dppl of "
          "the like-for-like affine row in column 'vs' (same tensors at the same bits); KL: mean "
          "KL(bf16 || method) per token, nats; top1: argmax agreement with bf16; bits/w: "
          "every stored byte (codes, scales, biases, "
          "16-bit tensors) * 8 / source parameters")
    all_rows = []
    for k in keys:
        results, header = run_model(k, args)
        all_rows += results
        print()
        print(table(results, header))
        print("bar, against the 'vs' row (3-bit: TQ dppl <= 0.5 x its dppl; 4-bit: TQ dppl <= "
              "its dppl at fewer bits/w):")
        for line in bar_checks(results):
            print(line)
    if not args.no_weight_error:
        print()
        print("diagnostic, weight error (no model run): sum ||W - W_hat||^2 / sum ||W||^2; "
              "Lloyd-Max on N(0,1): 2b 0.1175, 3b 0.0345, 4b 0.0095")
        for k in keys:
            print(weight_error(k, args.bits))
    print()
    print("TurboQuant flags per row (turboquant convert SRC OUT ... --no-prefect --in-process):")
    seen = set()
    for r in all_rows:
        if r["kind"] == "tq" and (r["model"], r["method"]) not in seen:
            seen.add((r["model"], r["method"]))
            print(f"  {r['model']:<5} {r['method']:<16} {r['flags']}")
    print()
    given = list(sys.argv[1:] if argv is None else argv)
    if "--json" in given:  # an output option: not part of what reproduces the table
        i = given.index("--json")
        del given[i : i + 2]
    given = [a for a in given if not a.startswith("--json=")]
    cmd = " ".join([".venv/bin/python benchmarks/quality.py", *map(shlex.quote, given)])
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(f"reproduce: {cmd}")
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-tensor ground truth and the error proxies that might predict it (issue 38, item 3).

`benchmarks/quality.py --model PATH --tables tensors` runs this (through quality_hf.py):

1. Ground truth: each matrix alone coded with the default recipe's codec (its column
   scales, its neuron rule; the embedding plain), the rest at source; the loss it causes on
   the held-out rows (KL to the source and dppl); --tensor-layers: only those layers'. The layers before the coded one are not
   recomputed: their outputs on the held-out rows are kept once (the same numbers, ~40%
   less work). --tensor-bits 4,3: 4 bits for every matrix, 3 bits for the matrices of
   --subset-layers (and the embedding).
2. Candidates, each a number per tensor from the exact coding error E = W_hat - W (its
   per-column energies c_j = ||E_:,j||^2):
   - rel_mse: what the manifest records (with column scales t, the error of W / t).
   - rel: ||E||^2 / ||W||^2; abs: ||E||^2.
   - df: sum_j c_j a_j with a_j a data-free estimate of E[x_j^2] of the layer's input:
     the residual stream's channel energies propagated from the embedding's columns through
     every earlier layer's o_proj / down_proj rows (second moments, inputs independent),
     times gamma_j^2 / mean(energy) after each RMSNorm; o_proj's input from v_proj's rows,
     down_proj's from gate/up's rows (the neuron's size squared); the tied embedding's
     head side from the final norm.
   - df/R: df over the estimated residual stream energy at the tensor's layer.
   - nrn: down_proj only, df with a_k the neuron rule's size squared (what the converter
     already computes); other classes as df.
   - ones, w, w-h, w+v: what the converter records with no text (out_error,
     pipeline/input_energy.py), ||E'||^2 mean(t^2 a) with a from the tensor's own layer
     only: ones a = 1; w the converter's (q/k/v and gate/up gamma^2 of the norm before them,
     down_proj ||gate_k||^2 ||up_k||^2 mean(gamma^2)^2 from the neuron rule's row sums, the
     head / tied embedding gamma^2 of the final norm, the rest 1); -h the embedding at 1;
     +v o_proj from v_proj's rows.
   - cal, cal/R: the same weighting with the real E[x_j^2] and residual energies measured
     on --cal-rows pydoc rows disjoint from the held-out ones (the upper bound).
   - calrel: cal over sum_j ||W_:,j||^2 E[x_j^2] (the activation-weighted relative error).
   - rel/R: rel_mse over the measured residual energy (the depth alone, no weighting).
3. Spearman (rank) and Pearson (linear) correlation of each candidate with the KL (and the
   dppl), over all tensors and within each class, and top-10: how many of the 10 costliest
   tensors the candidate's 10 largest hold. --seed-check: a few tensors coded with another
   rotation seed too (how much of the KL is the rotation's luck); --check-rows 16: a few on
   all 8,176 tokens (is the 2,044-token ranking stable). Results are kept in --work (a
   rerun reuses them).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

SEQ = 512
CLASSES = ["embed", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NORM_OF = {"q_proj": "input_layernorm", "k_proj": "input_layernorm",
           "v_proj": "input_layernorm", "gate_proj": "post_attention_layernorm",
           "up_proj": "post_attention_layernorm"}


SEED_CHECK = [(5, "q_proj"), (8, "v_proj"), (14, "o_proj"), (20, "gate_proj"), (11, "down_proj"),
              (29, "up_proj")]


def tensor_class(name: str) -> str:
    return name.split(".")[-2] if ".layers." in name else "embed"


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else -1


def f64(a) -> np.ndarray:
    return np.asarray(a.astype(mx.float32) if isinstance(a, mx.array) else a, dtype=np.float64)


# ----------------------------------------------------------------------------- the codec


def default_codec(source: dict, name: str, bits: int, group: int = 64, model_seed: int = 0):
    """(decoded weight float32, QuantizedTensor) as `turboquant convert --bits b` codes
    `name` with the llama recipe: column scales where a column is under 0.5 x the median,
    a down_proj's neuron rule at 8 x; the embedding plain. `model_seed`: the rotations'."""
    from turboquant.stages import decode, encode, tensor_seed
    from turboquant.stages.scale import (NEURON_RATIO, SMALL_COLUMN_RATIO,
                                         column_scales_from_sums, neuron_column_scales,
                                         neuron_sizes_from_sums)

    w = source[name]
    t = None
    if tensor_class(name) != "embed":
        a = f64(w)
        sums = (a * a).sum(axis=0)
        if tensor_class(name) == "down_proj":
            mlp = name.rsplit(".down_proj.", 1)[0]
            g, u = (f64(source[f"{mlp}.{c}.weight"]) for c in ("gate_proj", "up_proj"))
            sizes = neuron_sizes_from_sums((g * g).sum(axis=1), (u * u).sum(axis=1), g.shape[1])
            t = neuron_column_scales(sums, a.shape[0], sizes, NEURON_RATIO)
        if t is None:
            t = column_scales_from_sums(sums, a.shape[0], min_ratio=SMALL_COLUMN_RATIO)
    qt = encode(w, bits, group_size=group, seed=tensor_seed(model_seed, name), in_scales=t)
    back = decode(qt)
    mx.eval(back)
    return back, qt


# ----------------------------------------------------------------------------- forward


def layer_inputs(ev, rows: mx.array) -> list[list[mx.array]]:
    """The source model's hidden state at the input of every layer (and after the last),
    per batch of `rows`: [batch][layer] (float32)."""
    from mlx_lm.models.base import create_attention_mask

    inner = ev.model.model
    out = []
    for i in range(0, rows.shape[0], ev.batch):
        h = inner.embed_tokens(rows[i : i + ev.batch, :-1])
        mask = create_attention_mask(h, None)
        hs = [h]
        for layer in inner.layers:
            h = layer(h, mask, cache=None)
            mx.eval(h)
            hs.append(h)
        out.append(hs)
    return out


def run_from(ev, rows: mx.array, hidden: list[list[mx.array]], start: int) -> dict:
    """ev.run's ppl and KL with the layers before `start` taken from `hidden` (0: the
    embedding is recomputed too)."""
    from mlx_lm.models.base import create_attention_mask

    inner = ev.model.model
    ref = ev.ref[rows.shape[0]]
    nll, kl = [], []
    for j, i in enumerate(range(0, rows.shape[0], ev.batch)):
        x = rows[i : i + ev.batch]
        h = inner.embed_tokens(x[:, :-1]) if start <= 0 else hidden[j][start]
        mask = create_attention_mask(h, None)
        for layer in inner.layers[max(start, 0):]:
            h = layer(h, mask, cache=None)
        h = inner.norm(h)
        logits = (inner.embed_tokens.as_linear(h) if ev.model.args.tie_word_embeddings
                  else ev.model.lm_head(h)).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        n = -mx.take_along_axis(lp, x[:, 1:, None], axis=-1)[..., 0]
        p = ref[j].astype(mx.float32)
        k = (mx.exp(p) * (p - lp)).sum(axis=-1)
        mx.eval(n, k)
        nll.append(np.asarray(n, dtype=np.float64).mean(axis=-1))
        kl.append(float(k.mean()))
    row_nll = np.concatenate(nll)
    return {"ppl": math.exp(row_nll.mean()), "kl": float(np.mean(kl))}


# ----------------------------------------------------------------------------- statistics


def measured_energies(ev, rows: mx.array) -> tuple[dict, np.ndarray, np.ndarray]:
    """With data: ({linear weight name: E[x_j^2] of its input}, E[h_j^2] of the residual
    stream at each layer's input (layers + 1, hidden), E[x_j^2] of the final norm's output
    (the tied head's input))."""
    from quality_hf import capture_inputs

    lin = capture_inputs(ev, rows)
    hs = layer_inputs(ev, rows)
    count = sum(b[0].shape[0] * b[0].shape[1] for b in hs)
    resid = np.stack([sum(f64(mx.sum(b[k] * b[k], axis=(0, 1))) for b in hs)
                      for k in range(len(hs[0]))]) / count
    fin = sum(f64(mx.sum(mx.square(ev.model.model.norm(b[-1])), axis=(0, 1))) for b in hs)
    return lin, resid, fin / count


def estimated_energies(source: dict, n_layers: int, heads: int, kv_heads: int,
                       neuron_rule: bool = False) -> tuple[dict, np.ndarray, np.ndarray]:
    """Data-free: the same three as measured_energies, from the weights alone (see the
    module docstring). With `neuron_rule`, down_proj's input is a_k^2 with a_k the
    converter's neuron size (rms(gate_k) rms(up_k) over the median)."""
    from turboquant.pipeline.calibrate import propagate
    from turboquant.stages.scale import neuron_sizes_from_sums

    if not neuron_rule:  # what `turboquant calibrate --from-weights` writes
        return propagate({k: f64(v) for k, v in source.items() if v.ndim <= 2}, n_layers,
                         heads, kv_heads)
    emb = f64(source["model.embed_tokens.weight"])
    e = (emb * emb).mean(axis=0)  # a token drawn uniformly
    lin, resid = {}, [e.copy()]

    def normed(e, gamma):
        return f64(gamma) ** 2 * e / max(float(e.mean()), 1e-30)

    for L in range(n_layers):
        p = f"model.layers.{L}."
        x = normed(e, source[p + "input_layernorm.weight"])
        for c in ("q_proj", "k_proj", "v_proj"):
            lin[p + f"self_attn.{c}.weight"] = x
        wv = f64(source[p + "self_attn.v_proj.weight"])
        v = (wv * wv) @ x  # E[v_i^2], (kv_heads * head_dim,)
        hd = wv.shape[0] // kv_heads
        o_in = np.concatenate([v[(h // (heads // kv_heads)) * hd:][:hd] for h in range(heads)])
        lin[p + "self_attn.o_proj.weight"] = o_in
        wo = f64(source[p + "self_attn.o_proj.weight"])
        e = e + (wo * wo) @ o_in
        x = normed(e, source[p + "post_attention_layernorm.weight"])
        lin[p + "mlp.gate_proj.weight"] = lin[p + "mlp.up_proj.weight"] = x
        wg, wu = f64(source[p + "mlp.gate_proj.weight"]), f64(source[p + "mlp.up_proj.weight"])
        if neuron_rule:
            a = neuron_sizes_from_sums((wg * wg).sum(axis=1), (wu * wu).sum(axis=1), wg.shape[1])
            d_in = a * a
        else:
            d_in = ((wg * wg) @ x) * ((wu * wu) @ x)  # silu(g) ~ g where it matters
        lin[p + "mlp.down_proj.weight"] = d_in
        wd = f64(source[p + "mlp.down_proj.weight"])
        e = e + (wd * wd) @ d_in
        resid.append(e.copy())
    fin = normed(e, source["model.norm.weight"])
    return lin, np.stack(resid), fin


def candidates(rec: dict, source: dict, est: tuple, nrn: tuple, cal: tuple) -> dict:
    """Every candidate proxy of one tensor from its per-column error energies."""
    name = rec["name"]
    c = np.asarray(rec["col_err"])
    w = f64(source[name])
    colw = (w * w).sum(axis=0)
    L = layer_of(name)
    out = {"rel_mse": rec["rel_mse"], "rel": float(c.sum() / colw.sum()), "abs": float(c.sum())}
    for key, (lin, resid, fin) in (("df", est), ("nrn", nrn), ("cal", cal)):
        a = fin if name not in lin else lin[name]
        weighted = float(c @ a)
        r = float(resid[-1].sum() if L < 0 else resid[L].sum())
        out[key] = weighted
        out[key + "/R"] = weighted / r
        if key == "cal":
            out["calrel"] = weighted / float(colw @ a)
            out["rel/R"] = rec["rel_mse"] / r  # depth alone: the error unweighted
    return out


LOCAL = {"w": {}, "w-h": {"tied": False}, "w+v": {"values": True}}


def local_candidates(rec: dict, source: dict, tied: bool, offset: float = 0.0,
                     cache=None) -> dict:
    """The figure the converter records with no text (pipeline/input_energy.py): ||E'||^2
    times mean(t^2 a), a from the tensor's own layer: `ones` a = 1 everywhere; `w` the
    converter's (norms, down_proj's neurons, the head's final norm; `tied`: the embedding
    is the head); `w-h` without the head's norm; `w+v` o_proj from v_proj's rows."""
    from turboquant.pipeline.input_energy import input_energy
    from turboquant.stages.proxy import energy_factor

    cache = {} if cache is None else cache

    def norm(n):
        return f64(source[n]) if n in source else None

    def row_sq(n):
        if n not in cache and n in source:
            w = f64(source[n])
            cache[n] = (w * w).sum(axis=1)
        return cache.get(n)

    name = rec["name"]
    in_f = len(rec["col_err"])
    t = None if rec["t"] is None else np.asarray(rec["t"])
    out = {"ones": rec["scaled_err"] * energy_factor(np.ones(in_f), t)}
    for key, opts in LOCAL.items():
        a, _ = input_energy(name, in_f, norm, row_sq, offset, **{"tied": tied, **opts})
        out[key] = rec["scaled_err"] * energy_factor(a, t)
    return out


def spearman(x, y) -> float:
    rx = np.argsort(np.argsort(x)).astype(np.float64)
    ry = np.argsort(np.argsort(y)).astype(np.float64)
    return float(np.corrcoef(rx, ry)[0, 1]) if len(x) > 2 else float("nan")


def pearson(x, y) -> float:
    return float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 else float("nan")


# ----------------------------------------------------------------------------- the table


def ground_truth(ev, rows, bits: int, names: list[str], work: Path, tag: str,
                 model_seed: int = 0) -> list[dict]:
    """Per tensor: KL and dppl with it alone coded at `bits`, its recorded rel_mse and its
    per-column error energies; kept in work/tag.json and reused."""
    path = work / f"{tag}.json"
    done = {r["name"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    if all(n in done for n in names):
        return [done[n] for n in names]
    src = ev.run(rows)
    hidden = layer_inputs(ev, rows)
    check = run_from(ev, rows, hidden, 1)
    if abs(check["ppl"] - src["ppl"]) > 1e-3 * src["ppl"]:
        raise SystemExit(f"partial forward disagrees: {check['ppl']} vs {src['ppl']}")
    out = []
    for n in names:
        if n in done:
            out.append(done[n])
            continue
        t0 = time.perf_counter()
        back, qt = default_codec(ev.source, n, bits, model_seed=model_seed)
        err = f64(back) - f64(ev.source[n])
        ev.set({n: back})
        r = run_from(ev, rows, hidden, layer_of(n))
        ev.restore([n])
        t = None if qt.in_scales is None else f64(qt.in_scales)
        rec = {"name": n, "bits": bits, "kl": r["kl"], "dppl": r["ppl"] - src["ppl"],
               "rel_mse": qt.rel_mse, "col_err": (err * err).sum(axis=0).tolist(),
               "scaled_err": float(np.sum(qt.row_sq_error)),
               "t_sq_mean": None if t is None else float(np.mean(t * t)),
               "t": None if t is None else t.tolist()}
        out.append(rec)
        done[n] = rec
        path.write_text(json.dumps(list(done.values())))
        print(f"  {tag} {n:<40} KL {rec['kl']:.5f} dppl {rec['dppl']:+.4f} "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return out


def correlation_lines(recs: list[dict], cands: list[dict], target: str = "kl") -> list[str]:
    keys = list(cands[0])
    y = np.array([r[target] for r in recs])
    cls = [tensor_class(r["name"]) for r in recs]
    groups = [("all", list(range(len(recs))))]
    groups += [(c, [i for i, k in enumerate(cls) if k == c]) for c in CLASSES]
    groups = [(g, ix) for g, ix in groups if len(ix) > 2]
    lines = [f"  {'candidate':<9} " + " ".join(f"{g + f' ({len(ix)})':>15}" for g, ix in groups)
             + "  top-10",
             f"  {'':<9} " + " ".join(f"{'rank':>7} {'lin':>7}" for _ in groups)]
    worst = set(np.argsort(-y)[:10])  # the 10 costliest tensors
    for k in keys:
        x = np.array([c[k] for c in cands])
        cells = [f"{spearman(x[ix], y[ix]):7.2f} {pearson(x[ix], y[ix]):7.2f}" for _, ix in groups]
        hit = len(worst & set(np.argsort(-x)[:10]))
        lines.append(f"  {k:<9} " + " ".join(cells) + f"  {hit:6d}")
    return lines


def seed_lines(ev, rows, bits: int, names: list[str], work: Path) -> list[str]:
    """The SEED_CHECK tensors coded with model seed 0 and 1: how much of a tensor's KL is
    its rotation's luck (the floor under any proxy's ranking)."""
    few = [n for n in names if (layer_of(n), tensor_class(n)) in SEED_CHECK]
    tag = f"tensors-{bits}bit-{rows.shape[0]}rows"
    a = {r["name"]: r for r in ground_truth(ev, rows, bits, few, work, tag)}
    b = {r["name"]: r for r in ground_truth(ev, rows, bits, few, work, tag + "-seed1",
                                             model_seed=1)}
    lines = ["", f"rotation noise, {len(few)} tensors coded with model seed 0 and 1 "
             f"({rows.shape[0]} rows, {bits} bits): KL x 1e4, seed 0 / seed 1"]
    lines += [f"  {n.replace('model.layers.', 'L').replace('.weight', ''):<28} "
              f"{1e4 * a[n]['kl']:8.2f} {1e4 * b[n]['kl']:8.2f}" for n in few]
    ratio = [abs(math.log(a[n]["kl"] / b[n]["kl"])) for n in few]
    lines.append(f"  median |log(KL0 / KL1)| {np.median(ratio):.2f} (a factor "
                 f"{math.exp(np.median(ratio)):.2f})")
    return lines


def tensor_table(ev, rows, args, lines) -> None:
    import mlx_lm  # noqa: F401  (the model is loaded already)

    from quality_hf import heldout

    cfg = ev.model.args
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bits_list = [int(b) for b in args.tensor_bits.split(",")]
    subset = {int(x) for x in args.subset_layers.split(",") if x}
    order = [int(x) for x in args.tensor_layers.split(",") if x]  # measured in this order
    names = sorted(ev.matrices, key=lambda n: (order.index(layer_of(n)) if layer_of(n) in order
                                               else layer_of(n), CLASSES.index(tensor_class(n))))
    names = [n for n in names if not order or layer_of(n) in order or layer_of(n) < 0]
    # calibration: pydoc rows disjoint from every held-out selection (4 and 16 rows)
    all_rows, total = heldout(ev.tokenizer, 10**6)
    held = {i * total // k for k in (args.ablation_windows, 16, args.windows) for i in range(k)}
    cal_ix = [i * total // args.cal_rows + 7 for i in range(args.cal_rows)]
    cal_ix = [i for i in cal_ix if i not in held]
    cal = measured_energies(ev, all_rows[mx.array(cal_ix)])
    est = estimated_energies(ev.source, cfg.num_hidden_layers, cfg.num_attention_heads,
                             cfg.num_key_value_heads)
    nrn = estimated_energies(ev.source, cfg.num_hidden_layers, cfg.num_attention_heads,
                             cfg.num_key_value_heads, neuron_rule=True)
    tokens = rows.shape[0] * (SEQ - 1)
    lines.append(f"  calibration: pydoc rows {cal_ix} ({len(cal_ix) * (SEQ - 1):,} tokens, "
                 f"none held out); held out: {rows.shape[0]} rows ({tokens:,} tokens)")
    for b in bits_list:
        pick = names if b == bits_list[0] else [n for n in names
                                               if layer_of(n) in subset or layer_of(n) < 0]
        recs = ground_truth(ev, rows, b, pick, work, f"tensors-{b}bit-{rows.shape[0]}rows")
        cache: dict = {}
        cands = [{**candidates(r, ev.source, est, nrn, cal),
                  **local_candidates(r, ev.source, bool(cfg.tie_word_embeddings),
                                     cache=cache)} for r in recs]
        for target in ("kl", "dppl"):
            lines += ["", f"{b} bits, {len(recs)} tensors, each alone coded (default recipe's "
                      f"codec); correlation with its {target.upper()} (rank = Spearman, lin = "
                      "Pearson; top-10 = of the 10 costliest, how many in the candidate's 10 "
                      "largest):"]
            lines += correlation_lines(recs, cands, target)
        # the converter's cheap form: sum_j c_j a_j ~ scaled error * mean(t^2 a) (the
        # rotation spreads the coded error evenly over columns)
        ratio = []
        for r in recs:
            if r["name"] in cal[0]:
                a = cal[0][r["name"]]
                t2 = np.ones_like(a) if r["t"] is None else np.asarray(r["t"]) ** 2
                ratio.append(r["scaled_err"] * float(np.mean(t2 * a))
                             / float(np.asarray(r["col_err"]) @ a))
        lines.append(f"  converter form, scaled error x mean(t^2 a) over the exact cal: "
                     f"median {np.median(ratio):.3f}, range {min(ratio):.3f}-{max(ratio):.3f}")
        top = sorted(recs, key=lambda r: -r["kl"])[:12]
        lines.append(f"  largest KL: " + ", ".join(
            f"{r['name'].replace('model.layers.', 'L').replace('.weight', '')} {r['kl']:.4f}"
            for r in top))
        for ln in lines[-40:]:
            print(ln, file=sys.stderr)
        if args.seed_check and b == bits_list[0]:
            lines += seed_lines(ev, rows, b, names, work)
    if args.check_rows:  # the ranking on more tokens, a few tensors
        more, _ = heldout(ev.tokenizer, args.check_rows)
        few = [n for n in names if (layer_of(n), tensor_class(n)) in
               ((-1, "embed"), (11, "down_proj"), (8, "v_proj"))]
        a = {r["name"]: r for r in ground_truth(ev, rows, bits_list[0], few, work,
                                                 f"tensors-{bits_list[0]}bit-{rows.shape[0]}rows")}
        bb = {r["name"]: r for r in ground_truth(ev, more, bits_list[0], few, work,
                                                  f"tensors-{bits_list[0]}bit-{more.shape[0]}rows")}
        x = [a[n]["kl"] for n in few]
        y = [bb[n]["kl"] for n in few]
        xd = [a[n]["dppl"] for n in few]
        yd = [bb[n]["dppl"] for n in few]
        lines += ["", f"stability, {len(few)} tensors (the embedding, L8 v_proj, L11 down_proj) on "
                  f"{rows.shape[0]} against {more.shape[0]} rows: KL rank {spearman(x, y):.3f} "
                  f"lin {pearson(x, y):.3f}; dppl rank {spearman(xd, yd):.3f} "
                  f"lin {pearson(xd, yd):.3f}"]
        lines += [f"  {n.replace('model.layers.', 'L').replace('.weight', ''):<28} KL "
                  f"{a[n]['kl']:.5f} / {bb[n]['kl']:.5f}, dppl {a[n]['dppl']:+.4f} / "
                  f"{bb[n]['dppl']:+.4f}" for n in few]

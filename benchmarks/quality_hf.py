"""Quality on any HF llama-style folder: TurboQuant vs MLX affine, same tokens, same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
      .venv/bin/python benchmarks/quality.py --model out/smollm2-135m

(`benchmarks/quality.py --model PATH` runs this; tools/smollm2_folder.py makes the SmolLM2
folder.) Held-out text: Python's own pydoc topics (`pydoc_data.topics`, English technical
prose, offline), all topics in sorted order, tokenized with the folder's tokenizer.json, cut
in rows of 512; --windows rows spread evenly over it (16 rows = 8,176 predicted tokens).
Float32 math on the CPU. Every matrix is quantized on both sides (the tied embedding and
head too): affine by `mx.quantize` (group 64, what mlx_lm.convert -q writes), TurboQuant by
`turboquant.stages.encode` (group 64, the pipeline's seeds), and both are decoded back into
the same mlx-lm model (the runtime computes the same product; this isolates the codecs).
Rows:

- source: the folder's weights; the reference of KL and top-1.
- affine-b: mx.quantize / mx.dequantize, bits b, group 64.
- tq-b: the format-1 codec (plain rotation).
- tq-b eq: the column-equalised codec (in_scales = column RMS, docs/quality.md) on every
  linear layer; the embedding / tied head stays plain.
- tq-b trellis, tq-b eq-s trellis (asked for with --methods): the same with the trellis
  code (`encode(codec="trellis")`, L=16, V=1; docs/FORMAT.md), the same bytes. Suffixes:
  "L12" sets the trellis's state bits; "on=v_proj+down_proj+o_proj" trellis-codes only those
  classes and the rest with the scalar code ("tq eq-s trellis L12 on=v_proj+down_proj").
  The "encode s" column is the seconds spent coding the row's matrices.
- tq-repo-b: the user's path: the folder converted by `turboquant convert --bits b
  --embeddings-bits b --protect-layers 0` (the default recipe's column scales; every
  matrix at b bits, like affine-b) and loaded by `turboquant.runtime.load` (its layers on
  the pure-MLX reference kernels), float32; bits/w from the repo's safetensors bytes.
- tq-repo-b col: the same with the column rule on every down_proj (the llama recipe
  without `neuron_ratio`: the default before it).
- tq-repo-b rec: the same with the recipe's own bits for the rest (`--bits b` only: the
  embedding and the first and last layers at 4 bits).
- tq-repo-b emb4, emb3, dp3: the same as tq-repo-b with the embedding (tied head) at 4 or
  3 bits, or every down_proj at 3 bits (rules at the sizes an allocation is compared at).
- tq-repo-b alloc=B (choices=3+4 by default): tq-repo-b's folder, then `turboquant allocate
  FOLDER --target-bits B --choices 3,4` (bits per tensor from the manifest's out_error,
  docs/quality.md "Choosing bits per tensor"), converted again with that recipe and loaded
  the same way.

bits/w = every stored byte (codes, scales, affine biases, in_scales, 16-bit tensors) * 8 /
parameters, tied embeddings counted once; affine's scales and biases as mlx-lm stores them
(16 bits each). Then per tensor class (one class quantized, the rest at source) and the
mechanism: how much of each layer input's activation energy sits in its smallest columns,
and each codec's activation-weighted error sum_j ||E_:,j||^2 E[x_j^2] / sum_j ||W_:,j||^2 E[x_j^2]
(a diagnostic with data; the codec itself uses none).
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SEQ = 512
GROUP = 64
MIN_RATIO = [0.0]
WORK = [Path(__file__).resolve().parents[1] / "out" / "quality-hf"]  # --work  # --min-ratio: tq eq-s's rule (0: the codec's SMALL_COLUMN_RATIO)
CLASSES = ["embed", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tensor_class(name: str) -> str:
    return name.split(".")[-2] if ".layers." in name else "embed"


def heldout(tokenizer, count: int) -> tuple[mx.array, int]:
    """`count` rows of SEQ tokens spread evenly over pydoc_data.topics; (rows, rows there)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = np.array(tokenizer.encode(text), dtype=np.int32)
    rows = ids[: len(ids) // SEQ * SEQ].reshape(-1, SEQ)
    count = min(count, len(rows))
    return mx.array(rows[[i * len(rows) // count for i in range(count)]]), len(rows)


def calibration_rows(tokenizer, count: int) -> mx.array:
    """`count` rows of SEQ tokens from this repository's user guides (docs/*.md, sorted):
    English technical prose that is not the held-out pydoc text (the `cal` rows only)."""
    docs = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    ids = np.array(tokenizer.encode("\n\n".join(d.read_text() for d in docs)), dtype=np.int32)
    rows = ids[: len(ids) // SEQ * SEQ].reshape(-1, SEQ)
    count = min(count, len(rows))
    return mx.array(rows[[i * len(rows) // count for i in range(count)]])


CAL_ENERGY: dict[str, np.ndarray] = {}  # E[x_j^2] of each linear layer's input, docs rows


class Evaluator:
    """One float32 mlx-lm model; variants swap matrices in and out of it."""

    def __init__(self, path: Path, batch: int = 2):
        from mlx.utils import tree_flatten
        from mlx_lm import load

        self.path = Path(path)
        self.model, self.tokenizer = load(str(path))
        self.source = dict(tree_flatten(self.model.parameters()))  # as stored (bf16)
        self.model.set_dtype(mx.float32)
        mx.eval(self.model.parameters())
        self.matrices = [n for n, v in self.source.items() if v.ndim == 2]
        self.batch = batch
        self.ref: dict[int, list] = {}

    def n_params(self) -> int:
        return sum(v.size for v in self.source.values())

    def set(self, weights: dict[str, mx.array]) -> None:
        self.model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()],
                                strict=False)
        mx.eval(self.model.parameters())

    def restore(self, names) -> None:
        self.set({n: self.source[n] for n in names})

    def run(self, rows: mx.array, model=None) -> dict:
        """ppl, KL(source || this) and top-1 agreement on `rows` (of `model`, by default
        the evaluator's own); the first call per row count is the source and keeps its
        log-probs (float16) as the reference."""
        ref = self.ref.get(rows.shape[0])
        model = self.model if model is None else model
        nll, kl, agree, keep = [], [], 0, []
        for j, i in enumerate(range(0, rows.shape[0], self.batch)):
            x = rows[i : i + self.batch]
            logits = model(x[:, :-1]).astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            n = -mx.take_along_axis(lp, x[:, 1:, None], axis=-1)[..., 0]
            if ref is None:
                keep.append(lp.astype(mx.float16))
                mx.eval(n, keep[-1])
            else:
                p = ref[j].astype(mx.float32)
                k = (mx.exp(p) * (p - lp)).sum(axis=-1)
                a = (mx.argmax(p, -1) == mx.argmax(lp, -1)).sum()
                mx.eval(n, k, a)
                kl.append(float(k.mean()))
                agree += a.item()
            nll.append(np.asarray(n, dtype=np.float64).mean(axis=-1))
        if ref is None:
            self.ref[rows.shape[0]] = keep
        row_nll = np.concatenate(nll)
        return {"ppl": math.exp(row_nll.mean()), "row_nll": row_nll,
                "kl": float(np.mean(kl)) if kl else 0.0,
                "top1": agree / (rows.shape[0] * (SEQ - 1)) if ref is not None else 1.0}


# ----------------------------------------------------------------------------- codecs


def affine(w: mx.array, bits: int) -> tuple[mx.array, int]:
    """(decoded weight, stored bytes as mlx-lm writes it: uint32 codes, 16-bit scales+biases)."""
    q, s, b = mx.quantize(w, group_size=GROUP, bits=bits)
    back = mx.dequantize(q, s, b, group_size=GROUP, bits=bits)
    return back, q.nbytes + 2 * s.size + 2 * b.size


def norm_weight(source: dict, name: str) -> mx.array | None:
    """The RMSNorm weight (gamma) in front of a linear layer: input_layernorm for q/k/v,
    post_attention_layernorm for gate/up; None for o_proj, down_proj and the embedding."""
    c = tensor_class(name)
    norm = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
            "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}.get(c)
    if norm is None:
        return None
    layer = name.split(".self_attn.")[0].split(".mlp.")[0]
    return source.get(f"{layer}.{norm}.weight")


def neuron_sizes(source: dict, name: str, above: float | None) -> np.ndarray | None:
    """For a down_proj: rms(gate row k) * rms(up row k) over its median, a data-free size of
    MLP neuron k's activation (SmolLM2's massive neurons: 11-56x); None for other weights,
    when `above` is None, or when no neuron is over `above` x the median."""
    if above is None or tensor_class(name) != "down_proj":
        return None
    mlp = name.rsplit(".down_proj.", 1)[0]
    g, u = (np.asarray(source[f"{mlp}.{c}.weight"].astype(mx.float32), dtype=np.float64)
            for c in ("gate_proj", "up_proj"))
    a = np.sqrt((g * g).mean(axis=1) * (u * u).mean(axis=1))
    a = a / float(np.median(a))
    return a if float(a.max()) > above else None


def turboquant(w: mx.array, bits: int, name: str, equalise: str | bool, group: int = GROUP,
               power: float | None = None, codec: str = "scalar", state_bits: int | None = None,
               gamma: mx.array | None = None, gamma_power: float | None = None,
               energy: np.ndarray | None = None, neurons: np.ndarray | None = None
               ) -> tuple[mx.array, int, float]:
    """(decoded weight, stored bytes, recorded rel_mse) through turboquant.stages.
    equalise: False, True (every weight) or "small" (only weights with a small column);
    state_bits: the trellis's L (None: the codec's default, 16)."""
    from turboquant.stages import column_scales, decode, encode, tensor_seed
    from turboquant.stages.scale import COLUMN_POWER, SMALL_COLUMN_RATIO

    t = None
    if equalise:
        t = column_scales(w, power or COLUMN_POWER, min_ratio=MIN_RATIO[0] or
                          SMALL_COLUMN_RATIO if equalise == "small" else None)
    if energy is not None:  # calibrated: t_j = (colRMS_j / xrms_j) ** 0.5, which minimises
        # sum_j ||E_:,j||^2 E[x_j^2] when each column's error is t_j^2 x the same
        a = np.asarray(w.astype(mx.float32), dtype=np.float64)
        col = np.sqrt((a * a).mean(axis=0))
        x = np.sqrt(np.maximum(energy, 1e-6 * float(np.median(energy))))
        t = np.maximum(col, 1e-2 * float(np.median(col))) / x
        t = np.sqrt(t)
        t = (t / np.sqrt(np.mean(t * t))).astype(np.float16)
    if neurons is not None:  # down_proj: t_k = (colRMS_k / a_k) ** 0.5, the calibrated rule with
        # a_k = rms(gate row k) * rms(up row k) / median for the activation of neuron k
        from turboquant.stages.scale import neuron_column_scales

        a = np.asarray(w.astype(mx.float32), dtype=np.float64)
        t = neuron_column_scales((a * a).sum(axis=0), a.shape[0], neurons, ratio=0.0)
    if gamma is not None and gamma_power:  # t *= |gamma| ** a (a < 0: big gamma, small t)
        g = np.abs(np.asarray(gamma.astype(mx.float32), dtype=np.float64))
        g = np.maximum(g, 1e-2 * float(np.median(g))) ** gamma_power
        t0 = np.ones(w.shape[1]) if t is None else np.asarray(t, dtype=np.float64)
        t = t0 * g
        t = (t / np.sqrt(np.mean(t * t))).astype(np.float16)
    kw = {} if state_bits is None else {"trellis_state_bits": state_bits}
    qt = encode(w, bits, group_size=group, seed=tensor_seed(0, name), in_scales=t, codec=codec,
                **kw)
    return decode(qt), qt.nbytes, qt.rel_mse


def variant(method: str) -> tuple[str, dict]:
    """A main-table method and its options: "tq eq-s g32 e32 p0.75" is tq eq-s with linear
    layers at group 32 (g), the embedding at group 32 (e), t = rms ** 0.75 (p).
    "trellis" codes with the trellis, "L12" at state bits 12 (L), "on=v_proj+down_proj" only
    the named classes (the rest with the scalar code, same column scales). "a-0.5" multiplies
    t by |gamma| ** -0.5 (the preceding RMSNorm's weight; q/k/v, gate/up), "raw=layers.0.+v_proj"
    keeps the matrices whose name holds one of the parts at source (16 bits), "r4096" the
    embedding's first 4096 rows (token ids)."""
    base, *opts = method.split(" ")
    if base == "tq" and opts and opts[0].startswith("eq"):
        base, opts = f"tq {opts[0]}", opts[1:]
    kw = {}
    for o in opts:
        if o == "trellis":
            kw["codec"] = "trellis"
        elif o.startswith("on="):
            kw["trellis_classes"] = o[3:].split("+")
        elif o == "cal":
            kw["cal"] = True
        elif o.startswith("dgu"):  # "dgu8": only where the largest neuron is over 8x the median
            kw["dgu"] = float(o[3:] or 0)
        elif o.startswith("raw="):
            kw["raw"] = o[4:].split("+")
        else:
            key = {"g": "group", "e": "embed_group", "p": "power", "L": "state_bits",
                   "a": "gamma_power", "r": "embed_raw_rows"}[o[0]]
            kw[key] = float(o[1:]) if o[0] in "pa" else int(o[1:])
    return base, kw


def quantized(ev: Evaluator, method: str, bits: int, names) -> tuple[dict, int]:
    """{name: decoded weight} for `names` under `method`, and their stored bytes."""
    out, nbytes = {}, 0
    if method != "affine" and variant(method)[1].get("cal") and not CAL_ENERGY:
        ev.restore(ev.matrices)  # the source model's activations
        CAL_ENERGY.update(capture_inputs(ev, calibration_rows(ev.tokenizer, 8)))
    for n in names:
        w = ev.source[n]
        if method == "affine":
            out[n], b = affine(w, bits)
        else:
            base, kw = variant(method)
            eq = {"tq": False, "tq eq": True, "tq eq-s": "small"}[base]
            only = kw.get("trellis_classes")
            if any(part in n for part in kw.get("raw", ())):
                out[n], b = w, w.nbytes
                mx.eval(out[n])
                nbytes += b
                continue
            codec = kw.get("codec", "scalar") if only is None or tensor_class(n) in only \
                else "scalar"
            if tensor_class(n) == "embed":
                out[n], b, _ = turboquant(w, bits, n, False, kw.get("embed_group", GROUP),
                                          codec=codec, state_bits=kw.get("state_bits"))
                k = kw.get("embed_raw_rows", 0)
                if k:  # the first k token ids (BPE's most frequent merges) kept at source
                    out[n] = mx.concatenate([w[:k].astype(out[n].dtype), out[n][k:]])
                    b += k * w.shape[1] * 2 - b * k // w.shape[0]
            else:
                out[n], b, _ = turboquant(w, bits, n, eq, kw.get("group", GROUP),
                                          kw.get("power"), codec, kw.get("state_bits"),
                                          norm_weight(ev.source, n), kw.get("gamma_power"),
                                          CAL_ENERGY.get(n) if kw.get("cal") else None,
                                          neuron_sizes(ev.source, n, kw.get("dgu")))
        mx.eval(out[n])
        nbytes += b
    return out, nbytes


REPO_FLAGS = {"tq-repo": ["--embeddings-bits", "{b}", "--protect-layers", "0"],
              "tq-repo rec": [],
              "tq-repo emb4": ["--embeddings-bits", "4", "--protect-layers", "0"],
              "tq-repo emb3": ["--embeddings-bits", "3", "--protect-layers", "0"],
              "tq-repo dp3": ["--embeddings-bits", "{b}", "--protect-layers", "0",
                              "--down-proj-bits", "3"],
              "tq-repo trellis": ["--embeddings-bits", "{b}", "--protect-layers", "0",
                                  "--recipe", "{recipe}"],
              "tq-repo col": ["--embeddings-bits", "{b}", "--protect-layers", "0",
                              "--recipe", "{recipe}"]}


def column_rule_recipe(work: Path) -> Path:
    """The llama recipe without `neuron_ratio` (the column rule on every down_proj, as
    before it): what `tq-repo col` converts with."""
    from turboquant.manifests.recipe import RECIPES_DIR

    lines = (RECIPES_DIR / "llama.toml").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.startswith("neuron_ratio")]
    if len(kept) != len(lines) - 1:
        raise SystemExit("llama.toml has no neuron_ratio line")
    path = work / "llama-column-rule.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(kept))
    return path


def trellis_recipe(work: Path, state_bits: int = 12) -> Path:
    """The llama recipe with the trellis code at `state_bits` for every coded weight (its
    column scales as they are): what `tq-repo trellis` converts with."""
    from turboquant.manifests.recipe import RECIPES_DIR

    text = (RECIPES_DIR / "llama.toml").read_text()
    if "\n[quant]\n" not in "\n" + text:
        raise SystemExit("llama.toml has no [quant] table")
    text = text.replace("[quant]\n", f'[quant]\ncodec = "trellis"\ntrellis_state_bits = {state_bits}\n', 1)
    path = work / f"llama-trellis-L{state_bits}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def tensor_bytes(folder: Path) -> int:
    """Stored tensor bytes of a folder's safetensors files (their headers left out)."""
    import struct

    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


def repo_model(src: Path, method: str, bits: int, work: Path):
    """(model, stored bytes) of `src` converted by the CLI as `method` says and loaded by
    the runtime; the conversion is kept in `work` (a rerun of the command is a no-op)."""
    import subprocess

    from turboquant.runtime import load

    recipe = (trellis_recipe(work) if "trellis" in method
              else column_rule_recipe(work) if method == "tq-repo col" else None)
    flags = [f.format(b=bits, recipe=recipe) for f in REPO_FLAGS[method]]
    out = work / f"{src.name}-{method.replace(' ', '-')}-{bits}"
    cmd = [sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q", "--fresh",
           "--bits", str(bits), *flags]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"  ({' '.join(cmd[1:])}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    # the runtime's layers on its pure-MLX reference kernels: the CPU's numba kernels compute
    # the same product (tests/test_in_scales_repo.py) but a 512-token prefill runs a GEMV
    # per token, where the reference's dense product goes to (preloaded) OpenBLAS
    from turboquant.kernels import dispatch

    dispatch.backend = lambda: "reference"
    model, _ = load(out, dtype="float32")
    return model, tensor_bytes(out)


def alloc_options(method: str) -> tuple[float, list[int], str | None]:
    """"tq-repo alloc=3.5 choices=2+3+4 cal=text" -> (3.5, [2, 3, 4], "text"); choices
    default 3, 4; cal (the base folder's out_error from `turboquant calibrate --text` on
    this repository's docs/*.md, not the held-out text) default None (from the weights)."""
    opts = dict(o.split("=", 1) for o in method.split(" ")[1:] if "=" in o)
    return (float(opts["alloc"]), [int(b) for b in opts.get("choices", "3+4").split("+")],
            opts.get("cal"))


def docs_text_stats(src: Path, work: Path) -> Path:
    """`turboquant calibrate SRC --text` on this repository's docs/*.md (sorted, joined)."""
    import subprocess

    text = work / "calibration-docs.txt"
    root = Path(__file__).resolve().parents[1]
    text.write_text("\n\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md"))))
    stats = work / f"{src.name}-docs-stats.safetensors"
    subprocess.run([sys.executable, "-m", "turboquant", "calibrate", str(src), "--text",
                    str(text), "--out", str(stats)], check=True)
    return stats


def alloc_repo_model(src: Path, method: str, bits: int, work: Path):
    """(model, stored bytes) of `src` converted with the bits `turboquant allocate` chose
    from tq-repo-b's manifest for the method's target (`alloc=B`, `choices=3+4`)."""
    import subprocess

    from turboquant.runtime import load

    target, choices, cal = alloc_options(method)
    base = work / (f"{src.name}-tq-repo-{bits}" + ("" if cal is None else f"-cal-{cal}"))
    flags = [f.format(b=bits) for f in REPO_FLAGS["tq-repo"]]
    if cal == "text":
        flags += ["--input-stats", str(docs_text_stats(src, work))]
    elif cal is not None:
        raise SystemExit(f"{method!r}: cal= takes only 'text'")
    subprocess.run([sys.executable, "-m", "turboquant", "convert", str(src), str(base), "-q",
                    "--fresh", "--bits", str(bits), *flags], check=True)
    tag = f"alloc{target:g}-{'+'.join(map(str, choices))}-from{bits}" + \
        ("" if cal is None else f"-cal-{cal}")
    recipe = work / f"{src.name}-{tag}.toml"
    cmd = [sys.executable, "-m", "turboquant", "allocate", str(base), "--target-bits",
           str(target), "--choices", ",".join(map(str, choices)), "--out", str(recipe)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    print(f"  ({' '.join(cmd[1:])}):\n{done.stdout}", file=sys.stderr)
    out = work / f"{src.name}-tq-repo-{tag}"
    subprocess.run([sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q",
                    "--fresh", "--recipe", str(recipe)], check=True)
    from turboquant.kernels import dispatch

    dispatch.backend = lambda: "reference"  # as repo_model
    model, _ = load(out, dtype="float32")
    return model, tensor_bytes(out)


def bits_per_weight(ev: Evaluator, names, nbytes: int) -> float:
    rest = sum(v.nbytes for n, v in ev.source.items() if n not in names)
    return 8 * (nbytes + rest) / ev.n_params()


# ----------------------------------------------------------------------------- tables


def fmt_row(label, r, base, peer=None, bpw=None):
    d = r["ppl"] - base
    ratio = f"{d / (peer['ppl'] - base):.2f}" if peer and peer["ppl"] > base else "-"
    b = "" if bpw is None else f"{bpw:6.3f}"
    enc = f" {r['encode_s']:8.0f}" if "encode_s" in r else ""
    return (f"  {label:<14} {b:>6} {r['ppl']:9.3f} {d:+9.3f} {ratio:>9} {r['kl']:7.4f} "
            f"{100 * r['top1']:6.1f}%{enc}")


def head(first="method"):
    return (f"  {first:<14} {'bits/w':>6} {'ppl':>9} {'dppl':>9} {'/affine':>9} {'KL':>7} "
            f"{'top-1':>7} {'encode s':>8}")


def scalar_peer(method: str) -> str:
    """The same method with the scalar code everywhere: "tq eq-s trellis L12" -> "tq eq-s"."""
    return " ".join(o for o in method.split(" ")
                    if o != "trellis" and not o.startswith(("L", "on=")))


def label(method: str, b: int) -> str:
    return f"{method}-{b}" if " " not in method else method.replace(" ", f"-{b} ", 1)


def main_table(ev, rows, bits_list, lines, methods=("affine", "tq", "tq eq")):
    t0 = time.perf_counter()
    src = ev.run(rows)
    lines.append(head())
    bpw16 = 8 * sum(v.nbytes for v in ev.source.values()) / ev.n_params()
    lines.append(fmt_row("source", src, src["ppl"], bpw=bpw16))
    names = ev.matrices
    results = {}
    for b in bits_list:
        for method in methods:
            if method in REPO_FLAGS or method.startswith("tq-repo alloc="):
                model, nbytes = (alloc_repo_model if method.startswith("tq-repo alloc=")
                                 else repo_model)(ev.path, method, b, WORK[0])
                r = ev.run(rows, model)
                del model
                r["bpw"] = 8 * nbytes / ev.n_params()
                results[(method, b)] = r
                lines.append(fmt_row(label(method, b), r, src["ppl"],
                                     results.get(("affine", b)), r["bpw"]))
                print(lines[-1], file=sys.stderr, flush=True)
                continue
            t1 = time.perf_counter()
            ws, nbytes = quantized(ev, method, b, names)
            encode_s = time.perf_counter() - t1
            ev.set(ws)
            del ws
            r = ev.run(rows)
            r["bpw"] = bits_per_weight(ev, names, nbytes)
            r["encode_s"] = encode_s
            results[(method, b)] = r
            lines.append(fmt_row(label(method, b), r, src["ppl"], results.get(("affine", b)),
                                 r["bpw"]))
            print(lines[-1], file=sys.stderr, flush=True)
        ev.restore(names)
    checks = []
    for (method, b), tq in results.items():
        aim = {3: 0.7, 4: 0.8}.get(b)
        trellis = "trellis" in method.split(" ")
        if (not (method.startswith(("tq eq", "tq-repo")) or trellis) or aim is None
                or ("affine", b) not in results):
            continue
        af = results[("affine", b)]
        ratio = (tq["ppl"] - src["ppl"]) / (af["ppl"] - src["ppl"])
        d = tq["row_nll"] - af["row_nll"]
        se = math.exp(af["row_nll"].mean()) * d.std(ddof=1) / math.sqrt(len(d))
        ok = ratio <= aim and tq["bpw"] <= af["bpw"]
        checks.append(f"  {label(method, b)}: dppl {ratio:.2f} x affine-{b}'s (aim <= {aim}), "
                      f"ppl {tq['ppl'] - af['ppl']:+.3f} +- {se:.3f} (paired se over rows), "
                      f"bits/w {tq['bpw']:.3f} vs {af['bpw']:.3f}: {'PASS' if ok else 'FAIL'}")
        sc = results.get((scalar_peer(method), b))
        if trellis and b == 3 and sc is not None:  # issue 39: <= 0.6x scalar, <= 0.5x affine
            r_sc = (tq["ppl"] - src["ppl"]) / (sc["ppl"] - src["ppl"])
            ok = r_sc <= 0.6 and ratio <= 0.5 and tq["bpw"] <= min(sc["bpw"], af["bpw"])
            checks.append(f"  {label(method, b)} (trellis aim): dppl {r_sc:.2f} x "
                          f"{label(scalar_peer(method), b)}'s (aim <= 0.6), {ratio:.2f} x "
                          f"affine-{b}'s (aim <= 0.5): {'PASS' if ok else 'FAIL'}")
    for (method, b), tq in results.items():  # an allocation against the repos of rules
        if not method.startswith("tq-repo alloc="):
            continue
        for peer in ("tq-repo", "tq-repo rec", "tq-repo emb4", "tq-repo emb3", "tq-repo dp3"):
            uni = results.get((peer, b))
            if uni is None:
                continue
            d = tq["row_nll"] - uni["row_nll"]
            se = math.exp(uni["row_nll"].mean()) * d.std(ddof=1) / math.sqrt(len(d))
            checks.append(f"  {label(method, b)} against {label(peer, b)}: ppl "
                          f"{tq['ppl'] - uni['ppl']:+.3f} +- {se:.3f} (paired se over rows), "
                          f"KL {tq['kl']:.4f} vs {uni['kl']:.4f}, bits/w {tq['bpw']:.3f} vs "
                          f"{uni['bpw']:.3f}")
    lines += ["", "aim (same rows, same run):", *checks]
    lines.append(f"  ({time.perf_counter() - t0:.0f} s)")
    return src


def class_table(ev, rows, bits, lines):
    src = ev.run(rows)
    lines.append(f"  {'class':<10} {'affine':>9} {'tq':>9} {'tq eq':>9}   dppl with only this "
                 f"class at {bits} bits")
    for c in CLASSES:
        names = [n for n in ev.matrices if tensor_class(n) == c]
        cells = []
        for method in ("affine", "tq", "tq eq"):
            ws, _ = quantized(ev, method, bits, names)
            ev.set(ws)
            cells.append(ev.run(rows)["ppl"] - src["ppl"])
            ev.restore(names)
        lines.append(f"  {c:<10} " + " ".join(f"{x:+9.3f}" for x in cells))
        print(lines[-1], file=sys.stderr, flush=True)


def layer_table(ev, rows, bits, method, lines, classes=()):
    """Everything coded by `method`; then each layer (and the embedding) back at source alone:
    how much of the loss each carries, and what keeping it raw would cost in bits/w; with
    `classes`, also each layer's matrices of those classes alone."""
    names = ev.matrices
    ws, _ = quantized(ev, method, bits, names)
    src = ev.run(rows)
    ev.set(ws)
    full = ev.run(rows)
    lines.append(f"  all coded ({method}, {bits} bits): dppl {full['ppl'] - src['ppl']:+.3f}")
    lines.append(f"  {'kept raw':<22} {'weights':>10} {'+bits/w':>8} {'dppl':>9} {'gain':>8} "
                 f"{'gain/bit':>9}")
    groups: dict[str, list[str]] = {}
    for n in names:
        key = n.split(".self_attn.")[0].split(".mlp.")[0] if ".layers." in n else "embed"
        groups.setdefault(key, []).append(n)
        if ".layers." in n:
            groups.setdefault(f"{key} {tensor_class(n)}", []).append(n)
    for key, part in groups.items():
        if " " in key and tensor_class(part[0]) not in classes:
            continue
        ev.restore(part)
        r = ev.run(rows)
        ev.set({n: ws[n] for n in part})
        size = sum(ev.source[n].size for n in part)
        extra = (16 - bits - 0.27) * size / ev.n_params()
        gain = full["ppl"] - r["ppl"]
        lines.append(f"  {key:<22} {size:>10,} {extra:8.4f} {r['ppl'] - src['ppl']:+9.3f} "
                     f"{gain:+8.3f} {gain / extra:9.2f}")
        print(lines[-1], file=sys.stderr, flush=True)
    ev.restore(names)


def capture_inputs(ev, rows) -> dict[str, np.ndarray]:
    """E[x_j^2] of every linear layer's input over `rows` (a diagnostic with data)."""
    stats: dict[str, np.ndarray] = {}
    count = [0]

    class Probe(nn.Module):
        def __init__(self, inner, name):
            super().__init__()
            self.inner, self.probe_name = inner, name

        def __call__(self, x):
            e = (x.astype(mx.float32) ** 2).reshape(-1, x.shape[-1]).sum(axis=0)
            mx.eval(e)
            stats[self.probe_name] = stats.get(self.probe_name, 0) + np.asarray(e, np.float64)
            return self.inner(x)

    swapped = []
    for path, mod in ev.model.named_modules():
        if isinstance(mod, nn.Linear) and f"{path}.weight" in ev.source:
            parent_path, _, attr = path.rpartition(".")
            parent = dict(ev.model.named_modules())[parent_path]
            setattr(parent, attr, Probe(mod, f"{path}.weight"))
            swapped.append((parent, attr, mod))
    for i in range(0, rows.shape[0], ev.batch):
        x = rows[i : i + ev.batch, :-1]
        mx.eval(ev.model(x))
        count[0] += x.size
    for parent, attr, mod in swapped:
        setattr(parent, attr, mod)
    return {k: v / count[0] for k, v in stats.items()}


def mechanism_table(ev, rows, bits, lines):
    energy = capture_inputs(ev, rows)
    lines.append(f"  {'class':<10} {'top-2 ch':>8} {'small10%':>8} {'corr':>6} "
                 f"{'affine':>8} {'tq':>8} {'tq eq':>8} {'rel_mse tq':>10} {'affine':>8} "
                 f"{'small-col tq':>12} {'affine':>8} {'tq eq':>8}")
    for c in CLASSES[1:]:
        top2 = small = cor = 0.0
        aw = {"affine": [0.0, 0.0], "tq": [0.0, 0.0], "tq eq": [0.0, 0.0]}
        plain = [0.0, 0.0, 0.0]
        smallcol = {m: 0.0 for m in aw}  # data-free: error / size of the 10% smallest columns
        names = [n for n in ev.matrices if tensor_class(n) == c]
        for n in names:
            w = np.asarray(ev.source[n].astype(mx.float32), dtype=np.float64)
            e = energy[n]
            col2 = (w * w).mean(axis=0)
            top2 += np.sort(e)[-2:].sum() / e.sum()
            small += e[col2 <= np.quantile(col2, 0.1)].sum() / e.sum()
            cor += np.corrcoef(np.log(e + 1e-20), -np.log(col2 + 1e-20))[0, 1]
            den = (col2 * e).sum() * w.shape[0]
            for m in aw:
                wm = ev.source[n]
                back = (affine(wm, bits)[0] if m == "affine"
                        else turboquant(wm, bits, n, m == "tq eq")[0])
                err = np.asarray(back.astype(mx.float32), dtype=np.float64) - w
                aw[m][0] += ((err * err).sum(axis=0) * e).sum()
                sel = col2 <= np.quantile(col2, 0.1)
                smallcol[m] += float(((err * err).mean(axis=0)[sel] / col2[sel]).mean())
                aw[m][1] += den
                if m != "tq eq":
                    plain[0 if m == "tq" else 1] += (err * err).sum()
            plain[2] += (w * w).sum()
        k = len(names)
        lines.append(f"  {c:<10} {100 * top2 / k:7.1f}% {100 * small / k:7.1f}% {cor / k:6.2f} "
                     + " ".join(f"{aw[m][0] / aw[m][1]:8.4f}" for m in aw)
                     + f" {plain[0] / plain[2]:10.4f} {plain[1] / plain[2]:8.4f} "
                     + f"{smallcol['tq'] / k:12.4f} {smallcol['affine'] / k:8.4f} "
                     + f"{smallcol['tq eq'] / k:8.4f}")
        print(lines[-1], file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="an HF folder (llama-style)")
    ap.add_argument("--bits", default="3,4", help="comma list of 2, 3, 4")
    ap.add_argument("--windows", type=int, default=16, help="rows of 512 tokens (16 = 8,176 "
                    "predicted tokens)")
    ap.add_argument("--methods", default="affine,tq,tq eq,tq eq-s",
                    help="main table rows: affine, tq, tq eq (every linear layer equalised), "
                    "tq eq-s (only weights with a small column: the codec's rule), tq-repo "
                    "(converted by `turboquant convert`, every matrix at b bits, loaded by the "
                    "runtime), tq-repo rec (the recipe's own bits besides --bits), tq-repo emb4 / "
                    "emb3 / dp3 (rules), 'tq-repo alloc=3.5' (tq-repo-b's folder allocated to "
                    "3.5 bits/w by `turboquant allocate`; choices=2+3+4 widens from 3,4; "
                    "cal=text allocates from a text's out_error)")
    ap.add_argument("--min-ratio", type=float, default=0.0, help="tq eq-s: equalise weights "
                    "whose smallest column RMS is under this x the median (default: the "
                    "codec's stages.scale.SMALL_COLUMN_RATIO, 0.5)")
    ap.add_argument("--tables", default="main,classes,mechanism",
                    help="which tables: main, classes, mechanism, layers, tensors (comma "
                    "list; tensors: benchmarks/quality_tensors.py)")
    ap.add_argument("--tensor-bits", default="4,3", help="tensors table: every matrix at the "
                    "first, the --subset-layers ones (and the embedding) at the others")
    ap.add_argument("--tensor-layers", default="", help="tensors table: only these layers' "
                    "matrices (and the embedding) at the first --tensor-bits, in this order "
                    "(default: all)")
    ap.add_argument("--subset-layers", default="11,20",
                    help="tensors table: the layers measured at the later --tensor-bits")
    ap.add_argument("--cal-rows", type=int, default=8, help="tensors table: pydoc rows (none "
                    "held out) whose input second moments weight the calibrated proxy")
    ap.add_argument("--seed-check", action="store_true", help="tensors table: code a few "
                    "tensors with another rotation seed too (the KL's noise floor)")
    ap.add_argument("--check-rows", type=int, default=0, help="tensors table: also rank a "
                    "few tensors on this many rows (16: all 8,176 tokens) against the others")
    ap.add_argument("--ablation-windows", type=int, default=4,
                    help="rows for the per-class and mechanism tables")
    ap.add_argument("--ablation-bits", type=int, default=3)
    ap.add_argument("--ablation-method", default="tq eq-s",
                    help="the layers table's method (a main-table method)")
    ap.add_argument("--layer-classes", default="", help="the layers table: also each layer's "
                    "matrices of these classes alone (comma list, e.g. v_proj,down_proj)")
    ap.add_argument("--batch", type=int, default=2, help="rows per forward pass")
    ap.add_argument("--out", type=Path, help="also write the report here")
    ap.add_argument("--work", type=Path, default=WORK[0], help="where tq-repo conversions go")
    args = ap.parse_args(argv)
    WORK[0] = args.work
    bits_list = [int(b) for b in args.bits.split(",")]
    MIN_RATIO[0] = args.min_ratio

    import mlx_lm

    t0 = time.perf_counter()
    ev = Evaluator(args.model, args.batch)
    rows, total = heldout(ev.tokenizer, args.windows)
    lines = [f"TurboQuant vs MLX affine on {args.model} ({ev.n_params():,} parameters), mlx "
             f"{mx.__version__}, mlx-lm {mlx_lm.__version__}, {mx.default_device()}, float32",
             f"held-out: pydoc_data.topics, {rows.shape[0]} rows of {SEQ} (of {total}) = "
             f"{rows.shape[0] * (SEQ - 1):,} predicted tokens; every matrix quantized, group "
             f"{GROUP}; /affine = dppl over affine-b's",
             ""]
    tables = args.tables.split(",")
    if "main" in tables:
        main_table(ev, rows, bits_list, lines, args.methods.split(","))
    small, _ = heldout(ev.tokenizer, args.ablation_windows)
    for table in tables:  # in the order asked
        if table == "classes":
            lines += ["", f"per tensor class, {small.shape[0]} rows "
                      f"({small.shape[0] * (SEQ - 1):,} tokens), {args.ablation_bits} bits; "
                      "tq eq = every weight of the class equalised:"]
            class_table(ev, small, args.ablation_bits, lines)
        elif table == "layers":
            lines += ["", f"per layer, {small.shape[0]} rows ({small.shape[0] * (SEQ - 1):,} "
                      f"tokens), {args.ablation_bits} bits, {args.ablation_method}: one layer "
                      "(or one of its classes) back at source:"]
            layer_table(ev, small, args.ablation_bits, args.ablation_method, lines,
                        [c for c in args.layer_classes.split(",") if c])
        elif table == "mechanism":
            lines += ["", f"mechanism, {args.ablation_bits} bits, {small.shape[0]} rows: top-2 ch "
                      "= share of the input's activation energy in its 2 largest channels; "
                      "small10% = share entering through the 10% of columns with the smallest "
                      "weight RMS; corr = corr(log E[x_j^2], -log colRMS_j^2); then each "
                      "codec's activation-weighted relative error (tq eq: every weight "
                      "equalised), the plain relative weight error (rel_mse), and the "
                      "data-free small-column error: mean over the 10% smallest-RMS columns "
                      "of ||E_:,j||^2 / ||W_:,j||^2:"]
            mechanism_table(ev, small, args.ablation_bits, lines)
        elif table == "tensors":
            from quality_tensors import tensor_table

            lines += ["", f"per tensor, {small.shape[0]} rows ({small.shape[0] * (SEQ - 1):,} "
                      "tokens): each matrix alone coded, the rest at source:"]
            tensor_table(ev, small, args, lines)
    given = list(sys.argv[1:] if argv is None else argv)
    lines += ["", f"total {time.perf_counter() - t0:.0f} s",
              "reproduce: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 "
              ".venv/bin/python benchmarks/quality.py " + " ".join(map(shlex.quote, given))]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

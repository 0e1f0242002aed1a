"""Input statistics from a small text: what `turboquant calibrate` writes and `convert
--input-stats` reads to record each tensor's output error (docs/quality.md).

Optional and off by default: the converter itself is data-free. The source model is loaded
whole by mlx-lm (a model that fits in memory) and run in float32 over the text, cut in rows
of `seq` tokens; every linear layer's input is probed:

- `<weight name>`: float32 (in,), E[x_j^2] of the layer's input per channel;
- `<weight name>:output_energy`: float32 (1,), E||W x||^2 (the layer's own output);
- a tied embedding (`model.embed_tokens.weight` with `tie_word_embeddings`) gets the final
  norm's output, the tied head's input, and the logits' energy as its output energy.

Names are mlx-lm's parameter paths (the source's names for the Llama layout); a tensor the
file does not name gets no value. The file is safetensors, its metadata says what it is.

`from_weights` writes the same file with no text (`calibrate --from-weights`): E[x_j^2]
propagated through the weights (docs/quality.md, "data-free" there), Llama layout only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STATS_FORMAT = "turboquant-input-stats"
STATS_VERSION = "1"
OUTPUT_SUFFIX = ":output_energy"


@dataclass
class InputStats:
    energy: dict[str, np.ndarray]  # weight name -> E[x_j^2] of its input (float64)
    output_energy: dict[str, float]  # weight name -> E||W x||^2
    meta: dict

    def get(self, name: str, in_features: int) -> tuple[np.ndarray, float | None] | None:
        """(energy, output energy) of a weight with `in_features` inputs, or None."""
        a = self.energy.get(name)
        if a is None or a.shape != (in_features,):
            return None
        return a, self.output_energy.get(name)


def measure(folder: str | Path, text: str, tokens: int = 8192, seq: int = 512,
            batch: int = 2) -> InputStats:
    """Run the model of `folder` on up to `tokens` tokens of `text` and probe its linear
    layers' inputs (module docstring)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    params = {k for k, _ in tree_flatten(model.parameters())}
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)[: max(int(tokens), 1)]
    if len(ids) < 2:
        raise ValueError("the calibration text has fewer than 2 tokens: give more text")
    seq = min(seq, len(ids))
    n_rows = len(ids) // seq
    sq: dict[str, np.ndarray] = {}
    out: dict[str, float] = {}
    count = [0]

    class Probe(nn.Module):
        """A linear layer: its input per channel and its output's total; else (the final
        norm, for a tied head) its output per channel."""

        def __init__(self, inner, name, linear=True):
            super().__init__()
            self.inner, self.probe_name, self.linear = inner, name, linear

        def __call__(self, x, *args, **kwargs):
            y = self.inner(x, *args, **kwargs)
            v = x if self.linear else y
            e = mx.sum(mx.square(v.astype(mx.float32)).reshape(-1, v.shape[-1]), axis=0)
            o = mx.sum(mx.square(y.astype(mx.float32))) if self.linear else None
            mx.eval(e, *([o] if o is not None else []))
            sq[self.probe_name] = sq.get(self.probe_name, 0) + np.asarray(e, np.float64)
            if o is not None:
                out[self.probe_name] = out.get(self.probe_name, 0.0) + float(o)
            return y

    modules = dict(model.named_modules())
    swapped = []

    def swap(path, probe):
        parent_path, _, attr = path.rpartition(".")
        parent = modules[parent_path] if parent_path else model
        swapped.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, probe)

    for path, mod in modules.items():
        if isinstance(mod, nn.Linear) and f"{path}.weight" in params:
            swap(path, Probe(mod, f"{path}.weight"))
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    head = None
    if tied and "model.norm" in modules and "model.embed_tokens.weight" in params:
        head = "model.embed_tokens.weight"
        swap("model.norm", Probe(modules["model.norm"], head, False))
    try:
        rows = ids[: n_rows * seq]
        for i in range(0, n_rows, batch):
            x = np.stack([rows[r * seq : r * seq + seq] for r in range(i, min(n_rows, i + batch))])
            logits = model(mx.array(x))
            if head:  # the tied head's own output
                o = mx.sum(mx.square(logits.astype(mx.float32)))
                mx.eval(o)
                out[head] = out.get(head, 0.0) + float(o)
            else:
                mx.eval(logits)
            count[0] += x.size
    finally:
        for parent, attr, mod in reversed(swapped):
            setattr(parent, attr, mod)
    meta = {"format": STATS_FORMAT, "version": STATS_VERSION, "tokens": str(count[0]),
            "seq": str(seq), "source": str(folder), "method": "text",
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    return InputStats({k: v / count[0] for k, v in sq.items()},
                      {k: v / count[0] for k, v in out.items()}, meta)


def write_stats(path: str | Path, stats: InputStats) -> None:
    from safetensors.numpy import save_file

    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in stats.energy.items()}
    tensors.update({k + OUTPUT_SUFFIX: np.array([v], dtype=np.float32)
                    for k, v in stats.output_energy.items()})
    save_file(tensors, str(path), metadata=stats.meta)


def read_stats(path: str | Path) -> InputStats:
    """The file `write_stats` wrote; ValueError naming it if it is not one."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != STATS_FORMAT:
                raise ValueError(f"{path}: not a turboquant input-statistics file (metadata "
                                 f"format {meta.get('format')!r}); write one with "
                                 "`turboquant calibrate SRC --text FILE --out PATH`")
            if meta.get("version") != STATS_VERSION:
                raise ValueError(f"{path}: input-statistics version {meta.get('version')!r}, "
                                 f"this turboquant reads {STATS_VERSION}: write it again")
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read input statistics ({e})") from None
    except Exception as e:  # safetensors' own errors: a file that is not safetensors
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"{path}: not a safetensors input-statistics file ({e}); write "
                         "one with `turboquant calibrate SRC --text FILE --out PATH`") from None
    energy = {k: v.astype(np.float64) for k, v in arrays.items() if ":" not in k}
    output = {k[: -len(OUTPUT_SUFFIX)]: float(v[0]) for k, v in arrays.items()
              if k.endswith(OUTPUT_SUFFIX)}
    return InputStats(energy, output, meta)


def propagate(weights: dict, layers: int, heads: int, kv_heads: int):
    """Data-free second moments of every linear layer's input in the Llama layout, from the
    weights (name -> float array) alone: (inputs {name: E[x_j^2]}, residual energies per
    layer input and after the last, the final norm's output). A token drawn uniformly from
    the embedding starts the residual stream; after an RMSNorm with weight gamma a channel
    has gamma_j^2 e_j / mean(e); a product's channels are sums of the squared weights times
    their inputs' moments (inputs taken as independent); v's moments pass through attention
    unchanged, silu(g) u's as g's times u's; o_proj and down_proj add theirs to the stream."""
    def f64(name):
        return np.asarray(weights[name], dtype=np.float64)

    emb = f64("model.embed_tokens.weight")
    e = (emb * emb).mean(axis=0)
    lin, resid = {}, [e.copy()]

    def normed(e, gamma):
        return f64(gamma) ** 2 * e / max(float(e.mean()), 1e-30)

    for L in range(layers):
        p = f"model.layers.{L}."
        x = normed(e, p + "input_layernorm.weight")
        for c in ("q_proj", "k_proj", "v_proj"):
            lin[p + f"self_attn.{c}.weight"] = x
        wv = f64(p + "self_attn.v_proj.weight")
        v = (wv * wv) @ x
        hd = wv.shape[0] // kv_heads
        o_in = np.concatenate([v[(h // (heads // kv_heads)) * hd:][:hd] for h in range(heads)])
        lin[p + "self_attn.o_proj.weight"] = o_in
        wo = f64(p + "self_attn.o_proj.weight")
        e = e + (wo * wo) @ o_in
        x = normed(e, p + "post_attention_layernorm.weight")
        lin[p + "mlp.gate_proj.weight"] = lin[p + "mlp.up_proj.weight"] = x
        wg, wu = f64(p + "mlp.gate_proj.weight"), f64(p + "mlp.up_proj.weight")
        d_in = ((wg * wg) @ x) * ((wu * wu) @ x)
        lin[p + "mlp.down_proj.weight"] = d_in
        wd = f64(p + "mlp.down_proj.weight")
        e = e + (wd * wd) @ d_in
        resid.append(e.copy())
    return lin, np.stack(resid), normed(e, "model.norm.weight")


def from_weights(folder: str | Path) -> InputStats:
    """InputStats from the weights of `folder` alone (propagate); the whole model is read
    (float32). ValueError naming the folder for a layout it does not know."""
    import mlx.core as mx

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if v.ndim <= 2:
                weights[k] = np.asarray(v.astype(mx.float32))
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        lin, _, fin = propagate(weights, layers, heads, kv)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{folder}: not the Llama layout --from-weights knows ({e}); use "
                         "--text FILE") from None
    head = "model.embed_tokens.weight" if "lm_head.weight" not in weights else "lm_head.weight"
    lin[head] = fin
    out = {}
    for name, a in lin.items():
        w = weights[name]
        out[name] = float(np.einsum("ij,ij->j", w, w, dtype=np.float64) @ a)
    meta = {"format": STATS_FORMAT, "version": STATS_VERSION, "tokens": "0",
            "source": str(folder), "method": "weights"}
    return InputStats(lin, out, meta)

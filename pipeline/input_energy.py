"""A coded matrix's input energies from its own layer's tensors: what the converter weights
each tensor's coded error by for the manifest's `out_error` when no text statistics are
given (docs/quality.md, "What the manifest's error figures mean").

By the tensor's name (the Llama layout's, which most families share):

- q/k/v (and a fused qkv) read `input_layernorm`'s output, gate/up (and a fused gate_up,
  routed experts' too) `post_attention_layernorm`'s (`pre_feedforward_layernorm` where the
  layer has one): a_j = gamma_j^2 (`stages.proxy.norm_energy`), "norm";
- down_proj: its neurons' energies from the gate and up rows' sums of squares, the ones the
  neuron rule's pre-pass reads (`stages.proxy.neuron_energy`), "neurons";
- the head (`lm_head`, or a tied embedding) reads the final norm's output: "norm";
- anything else (o_proj, an untied embedding, a layer whose norm the job's files do not
  hold, a down_proj without the neuron pre-pass): a = 1, "ones".

The lookup is given the tensors as functions, so the converter (a job reading its source
files) and the benchmark (a model in memory) compute the same figure.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from turboquant.stages.proxy import neuron_energy, norm_energy, value_energy

ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj")
MLP_INPUTS = ("gate_proj", "up_proj", "gate_up_proj")
# mlx-lm model_types whose RMSNorm scales by 1 + w (the checkpoint stores w)
OFFSET_NORMS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "recurrent_gemma",
                          "nemotron", "qwen3_next", "qwen3_5", "qwen3_5_moe"})
HEAD, EMBEDDING, FINAL_NORM = "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"
_LAYER = re.compile(r"^(.*?\blayers\.\d+\.)")

Lookup = Callable[[str], "np.ndarray | None"]


def norm_offset(model_type: str | None) -> float:
    """1 for a family whose norms scale by 1 + w, else 0."""
    return 1.0 if model_type in OFFSET_NORMS else 0.0


def _cls(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else parts[-1]


def norm_names(name: str) -> list[str]:
    """The norms whose output the matrix `name` reads, in the order to try; [] if none."""
    m = _LAYER.match(name)
    cls = _cls(name)
    if m is None:
        return []
    layer = m.group(1)
    if cls in ATTENTION_INPUTS:
        return [layer + "input_layernorm.weight"]
    if cls in MLP_INPUTS or cls == "down_proj":
        return [layer + "pre_feedforward_layernorm.weight",
                layer + "post_attention_layernorm.weight"]
    return []


def partner_names(name: str) -> tuple[str, str] | None:
    """A down projection's gate and up weights, or None."""
    if _cls(name) != "down_proj" or ".down_proj." not in name:
        return None
    return name.replace(".down_proj.", ".gate_proj."), name.replace(".down_proj.", ".up_proj.")


def input_energy(name: str, in_features: int, norm: Lookup, row_sq: Lookup,
                 offset: float = 0.0, tied: bool = False,
                 values: bool = False) -> tuple[np.ndarray, str]:
    """(a (in_features,), where it came from: "norm", "neurons", "values" or "ones") of the
    coded matrix `name`. `norm(n)`: the 1-D norm weight `n` or None; `row_sq(n)`: the sums
    of squares of the rows of weight `n` (gate/up, v) or None. `tied`: the embedding is
    also the head (it reads the final norm's output, as lm_head does). `values`: o_proj
    from its v_proj's rows (a candidate benchmarks/quality_tensors.py measured worse than
    a = 1)."""
    if values and _cls(name) == "o_proj" and ".o_proj." in name:
        gamma = norm(_LAYER.match(name).group(1) + "input_layernorm.weight") \
            if _LAYER.match(name) else None
        v = row_sq(name.replace(".o_proj.", ".v_proj."))
        if gamma is not None and v is not None:
            return value_energy(v, float(norm_energy(gamma, offset).mean()), in_features), \
                "values"
    if name == HEAD or (tied and name == EMBEDDING):
        gamma = norm(FINAL_NORM)
        if gamma is not None and gamma.shape == (in_features,):
            return norm_energy(gamma, offset), "norm"
    gamma = None
    for n in norm_names(name):
        gamma = norm(n)
        if gamma is not None:
            break
    ones = (np.ones(in_features), "ones")
    if gamma is None:
        return ones
    e = norm_energy(gamma, offset)
    pair = partner_names(name)
    if pair is None:
        return (e, "norm") if e.shape == (in_features,) else ones
    g, u = row_sq(pair[0]), row_sq(pair[1])
    if g is None or u is None or g.shape != (in_features,) or u.shape != (in_features,):
        return ones
    return neuron_energy(g, u, float(e.mean())), "neurons"

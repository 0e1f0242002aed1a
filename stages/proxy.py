"""The coding error a layer's output sees: the weight error weighted by its input's energy.

A coded weight W_hat = W + E changes a layer's output by E x. Over inputs x whose channels
have second moments a_j = E[x_j^2] (and are uncorrelated), E||E x||^2 = sum_j ||E_:,j||^2 a_j.
TurboQuant codes W / t (t the column scales, ones without) after a random rotation, which
spreads the coded error evenly over the columns: ||E_:,j||^2 ~ t_j^2 ||E'||^2 / n, with
||E'||^2 the error of W / t that encode measures without decoding (sum of `row_sq_error`).
So the output error needs no decode: ||E'||^2 * mean_j(t_j^2 a_j), what the converter
records as `out_error` (docs/FORMAT.md): a_j from the layer's own tensors by default (the
functions below), from a small text with `convert --input-stats`. Compare tensors of one
model, not models.

Measured on SmolLM2-135M (benchmarks/quality_tensors.py, docs/quality.md) this weighting
orders tensors by the loss they cause far better than the unweighted relative error
(`rel_mse`).
"""

from __future__ import annotations

import numpy as np


def output_error(sq_error: float, energy, in_scales=None) -> float:
    """E||E x||^2 per input: `sq_error` (||E'||^2, of W / t) times mean_j(t_j^2 a_j), with
    `energy` a_j = E[x_j^2] of the layer's input (in,), `in_scales` t (in,) or None."""
    a = np.asarray(energy, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"energy must be a non-empty vector (in,), got shape {a.shape}")
    if in_scales is None:
        return float(sq_error) * float(a.mean())
    t = np.asarray(in_scales, dtype=np.float64)
    if t.shape != a.shape:
        raise ValueError(f"in_scales {t.shape} and energy {a.shape} differ in length")
    return float(sq_error) * float(np.mean(t * t * a))


# Data-free input energies a layer's own checkpoint neighbours give (docs/quality.md): what
# the converter weights `output_error` by when no text statistics are given. Each is in the
# units of a normalised residual stream (a channel of energy 1 before the RMSNorm), so the
# figures of different classes compare.


def norm_energy(gamma, offset: float = 0.0) -> np.ndarray:
    """a_j of a layer that reads an RMSNorm's output, (gamma_j + offset)^2 (the stream's
    channels taken as equal in energy; `offset` 1 for norms that scale by 1 + w)."""
    g = np.asarray(gamma, dtype=np.float64) + float(offset)
    return g * g


def neuron_energy(gate_row_sq, up_row_sq, in_energy: float) -> np.ndarray:
    """a_k of a down projection's input silu(g_k) u_k: E[g_k^2] E[u_k^2], each a row's sum
    of squares times `in_energy` (the mean energy of the MLP's input channels, taken as
    independent; silu(g) as g, what `calibrate --from-weights` does too)."""
    g = np.asarray(gate_row_sq, dtype=np.float64) * float(in_energy)
    u = np.asarray(up_row_sq, dtype=np.float64) * float(in_energy)
    return g * u


def value_energy(v_row_sq, in_energy: float, width: int) -> np.ndarray:
    """a of an output projection's input (attention's values mixed over tokens and heads):
    the values' mean energy, mean_i ||v_i||^2 times `in_energy`, in each of `width`
    channels."""
    v = np.asarray(v_row_sq, dtype=np.float64)
    return np.full(int(width), float(v.mean()) * float(in_energy) if v.size else 1.0)


def energy_factor(energy, in_scales=None) -> float:
    """mean_j(t_j^2 a_j): what `output_error` multiplies ||E'||^2 by (t None: ones)."""
    return output_error(1.0, energy, in_scales)

"""The coding error a layer's output sees: the weight error weighted by its input's energy.

A coded weight W_hat = W + E changes a layer's output by E x. Over inputs x whose channels
have second moments a_j = E[x_j^2] (and are uncorrelated), E||E x||^2 = sum_j ||E_:,j||^2 a_j.
TurboQuant codes W / t (t the column scales, ones without) after a random rotation, which
spreads the coded error evenly over the columns: ||E_:,j||^2 ~ t_j^2 ||E'||^2 / n, with
||E'||^2 the error of W / t that encode measures without decoding (sum of `row_sq_error`).
So the output error needs no decode: ||E'||^2 * mean_j(t_j^2 a_j), what `convert
--input-stats` records as `out_error` (docs/FORMAT.md), in the model's own units: compare
tensors of one model, not models.

Measured on SmolLM2-135M (benchmarks/quality_tensors.py, docs/quality.md) this weighting
with a_j from a small text orders tensors by the loss they cause; the unweighted relative
error (`rel_mse`) does not.
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

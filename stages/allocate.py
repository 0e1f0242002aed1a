"""Size-targeted bit allocation: pure functions of (errors, sizes, budget).

`choose_bits` gives each tensor one of its candidate bit widths so that the stored bytes
stay within a budget, spending bytes greedily where the predicted error drops most per
extra byte. `gaussian_distortion` measures the codec's relative error on the rotated
Gaussian it codes, which predicts a tensor's error at a bit width it was not coded with
(`predict_errors`). No files: pipeline/allocate.py reads a repo's manifest and writes the
recipe (docs/quality.md, "Choosing bits per tensor").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class Candidate:
    """One tensor's options: its predicted error and stored bytes at each bit width."""

    name: str
    errors: dict  # bits -> predicted error (any unit shared by all candidates)
    nbytes: dict  # bits -> stored bytes (codes, scales, in_scales)

    @property
    def bits(self) -> list[int]:
        return sorted(self.errors)


def choose_bits(candidates: list[Candidate], budget: int) -> dict[str, int]:
    """Bits per tensor name: every tensor at its fewest bits, then one step up at a time,
    the largest error drop per extra byte first, taking a step only while the total stays
    within `budget` bytes (a step that does not fit ends that tensor's climb).

    The result's bytes are <= budget, and every tensor below its most bits has a next step
    larger than the budget left. ValueError when the fewest bits already exceed it."""
    chosen = {c.name: c.bits[0] for c in candidates}
    total = sum(c.nbytes[c.bits[0]] for c in candidates)
    if total > budget:
        raise ValueError(f"the fewest bits already take {total} bytes, over the budget of "
                         f"{budget}: raise the target or add a smaller choice")
    by_name = {c.name: c for c in candidates}
    heap: list[tuple[float, str, int]] = []

    def push(c: Candidate, i: int) -> None:  # the step from c.bits[i] to c.bits[i + 1]
        if i + 1 < len(c.bits):
            a, b = c.bits[i], c.bits[i + 1]
            gain = c.errors[a] - c.errors[b]
            cost = max(c.nbytes[b] - c.nbytes[a], 1)
            heapq.heappush(heap, (-gain / cost, c.name, i))

    for c in candidates:
        push(c, 0)
    while heap:
        _, name, i = heapq.heappop(heap)
        c = by_name[name]
        cost = c.nbytes[c.bits[i + 1]] - c.nbytes[c.bits[i]]
        if total + cost > budget:
            continue  # does not fit: this tensor stays where it is
        total += cost
        chosen[name] = c.bits[i + 1]
        push(c, i + 1)
    return chosen


def total_bytes(candidates: list[Candidate], chosen: dict[str, int]) -> int:
    return sum(c.nbytes[chosen[c.name]] for c in candidates)


def predict_errors(error: float, bits: int, choices, ratios: dict) -> dict:
    """A tensor's error at each bit width of `choices`, from its `error` at `bits` and the
    codec's distortion at each width (`ratios`: bits -> relative error)."""
    return {b: error * ratios[b] / ratios[bits] for b in choices}


@lru_cache(maxsize=None)
def gaussian_distortion(bits: int, group_size: int, refit: bool = True, rows: int = 256,
                        cols: int = 4096, seed: int = 0) -> float:
    """The codec's relative squared error on a Gaussian matrix (what a rotated weight's
    groups look like to the codebook): rotation, per-group scales, Lloyd-Max codes and the
    refit, as `stages.encode` codes a weight."""
    from .codec import encode

    w = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    return float(encode(w, bits, group_size=group_size, seed=seed, refit=refit).rel_mse)

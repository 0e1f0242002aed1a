"""Run the linears that read one input (q/k/v, gate/up) as one kernel group.

mlx-lm's attention calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` on the same x, and its MLPs
`gate_proj(x)` and `up_proj(x)`. `group_linears(model)` turns such siblings into
`TQGroupedLinear`s sharing a `layers.LinearGroup`: the first of them called with a new x computes
every member's output in one `kernels.tq_linear_group` call (on CUDA: one rotation launch
for all seeds and one GEMV over the stacked rows), the others return their share for that
same x. Parameters, their names and the results are unchanged; only the launches are
fewer. Prefill (many tokens) runs each layer on its own, as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turboquant.kernels import dispatch, group

from .layers import LinearGroup, TQLinear

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class TQGroupedLinear(TQLinear):
    """A TQLinear that, for a few tokens, takes its output from its group's shared call."""

    def join(self, shared: LinearGroup, index: int) -> None:
        self._group, self._index = shared, index

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.size // max(1, x.shape[-1])
        shared = getattr(self, "_group", None)
        if shared is None or tokens > dispatch.MATVEC_MAX_TOKENS:
            return super().__call__(x)
        return shared.output(x, self._index)


def _batches(layers: list[TQLinear]) -> list[list[int]]:
    """Indices of the layers that can share a kernel, two or more at a time, in order."""
    out: list[list[int]] = []
    for i, layer in enumerate(layers):
        for batch in out:
            trial = tuple(layers[j].member() for j in batch) + (layer.member(),)
            if group.fusable(trial):
                batch.append(i)
                break
        else:
            out.append([i])
    return [b for b in out if len(b) > 1]


def group_linears(model: nn.Module) -> int:
    """Group sibling TQLinears in place; returns how many groups were formed."""
    formed = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            layers = [getattr(module, n, None) for n in names]
            if not all(type(layer) is TQLinear for layer in layers):
                continue
            for batch in _batches(layers):
                grouped = [layers[i] for i in batch]
                shared = LinearGroup(grouped)
                for k, layer in enumerate(grouped):
                    layer.__class__ = TQGroupedLinear  # same state, grouped forward
                    layer.join(shared, k)
                formed += 1
    return formed

"""turboquant.runtime: load a TurboQuant repo into mlx-lm's architectures and run it.

    from turboquant.runtime import load
    model, tokenizer = load("path/or/owner-repo")

The model is mlx-lm's own for the config's model_type, with TQLinear, TQSwitchLinear and
TQEmbedding in place of the quantized layers, so `mlx_lm.generate` and
`mlx_lm.stream_generate` work on it unchanged.

`load(..., expert_budget="25%")` streams a Mixture-of-Experts model's experts from disk
through a cache of that size (docs/expert-streaming.md); `expert_stats(model)` reports it.
"""

from .experts import ExpertBudgetError, ExpertReadError, ExpertStats, expert_cache, expert_stats
from .layers import TQEmbedding, TQLinear, TQSwitchLinear
from .loader import load, load_model
from .repo import RepoError, open_repo, resolve

__all__ = [
    "ExpertBudgetError",
    "ExpertReadError",
    "ExpertStats",
    "RepoError",
    "TQEmbedding",
    "TQLinear",
    "TQSwitchLinear",
    "expert_cache",
    "expert_stats",
    "load",
    "load_model",
    "open_repo",
    "resolve",
]

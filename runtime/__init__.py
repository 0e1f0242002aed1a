"""turboquant.runtime: load a TurboQuant repo into mlx-lm's architectures and run it.

    from turboquant.runtime import load
    model, tokenizer = load("path/or/owner-repo")

The model is mlx-lm's own for the config's model_type, with TQLinear, TQSwitchLinear and
TQEmbedding in place of the quantized layers, so `mlx_lm.generate` and
`mlx_lm.stream_generate` work on it unchanged.

`load(..., expert_budget="25%")` streams a Mixture-of-Experts model's experts from disk
through a cache of that size (docs/expert-streaming.md); `expert_stats(model)` reports it.
"""

import os

# MLX's CUDA backend keeps 100 CUDA graphs (of at most 20 nodes each) by default. A
# TurboQuant KV cache compresses one layer's block on most decode steps, a different layer
# each step (`make_turboquant_cache` staggers them), so a step's graphs change from step
# to step and thrash that cache: on the H200 (MLX 0.32.4, 8B-shaped bf16 Llama, graphs on)
# MLX stopped with "Cache thrashing is happening, please set the environment variable
# MLX_CUDA_GRAPH_CACHE_SIZE to a larger value than 100", or re-built graphs each step:
# at 32K the cache decoded at 0.79-0.99x of the fp16 cache in three runs, 1.00x with a
# cache of 2000 (2026-11-30). MLX reads the variable once, at its first graph: set here,
# before any model runs, unless it is set already. Ignored by MLX on Metal and the CPU.
CUDA_GRAPH_CACHE_SIZE = "2000"
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", CUDA_GRAPH_CACHE_SIZE)

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

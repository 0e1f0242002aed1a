"""turboquant.runtime: load a TurboQuant repo into mlx-lm's architectures and run it.

    from turboquant.runtime import load
    model, tokenizer = load("path/or/owner-repo")

The model is mlx-lm's own for the config's model_type, with TQLinear, TQSwitchLinear and
TQEmbedding in place of the quantized layers, so `mlx_lm.generate` and
`mlx_lm.stream_generate` work on it unchanged.
"""

from .layers import TQEmbedding, TQLinear, TQSwitchLinear
from .loader import load, load_model
from .repo import RepoError, open_repo, resolve

__all__ = [
    "RepoError",
    "TQEmbedding",
    "TQLinear",
    "TQSwitchLinear",
    "load",
    "load_model",
    "open_repo",
    "resolve",
]

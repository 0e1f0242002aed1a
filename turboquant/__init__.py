"""TurboQuant: data-free LLM compression (rotation + Lloyd-Max codebooks) on MLX.

Subpackages map onto the repository's top-level folders:
``turboquant.stages`` (stages/), ``turboquant.manifests`` (manifests/),
``turboquant.pipeline`` (pipeline/), ``turboquant.kernels`` (kernels/),
``turboquant.runtime`` (runtime/).
"""

__version__ = "0.1.0"

"""turboquant.kernels: TurboQuant decode and prefill kernels and their dispatch.

`reference` is pure MLX (the CPU path and the oracle); `dispatch` picks a CUDA, Metal or
CPU (numba) kernel when one is registered for the current device, and the reference
otherwise; `tiles` is the prefill product the GPU backends share; `attend` the attention
of a decode step over a KV buffer whose length is an array (the compiled whole step's).
"""

from .attend import buffer_attention
from .dispatch import (
    add_op,
    backend,
    describe,
    get,
    register,
    tq_embed,
    tq_gather,
    tq_linear,
)
from .group import NO_EXTRAS, Extras, Member, Rope, bind_linear_group, tq_linear_group
from .reference import (
    dequantize,
    tq_embedding,
    tq_gather_matmul,
    tq_matmul,
    tq_matvec,
    unpack,
    words_per_row,
)

__all__ = [
    "NO_EXTRAS",
    "Extras",
    "Member",
    "Rope",
    "add_op",
    "backend",
    "buffer_attention",
    "bind_linear_group",
    "dequantize",
    "describe",
    "get",
    "register",
    "tq_embed",
    "tq_embedding",
    "tq_gather",
    "tq_gather_matmul",
    "tq_linear",
    "tq_linear_group",
    "tq_matmul",
    "tq_matvec",
    "unpack",
    "words_per_row",
]

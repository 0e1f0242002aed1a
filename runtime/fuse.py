"""Run the linears that read one input (q/k/v, gate/up) as one kernel group.

mlx-lm's attention calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` on the same x, and its MLPs
`gate_proj(x)` and `up_proj(x)`. `group_linears(model)` turns such siblings into
`TQGroupedLinear`s sharing a `layers.LinearGroup`: the first of them called with a new x computes
every member's output in one `kernels.tq_linear_group` call (on CUDA: one launch that
rotates with each member's seed and runs the GEMV over their stacked rows), the others
return their share for that same x. Parameters, their names and the results are
unchanged; only the launches are fewer. Prefill (many tokens) runs each layer on its own,
as before.

`fuse_blocks(model)` goes one step further for the pre-norm decoder blocks of mlx-lm's
Llama, Qwen2 and Qwen3 (and the families mapped onto them): when decoding, the block hands
its RMSNorms to the q/k/v and gate/up calls, its SwiGLU to down_proj's and its two
residual adds to o_proj's and down_proj's (`kernels.Extras`), so on CUDA a layer's norms,
gate and adds cost no launches of their own. A single-token step hands RoPE to the q/k/v
call too where the launch can do it (`rope_inverse`, `ROPE`: its rows laid out in RoPE
pairs). The cache and the softmax are mlx-lm's, unchanged.

Where kernels are graph nodes (CUDA, where `load` fuses blocks) a fused block's
single-token step with a cache runs as two `mx.compile`d halves around the cache
(`COMPILE_STEP`): the norm, q/k/v and RoPE before it; o_proj, the residual and the MLP
half (an MoE block's sparse one too, unless its experts stream) after it. The host then
replays each half's traced launches instead of building them in Python every token.
"""

from __future__ import annotations

import functools
import importlib
import os

import mlx.core as mx
import mlx.nn as nn

from turboquant.kernels import dispatch, group
from turboquant.kernels.group import NO_EXTRAS, Extras, Rope

from . import layers
from .layers import LinearGroup, TQLinear

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class TQGroupedLinear(TQLinear):
    """A TQLinear that, for a few tokens, takes its output from its group's shared call."""

    def join(self, shared: LinearGroup, index: int) -> None:
        self._group, self._index = shared, index

    def __call__(self, x: mx.array) -> mx.array:
        shared = self._group
        ready = shared.ready
        if ready is not None and ready[0] is x:  # a fused block computed the group's outputs
            return ready[1][self._index]
        if x.size > dispatch.MATVEC_MAX_TOKENS * x.shape[-1]:
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


# the loader fuses blocks on CUDA; TURBOQUANT_FUSE_BLOCKS=0 keeps mlx-lm's (for comparison)
BLOCKS = os.environ.get("TURBOQUANT_FUSE_BLOCKS", "1") != "0"

# TURBOQUANT_FUSE_ATTENTION=0: a fused block's single-token step goes through mlx-lm's
# Attention (with the head transposes) instead of `_attention_half` (for comparison)
ATTENTION = os.environ.get("TURBOQUANT_FUSE_ATTENTION", "1") != "0"

# TURBOQUANT_COMPILE_STEP=0: a fused block's single-token step is built op by op in Python
# every token instead of replaying its two compiled halves (`_compiled_halves`)
COMPILE_STEP = os.environ.get("TURBOQUANT_COMPILE_STEP", "1") != "0"
# where kernels are nodes of MLX's graph (the CPU's numba kernels evaluate: no tracing)
GRAPH_KERNEL_BACKENDS = ("cuda", "metal")

# mlx-lm's RoPE classes that take their offset as an array into `mx.fast.rope` untouched, so
# one trace serves every position (DynamicNTKScalingRoPE computes its base from the offset)
TRACEABLE_ROPES = ("RoPE", "SuScaledRoPE", "Llama3RoPE", "YarnRoPE", "ProportionalRoPE")

# mlx-lm modules whose TransformerBlock is x + attn(norm(x)), then h + mlp(norm(h)), with
# MLP down(swiglu(gate(x), up(x))): the structure FusedDecoderBlock reproduces
FUSABLE_FAMILIES = ("llama", "qwen2", "qwen3")

# mlx-lm MoE modules whose decoder block is x + attn(norm(x)), then h + moe(norm(h)), with
# an attention of the dense families' kind: (block class, attention class, the sparse
# MLP's attribute), the blocks FusedAttentionBlock takes
ATTENTION_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeDecoderLayer", "Attention", "mlp"),
    "qwen2_moe": ("Qwen2MoeDecoderLayer", "Attention", "mlp"),
    "mixtral": ("MixtralDecoderLayer", "MixtralAttention", "block_sparse_moe"),
}


class FusedDecoderBlock:
    """Mixed into a fusable block's class: the same layer, its decode step done by the
    linears' kernels (norms, SwiGLU and residuals in `kernels.Extras`)."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if x.size > dispatch.MATVEC_MAX_TOKENS * x.shape[-1]:
            return super().__call__(x, mask, cache)
        if not (ATTENTION and x.shape[1] == 1 and cache is not None):
            return _mlp_half(self, self._grouped_attention(x, mask, cache))
        if COMPILE_STEP and self.compiles and dispatch.backend() in GRAPH_KERNEL_BACKENDS:
            before, after = _compiled_halves(self)
            return after(_attend(self, before(x, _offset_array(cache.offset)), mask, cache), x)
        return _mlp_half(self, _attention_half(self, x, mask, cache))

    def _grouped_attention(self, x: mx.array, mask, cache) -> mx.array:
        """x + o_proj(attention(rms_norm(x))) through mlx-lm's Attention, its q/k/v calls
        served by one group call and its o_proj adding the residual."""
        # children as items, not attributes: Module.__getattr__ would be a Python call each
        attn, norm = self["self_attn"], self["input_layernorm"]
        qkv, out = attn["q_proj"]._group, attn["o_proj"]._alone
        qkv.extras = Extras(norm=norm["weight"], eps=norm.eps)
        out.extras = Extras(residual=x)
        try:
            # q/k/v in one call, taken by the attention's calls on x (any other would still
            # be normalised: the extras stay set while it runs)
            qkv.ready = (x, qkv.outputs(x, qkv.extras))
            return attn(x, mask, cache)
        finally:
            qkv.extras = out.extras = NO_EXTRAS
            qkv.ready = None


class FusedAttentionBlock:
    """Mixed into an ATTENTION_FAMILIES block's class (MoE layers): a single-token step
    with a cache runs its attention half as a fused block does (`_attention_half`: the
    norm in the q/k/v launch, the residual in o_proj's); the sparse MLP half, and every
    other step, stay mlx-lm's. Compiled, the step's second half takes the sparse MLP in
    too, unless its experts stream from disk (`moe_compiles`: streaming evaluates)."""

    moe_name = "mlp"  # the sparse MLP's attribute (the fused class sets its family's)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if not (ATTENTION and x.shape[1] == 1 and cache is not None):
            return super().__call__(x, mask, cache)
        if COMPILE_STEP and self.compiles and dispatch.backend() in GRAPH_KERNEL_BACKENDS:
            before, after = _compiled_halves(self)
            h = after(_attend(self, before(x, _offset_array(cache.offset)), mask, cache), x)
            if self.moe_compiles:  # `after` ran the sparse MLP half too
                return h
        else:
            h = _attention_half(self, x, mask, cache)
        return _moe_half(self, h)


def _attention_half(block, x: mx.array, mask, cache) -> mx.array:
    """x + o_proj(attention(rms_norm(x))) for one token with a cache: mlx-lm's Attention
    step (Llama, Qwen2, Qwen3 and the MoE families of ATTENTION_FAMILIES) with fewer
    operations. For one token the (B, 1, H, D) -> (B, H, 1, D) transposes are reshapes, so
    q/k/v come from their group call in that shape (on CUDA the launch declares it: no
    operation at all; elsewhere a reshape each) instead of a reshape and a transpose, and
    the attention's output takes one reshape instead of two; every value is the same.
    Each operation saved is host time on a GPU (MLX encodes every one). The head counts
    and sizes are the block's (`_set_heads`)."""
    return _attention_out(block, _attend(block, _queries(block, x, cache.offset), mask, cache), x)


def _queries(block, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
    """(q, k, v) of one token as (B, heads, 1, D), q and k rotated by RoPE at `offset`
    (an int, or an array: the compiled step's, traced once for every position); by the
    q/k/v call itself where it can (`block.rope_inverse`, one position: on CUDA the
    launch rotates as it stores, two operations fewer a layer)."""
    attn, norm = block["self_attn"], block["input_layernorm"]
    b, (hq, dq), (hkv, dk, dv) = x.shape[0], block.q_heads, block.kv_heads
    # q/k/v as (B, heads, 1, D): on CUDA the launch declares these shapes (no reshapes)
    views = ((b, hq, 1, dq), (b, hkv, 1, dk), (b, hkv, 1, dv))
    qkv, rope = attn["q_proj"]._group, attn["rope"]
    if block.rope_inverse is not None and (type(offset) is int or offset.ndim == 0):
        turn = Rope(rope, block.rope_inverse, _offset_array(offset))
        return tuple(qkv.outputs(x, Extras(norm=norm["weight"], eps=norm.eps, rope=turn), views))
    q, k, v = qkv.outputs(x, Extras(norm=norm["weight"], eps=norm.eps), views)
    if "q_norm" in attn:  # Qwen3: each head's query and key normalised first
        q, k = attn["q_norm"](q), attn["k_norm"](k)
    return rope(q, offset=offset), rope(k, offset=offset), v


def _attend(block, qkv: tuple, mask, cache) -> mx.array:
    """The attention's output (B, heads, 1, D) for `_queries`' q/k/v, k and v stored in the
    cache first: mlx-lm's cache and attention function, never compiled (a cache's arrays
    and length change every token)."""
    q, k, v = qkv
    k, v = cache.update_and_fetch(k, v)
    # the attention function of the block's mlx-lm module, looked up each call as mlx-lm's
    # own code does (a KV cache's hook replaces what it routes to)
    sdpa = block.mlx_module.scaled_dot_product_attention
    return sdpa(q, k, v, cache=cache, scale=block["self_attn"].scale, mask=mask)


def _attention_out(block, o: mx.array, x: mx.array) -> mx.array:
    """x + o_proj(o) for the attention's output o (B, heads, 1, D), read as the token's row
    (on CUDA the launch reads o's memory so: no reshape), the residual in o_proj's call."""
    out = block["self_attn"]["o_proj"]._alone
    row = (x.shape[0], 1, o.shape[1] * o.shape[-1])
    return out.outputs(o, Extras(residual=x), read_as=row)[0]


def _moe_half(block, h: mx.array) -> mx.array:
    """h + moe(rms_norm(h)): an MoE block's sparse MLP half, mlx-lm's."""
    return h + block[block.moe_name](block["post_attention_layernorm"](h))


def _step_after(block, o: mx.array, x: mx.array) -> mx.array:
    """A block's step after its attention: o_proj with the residual, then the MLP half
    (the sparse one of an MoE block)."""
    h = _attention_out(block, o, x)
    return _mlp_half(block, h) if isinstance(block, FusedDecoderBlock) else _moe_half(block, h)


def _compiled_halves(block):
    """(before, after): `_queries` and the step after the attention (`_step_after`; for an
    MoE block whose sparse MLP cannot be traced, `_attention_out`) compiled for this block
    (`compiled_for`). (The backend is the caller's check: a process has one GPU backend,
    the only kind that compiles.)"""
    def build():
        whole = isinstance(block, FusedDecoderBlock) or block.moe_compiles
        return (mx.compile(functools.partial(_queries, block)),
                mx.compile(functools.partial(_step_after if whole else _attention_out, block)))

    return compiled_for(block, build)


def compiled_for(owner: nn.Module, build):
    """`build()` (compiled functions tracing `owner`'s modules), kept on `owner` and built
    again when a trace's constants may be stale: a trace holds what it read as constants,
    so it is traced again once a TurboQuant layer's arrays were replaced
    (`layers._arrays_version`), any other array of `owner` was (a norm's weight, a
    router's: `_watched`), or the kernels registered changed."""
    key = (layers._arrays_version, dispatch.GENERATION[0])
    hit = owner.__dict__.get("_step_compiled")
    if hit is not None and hit[0] == key:
        for module, name, array in hit[1]:
            if module.get(name) is not array:
                break
        else:
            return hit[2]
    made = build()
    owner.__dict__["_step_compiled"] = (key, _watched(owner), made)
    return made


def _watched(block) -> tuple:
    """(module, name, array) for every array item of `block`'s modules other than its
    TurboQuant layers (whose changes `layers._arrays_version` follows): the norms' weights,
    a router's, RoPE's frequencies."""
    return tuple((m, name, v) for _, m in block.named_modules()
                 if not isinstance(m, layers._TQBase)
                 for name, v in m.items() if isinstance(v, mx.array))


# (offset, its 4-lane int32 buffer, the scalar view of lane 0) last given to a compiled
# step, shared by a token's layers; one tuple swapped whole, so a reader never pairs one
# offset with another's array
_last_offset: tuple = (None, None, None)
# int32 lanes of a position's buffer: 16 bytes, past MLX's CUDA pool of arrays of <= 8
# bytes. That pool is managed memory the host also writes (every new scalar lands there),
# and a kernel reading a scalar from it stalled: on the H200 (2026-12-04, ncu) the
# attention launch ~15 us a launch on its position, the q/k/v launch (RoPE) ~13 us
POSITION_LANES = 4


def _offset_array(offset):
    """A cache's offset as the array RoPE and the attention take in a compiled step (traced
    once for every position); an array offset (batched caches) as it is. The next offset's
    array is this one's plus one, computed on the device (no host write, none of MLX's
    small-array pool: see POSITION_LANES); any other offset is filled on the device."""
    global _last_offset
    if type(offset) is not int:
        return offset
    last, lanes, view = _last_offset
    if last == offset:
        return view
    if last is not None and last + 1 == offset:
        lanes = lanes + _ones()
    else:
        lanes = mx.full((POSITION_LANES,), offset, dtype=mx.int32)
    view = lanes[:1].reshape(())  # a view: no kernel writes a scalar of its own
    _last_offset = (offset, lanes, view)
    return view


@functools.cache
def _ones() -> mx.array:
    """POSITION_LANES int32 ones, made once: a step's increment broadcasts no scalar."""
    ones = mx.ones((POSITION_LANES,), dtype=mx.int32)
    mx.eval(ones)
    return ones


def _mlp_half(block, h: mx.array) -> mx.array:
    """h + down(silu(gate(n)) * up(n)), n = rms_norm(h): the gate/up and down group calls
    with the norm, the SwiGLU and the residual as their extras."""
    mlp, norm = block["mlp"], block["post_attention_layernorm"]
    gate, up = mlp["gate_proj"]._group.outputs(h, Extras(norm=norm["weight"], eps=norm.eps))
    return mlp["down_proj"]._alone.outputs(gate, Extras(up=up, residual=h))[0]


@functools.cache
def _fused_class(cls: type, moe_name: str | None = None) -> type:
    """`cls` with FusedDecoderBlock's step, or FusedAttentionBlock's when the block's
    sparse MLP is `moe_name`; `mlx_module` is the mlx-lm module `cls` comes from."""
    attrs = {"mlx_module": importlib.import_module(cls.__module__)}
    if moe_name is None:
        return type(f"Fused{cls.__name__}", (FusedDecoderBlock, cls), attrs)
    return type(f"Fused{cls.__name__}", (FusedAttentionBlock, cls), {**attrs, "moe_name": moe_name})


def _set_heads(block) -> None:
    """The attention's heads as plain attributes `_attention_half` reads every token:
    q_heads (count, head size), kv_heads (count, key size, value size). Mixtral's
    attention names the counts num_heads and num_key_value_heads."""
    attn = block.self_attn
    if hasattr(attn, "n_heads"):
        hq, hkv = attn.n_heads, attn.n_kv_heads
    else:
        hq, hkv = attn.num_heads, attn.num_key_value_heads
    widths = [attn[name].output_dims for name in ("q_proj", "k_proj", "v_proj")]
    # ints in a tuple would become a Module item (a child): kept as an object attribute
    object.__setattr__(block, "q_heads", (hq, widths[0] // hq))
    object.__setattr__(block, "kv_heads", (hkv, widths[1] // hkv, widths[2] // hkv))


# TURBOQUANT_FUSE_ROPE=0: RoPE stays mlx-lm's op after the q/k/v call (for comparison)
ROPE = os.environ.get("TURBOQUANT_FUSE_ROPE", "1") != "0"


def rope_inverse(rope, head: int) -> mx.array | None:
    """The inverse frequencies (float32, head / 2) by which mlx-lm's RoPE module `rope`
    turns each pair (i, i + head / 2) of a head per position, for the RoPEs a q/k/v call
    can do itself (`kernels.Rope`): `nn.RoPE` and `Llama3RoPE`, non-traditional, over
    whole heads. None for the others (YaRN's and SuScaled's scale the values too)."""
    if getattr(rope, "traditional", True) or getattr(rope, "dims", None) != head:
        return None
    half = mx.arange(0, head, 2, dtype=mx.float32) / head
    if type(rope) is nn.RoPE:
        return rope.scale * mx.power(mx.array(rope.base, mx.float32), -half)
    if type(rope).__name__ == "Llama3RoPE":
        return 1.0 / rope["_freqs"].astype(mx.float32)
    return None


def _set_rope(block) -> None:
    """`rope_inverse` of the block's RoPE where its q/k/v call can do RoPE (queries and
    keys of one head size, no norm between them and RoPE), else None; the q/k/v group
    told to lay its rows out for it (`LinearGroup.pair_rows`)."""
    attn = block.self_attn
    (_, dq), (_, dk, _) = block.q_heads, block.kv_heads
    inverse = None
    if ROPE and dq == dk and "q_norm" not in attn:
        inverse = rope_inverse(attn.rope, dq)
    if inverse is not None:
        mx.eval(inverse)
        attn.q_proj._group.pair_rows(dq)
    object.__setattr__(block, "rope_inverse", inverse)  # not a parameter


@functools.cache
def _family_classes(family: str, names=("TransformerBlock", "Attention", "MLP")) -> tuple | None:
    """The classes `names` of an mlx-lm model module, if it has them all."""
    try:
        module = importlib.import_module(f"mlx_lm.models.{family}")
    except ImportError:
        return None
    if not all(hasattr(module, n) for n in names):
        return None
    return tuple(getattr(module, n) for n in names)


def _grouped(layers) -> bool:
    """Whether these TQGroupedLinears are exactly the members of one group."""
    shared = [getattr(layer, "_group", None) for layer in layers]
    return (all(type(layer) is TQGroupedLinear for layer in layers) and shared[0] is not None
            and all(g is shared[0] for g in shared) and len(shared[0].layers) == len(layers))


def fusable_block(block) -> bool:
    """Whether `block` is a decoder block of a FUSABLE_FAMILIES module whose q/k/v and
    gate/up are grouped TurboQuant linears and o_proj and down_proj plain ones."""
    for family in FUSABLE_FAMILIES:
        classes = _family_classes(family)
        if classes is None or type(block) is not classes[0]:
            continue
        mlp = getattr(block, "mlp", None)
        return (type(mlp) is classes[2] and _attention_fusable(block, classes[1])
                and _grouped([mlp.gate_proj, mlp.up_proj]) and type(mlp.down_proj) is TQLinear)
    return False


def _attention_fusable(block, attention_class: type) -> bool:
    """Whether `block`'s attention is an `attention_class` with grouped TurboQuant q/k/v, a
    plain TurboQuant o_proj, a RoPE module and RMSNorms before its two halves."""
    attn = getattr(block, "self_attn", None)
    norms = (getattr(block, "input_layernorm", None),
             getattr(block, "post_attention_layernorm", None))
    return (type(attn) is attention_class
            and isinstance(attn.get("rope"), nn.Module)  # `_attention_half` calls it
            and all(type(n) is nn.RMSNorm for n in norms)
            and _grouped([attn.q_proj, attn.k_proj, attn.v_proj])
            and type(attn.o_proj) is TQLinear)


def attention_fusable_block(block) -> str | None:
    """The sparse MLP's attribute name if `block` is an ATTENTION_FAMILIES decoder block
    whose attention `_attention_half` can run; None otherwise."""
    for family, (block_name, attention_name, moe_name) in ATTENTION_FAMILIES.items():
        classes = _family_classes(family, (block_name, attention_name))
        if classes is not None and type(block) is classes[0]:
            fits = _attention_fusable(block, classes[1]) and moe_name in block
            return moe_name if fits else None
    return None


def fuse_blocks(model: nn.Module) -> int:
    """Give every fusable decoder block (after `group_linears`) the fused decode step, and
    every MoE block of ATTENTION_FAMILIES the fused attention half, in place; returns how
    many blocks were fused."""
    from .experts import StreamedExperts, StreamedSwitchLinear

    fused = 0
    for _, module in model.named_modules():
        moe_name = None
        if fusable_block(module):
            module.__class__ = _fused_class(type(module))
        elif (moe_name := attention_fusable_block(module)) is not None:
            module.__class__ = _fused_class(type(module), moe_name)
        else:
            continue
        _set_heads(module)
        _set_rope(module)
        # whether its single-token step may run compiled (`_compiled_halves`), and an MoE
        # block's sparse MLP with it (not while its experts stream from disk)
        rope = type(module.self_attn.rope).__name__
        object.__setattr__(module, "compiles", rope in TRACEABLE_ROPES)
        if moe_name is not None:
            object.__setattr__(module, "moe_compiles", not any(
                isinstance(m, (StreamedExperts, StreamedSwitchLinear))
                for _, m in module[moe_name].named_modules()))
        fused += 1
    return fused

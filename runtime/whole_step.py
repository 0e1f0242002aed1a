"""A fused model's single-token decode step as ONE compiled function (CUDA).

Decode on MLX's CUDA backend is bound by the host: every operation and every Python call
of a token costs microseconds to build and encode, and a fused block still took 7 Python
calls and 9 operations a layer around mlx-lm's cache (`fuse._compiled_halves`). Here the
whole step, embedding to final norm, is one `mx.compile`d function of (tokens, position,
every layer's key and value buffers), traced once for every position:

- each layer's q/k/v launch (norm and RoPE inside, RoPE at `position`, an array);
- the new key and value written into mlx-lm's `KVCache` buffers at `position` by the
  attention launch itself where the backend's kernel `stores_in_place` (CUDA): the
  buffers are its inputs, so nothing copies them (a scatter's output would be a copy
  whenever the last token's work still holds the buffer: generate_step's pipelining),
  and `mx.depends` on the launch's output hands them on, so MLX orders later reads
  after the write. Elsewhere `mx.put_along_axis` stores them first (the reference);
- the attention over the whole buffer, its length read on the GPU ("buffer_attention":
  `kernels/cuda_attend.py`), then o_proj, the MLP half (an MoE block's sparse one).

Ordering: MLX's CUDA graphs order a kernel after the last writer of each input buffer,
never after earlier readers, and the launch's store into the buffers is invisible to
them. So each layer's launch also takes the layer's last attention output (`after`, kept
on the cache as ATTENDED): without it, a decode fed its tokens (nothing joining one step
to the next) ran two steps' launches at once, which read rows not yet stored and counted
into one counter (issue 35: errors 0.19-0.80 against the per-layer step on the H200).
Whatever else touches the buffers (growing them, mlx-lm's step) waits for those outputs
first (`_settle`).

Python then does per token what mlx-lm's cache did per layer: swap in the new buffers and
count the offset. A new buffer size is a new trace, so the buffers grow by half their size
(at least GROW rows, in multiples of GROW): from a short prompt to 32K tokens, 8 traces
rather than 32 of a fixed step, for about a third of the buffers' rows unused just after
they grow.

It applies (`WholeStepModel.__call__`) to an inner model (`LlamaModel` and the other
families' `*Model`: embed_tokens, layers, norm) whose blocks are all fused and compile
(`fuse.fuse_blocks`; MoE blocks only while their experts stay in memory), for one new
token a sequence, every cache a plain mlx-lm `KVCache` already holding the prompt, no
embeddings passed in, on a backend with a "buffer_attention" kernel that takes the
shapes (CUDA). Anything else runs mlx-lm's model call, as before.

On by default since 2026-12-01 (TURBOQUANT_WHOLE_STEP=0 turns it off: the per-layer
compiled halves run), at any context since 2026-12-04 (TURBOQUANT_WHOLE_STEP_MAX_CONTEXT=N
hands over to mlx-lm's per-layer step from N cached tokens). On the H200 (graphs off, 8B
shape) it decoded TQ3 at 1.76-1.83x of affine-4 after a 16-token prompt, 2.13-2.29x after
4096 tokens, 2.05x after 16K and 1.82x after 32K, against 1.39-1.65x per layer
(`benchmarks/results/decode-h200-2026-12.txt` #4). Until 2026-12-04 every attention launch
stalled ~15 us on reading its position from MLX's host-written small-array pool
(`fuse._offset_array`), and the K/V were stored by scatters: it then lost to the
per-layer step past 2048 tokens.
"""

from __future__ import annotations

import functools
import itertools
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from turboquant.kernels import dispatch

from . import fuse

WHOLE_STEP = os.environ.get("TURBOQUANT_WHOLE_STEP", "1") == "1"
# cached tokens from which mlx-lm's per-layer step takes over (0: never; the whole step
# was the faster at every context measured, up to 32K, on 2026-12-04)
MAX_CONTEXT = int(os.environ.get("TURBOQUANT_WHOLE_STEP_MAX_CONTEXT", "0"))
GROW = 1024  # the least the KV buffers grow by, and the multiple their sizes take
_SLOTS = itertools.count()  # a compiled step's counter slots: (its number, layer)
BACKENDS = ("cuda",)  # where "buffer_attention" has a kernel (the reference masks MLX's sdpa)


class WholeStepModel:
    """Mixed into an inner model's class: a single-token step with plain KV caches runs
    as one compiled function (see the module docstring)."""

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None, **kwargs):
        if input_embeddings is None and not kwargs and _applies(self, inputs, cache):
            return _run(self, inputs, cache)
        if cache is not None:
            _settle(cache)
        if input_embeddings is not None:
            kwargs["input_embeddings"] = input_embeddings
        return super().__call__(inputs, cache, **kwargs)


def _applies(model, inputs: mx.array, cache) -> bool:
    """Whether this call is a step the compiled whole step takes."""
    if not (WHOLE_STEP and fuse.COMPILE_STEP and fuse.ATTENTION) or cache is None:
        return False
    if inputs.ndim != 2 or inputs.shape[1] != 1 or not model.__dict__.get("whole_step"):
        return False
    if dispatch.backend() not in BACKENDS:
        return False
    if len(cache) != len(model.layers):
        return False
    first = cache[0]  # (a compressed KV cache has no `keys`: its type is asked first)
    if type(first) is not KVCache or first.keys is None or \
            (MAX_CONTEXT and first.offset >= MAX_CONTEXT):
        return False
    for c in cache:  # a loop, not any(): a generator is a Python call a layer, every token
        if type(c) is not KVCache or c.keys is None or c.offset != first.offset:
            return False
    return _attention_fits(model, first.keys, first.values, inputs.shape[0])


def _attention_fits(model, keys: mx.array, values: mx.array, batch: int) -> bool:
    """Whether the backend's "buffer_attention" kernel takes every layer's shapes (kept
    on the model for each batch size and dtype: the buffer's length does not matter)."""
    known = model.__dict__.setdefault("_attention_fits", {})
    key = (batch, keys.dtype, values.dtype, dispatch.GENERATION[0])
    fits = known.get(key)
    if fits is None:
        # no kernel: the reference, which takes any shapes (BACKENDS says where it may run)
        kernel = dispatch.registered(dispatch.backend(), "buffer_attention")
        supports = getattr(kernel, "supports", lambda *shapes: True)
        fits = known[key] = values.dtype == keys.dtype and all(
            supports((batch, b.q_heads[0], 1, b.q_heads[1]),
                     (batch, b.kv_heads[0], keys.shape[2], b.kv_heads[1]),
                     (batch, b.kv_heads[0], keys.shape[2], b.kv_heads[2]), keys.dtype)
            for b in model.layers)
    return fits


# the attribute of a KVCache holding its layer's last attention output of the whole step:
# the next step's launch of that layer takes it as `after` (see `_build`)
ATTENDED = "tq_attended"


def _run(model, inputs: mx.array, cache) -> mx.array:
    """One step: room for the token in every buffer, the compiled function, the cache
    given its new buffers, offset and attention outputs."""
    offset = cache[0].offset
    _make_room(cache, offset + 1)
    step = fuse.compiled_for(model, functools.partial(_build, model))
    keys, values = [c.keys for c in cache], [c.values for c in cache]
    done = _attended(model, cache, inputs.shape[0])
    h, keys, values, done = step(inputs, fuse._offset_array(offset), keys, values, done)
    # the old buffers' only holder is now the step's graph: MLX updates them in place
    for i, (c, k, v) in enumerate(zip(cache, keys, values)):
        c.keys, c.values = k, v
        c.offset = offset + 1
        if done:
            setattr(c, ATTENDED, done[i])
    return h


def _attended(model, cache, batch: int) -> list:
    """Each layer's last attention output (zeros before the first step), when the kernel
    orders a launch after it (`orders_after`): else none."""
    if not getattr(dispatch.get("buffer_attention"), "orders_after", False):
        return []
    done = []
    for block, c in zip(model.layers, cache):
        last = getattr(c, ATTENDED, None)
        if last is None:
            last = mx.zeros((batch, block.q_heads[0], 1, block.kv_heads[2]), c.keys.dtype)
        done.append(last)
    return done


def _settle(cache) -> None:
    """Before anything but the whole step touches the buffers: wait for the whole step's
    last launches (their stores are invisible to MLX's graph edges: `_build`)."""
    pending = []
    for c in cache:  # a loop, not a comprehension: this runs every token of the per-layer step
        last = getattr(c, ATTENDED, None)
        if last is not None:
            pending.append(last)
            setattr(c, ATTENDED, None)
    if pending:
        mx.eval(pending)


def grown_size(size: int, rows: int) -> int:
    """The buffers' new size when `rows` rows do not fit in `size`: half as long again (at
    least GROW rows more, and `rows`), rounded up to a multiple of GROW."""
    wanted = max(rows, size + max(GROW, size // 2))
    return -(-wanted // GROW) * GROW


def _make_room(cache, rows: int) -> None:
    """Every buffer at least `rows` rows long, grown by `grown_size` (zeros), after the
    last step's stores are done (`_settle`: the copy would not wait for them)."""
    size = cache[0].keys.shape[2]
    if rows <= size:
        return
    _settle(cache)
    more = grown_size(size, rows) - size
    for c in cache:
        c.keys, c.values = _longer(c.keys, more), _longer(c.values, more)


def _longer(buffer: mx.array, rows: int) -> mx.array:
    """`buffer` (B, heads, S, D) with `rows` rows of zeros after its own."""
    b, h, _, d = buffer.shape
    return mx.concatenate([buffer, mx.zeros((b, h, rows, d), buffer.dtype)], 2)


def _build(model):
    """The compiled step of `model` (an inner model: embed_tokens, layers, norm)."""
    embed, norm, blocks = model["embed_tokens"], model["norm"], list(model.layers)
    attend = dispatch.get("buffer_attention")
    in_place = getattr(attend, "stores_in_place", False)
    slots = [(next(_SLOTS), i) for i in range(len(blocks))]  # counters no other model uses

    def step(tokens, position, keys, values, done):
        h = embed(tokens)
        at = position.reshape(1, 1, 1, 1)  # the row of every (batch, head)
        new_keys, new_values, attended = [], [], []
        for i, (block, k_buf, v_buf) in enumerate(zip(blocks, keys, values)):
            q, k, v = fuse._queries(block, h, position)
            scale = block["self_attn"].scale
            # the layer's launch after its last one (`done`): MLX's CUDA graphs would let
            # two run at once when no data joins them (a decode fed its tokens)
            after = {"after": done[i]} if done else {}
            if in_place:  # the launch stores k and v: the buffers, ordered after it
                if k.dtype != k_buf.dtype:
                    k, v = k.astype(k_buf.dtype), v.astype(v_buf.dtype)
                o = attend(q, k_buf, v_buf, position, scale, slot=slots[i], store=(k, v),
                           **after)
                k_buf, v_buf = mx.depends([k_buf, v_buf], [o])
            else:
                k_buf = mx.put_along_axis(k_buf, at, k, axis=2)
                v_buf = mx.put_along_axis(v_buf, at, v, axis=2)
                o = attend(q, k_buf, v_buf, position, scale, slot=slots[i], **after)
            h = fuse._step_after(block, o, h)
            new_keys.append(k_buf)
            new_values.append(v_buf)
            if done:
                attended.append(o)
        return norm(h), new_keys, new_values, attended

    return mx.compile(step)


def eligible(model: nn.Module) -> bool:
    """Whether every block of an inner model is fused, compiles, and (MoE) keeps its
    sparse MLP in the trace: what the whole step needs besides the call's own checks."""
    blocks = getattr(model, "layers", None)
    if not blocks or not all(k in model for k in ("embed_tokens", "norm")):
        return False
    for block in blocks:
        if not isinstance(block, (fuse.FusedDecoderBlock, fuse.FusedAttentionBlock)):
            return False
        if not block.compiles or not getattr(block, "moe_compiles", True):
            return False
    return True


@functools.cache
def _whole_class(cls: type) -> type:
    return type(f"WholeStep{cls.__name__}", (WholeStepModel, cls), {})


def enable(model: nn.Module) -> int:
    """Give every eligible inner model of `model` (after `fuse.fuse_blocks`) the whole
    step, in place; returns how many were."""
    done = 0
    for _, module in model.named_modules():
        if isinstance(module, WholeStepModel) or not eligible(module):
            continue
        module.__class__ = _whole_class(type(module))
        object.__setattr__(module, "whole_step", True)  # a flag, not a parameter
        done += 1
    return done

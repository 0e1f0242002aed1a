"""TurboQuant KV cache: mlx-lm's cache protocol over rotated, Lloyd-Max coded K/V.

    from turboquant.runtime.kvcache import make_turboquant_cache
    cache = make_turboquant_cache(model, bits_k=4, bits_v=3)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

Per layer the tokens live in three parts, in temporal order:

    sink (first `sink` tokens, fp16) | compressed (packed codes + fp16 norms) | tail (fp16)

New tokens go to the tail. Before each forward step (and when `state` is read) the tail
tokens older than the hot `window` are compressed in whole blocks: the compressed part
ends on a position sink + phase + k * block, so a compression happens once `block` more
tokens have left the window (and the context has reached `start_after`). So the queries
of one step see their own step's keys in fp16, and every query sees at least `window`
recent tokens in fp16. `make_turboquant_cache` gives each layer its own `phase`, so the
layers compress on different decode steps: a compression is 112 graph nodes a layer for
K4/V3 (67 through the compiled quantizer a GPU uses, `COMPILED_FLUSH`); on the H200 a
step with one layer's compression took ~0.8 ms more than one without, so one step
compressing all 32 layers of an 8B model would stall generation there, while one layer a
step can hide behind the GPU's work.
Only packed codes and norms are kept for the compressed part (no fp16 shadow copy).

Attention reads the parts as they are (kernels/kv_reference.py): `update_and_fetch`
returns a `KVParts` view, and the one hook in runtime/kv_attention.py sends mlx-lm's
attention to it. Importing this module installs that hook (idempotent).

`TurboQuantRotatingKVCache` is the sliding-window variant (mlx-lm's RotatingKVCache):
the first `keep` tokens stay as fp16 sinks and tokens older than `max_size` are dropped.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    RotatingKVCache,
    _BaseCache,
    create_attention_mask,
    make_prompt_cache,
)

from turboquant.kernels import dispatch
from turboquant.kernels.kv_reference import (
    CHUNK,
    KVParts,
    PackedKV,
    check_kv_bits,
    kv_quantize,
    kv_words,
)
from turboquant.stages import tensor_seed

from . import kv_attention

DEFAULTS = dict(bits_k=4, bits_v=3, sink=4, window=128, protect_layers=2, protect_bits=8,
                norm_correction=True)  # measured: docs/kv-cache.md
_STEP = 256


# A decode step's compression (a block of tokens) through one mx.compile'd kv_quantize:
# "auto" (the default) on a GPU backend, "1" everywhere, "0" never. Fewer graph nodes (a
# kv_quantize call: 54 -> 30 for 4-bit codes, 58 -> 31 for 3-bit, 111 -> 65 for 8-bit; a
# K4/V3 compression 112 -> 67) and a third of the graph-building time on the CPU; the
# same codes and norms, bit for bit on the CPU (tests/test_kv_cache.py) and within the GPU
# check's threshold-tie allowance on the H200 (tests/test_kernels_cuda_kv.py). Decode
# speed moved within the host's noise there (the 2026-11-30 run). Larger pieces (a prefill's) stay
# plain: every new shape would trace and build kernels again.
COMPILED_FLUSH = os.environ.get("TURBOQUANT_KV_COMPILED_FLUSH", "auto")


@functools.lru_cache(maxsize=None)
def _compiled_kv_quantize(bits: int, seed: int, norm_correction: bool):
    return mx.compile(functools.partial(kv_quantize, bits=bits, seed=seed,
                                        norm_correction=norm_correction))


def _quantizer(bits: int, seed: int, norm_correction: bool, block_sized: bool):
    """kv_quantize for one piece of a compression: x -> (codes, norms)."""
    compiled = COMPILED_FLUSH == "1" or (COMPILED_FLUSH == "auto" and dispatch.backend() != "cpu")
    if compiled and block_sized:
        return _compiled_kv_quantize(bits, seed, norm_correction)
    return functools.partial(kv_quantize, bits=bits, seed=seed, norm_correction=norm_correction)


def _grow(buf: mx.array | None, used: int, extra: int, shape_of: mx.array) -> mx.array:
    """A buffer with room for `extra` more rows on axis 2 after `used` (steps of 256)."""
    if buf is not None and used + extra <= buf.shape[2]:
        return buf
    n = (extra + _STEP - 1) // _STEP * _STEP
    b, h, _ = shape_of.shape[:3]
    new = mx.zeros((b, h, n, *shape_of.shape[3:]), dtype=shape_of.dtype)
    if buf is None or used == 0:
        return new
    return mx.concatenate([buf[:, :, :used], new], axis=2)


class TurboQuantKVCache(_BaseCache):
    """A KV cache that keeps tokens beyond the hot window as TurboQuant codes.

    bits_k, bits_v: 2, 3, 4 or 8. sink: leading tokens kept in fp16. window: recent tokens
    kept in fp16. block: compress once this many tokens have left the window. phase (0 <=
    phase < block): the compressed part ends on positions sink + phase + k * block (layers
    with different phases compress on different steps). start_after: compress nothing
    before the context holds this many tokens. seed: rotation seed of the layer.
    norm_correction: store the norm that makes each decoded vector's norm exact.
    """

    def __init__(
        self,
        bits_k: int = 4,
        bits_v: int = 3,
        *,
        sink: int = 4,
        window: int = 128,
        block: int = 64,
        phase: int = 0,
        start_after: int = 0,
        seed: int = 0,
        norm_correction: bool = True,
    ):
        self.bits_k = self.bits = check_kv_bits(bits_k)
        self.bits_v = check_kv_bits(bits_v)
        for name, v, lo in (("sink", sink, 0), ("window", window, 0), ("block", block, 1),
                            ("phase", phase, 0), ("start_after", start_after, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if phase >= block:
            raise ValueError(f"phase must be below block ({block}), got {phase}")
        if not 0 <= int(seed) < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        self.sink, self.window, self.block, self.start_after = sink, window, block, start_after
        self.phase = phase
        self.seed = int(seed)
        self.norm_correction = bool(norm_correction)
        self.offset = 0
        self._reset()

    def _reset(self):
        self._sink_k = self._sink_v = None
        self._tail_k = self._tail_v = None
        self._n_tail = 0
        self._comp = None  # [k_codes, k_norms, v_codes, v_norms] buffers, rows [lo, lo + n)
        self._c_lo = 0
        self._n_comp = 0
        self._packed = None  # (lo, n, PackedKV of those rows): parts() reuses it while valid
        self._set_dims(None)

    # mlx-lm's attention sends caches with `bits` to its quantized path (kv_attention hooks
    # it) and reads `bits` and `group_size` on every call: plain attributes, not properties
    # (a property is a Python call on the host of every layer's decode step)
    bits: int
    group_size: int  # one scale (norm) per head vector: k_dim, 0 before the first update

    def _set_dims(self, dims: tuple[int, int] | None):
        self._dims = dims  # (k_dim, v_dim)
        self.group_size = dims[0] if dims else 0

    # ------------------------------------------------------------------ sizes

    @property
    def sink_tokens(self) -> int:
        return 0 if self._sink_k is None else self._sink_k.shape[2]

    @property
    def compressed_tokens(self) -> int:
        return self._n_comp

    @property
    def fp16_tokens(self) -> int:
        return self.sink_tokens + self._n_tail

    def size(self) -> int:
        return self.sink_tokens + self._n_comp + self._n_tail

    def empty(self) -> bool:
        return self._dims is None

    @property
    def nbytes(self) -> int:
        """Bytes held for the tokens: fp16 parts + packed codes + fp16 norms."""
        if self._dims is None:
            return 0
        n = 0
        if self._sink_k is not None:
            n += self._sink_k.nbytes + self._sink_v.nbytes
        if self._n_tail:
            b, h = self._tail_k.shape[:2]
            item = self._tail_k.dtype.size
            n += b * h * self._n_tail * item * sum(self._dims)
        if self._n_comp:
            b, h = self._comp[0].shape[:2]
            kd, vd = self._dims
            per = 4 * (kv_words(kd, self.bits_k) + kv_words(vd, self.bits_v)) + 2 * 2
            n += b * h * self._n_comp * per
        return n

    @property
    def fp16_nbytes(self) -> int:
        """Bytes an fp16 cache would hold for the same tokens (K and V, 2 bytes each)."""
        held = [x for x in (self._sink_k, self._tail_k, *(self._comp or ())[:1]) if x is not None]
        if self._dims is None or not held:
            return 0
        b, h = held[0].shape[:2]
        return b * h * self.size() * 2 * sum(self._dims)

    # ------------------------------------------------------------------ update

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._dims is None:
            self._set_dims((keys.shape[-1], values.shape[-1]))
        n = keys.shape[2]
        if self._drops:
            self._drop_before_append(n)
        self._flush()
        take = min(max(self.sink - self.offset, 0), n) if self._n_comp + self._n_tail == 0 else 0
        if take:  # copies: a slice would keep the whole step's K/V alive
            sk, sv = mx.contiguous(keys[:, :, :take]), mx.contiguous(values[:, :, :take])
            if self._sink_k is None:
                self._sink_k, self._sink_v = sk, sv
            else:
                self._sink_k = mx.concatenate([self._sink_k, sk], axis=2)
                self._sink_v = mx.concatenate([self._sink_v, sv], axis=2)
        if take == 0:  # (a decode step)
            self._append_tail(keys, values)
        elif take < n:
            self._append_tail(keys[:, :, take:], values[:, :, take:])
        self.offset += n
        parts = self.parts()
        return parts, parts

    def _append_tail(self, k: mx.array, v: mx.array):
        m = k.shape[2]
        if self._tail_k is None or self._n_tail + m > self._tail_k.shape[2]:  # (_grow's test)
            self._tail_k = _grow(self._tail_k, self._n_tail, m, k)
            self._tail_v = _grow(self._tail_v, self._n_tail, m, v)
        self._tail_k[:, :, self._n_tail : self._n_tail + m] = k
        self._tail_v[:, :, self._n_tail : self._n_tail + m] = v
        self._n_tail += m

    _drops = False  # whether _drop_before_append does anything (the sliding-window variant)

    def _drop_before_append(self, n: int):
        """The sliding-window variant drops old tokens here."""

    def _flush(self):
        """Compress the tail tokens that have left the hot window, up to a block boundary:
        those before the last position sink + phase + k * block that has left it (none if
        none has since the last time). The test is inline: it runs every decode step."""
        anchor = self.sink + self.phase
        if self.offset - self.window < anchor or self.offset < self.start_after:
            return
        end = anchor + (self.offset - self.window - anchor) // self.block * self.block
        over = end - (self.offset - self._n_tail)  # the tail's first token's position
        if over <= 0:
            return
        kd, vd = self._dims
        b, h = self._tail_k.shape[:2]
        step = max(1, CHUNK // (b * h * max(kd, vd)))  # bound the float32 work per piece
        nc = self.norm_correction
        for a in range(0, over, step):
            e = min(a + step, over)
            quantize_k = _quantizer(self.bits_k, self.seed, nc, e - a <= self.block)
            quantize_v = _quantizer(self.bits_v, self.seed, nc, e - a <= self.block)
            kc, kn = quantize_k(self._tail_k[:, :, a:e])
            vc, vn = quantize_v(self._tail_v[:, :, a:e])
            self._append_comp([kc, kn, vc, vn])
        # copy the window out, so the fp16 copy of the compressed tokens is freed now
        self._tail_k = mx.contiguous(self._tail_k[:, :, over : self._n_tail])
        self._tail_v = mx.contiguous(self._tail_v[:, :, over : self._n_tail])
        self._n_tail -= over

    def _append_comp(self, rows: list[mx.array]):
        self._packed = None  # drop the old view first: the buffer updates can then be in place
        m = rows[0].shape[2]
        lo, n = self._c_lo, self._n_comp
        if self._comp is None or lo + n + m > self._comp[0].shape[2]:
            grown = []
            for i, r in enumerate(rows):
                live = None if self._comp is None else self._comp[i][:, :, lo : lo + n]
                grown.append(_grow(live, n, m, r))
            self._comp, self._c_lo, lo = grown, 0, 0
        for buf, r in zip(self._comp, rows):
            buf[:, :, lo + n : lo + n + m] = r
        self._n_comp += m

    def _packed_view(self) -> PackedKV | None:
        """The compressed rows as a PackedKV of slices, built again only when they changed.

        The compressed part changes once per `block` tokens, the tail on every token: the
        four slices (an MLX op each) are reused across decode steps."""
        if not self._n_comp:
            return None
        lo, n = self._c_lo, self._n_comp
        if self._packed is None or self._packed[:2] != (lo, n):
            kc, kn, vc, vn = (x[:, :, lo : lo + n] for x in self._comp)
            pk = PackedKV(kc, kn, vc, vn, self.bits_k, self.bits_v, self.seed, *self._dims)
            self._packed = (lo, n, pk)
        return self._packed[2]

    def parts(self) -> KVParts:
        """The current sink | compressed | tail view (what attention reads)."""
        held = self._packed  # (_packed_view's test inline: a decode step reuses the view)
        if held is not None and held[0] == self._c_lo and held[1] == self._n_comp:
            packed = held[2]
        else:
            packed = self._packed_view()
        tail_k = tail_v = None
        if self._n_tail:
            tail_k = self._tail_k[:, :, : self._n_tail]
            tail_v = self._tail_v[:, :, : self._n_tail]
        return KVParts(self._sink_k, self._sink_v, packed, tail_k, tail_v)

    # ------------------------------------------------------------------ masks, trim

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=window_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the newest n tokens (tail first, then compressed codes, then sinks)."""
        n = min(self.offset, n)
        left = n
        t = min(left, self._n_tail)
        self._n_tail -= t
        left -= t
        c = min(left, self._n_comp)
        self._n_comp -= c
        left -= c
        if left:
            keep = self.sink_tokens - left
            self._sink_k = self._sink_k[:, :, :keep] if keep else None
            self._sink_v = self._sink_v[:, :, :keep] if keep else None
        self.offset -= n
        return n

    # ------------------------------------------------------------------ save / load

    def _meta(self) -> dict:
        return {
            "bits_k": self.bits_k,
            "bits_v": self.bits_v,
            "sink": self.sink,
            "window": self.window,
            "block": self.block,
            "phase": self.phase,
            "start_after": self.start_after,
            "seed": str(self.seed),  # 64-bit: saved as text
            "norm_correction": self.norm_correction,
            "offset": self.offset,
            "dims": "" if self._dims is None else f"{self._dims[0]},{self._dims[1]}",
        }

    def _set_meta(self, meta: dict):
        self.bits_k, self.bits_v = int(meta["bits_k"]), int(meta["bits_v"])
        self.bits = self.bits_k
        self.sink, self.window = int(meta["sink"]), int(meta["window"])
        self.block, self.start_after = int(meta["block"]), int(meta["start_after"])
        self.phase = int(meta.get("phase", 0))  # caches saved before the 2026-11-30 run have none
        self.seed = int(meta["seed"])
        self.norm_correction = bool(meta["norm_correction"])
        self.offset = int(meta["offset"])

    @property
    def state(self) -> dict:
        """Arrays (used rows only) and settings, as mlx-lm's save_prompt_cache stores them.

        Reading the state first compresses what has left the window (what the next update
        would do anyway), so a saved cache is as small as it gets.
        """
        if self._dims is not None:
            self._flush()
        p = self.parts()
        pk = p.packed
        return {
            "sink_k": p.sink_k,
            "sink_v": p.sink_v,
            "k_codes": None if pk is None else pk.k_codes,
            "k_norms": None if pk is None else pk.k_norms,
            "v_codes": None if pk is None else pk.v_codes,
            "v_norms": None if pk is None else pk.v_norms,
            "tail_k": p.tail_k,
            "tail_v": p.tail_v,
            "meta": self._meta(),
        }

    @state.setter
    def state(self, v: dict):
        self._set_meta(v["meta"])
        self._reset()
        dims = v["meta"]["dims"]
        self._set_dims(tuple(int(x) for x in dims.split(",")) if dims else None)
        self._sink_k, self._sink_v = v["sink_k"], v["sink_v"]
        if v["k_codes"] is not None:
            self._comp = [v["k_codes"], v["k_norms"], v["v_codes"], v["v_norms"]]
            self._n_comp = self._comp[0].shape[2]
        if v["tail_k"] is not None:
            self._tail_k, self._tail_v = v["tail_k"], v["tail_v"]
            self._n_tail = self._tail_k.shape[2]

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Settings as strings (newer mlx-lm's protocol); `state` carries them too."""
        return tuple(f"{k}={v}" for k, v in self._meta().items())

    @meta_state.setter
    def meta_state(self, v):
        if v:
            meta = dict(item.split("=", 1) for item in v)
            meta["norm_correction"] = meta["norm_correction"] == "True"
            self._set_meta(meta)

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj.state = state
        if meta_state:
            obj.meta_state = meta_state
        return obj

    @classmethod
    def merge(cls, caches):
        raise NotImplementedError(
            "batched generation with the TurboQuant KV cache is not supported yet"
        )


class TurboQuantRotatingKVCache(TurboQuantKVCache):
    """Sliding-window variant: keeps the first `keep` tokens (fp16) and the last tokens.

    Like mlx-lm's RotatingKVCache, a step of N tokens sees at most max_size - 1 earlier
    tokens (keep included), and masks limit each query to its own window.
    """

    def __init__(self, max_size: int, keep: int = 0, **kwargs):
        kwargs["sink"] = keep
        super().__init__(**kwargs)
        if max_size < 1 or keep >= max_size:
            raise ValueError(f"need 0 <= keep < max_size, got keep={keep}, max_size={max_size}")
        self.max_size, self.keep = int(max_size), int(keep)

    _drops = True

    def _room(self) -> int:
        """Earlier non-sink tokens a step may still see."""
        return max(0, self.max_size - 1 - self.keep)

    def _drop_before_append(self, n: int):
        drop = self._n_comp + self._n_tail - self._room()
        if drop <= 0:
            return
        c = min(drop, self._n_comp)
        self._c_lo += c
        self._n_comp -= c
        t = drop - c
        if t:
            self._tail_k = mx.contiguous(self._tail_k[:, :, t : self._n_tail])
            self._tail_v = mx.contiguous(self._tail_v[:, :, t : self._n_tail])
            self._n_tail -= t

    def _layout_after(self, n: int) -> tuple[int, int, int]:
        """(sinks, first kept position, end) of what a step of n new tokens will see."""
        end = self.offset + n
        s = min(self.keep, end)
        return s, max(s, self.offset - self._room()), end

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        window = window_size or self.max_size
        s, lo, end = self._layout_after(N)
        if N == 1 and not return_array and end - lo <= window:
            return None  # the step sees exactly its window
        k = mx.concatenate([mx.arange(s), mx.arange(lo, end)])[None]
        q = mx.arange(self.offset, end)[:, None]
        mask = (k <= q) & ((k > q - window) | (k < self.keep))
        return mask[0] if N == 1 else mask

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def size(self) -> int:
        return min(self.offset, self.max_size)  # as mlx-lm's RotatingKVCache reports it

    def _meta(self) -> dict:
        return {**super()._meta(), "max_size": self.max_size, "keep": self.keep}

    def _set_meta(self, meta: dict):
        super()._set_meta(meta)
        self.max_size, self.keep = int(meta["max_size"]), int(meta["keep"])


# ---------------------------------------------------------------------------- construction


def _kv_slots(caches: list) -> list[tuple[object, int | None]]:
    """(container, index) of every KVCache / RotatingKVCache, in layer order."""
    slots = []
    for i, c in enumerate(caches):
        if isinstance(c, (KVCache, RotatingKVCache)):
            slots.append((caches, i))
        elif isinstance(c, CacheList):
            inner = list(c.caches)
            for j, s in enumerate(inner):
                if isinstance(s, (KVCache, RotatingKVCache)):
                    slots.append((c, j))
    return slots


def _learned_sinks(model) -> bool:
    return any(
        name.endswith("sinks") and isinstance(v, mx.array)
        for name, v in _flat_params(model.parameters())
    )


# mlx-lm attention that computes on the cached arrays itself instead of handing them to
# scaled_dot_product_attention (soft-capped or float32-upcast scores): the compressed
# cache's parts cannot reach it. tests/test_architectures.py keeps this list exact.
_OWN_ATTENTION = {"gemma2": "soft-capped attention scores", "phi": "float32 attention scores",
                  "stablelm": "float32 attention scores",
                  "plamo2": "its own attention call"}


def _check_attention_reads_parts(model) -> None:
    """Refuse, naming the reason, a model whose attention cannot read a compressed cache."""
    from mlx_lm.models.mla import MultiLinear

    for _, m in model.named_modules():
        if isinstance(m, MultiLinear):
            raise ValueError(
                "this model uses multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-4.7 "
                "Flash): mlx-lm caches the compressed latent and computes on it directly, so "
                "keep the fp16 cache for it"
            )
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family in _OWN_ATTENTION:
        raise ValueError(
            f"mlx-lm's {family} attention computes on the cached keys itself "
            f"({_OWN_ATTENTION[family]}): keep the fp16 cache for it"
        )


def _flat_params(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_params(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat_params(v, f"{prefix}.{i}")
    else:
        yield prefix, tree


def make_turboquant_cache(
    model,
    *,
    bits_k: int = DEFAULTS["bits_k"],
    bits_v: int = DEFAULTS["bits_v"],
    sink: int = DEFAULTS["sink"],
    window: int = DEFAULTS["window"],
    protect_layers: int = DEFAULTS["protect_layers"],
    protect_bits: int | None = DEFAULTS["protect_bits"],
    start_after: int = 0,
    block: int = 64,
    seed: int = 0,
    norm_correction: bool = DEFAULTS["norm_correction"],
    max_kv_size: int | None = None,
) -> list:
    """The model's own cache list with every KV cache replaced by a TurboQuant one.

    Layers whose cache is not a KV cache (linear attention, Mamba) keep theirs. The first
    and last `protect_layers` KV-bearing layers (counted in KV-layer order) use
    `protect_bits` for K and V (None or 16: the model's fp16 cache). Sliding-window layers
    (RotatingKVCache) get TurboQuantRotatingKVCache with the same size and keep. KV layer
    i of n compresses at phase i * block // n, so a decode step compresses at most
    ceil(n / block) layers.
    """
    if _learned_sinks(model):
        raise ValueError(
            "this model has learned attention sinks (e.g. gpt-oss); mlx-lm's quantized "
            "attention route does not pass them on, so keep the fp16 cache for it"
        )
    _check_attention_reads_parts(model)
    kv_attention.install(TurboQuantKVCache, TurboQuantRotatingKVCache)
    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    slots = _kv_slots(caches)
    n = len(slots)
    protected = set(range(min(protect_layers, n))) | set(range(max(0, n - protect_layers), n))
    for i, (owner, j) in enumerate(slots):
        bk, bv = bits_k, bits_v
        if i in protected:
            if protect_bits in (None, 16):
                continue
            bk, bv = max(bits_k, protect_bits), max(bits_v, protect_bits)
        kw = dict(bits_k=bk, bits_v=bv, window=window, block=block, phase=i * block // n,
                  start_after=start_after, seed=tensor_seed(seed, f"kv_cache.{i}"),
                  norm_correction=norm_correction)
        old = owner.caches[j] if isinstance(owner, CacheList) else owner[j]
        if isinstance(old, RotatingKVCache):
            new = TurboQuantRotatingKVCache(old.max_size, old.keep, **kw)
        else:
            new = TurboQuantKVCache(sink=sink, **kw)
        if isinstance(owner, CacheList):
            inner = list(owner.caches)
            inner[j] = new
            owner.caches = tuple(inner)
        else:
            owner[j] = new
    return caches


def kv_summary(caches: list) -> str:
    """One line on a cache list's TurboQuant layers: bytes held against an fp16 cache of
    the same tokens, and what one-token attention over them runs (`generate` prints it)."""
    tq = [c for c in caches if isinstance(c, TurboQuantKVCache)]
    tq += [s for c in caches if isinstance(c, CacheList) for s in c.caches
           if isinstance(s, TurboQuantKVCache)]
    held = sum(c.nbytes for c in tq)
    dense = sum(c.fp16_nbytes for c in tq)
    tokens = max((c.size() for c in tq), default=0)
    ratio = f", {dense / held:.1f}x less" if held else ""
    return (f"KV cache: {held / 2**20:.2f} MB for {tokens} tokens in {len(tq)} TurboQuant "
            f"layers (fp16: {dense / 2**20:.2f} MB{ratio}); decode attention: "
            f"{kv_attention.decode_path()}")


def kv_cache_from_args(
    model,
    bits_k: int | None = None,
    bits_v: int | None = None,
    sink: int | None = None,
    window: int | None = None,
    protect_layers: int | None = None,
    **kwargs,
) -> list | None:
    """For CLI flags (--kv-bits-k/-v, --kv-sink, --kv-window, --kv-protect-layers).

    Returns a cache list for `prompt_cache=`, or None (the fp16 cache) when neither bits
    flag is given or both are 16. A missing flag takes its default from DEFAULTS. With
    `add_kv_arguments(parser)`:

        cache = kv_cache_from_args(model, args.kv_bits_k, args.kv_bits_v, args.kv_sink,
                                   args.kv_window, args.kv_protect_layers)
    """
    if bits_k is None and bits_v is None or (bits_k == 16 and bits_v == 16):
        return None
    if bits_k == 16 or bits_v == 16:
        raise ValueError(
            "--kv-bits-k and --kv-bits-v must both be 16 (fp16 cache) or both in 2, 3, 4, 8"
        )
    opts = dict(
        bits_k=DEFAULTS["bits_k"] if bits_k is None else bits_k,
        bits_v=DEFAULTS["bits_v"] if bits_v is None else bits_v,
        sink=DEFAULTS["sink"] if sink is None else sink,
        window=DEFAULTS["window"] if window is None else window,
        protect_layers=DEFAULTS["protect_layers"] if protect_layers is None else protect_layers,
    )
    return make_turboquant_cache(model, **opts, **kwargs)


def add_kv_arguments(parser) -> None:
    """The KV cache flags of `generate` and `serve`, on an argparse parser."""
    g = parser.add_argument_group("KV cache (TurboQuant)")
    g.add_argument("--kv-bits-k", type=int, choices=(2, 3, 4, 8, 16), default=None,
                   help=f"bits per key coordinate (16: fp16 cache; default {DEFAULTS['bits_k']} "
                        "when --kv-bits-v is given, else the fp16 cache)")
    g.add_argument("--kv-bits-v", type=int, choices=(2, 3, 4, 8, 16), default=None,
                   help=f"bits per value coordinate (default {DEFAULTS['bits_v']})")
    g.add_argument("--kv-sink", type=int, default=None,
                   help=f"first tokens kept in fp16 (default {DEFAULTS['sink']})")
    g.add_argument("--kv-window", type=int, default=None,
                   help=f"recent tokens kept in fp16 (default {DEFAULTS['window']})")
    g.add_argument("--kv-protect-layers", type=int, default=None,
                   help=f"first and last N KV layers at {DEFAULTS['protect_bits']} bits "
                        f"(default {DEFAULTS['protect_layers']})")


def kv_bytes_per_token(head_dim: int, bits_k: int, bits_v: int) -> int:
    """Bytes of one token of one KV head in the compressed part (codes + norms)."""
    return 4 * (kv_words(head_dim, bits_k) + kv_words(head_dim, bits_v)) + 4


kv_attention.install(TurboQuantKVCache, TurboQuantRotatingKVCache)

__all__ = [
    "DEFAULTS",
    "TurboQuantKVCache",
    "TurboQuantRotatingKVCache",
    "add_kv_arguments",
    "kv_bytes_per_token",
    "kv_cache_from_args",
    "make_turboquant_cache",
]

"""Memory planning: will a model run on this machine, resident or with expert streaming?

    inv = inventory(open_source("Qwen/Qwen3-235B-A22B"))       # headers only
    p = project(inv, context=8192, machine=this_machine())
    p.verdict, p.expert_budget                                  # e.g. "STREAM", 12.7e9

The projection is the peak memory MLX reports for a prompt of `context` tokens followed
by generation (`mx.get_peak_memory()`), plus a reserve for everything MLX does not count:

    peak    = weights + KV cache + workspace
    need    = peak + reserve                      reserve = 1 GB + 5% of memory

- weights: every tensor as the runtime holds it (fit_weights.py): codes + fp16 scales for a
  coded weight; kept tensors at their dtype, cast to float32 when the runtime casts them
  (a Mixture-of-Experts model on the CPU backend). Coded routed experts (`.experts.E.`)
  are counted apart: expert streaming keeps only a budget of them in memory.
- KV cache (per layer kind, fit_model.py): a full-attention layer keeps
  2 x kv_heads x head_dim x act bytes per token, allocated in steps of 256 tokens (mlx-lm's
  KVCache); a sliding-window layer at most window + one prefill chunk of tokens; a
  linear-attention or Mamba layer a constant state. With `kv_bits=(K, V)` the runtime's
  TurboQuant cache: the sink tokens and the last prefill step at act bytes, the rest at
  4 x (words(K) + words(V)) + 4 bytes per head vector, the first and last two KV layers
  at 8 bits (runtime/kvcache.py's defaults).
- workspace: the largest of three phases, fitted to MLX's CPU backend (benchmarks/plan.py):
  * prefill attention: 1.15 x heads x T x S x act (unfused attention scores; 0 on a GPU,
    whose attention is fused) + 28 x hidden x T, plus the MLP tiles below;
  * prefill MLP: (8 x hidden + 24 x ffn) x T + the decode tiles of one layer's MLP
    (or of one expert), ffn = the dense MLP width, or top-k x expert width + shared experts;
    on the CPU with numba the linears and (since 2026-11-30) the experts prefill through
    its kernel: (8 x hidden + 14 x ffn) x T, no dense tiles; an MoE model keeps one
    expert's tiles in the projection (fitted: without them it falls to 0.79x of the
    measured peak at 512 tokens);
  * decode: the tiles of one layer's top-k experts (or dense MLP), or of the lm_head;
    none on Metal or the CPU with numba (GEMV kernels for the dense linears and the
    experts), only the experts' on CUDA (a GEMV kernel for the dense linears).
  T = min(prefill chunk, context) (mlx-lm prefills 2048 tokens at a time), S = context.
  A "tile" is what the reference kernels decode at once: min(weights, 4 x 4Mi) x 8.15
  bytes (2 and 4 bits, ternary) or x 20.1 bytes (3 bits: the unpacking needs more).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from turboquant.stages.fast_hadamard import AVAILABLE as NUMBA

from .fit_model import ModelShape, max_position, model_shape, round_up
from .fit_weights import Inventory, Weight

GB = 10**9
PREFILL_STEP = 2048  # mlx-lm's generate_step prefill chunk (turboquant generate uses it)
KV_STEP = 256  # mlx-lm's KVCache (and the TurboQuant cache) grow in steps of 256 tokens
RESERVE_FIXED = 1 * GB
RESERVE_FRACTION = 0.05
# The runtime's TurboQuant KV cache defaults (runtime/kvcache.py DEFAULTS).
KV_SINK, KV_WINDOW, KV_PROTECT_LAYERS, KV_PROTECT_BITS = 4, 128, 2, 8
# Reference kernels (kernels/reference.py): weights decoded per chunk, and what was measured.
CHUNK = 1 << 22
TILE_CHUNKS = 4  # chunks of one matrix seen decoded at once
TILE_BYTES = {3: 20.1}  # bytes per decoded weight; 8.15 for 2, 4 bits and ternary
TILE_BYTES_DEFAULT = 8.15
SCORE_COPIES = 1.15  # unfused attention: scores, masked and soft-maxed
ATTN_BYTES = 28  # x hidden, per prefill token, around the attention
MLP_BYTES = (8, 24)  # x hidden, x ffn width, per prefill token, around the MLP
# an MLP whose linears (or experts) prefill through numba (the CPU with numba): no float32
# GEMM copies of the reference (fitted on 2026-11-30 on pystd-dense at 256 and 512 tokens;
# pystd-moe's experts since 2026-11-30: 1.15x -> 1.10x at 256 tokens)
MLP_BYTES_NUMBA = (8, 14)
ACT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
_STORED = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_ATTENTION = (".self_attn.", ".attn.", ".attention.", ".linear_attn.", ".mixer.")
VERDICTS = ("RESIDENT", "STREAM", "WON'T FIT")


@dataclass(frozen=True)
class Machine:
    backend: str  # "cpu", "metal", "cuda"
    memory: int  # bytes a model may use
    description: str
    available: int | None = None  # free now (informative)


def physical_memory() -> tuple[int, int | None]:
    """(total, available) bytes of RAM."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            avail = None
        return int(total), avail


def backend() -> str:
    try:
        import mlx.core as mx
    except ImportError:
        return "cpu"
    if mx.default_device().type == mx.DeviceType.gpu:
        return "metal" if mx.metal.is_available() else "cuda"
    return "cpu"


def this_machine(memory_gb: float | None = None, backend_name: str | None = None) -> Machine:
    """This machine's memory for a model (Metal: its recommended working set; CUDA: the
    GPU's memory; CPU: RAM), or `memory_gb` when given."""
    be = backend_name or backend()
    total, avail = physical_memory()
    if memory_gb is not None:
        return Machine(be, int(memory_gb * GB), f"--memory-gb {memory_gb:g}, {be} backend")
    memory, what = total, f"{total / GB:.1f} GB RAM"
    if be in ("metal", "cuda") and be == backend():
        import mlx.core as mx

        info = mx.device_info()
        key = "max_recommended_working_set_size" if be == "metal" else "memory_size"
        if info.get(key):
            memory = int(info[key])
            what = (f"{memory / GB:.1f} GB Metal working set of {total / GB:.1f} GB RAM"
                    if be == "metal" else f"{memory / GB:.1f} GB GPU memory")
    return Machine(be, memory, f"this machine: {what}, {be} backend", avail)


# ------------------------------------------------------------------------ the projection


@dataclass
class Projection:
    inventory: Inventory = field(repr=False)
    shape: ModelShape
    machine: Machine
    context: int
    dtype: str  # activation dtype
    kv_bits: tuple[int, int] | None
    prefill_step: int
    weights: int
    experts: int  # routed experts' part of weights
    kv: int
    workspace: int
    phases: dict[str, int]
    reserve: int
    min_expert_budget: int  # one token's worth: top-k experts of every MoE layer
    expert_unit: int  # the largest expert of one layer (bytes)
    moe_layers: int
    notes: list[str] = field(default_factory=list)
    _kv_fn: object = field(default=None, repr=False)
    _ws_fn: object = field(default=None, repr=False)

    @property
    def nonexpert(self) -> int:
        return self.weights - self.experts

    @property
    def peak(self) -> int:
        """What MLX's peak memory should read: weights + KV cache + workspace."""
        return self.weights + self.kv + self.workspace

    @property
    def need(self) -> int:
        return self.peak + self.reserve

    @property
    def fixed(self) -> int:
        """Everything but the routed experts, reserve included."""
        return self.nonexpert + self.kv + self.workspace + self.reserve

    @property
    def verdict(self) -> str:
        if self.need <= self.machine.memory:
            return "RESIDENT"
        if self.experts and self.fixed + self.min_expert_budget <= self.machine.memory:
            return "STREAM"
        return "WON'T FIT"

    @property
    def expert_budget(self) -> int | None:
        """Memory for experts under streaming (bytes, rounded down to 0.1 GB)."""
        if self.verdict != "STREAM":
            return None
        left = min(self.experts, self.machine.memory - self.fixed)
        return max(self.min_expert_budget, int(left // (GB // 10)) * (GB // 10))

    def at_context(self, context: int) -> tuple[int, int]:
        """(KV cache, workspace) bytes at another context."""
        return self._kv_fn(context), self._ws_fn(context)

    def max_context(self, mode: str = "RESIDENT") -> int:
        """Longest context that still fits resident (or streaming with the least budget)."""
        weights = self.weights if mode == "RESIDENT" else self.nonexpert + self.min_expert_budget
        if mode != "RESIDENT" and not self.experts:
            return 0
        limit = max_position(self.inventory.config) or 1 << 20

        def fits(n: int) -> bool:
            kv, ws = self.at_context(n)
            return weights + kv + ws + self.reserve <= self.machine.memory

        if not fits(1):
            return 0
        lo, hi = 1, limit
        if fits(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def summary(self) -> str:
        """One line: the verdict and the numbers behind it."""
        b = bytes_text
        s = (f"{self.verdict}: needs {b(self.need)} (weights {b(self.weights)}, KV cache "
             f"{b(self.kv)} at {self.context} tokens, workspace {b(self.workspace)}, reserve "
             f"{b(self.reserve)}) of {b(self.machine.memory)}")
        if self.verdict == "STREAM":
            s += f"; stream experts with --expert-budget {self.expert_budget / GB:.1f}GB"
        return s

    def to_dict(self) -> dict:
        inv = self.inventory
        d = {
            "source": inv.source, "kind": inv.kind, "recipe": inv.recipe,
            "model_type": self.shape.model_type, "context": self.context,
            "dtype": self.dtype, "kv_bits": list(self.kv_bits) if self.kv_bits else None,
            "backend": self.machine.backend, "memory": self.machine.memory,
            "weights": self.weights, "experts": self.experts, "nonexpert": self.nonexpert,
            "kv_cache": self.kv, "workspace": self.workspace, "phases": dict(self.phases),
            "reserve": self.reserve, "peak": self.peak, "need": self.need,
            "verdict": self.verdict, "expert_budget": self.expert_budget,
            "min_expert_budget": self.min_expert_budget,
            "layers": {k: self.shape.count(k) for k in ("full", "sliding", "linear")},
            "problems": list(inv.problems), "notes": list(self.notes),
        }
        return d


def activation_dtype(inv: Inventory, shape: ModelShape, machine: Machine,
                     dtype: str | None) -> tuple[str, bool]:
    """(activation dtype, whether kept float tensors are cast to it), as the runtime picks:
    float32 for a Mixture-of-Experts model on the CPU backend (MLX's CPU gather_mm), else
    the stored dtype."""
    if dtype:
        return dtype, True
    if machine.backend == "cpu" and (shape.moe or any(w.is_expert for w in inv.weights)):
        return "float32", True
    return _STORED.get(inv.dtype, "bfloat16"), False


def project(inv: Inventory, context: int, machine: Machine, *, dtype: str | None = None,
            kv_bits: tuple[int, int] | None = None, prefill_step: int = PREFILL_STEP
            ) -> Projection:
    if context < 1:
        raise ValueError("context must be at least 1 token")
    shape = model_shape(inv.config)
    act_name, cast = activation_dtype(inv, shape, machine, dtype)
    act = ACT_SIZES[act_name]
    notes = list(shape.notes)
    size = act if cast else None
    weights = sum(w.resident(size) for w in inv.weights)
    # what expert streaming pages: the coded experts (kept ones, e.g. biases, stay loaded)
    experts = sum(w.resident(size) for w in inv.weights if w.is_expert and w.coded)

    groups: dict[tuple[int | None, int], int] = {}
    for w in inv.weights:
        if w.is_expert and w.coded:
            groups[(w.layer, w.expert)] = groups.get((w.layer, w.expert), 0) + w.resident(size)
    per_layer: dict[int | None, int] = {}
    for (layer, _), b in groups.items():
        per_layer[layer] = max(per_layer.get(layer, 0), b)
    top_k = shape.top_k or (1 if groups else 0)
    if groups and not shape.top_k:
        notes.append("config.json gives no experts per token: projected with 1")
    min_budget = top_k * sum(per_layer.values())

    if kv_bits and shape.model_type == "gpt_oss":
        notes.append("gpt-oss has learned attention sinks: the runtime keeps its fp16 KV "
                     "cache, so --kv-bits does not apply to it")
    tiles = _Tiles(inv.weights, shape, machine.backend)

    def kv_fn(n: int) -> int:
        return kv_cache_bytes(shape, n, act, kv_bits, min(prefill_step, n))

    def ws_fn(n: int) -> int:
        return max(_phases(shape, tiles, n, act, machine.backend, prefill_step).values())

    phases = _phases(shape, tiles, context, act, machine.backend, prefill_step)
    reserve = int(RESERVE_FIXED + RESERVE_FRACTION * machine.memory)
    limit = max_position(inv.config)
    if limit and context > limit:
        notes.append(f"context {context} is beyond the model's max_position_embeddings "
                     f"({limit})")
    return Projection(
        inventory=inv, shape=shape, machine=machine, context=context, dtype=act_name,
        kv_bits=kv_bits, prefill_step=prefill_step, weights=weights, experts=experts,
        kv=kv_fn(context), workspace=max(phases.values()), phases=phases, reserve=reserve,
        min_expert_budget=min_budget, expert_unit=max(per_layer.values(), default=0),
        moe_layers=len(per_layer), notes=notes, _kv_fn=kv_fn, _ws_fn=ws_fn,
    )


# ------------------------------------------------------------------------ KV cache


def kv_words(dim: int, bits: int) -> int:
    """uint32 words of one packed head vector (kernels/kv_reference.py's kv_words)."""
    if bits == 3:
        return -(-dim // 32) * 3
    return -(-dim // (32 // bits))


def kv_cache_bytes(shape: ModelShape, context: int, act: int, kv_bits, chunk: int) -> int:
    total = 0
    kv_index = 0
    n_kv = shape.kv_layers
    protected = set(range(min(KV_PROTECT_LAYERS, n_kv))) | \
        set(range(max(0, n_kv - KV_PROTECT_LAYERS), n_kv))
    for kind in shape.kinds:
        if kind == "linear":
            total += shape.linear_state_bytes(act)
            continue
        if kind not in ("full", "sliding"):
            continue
        tokens = context
        if kind == "sliding" and shape.sliding_window:
            tokens = min(context, shape.sliding_window + chunk)
        if kv_bits is None:
            total += round_up(tokens, KV_STEP) * shape.kv_bytes_per_token(act)
        else:
            bk, bv = kv_bits
            if kv_index in protected:
                bk, bv = max(bk, KV_PROTECT_BITS), max(bv, KV_PROTECT_BITS)
            hot = min(tokens, KV_SINK + max(KV_WINDOW, chunk))
            cold = tokens - hot
            per_head = 4 * (kv_words(shape.k_dim, bk) + kv_words(shape.v_dim, bv)) + 4
            total += hot * shape.kv_bytes_per_token(act)
            total += round_up(cold, KV_STEP) * shape.kv_heads * per_head
        kv_index += 1
    return total


# ------------------------------------------------------------------------ workspace


def tile(weights: int, bits) -> float:
    """Bytes the reference kernels hold while decoding a matrix of `weights` values."""
    return min(weights, TILE_CHUNKS * CHUNK) * TILE_BYTES.get(bits, TILE_BYTES_DEFAULT)


class _Tiles:
    """Decode tiles per layer: prefill (attention, MLP with one expert) and decode."""

    def __init__(self, weights: list[Weight], shape: ModelShape, backend_name: str):
        attn: dict = {}
        mlp: dict = {}
        mlp_single: dict = {}
        proj: dict = {}  # (layer, projection) -> (values of one expert, bits)
        head = emb = 0.0
        has_head = False
        for w in weights:
            if w.layer is None and "lm_head" in w.name:
                has_head = True
            if w.bits is None:
                continue
            if w.expert is not None:
                key = (w.layer, w.group)
                if key not in proj:  # every expert of a projection shares its spec
                    proj[key] = (w.weights, w.bits)
                continue
            t = tile(w.weights, w.bits)
            if w.layer is None:
                if "lm_head" in w.name:
                    head = max(head, t)
                elif "embed" in w.name or ".wte." in w.name:
                    emb = max(emb, t)
            elif any(m in w.name for m in _ATTENTION):
                attn[w.layer] = attn.get(w.layer, 0) + t
            else:
                mlp[w.layer] = mlp.get(w.layer, 0) + t
                mlp_single[w.layer] = max(mlp_single.get(w.layer, 0), t)
        one_expert: dict = {}  # prefill runs one expert at a time
        gathered: dict = {}  # decode gathers the top-k experts' rows together
        k = max(shape.top_k, 1)
        single = max(mlp_single.values(), default=0.0)
        for (layer, _), (n, bits) in proj.items():
            one_expert[layer] = one_expert.get(layer, 0) + tile(n, bits)
            gathered[layer] = gathered.get(layer, 0) + tile(k * n, bits)
            single = max(single, tile(k * n, bits))
        layers = set(attn) | set(mlp) | set(one_expert)
        if backend_name == "cpu" and NUMBA:  # numba prefills the dense linears: no tiles
            self.prefill = max(one_expert.values(), default=0.0)
        else:
            self.prefill = max((max(attn.get(i, 0), mlp.get(i, 0) + one_expert.get(i, 0))
                                for i in layers), default=0.0)
        body = max((mlp.get(i, 0) + gathered.get(i, 0) for i in layers), default=0.0)
        # a tied lm_head is the coded embedding used as a linear layer; its decode was
        # seen to overlap the last layer's last MLP tile
        self.head = head if has_head else emb
        decode = max(body, self.head + single) if self.head else body
        # Metal and the CPU (with numba) decode one token with their GEMV kernels, experts
        # included: no decoded tiles. CUDA has GEMV kernels for the dense linears; its
        # experts still decode the gathered rows' tiles
        if backend_name == "metal" or (backend_name == "cpu" and NUMBA):
            self.decode = 0.0
        elif backend_name == "cuda":
            self.decode = max((gathered.get(i, 0) for i in layers), default=0.0)
        else:
            self.decode = decode


def _phases(shape: ModelShape, tiles: _Tiles, context: int, act: int, backend_name: str,
            prefill_step: int) -> dict[str, int]:
    t = min(prefill_step, context)
    if shape.count("full"):
        span = context
    elif shape.count("sliding") and shape.sliding_window:
        span = min(context, shape.sliding_window + t)
    else:
        span = 0
    scores = SCORE_COPIES * shape.heads * t * span * act if backend_name == "cpu" else 0
    attention = scores + ATTN_BYTES * shape.hidden * t + tiles.prefill
    per = MLP_BYTES_NUMBA if backend_name == "cpu" and NUMBA else MLP_BYTES
    mlp = tiles.prefill + (per[0] * shape.hidden + per[1] * shape.ffn_per_token) * t
    return {"prefill_attention": int(attention), "prefill_mlp": int(mlp),
            "decode": int(tiles.decode)}


def bytes_text(n: float) -> str:
    if abs(n) >= GB / 10:
        return f"{n / GB:.2f} GB"
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e5 else f"{n / 1e3:.1f} KB"


__all__ = ["GB", "Machine", "Projection", "VERDICTS", "activation_dtype", "bytes_text",
           "kv_cache_bytes", "project", "this_machine"]

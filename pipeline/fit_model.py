"""What a model's config.json says about its run-time memory: layer kinds and KV state.

`model_shape(config)` reads the keys mlx-lm's architectures read (a `text_config` is
merged over the top level) and says, per decoder layer, what it keeps per token:

- "full": full attention, a KV cache that grows with the context;
- "sliding": sliding-window attention, a KV cache capped at `sliding_window` tokens;
- "linear": linear attention (Qwen3-Next's gated delta net) or Mamba, a constant state.

Layer kinds come from mlx-lm's own cache list for the model (its `make_cache`, built
from the weightless skeleton), or where mlx-lm cannot build it, from the config:
`layer_types` (gpt-oss, Gemma, Llama 4 style), else
`sliding_window_pattern` (Gemma 3), else `full_attention_interval` (Qwen3-Next), else
`hybrid_override_pattern` (Nemotron-H), else every layer is full attention (a bare
`sliding_window` is ignored, as mlx-lm's Llama/Qwen/Mixtral ignore it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# What each kind of layer is called in `layer_types`.
_LAYER_TYPES = {
    "full_attention": "full", "attention": "full", "global": "full",
    "sliding_attention": "sliding", "sliding": "sliding", "local": "sliding",
    "chunked_attention": "sliding",
    "linear_attention": "linear", "mamba": "linear", "mamba2": "linear", "ssm": "linear",
}
MLA_LATENT_TYPES = ("deepseek_v3", "kimi_k2")  # mlx-lm caches the compressed latent


class ShapeError(ValueError):
    """config.json lacks a key the projection needs; the message names it."""


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int  # KV "heads" per token (1 for a cached MLA latent)
    k_dim: int  # per KV head
    v_dim: int
    vocab: int
    kinds: tuple[str, ...]  # per layer: "full", "sliding", "linear", or "none"
    sliding_window: int | None
    intermediate: int  # dense MLP width (0 if none)
    moe_intermediate: int  # one expert's width (0 if not MoE)
    shared_intermediate: int  # shared experts' total width
    experts: int
    top_k: int
    state_dims: tuple[int, int] = (0, 0)  # linear layer state: (conv elements at the
    #                                       activation dtype, float32 recurrent elements)
    notes: list[str] = field(default_factory=list)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def count(self, kind: str) -> int:
        return sum(k == kind for k in self.kinds)

    @property
    def kv_layers(self) -> int:
        return self.count("full") + self.count("sliding")

    def kv_bytes_per_token(self, act: int) -> int:
        """fp16/bf16/fp32 cache: K and V of one token in one attention layer."""
        return self.kv_heads * (self.k_dim + self.v_dim) * act

    def linear_state_bytes(self, act: int) -> int:
        conv, f32 = self.state_dims
        return conv * act + f32 * 4

    @property
    def ffn_per_token(self) -> int:
        """Widest MLP activation per token: a dense MLP, or top-k experts plus shared ones."""
        return max(self.intermediate,
                   self.top_k * self.moe_intermediate + self.shared_intermediate)


def text_config(config: dict) -> dict:
    """The language model's config: `text_config` (multimodal checkpoints) over the top level."""
    inner = config.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return config


def _int(cfg: dict, *keys, default=None, required: str | None = None) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    if default is None and required:
        raise ShapeError(f"config.json has no {required} ({' / '.join(keys)})")
    return default if default is not None else 0


def _kinds_from_mlx_lm(config: dict) -> tuple[list[str], int | None] | None:
    """Layer kinds as mlx-lm's own model caches them, from its weightless skeleton: one
    entry per cache (a layer holding both, like Falcon-H1's, counts both), and the
    sliding window its RotatingKVCache keeps. None when mlx-lm cannot build the model."""
    try:
        from mlx_lm.models.cache import (ArraysCache, CacheList, KVCache, RotatingKVCache,
                                         make_prompt_cache)

        from turboquant.manifests.architecture import build_skeleton

        caches = make_prompt_cache(build_skeleton(config))
    except Exception:  # no mlx-lm model for it, or a config it cannot build: read the config
        return None
    kinds, window = [], None
    for c in caches:
        for one in (c.caches if isinstance(c, CacheList) else [c]):
            if isinstance(one, RotatingKVCache):
                kinds.append("sliding")
                window = window or one.max_size
            elif isinstance(one, KVCache):
                kinds.append("full")
            elif isinstance(one, ArraysCache):
                kinds.append("linear")
            elif type(one).__name__ == "ChunkedKVCache":  # Llama 4: at most a chunk
                kinds.append("sliding")
                window = window or one.chunk_size
            else:
                return None  # a cache kind this projection does not know
    return kinds, window


def _kinds(cfg: dict, layers: int, notes: list[str]) -> list[str]:
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) >= layers:
        out = []
        for t in types[:layers]:
            kind = _LAYER_TYPES.get(str(t).lower())
            if kind is None:
                notes.append(f"layer type {t!r} is unknown: projected as full attention")
                kind = "full"
            out.append(kind)
        return out
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1 and cfg.get("sliding_window"):
        return ["full" if i % pattern == pattern - 1 else "sliding" for i in range(layers)]
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0 and cfg.get("linear_num_value_heads"):
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(layers)]
    hybrid = cfg.get("hybrid_override_pattern")
    if isinstance(hybrid, str) and len(hybrid) == layers:
        return [{"M": "linear", "*": "full"}.get(c, "none") for c in hybrid]
    return ["full"] * layers


def _args_with_defaults(config: dict, cfg: dict) -> dict:
    """cfg over the defaults of mlx-lm's ModelArgs for the config: a release's config.json
    leaves out what the model class defaults (Falcon-H1's Mamba sizes, LFM2's conv)."""
    try:
        from turboquant.manifests.architecture import model_module

        args = vars(model_module(config).ModelArgs.from_dict(config))
    except Exception:  # no mlx-lm model for it, or a config it cannot read
        return cfg
    inner = args.get("text_config")
    if isinstance(inner, dict):
        args = {**args, **inner}
    return {**{k: v for k, v in args.items() if v is not None}, **cfg}


def _state_dims(cfg: dict) -> tuple[int, int]:
    """(conv state elements, recurrent state elements) of one linear layer, as mlx-lm's
    caches hold them (the recurrent state counted at float32)."""
    if cfg.get("linear_num_value_heads"):  # Qwen3-Next gated delta net
        hv, hk = cfg["linear_num_value_heads"], _int(cfg, "linear_num_key_heads")
        dk, dv = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim", default=4)
        conv_dim = 2 * hk * dk + hv * dv
        return (kernel - 1) * conv_dim, hv * dv * dk
    if cfg.get("mamba_num_heads") and cfg.get("hidden_size_per_head") \
            and not cfg.get("mamba_head_dim"):  # PLaMo2: only x goes through the conv
        heads, hd = cfg["mamba_num_heads"], cfg["hidden_size_per_head"]
        d_state = _int(cfg, "mamba_d_state", default=64)
        kernel = _int(cfg, "mamba_d_conv", default=4)
        return (kernel - 1) * heads * hd, heads * hd * d_state
    heads = _int(cfg, "mamba_num_heads", "mamba_n_heads", default=0)
    if not heads and cfg.get("model_type") == "mamba2":
        heads = _int(cfg, "num_heads", default=0)
    if heads:  # Mamba-2 (Nemotron-H, Falcon-H1, Mamba2): x, B and C through the conv
        hd = _int(cfg, "mamba_head_dim", "mamba_d_head", "head_dim", default=0)
        if not hd:
            hd = _int(cfg, "expand", default=2) * _int(cfg, "hidden_size") // heads
        d_state = _int(cfg, "ssm_state_size", "mamba_d_state", "state_size", default=128)
        groups = _int(cfg, "n_groups", "mamba_n_groups", default=1)
        kernel = _int(cfg, "conv_kernel", "mamba_d_conv", default=4)
        conv_dim = heads * hd + 2 * groups * d_state
        return (kernel - 1) * conv_dim, heads * hd * d_state
    if cfg.get("mamba_d_state") and cfg.get("mamba_expand"):  # Jamba's Mamba-1 layers
        inner = cfg["mamba_expand"] * _int(cfg, "hidden_size")
        return (_int(cfg, "mamba_d_conv", default=4) - 1) * inner, inner * cfg["mamba_d_state"]
    if cfg.get("state_size") and cfg.get("intermediate_size"):  # Mamba-1
        inner = cfg["intermediate_size"]
        return (_int(cfg, "conv_kernel", default=4) - 1) * inner, inner * cfg["state_size"]
    if cfg.get("conv_L_cache"):  # LFM2's short convolutions: no recurrent state
        return (cfg["conv_L_cache"] - 1) * _int(cfg, "hidden_size"), 0
    return 0, 0


def model_shape(config: dict) -> ModelShape:
    cfg = text_config(config)
    notes: list[str] = []
    model_type = str(cfg.get("model_type") or "unknown")
    hidden = _int(cfg, "hidden_size", "d_model", "n_embd", required="hidden size")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", required="layer count")
    heads = _int(cfg, "num_attention_heads", "n_head", required="attention head count")
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
    head_dim = _int(cfg, "head_dim", default=hidden // max(heads, 1))
    k_dim = v_dim = head_dim
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2)
        rope = _int(cfg, "qk_rope_head_dim")
        if model_type in MLA_LATENT_TYPES:
            kv_heads, k_dim, v_dim = 1, cfg["kv_lora_rank"], rope
        else:
            kv_heads = heads
            k_dim = _int(cfg, "qk_nope_head_dim") + rope
            v_dim = _int(cfg, "v_head_dim", default=k_dim)
    vocab = _int(cfg, "vocab_size", required="vocab_size")
    experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    top_k = _int(cfg, "num_experts_per_tok", "moe_topk", "top_k", default=0) if experts else 0
    moe_inter = _int(cfg, "moe_intermediate_size", default=0) if experts else 0
    inter = _int(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
    if experts and not moe_inter:  # Mixtral, gpt-oss: intermediate_size is per expert
        moe_inter, inter = inter, 0
    elif experts and not (cfg.get("first_k_dense_replace") or cfg.get("mlp_only_layers")
                          or cfg.get("decoder_sparse_step", 1) > 1):
        inter = 0  # no dense MLP layer
    shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    if not shared and cfg.get("n_shared_experts"):
        shared = cfg["n_shared_experts"] * moe_inter
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    from_mlx_lm = _kinds_from_mlx_lm(config)
    if from_mlx_lm is not None:
        kinds, cache_window = from_mlx_lm
        window = window or cache_window
    else:
        kinds = _kinds(cfg, layers, notes)
    if "sliding" in kinds and not window:
        notes.append("sliding-window layers without a sliding_window: projected as full")
        kinds = ["full" if k == "sliding" else k for k in kinds]
    dims = _state_dims(_args_with_defaults(config, cfg)) if "linear" in kinds else (0, 0)
    if "linear" in kinds and dims == (0, 0):
        notes.append("linear-attention layers whose state size the config does not give: "
                     "projected with no state")
    return ModelShape(
        model_type=model_type, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        k_dim=k_dim, v_dim=v_dim, vocab=vocab, kinds=tuple(kinds), sliding_window=window,
        intermediate=inter, moe_intermediate=moe_inter, shared_intermediate=shared,
        experts=experts, top_k=top_k, state_dims=dims,
        notes=notes,
    )


def max_position(config: dict) -> int | None:
    v = text_config(config).get("max_position_embeddings")
    return v if isinstance(v, int) and v > 0 else None


def round_up(n: int, step: int) -> int:
    return int(math.ceil(n / step) * step) if n > 0 else 0

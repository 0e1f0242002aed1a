"""Tiny random checkpoints of many mlx-lm architectures, in the layout they are published in.

Each config below is written here (never downloaded): hidden 64, 2 layers, 4 experts. The
weights are mlx-lm's own random initialisation of that config, written under the names
the Hugging Face release uses: per-expert tensors unstacked from mlx-lm's SwitchLinear
(`switch_mlp.gate_proj` -> `experts.{e}.gate_proj`, `w1`/`w2`/`w3` where the family names
them so), convolutions in PyTorch's (C, 1, K). `write_arch_checkpoint` checks that mlx-lm's
own `sanitize` turns the written names back into exactly its parameters, so the layout is
one mlx-lm reads as published.

    config = arch_config("qwen3_moe")
    write_arch_checkpoint(path, "qwen3_moe", seed=0)   # -> "hf" (or "mlx": its own layout)
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from checkpoints import write_tokenizer

BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=320, rms_norm_eps=1e-5,
            layer_norm_eps=1e-5, norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=256, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=64, norm_topk_prob=True)
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
           routed_scaling_factor=1.0, n_group=1, topk_group=1, topk_method="noaux_tc",
           scoring_func="sigmoid")

YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256, "mscale": 1.0,
        "mscale_all_dim": 0.0, "beta_fast": 32, "beta_slow": 1}

_QWEN35 = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
               rope_parameters={"type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5})

# model_type -> (kind, config overrides). kind: what the architecture exercises.
ARCHS: dict[str, tuple[str, dict]] = {
    # dense
    "llama": ("dense", {}),
    "mistral": ("dense", {}),
    "qwen2": ("dense", {}),
    "qwen3": ("dense", {}),
    "gemma": ("dense", {}),
    "gemma2": ("sliding", {"sliding_window": 8, "query_pre_attn_scalar": 16,
                           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3_text": ("sliding", {"sliding_window": 8, "sliding_window_pattern": 2,
                                "query_pre_attn_scalar": 16, "rope_local_base_freq": 10000.0,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    "cohere": ("dense", {"use_qk_norm": False}),
    "glm": ("dense", {}),
    "glm4": ("dense", {"attention_bias": True, "partial_rotary_factor": 0.5}),
    "phi3": ("dense", {}),
    "phi": ("dense", {"partial_rotary_factor": 0.5}),
    "starcoder2": ("dense", {"norm_epsilon": 1e-5}),
    "olmo2": ("dense", {}),
    "olmo3": ("sliding", {"sliding_window": 8,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    "internlm2": ("dense", {"bias": False}),
    "internlm3": ("dense", {}),
    "hunyuan_v1_dense": ("dense", {}),
    "mimo": ("dense", {}),
    "nanbeige": ("dense", {}),
    "seed_oss": ("dense", {}),
    "smollm3": ("dense", {}),
    "telechat3": ("dense", {}),
    "helium": ("dense", {"attention_bias": False, "mlp_bias": False}),
    "apertus": ("dense", {"mlp_bias": False, "attention_bias": False, "post_norm": False,
                          "qk_norm": True}),
    "granite": ("dense", {"logits_scaling": 2.0, "attention_multiplier": 0.25,
                          "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                          "attention_bias": False, "mlp_bias": False}),
    "stablelm": ("dense", {"use_qkv_bias": True, "partial_rotary_factor": 0.25}),
    "gpt_neox": ("dense", {"rotary_emb_base": 10000.0, "rotary_pct": 0.25}),
    "exaone4": ("sliding", {"rope_scaling": None, "sliding_window": 8,
                            "sliding_window_pattern": "LG",
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "minicpm": ("dense", {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 2.0}),
    "ernie4_5": ("dense", {"use_bias": False}),
    "gpt2": ("dense", {"n_ctx": 256, "n_embd": 64, "n_head": 4, "n_layer": 2,
                       "n_positions": 256, "layer_norm_epsilon": 1e-5}),
    # MoE
    "mixtral": ("moe", MOE),
    "qwen2_moe": ("moe", {**MOE, "shared_expert_intermediate_size": 64}),
    "qwen3_moe": ("moe", {**MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "olmoe": ("moe", MOE),
    "phimoe": ("moe", MOE),
    "minimax": ("moe", {**MOE, "shared_intermediate_size": 0, "rotary_dim": 16}),
    "glm4_moe": ("moe", {**MOE, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                         "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                         "rope_scaling": None, "use_qk_norm": True, "attention_bias": True,
                         "partial_rotary_factor": 0.5}),
    "dots1": ("moe", {**MOE, "n_shared_experts": 1, "first_k_dense_replace": 1,
                      "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1}),
    "ernie4_5_moe": ("moe", {**MOE, "use_bias": False, "moe_num_experts": 4, "moe_k": 2,
                             "moe_layer_start_index": 1, "moe_num_shared_experts": 1}),
    "bailing_moe": ("moe", {**MOE, "num_shared_experts": 1, "first_k_dense_replace": 1}),
    "bailing_moe_v3": ("mla", {**MOE, "n_group": 1, "topk_group": 1}),
    "gpt_oss": ("moe", {**MOE, "sliding_window": 8, "intermediate_size": 64,
                        "layer_types": ["sliding_attention", "full_attention"]}),
    # MLA
    "deepseek_v2": ("mla", {**MOE, **MLA, "topk_method": "greedy", "scoring_func": "softmax",
                            "rope_scaling": YARN}),
    "deepseek_v3": ("mla", {**MOE, **MLA}),
    "kimi_k2": ("mla", {**MOE, **MLA}),
    "glm4_moe_lite": ("mla", {**MOE, **MLA}),
    "minicpm3": ("mla", {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 2.0,
                         "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                         "qk_nope_head_dim": 16, "rope_scaling": YARN}),
        "deepseek": ("moe", {**MOE, "n_shared_experts": 1, "first_k_dense_replace": 1,
                         "moe_layer_freq": 1}),
    "iquestloopcoder": ("dense", {}),
    "laguna": ("moe", MOE),
    "muse_glimmer": ("dense", {}),
    "nanochat": ("dense", {}),
    "plamo3": ("dense", {}),
    "youtu_llm": ("mla", {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                          "qk_nope_head_dim": 16, "v_head_dim": 16}),
    "cohere2": ("sliding", {"sliding_window": 8, "sliding_window_pattern": 2,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "jamba": ("hybrid-mamba", {**MOE, "attn_layer_offset": 1, "attn_layer_period": 2,
                               "expert_layer_offset": 1, "expert_layer_period": 2,
                               "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
                               "mamba_dt_rank": 8}),
    "mamba": ("ssm", {"state_size": 16, "conv_kernel": 4, "use_bias": False,
                      "use_conv_bias": True, "time_step_rank": 8, "num_hidden_layers": 2}),
    "mamba2": ("ssm", {"num_heads": 8, "state_size": 16, "layer_norm_epsilon": 1e-5,
                       "conv_kernel": 4, "n_groups": 1, "use_bias": False,
                       "use_conv_bias": True, "time_step_limit": [0.0, 1e9],
                       "time_step_rank": 8, "expand": 2}),
    "plamo2": ("hybrid-mamba", {}),
    # multimodal releases, text weights (config under text_config; HF names
    # model.language_model.*, zero-centred norms, Qwen3.5-MoE's experts fused per layer)
    "qwen3_5": ("hybrid-deltanet", {"text_config": dict(_QWEN35)}),
    "qwen3_5_moe": ("hybrid-deltanet", {"text_config": {**_QWEN35, **MOE,
                                                       "shared_expert_intermediate_size": 64}}),
    # experts fused and turned in the release: Granite-MoE's input_linear (E, 2 x I, H),
    # Llama 4's gate_up_proj (E, H, 2 x I) and down_proj (E, I, H)
    "granitemoe": ("moe", {**MOE, "logits_scaling": 2.0, "attention_multiplier": 0.25,
                           "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                           "attention_bias": False}),
    "llama4": ("moe", {"text_config": {**MOE, "attention_bias": False, "attention_chunk_size": 8,
                                       "interleave_moe_layer_step": 2,
                                       "intermediate_size_mlp": 128, "rope_scaling": None,
                                       "use_qk_norm": True, "model_type": "llama4_text",
                                       "num_hidden_layers": 4,
                                       "num_experts_per_tok": 1}}),
    # hybrids
    "qwen3_next": ("hybrid-deltanet", {**MOE, "linear_num_value_heads": 4,
                                       "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                                       "linear_value_head_dim": 16,
                                       "linear_conv_kernel_dim": 4, "decoder_sparse_step": 1,
                                       "mlp_only_layers": [], "partial_rotary_factor": 0.5,
                                       "full_attention_interval": 2,
                                       "shared_expert_intermediate_size": 64}),
    "nemotron_h": ("hybrid-mamba", {"attention_bias": False, "mamba_num_heads": 4,
                                    "mamba_head_dim": 16, "mamba_proj_bias": False,
                                    "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2,
                                    "mlp_bias": False, "layer_norm_epsilon": 1e-5,
                                    "use_bias": False, "use_conv_bias": True,
                                    "hybrid_override_pattern": "M*-", "num_hidden_layers": 3,
                                    "time_step_limit": [0.0, 1e9]}),
    "falcon_h1": ("hybrid-mamba", {}),
    "lfm2": ("hybrid-conv", {"conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
                             "block_ff_dim": 128, "block_multiple_of": 32,
                             "block_ffn_dim_multiplier": 1.0,
                             "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1]}),
}

# per-expert names the published checkpoints use where they are not mlx-lm's
_EXPERT_NAMES = {
    "mixtral": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    "minimax": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    "phimoe": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
}


def arch_config(model_type: str) -> dict:
    kind, over = ARCHS[model_type]
    if "text_config" in over:
        text = {**copy.deepcopy(BASE), "model_type": f"{model_type}_text",
                **copy.deepcopy(over["text_config"])}
        return {"model_type": model_type, "text_config": text, "tie_word_embeddings": False,
                "vocab_size": text["vocab_size"]}
    cfg = {**copy.deepcopy(BASE), **copy.deepcopy(over), "model_type": model_type}
    return cfg


def mlx_weights(config: dict, seed: int = 0) -> tuple[object, dict[str, mx.array]]:
    """mlx-lm's model for `config` and its random parameters (mlx-lm's names)."""
    from turboquant.manifests.architecture import build_skeleton

    mx.random.seed(seed)
    model = build_skeleton(config)
    params = dict(tree_flatten(model.parameters()))
    mx.eval(params)
    return model, params


def hf_layout(model, model_type: str, params: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's parameters under the published names: experts unstacked, MLA's kv_b_proj
    rebuilt from embed_q / unembed_out, convolutions in PyTorch's (C, 1, K)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    if model_type == "gpt_oss":
        return _gpt_oss_layout(params)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return _qwen35_layout(model, params)
    if model_type in _FUSED_TURNED:
        return _fused_turned_layout(model_type, params)
    names = _EXPERT_NAMES.get(model_type, {})
    switch = {p for p, m in model.named_modules() if isinstance(m, SwitchLinear)}
    out = {}
    for k, v in params.items():
        path, _, kind = k.rpartition(".")
        if path in switch:
            pre, proj = path.rsplit(".", 1)
            pre = pre.rsplit(".", 1)[0]  # drop switch_mlp / experts
            for e in range(v.shape[0]):
                out[f"{pre}.experts.{e}.{names.get(proj, proj)}.{kind}"] = v[e]
        elif k.endswith("self_attn.embed_q.weight"):
            wk = v.swapaxes(-1, -2)  # (heads, nope, rank)
            wv = params[k.replace("embed_q", "unembed_out")]  # (heads, v, rank)
            kv = mx.concatenate([wk, wv], axis=1)
            out[k.replace("embed_q", "kv_b_proj")] = kv.reshape(-1, kv.shape[-1])
        elif k.endswith("self_attn.unembed_out.weight"):
            continue
        elif "conv1d.weight" in k and v.ndim == 3 and v.shape[1] != 1:
            out[k] = v.moveaxis(2, 1)
        else:
            out[k] = v
    return out


def _qwen35_layout(model, params: dict[str, mx.array]) -> dict[str, mx.array]:
    """Qwen3.5's release: model.language_model.*, norms stored zero-centred (mlx-lm adds 1),
    convolutions (C, 1, K), and a MoE layer's experts fused: gate_up_proj (E, 2 x I, H) with
    the gate half first, down_proj (E, H, I)."""
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight",
             "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
    out = {}
    for k, v in params.items():
        name = k.replace("language_model.model.", "model.language_model.", 1)
        name = name.replace("language_model.lm_head.", "lm_head.", 1)
        m = re.match(r"^(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            if m[2] == "gate_proj":
                up = params[k.replace("gate_proj", "up_proj")]
                out[f"{m[1]}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
            elif m[2] == "down_proj":
                out[f"{m[1]}.experts.down_proj"] = v
            continue
        if "conv1d.weight" in name and v.ndim == 3:
            v = v.moveaxis(2, 1)
        elif v.ndim == 1 and name.endswith(norms):
            v = v - 1.0
        out[name] = v
    return out


_FUSED_TURNED = ("granitemoe", "llama4")


def _fused_turned_layout(model_type: str, params: dict[str, mx.array]) -> dict[str, mx.array]:
    """Granite-MoE: `block_sparse_moe.input_linear.weight` (E, 2 x I, H), gate first, and
    `output_linear.weight` (E, H, I). Llama 4: `language_model.model.*`,
    `feed_forward.experts.gate_up_proj` (E, H, 2 x I), gate first, and `down_proj`
    (E, I, H): both turned (in, out)."""
    out = {}
    for k, v in params.items():
        m = re.match(r"^(.*)\.(?:switch_mlp|experts)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if not m:
            out[k] = v
            continue
        pre, proj = m.groups()
        if proj == "up_proj":
            continue
        if model_type == "granitemoe":
            if proj == "gate_proj":
                up = params[k.replace("gate_proj", "up_proj")]
                out[f"{pre}.input_linear.weight"] = mx.concatenate([v, up], axis=1)
            else:
                out[f"{pre}.output_linear.weight"] = v
            continue
        if proj == "gate_proj":
            up = params[k.replace("gate_proj", "up_proj")]
            out[f"{pre}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=1).swapaxes(1, 2)
        else:
            out[f"{pre}.experts.down_proj"] = v.swapaxes(1, 2)
    return out


def _gpt_oss_layout(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """GPT-OSS's BF16 release: experts fused and stacked, (E, in, out), gate/up interleaved."""
    out = {}
    for k, v in params.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$", k)
        if not m:
            out[k] = v
            continue
        pre, proj, kind = m.groups()
        if proj == "up_proj":
            continue
        if proj == "down_proj":
            out[f"{pre}.down_proj" + ("" if kind == "weight" else "_bias")] = \
                v.swapaxes(-1, -2) if kind == "weight" else v
            continue
        up = params[f"{pre}.up_proj.{kind}"]
        fused = mx.stack([v, up], axis=-2)  # (E, I, 2, H) or (E, I, 2)
        if kind == "weight":
            out[f"{pre}.gate_up_proj"] = fused.reshape(v.shape[0], -1, v.shape[-1]).swapaxes(-1, -2)
        else:
            out[f"{pre}.gate_up_proj_bias"] = fused.reshape(v.shape[0], -1)
    return out


def _round_trips(model, written: dict, params: dict) -> bool:
    back = model.sanitize(dict(written)) if hasattr(model, "sanitize") else written
    if set(back) != set(params):
        return False
    return all(tuple(back[k].shape) == tuple(params[k].shape) for k in params)


def write_arch_checkpoint(path, model_type: str, seed: int = 0, layout: str = "hf") -> str:
    """Write config.json, model.safetensors and a tokenizer; return the layout written.

    layout "hf" writes the published names when mlx-lm's sanitize reads them back to its
    own parameters, else mlx-lm's layout ("mlx"); layout "mlx" always writes mlx-lm's.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = arch_config(model_type)
    model, params = mlx_weights(config, seed)
    written, got = params, "mlx"
    if layout == "hf":
        hf = hf_layout(model, model_type, params)
        # mlx-lm reads GPT-OSS's MXFP4 release only; its BF16 layout is split by the recipe
        if model_type == "gpt_oss" or _round_trips(model, hf, params):
            written, got = hf, "hf"
    weights = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in written.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, config.get("vocab_size", 320))
    return got


# ---------------------------------------------------------------------------- flagships
# The big releases' tensor names, shapes, dtypes and shard counts, from their config.json as
# published (Qwen3.5: the shape its model card gives). One definition: tests/
# published_checkpoints.py writes them (sparse, or a full-size slice with random codes).

_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
_DSV3 = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
             intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
             num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
             n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
             q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
             topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
             moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
             scoring_func="sigmoid", rope_theta=10000.0, max_position_embeddings=163840,
             rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=1,
             torch_dtype="bfloat16",
             rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                           "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096},
             quantization_config=_FP8)

# name -> (config, source dtype of the linear weights, shards).
FLAGSHIPS: dict[str, tuple[dict, str, int]] = {
    "DeepSeek-V3.1": ({**_DSV3, "model_type": "deepseek_v3"}, "F8_E4M3", 163),
    # DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer
    "Kimi-K2": ({**_DSV3, "model_type": "kimi_k2", "n_routed_experts": 384,
                 "num_attention_heads": 64, "num_key_value_heads": 64,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 2.827, "vocab_size": 163840,
                 "num_nextn_predict_layers": 0, "max_position_embeddings": 131072},
                "F8_E4M3", 61),
    "GLM-4.6": (dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                     vocab_size=151552, hidden_size=5120,
                     intermediate_size=12288, moe_intermediate_size=1536,
                     num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8,
                     head_dim=128, n_routed_experts=160, n_shared_experts=1,
                     num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                     routed_scaling_factor=2.5, n_group=1, topk_group=1,
                     partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                     rope_theta=1000000.0, max_position_embeddings=202752,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, rope_scaling=None,
                     num_nextn_predict_layers=1, torch_dtype="bfloat16"), "BF16", 93),
    "Qwen3.5-397B-A17B": (dict(architectures=["Qwen3_5MoeForConditionalGeneration"],
                               model_type="qwen3_5_moe", tie_word_embeddings=False,
                               text_config=dict(
                                   model_type="qwen3_5_moe_text", vocab_size=248320,
                                   hidden_size=4096, num_hidden_layers=60,
                                   num_attention_heads=32, num_key_value_heads=2, head_dim=256,
                                   num_experts=512, num_experts_per_tok=10,
                                   moe_intermediate_size=1024,
                                   shared_expert_intermediate_size=1024,
                                   linear_num_value_heads=64, linear_num_key_heads=16,
                                   linear_key_head_dim=128, linear_value_head_dim=128,
                                   linear_conv_kernel_dim=4, full_attention_interval=4,
                                   max_position_embeddings=262144, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False,
                                   rope_parameters={"type": "default", "rope_theta": 1e7,
                                                    "partial_rotary_factor": 0.25,
                                                    "mrope_section": [11, 11, 10]})),
                          "BF16", 94),
    "MiniMax-M2": (dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax",
                        vocab_size=200064, hidden_size=3072,
                        intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
                        num_key_value_heads=8, head_dim=128, num_local_experts=256,
                        num_experts_per_tok=8, rotary_dim=64, shared_intermediate_size=0,
                        use_qk_norm=True, rope_theta=5000000.0,
                        max_position_embeddings=196608, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, torch_dtype="bfloat16",
                        quantization_config=_FP8), "F8_E4M3", 130),
    "gpt-oss-120b": (dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                          vocab_size=201088, hidden_size=2880,
                          intermediate_size=2880, num_hidden_layers=36,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                          num_local_experts=128, num_experts_per_tok=4, experts_per_token=4,
                          sliding_window=128, rope_theta=150000.0,
                          max_position_embeddings=131072, rms_norm_eps=1e-5,
                          tie_word_embeddings=False, torch_dtype="bfloat16",
                          layer_types=["sliding_attention", "full_attention"] * 18,
                          rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                        "original_max_position_embeddings": 4096,
                                        "rope_type": "yarn", "truncate": False},
                          quantization_config={"quant_method": "mxfp4",
                                               "modules_to_not_convert": [
                                                   "model.layers.*.self_attn",
                                                   "model.layers.*.mlp.router",
                                                   "model.embed_tokens", "lm_head"]}),
                     "MXFP4", 15),
}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}


def flagship_tensors(name: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor of the release, in file order (nothing built
    but mlx-lm's lazy skeleton: its arrays are never evaluated)."""
    config, dtype, _ = FLAGSHIPS[name]
    model, params = _skeleton(config)
    names = hf_layout(model, config["model_type"], params)
    mtp = config.get("num_nextn_predict_layers", 0)
    if mtp:  # the multi-token-prediction layer(s) past the last: a decoder layer and more
        last = config["num_hidden_layers"] - 1
        for k in [k for k in names if k.startswith(f"model.layers.{last}.")]:
            for i in range(mtp):
                names[k.replace(f".{last}.", f".{last + 1 + i}.", 1)] = names[k]
        h, voc = config["hidden_size"], config["vocab_size"]
        for i in range(mtp):
            n = last + 1 + i
            names[f"model.layers.{n}.embed_tokens.weight"] = mx.zeros((voc, h))
            names[f"model.layers.{n}.eh_proj.weight"] = mx.zeros((h, 2 * h))
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                names[f"model.layers.{n}.{norm}.weight"] = mx.zeros((h,))
            names[f"model.layers.{n}.shared_head.head.weight"] = mx.zeros((voc, h))
    out = []
    for k, v in names.items():
        shape = tuple(v.shape)
        if dtype == "MXFP4" and re.search(r"\.experts\.(gate_up_proj|down_proj)$", k):
            e, a, b = shape  # (E, in, out) as BF16: published as (E, out, in/32, 16) blocks
            out.append((f"{k}_blocks", (e, b, a // 32, 16), "U8"))
            out.append((f"{k}_scales", (e, b, a // 32), "U8"))
            continue
        fp8 = dtype == "F8_E4M3" and len(shape) == 2 and _fp8_weight(k)
        out.append((k, shape, "F8_E4M3" if fp8 else ("F32" if "e_score" in k else "BF16")))
        if fp8:
            out.append((f"{k}_scale_inv", (-(-shape[0] // 128), -(-shape[1] // 128)), "F32"))
    return out


def _fp8_weight(name: str) -> bool:
    """Linear weights the FP8 releases store in FP8 (not embeddings, head, norms, routers,
    nor the multi-token-prediction layer's eh_proj)."""
    return name.endswith("proj.weight") and not name.endswith("eh_proj.weight") \
        or re.search(r"\.w[123]\.weight$", name) is not None


def _skeleton(config: dict):
    from turboquant.manifests.architecture import build_skeleton

    model = build_skeleton(config)
    return model, dict(tree_flatten(model.parameters()))

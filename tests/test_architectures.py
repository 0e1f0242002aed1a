"""Every architecture in tests/arch_checkpoints.py, end to end, through the generic recipe.

For each model_type: a tiny random checkpoint in its published layout converts with no
recipe of its own, loads strictly, its logits equal mlx-lm's own model on the decoded
weights within 1e-4, and a greedy generate runs. An architecture that converts but that
mlx-lm cannot run, or that gives other logits, fails here: nothing is skipped.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from arch_checkpoints import ARCHS, arch_config, write_arch_checkpoint
from test_runtime_fixtures import decoded_from_repo

from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.plan import build_plan
from turboquant.pipeline.sources import LocalSource
from turboquant.runtime import TQLinear, TQSwitchLinear, load

TOKENS = mx.array([[1, 5, 70, 33, 200, 9, 12, 250, 17, 3, 101, 64]])
# also converted from mlx-lm's own layout (the MLX community's bf16 repos: experts stacked
# (E, out, in), MLA's embed_q / unembed_out, convolutions (C, K, 1))
MLX_LAYOUT = ["deepseek_v3", "dots1", "gemma3_text", "glm4_moe", "gpt_oss", "llama", "minimax",
              "mixtral", "nemotron_h", "qwen3_moe", "qwen3_next"]
# mlx-lm's predicate asks 8 bits for these experts' down_proj (it matches `mlp.down_proj`):
# they stay raw, per expert beside the coded gate and up
RAW_EXPERT_DOWN = {"granitemoe"}
CASES = [(t, "hf") for t in sorted(ARCHS)] + [(t, "mlx") for t in MLX_LAYOUT]


def _convert(tmp_path, model_type, layout="hf"):
    src, out = tmp_path / "src", tmp_path / "tq"
    written = write_arch_checkpoint(src, model_type, layout=layout)
    convert(ConvertOptions(source=str(src), output=str(out), group_size=32, in_process=True,
                           progress=False, check_disk=False))
    return src, out, written


@pytest.mark.parametrize("model_type,layout", CASES, ids=[f"{t}-{lay}" for t, lay in CASES])
def test_architecture_converts_loads_and_matches_mlx_lm(tmp_path, model_type, layout):
    src, out, written = _convert(tmp_path, model_type, layout)
    assert written == layout
    plan = build_plan(LocalSource(src), overrides={"group_size": 32})
    assert plan.recipe.name == "default" or model_type in _FAMILY_RECIPES
    coded = [it for it in plan.items if it.codec != "raw"]
    assert coded, "nothing was coded"

    model, tokenizer = load(out, dtype="float32")
    ref = reference(decoded_from_repo(out).decoded_weights(), arch_config(model_type))
    mods = [m for _, m in model.named_modules()]
    assert any(isinstance(m, TQLinear) or type(m).__name__ == "TQGroupedLinear" for m in mods)
    if any(isinstance(m, SwitchLinear) for _, m in ref.named_modules()):
        assert any(isinstance(m, TQSwitchLinear) for m in mods), "the experts were not coded"
        if model_type not in RAW_EXPERT_DOWN:
            assert not any(isinstance(m, SwitchLinear) for m in mods), "some experts stayed raw"
        if layout == "hf":  # expert streaming: half the experts in memory, same logits
            streamed, _ = load(out, dtype="float32", expert_budget="50%")
            assert mx.array_equal(streamed(TOKENS), model(TOKENS))
    a, b = model(TOKENS), ref(TOKENS)
    assert a.shape == b.shape
    err = (mx.abs(a - b).max() / mx.abs(b).max()).item()
    assert err < 1e-4, f"{model_type}: logits differ from mlx-lm's by {err:.2e}"

    from mlx_lm import generate

    text = generate(model, tokenizer, "hello", max_tokens=4, verbose=False)
    assert isinstance(text, str)
    if layout == "hf":
        _check_compressed_kv_cache(model, tokenizer, model_type)


# attention that cannot read a compressed cache: MLA's latent cache, learned sinks, and
# attention computing on the cached arrays itself; make_turboquant_cache refuses them
KV_REFUSED = {"deepseek_v3", "kimi_k2", "glm4_moe_lite", "bailing_moe_v3", "gpt_oss", "gemma2",
              "phi", "stablelm", "plamo2"}


def _check_compressed_kv_cache(model, tokenizer, model_type):
    """The compressed cache replaces exactly the KV caches; recurrent state stays mlx-lm's."""
    from mlx_lm import generate
    from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

    from turboquant.runtime.kvcache import (TurboQuantKVCache, TurboQuantRotatingKVCache,
                                            make_turboquant_cache)

    if model_type in KV_REFUSED:
        with pytest.raises(ValueError, match="keep the fp16 cache"):
            make_turboquant_cache(model)
        return
    cache = make_turboquant_cache(model, window=4, sink=2, block=8, protect_layers=0)
    swapped = {KVCache: TurboQuantKVCache, RotatingKVCache: TurboQuantRotatingKVCache}

    def same_slots(base, new):
        for b, c in zip(base, new):
            if isinstance(b, CacheList):
                same_slots(b.caches, c.caches)
            else:
                assert type(c) is swapped.get(type(b), type(b)), (type(b), type(c))

    base = make_prompt_cache(model)
    assert len(base) == len(cache)
    same_slots(base, cache)
    prompt = "the quick brown fox jumps over the lazy dog " * 2
    generate(model, tokenizer, prompt, max_tokens=6, verbose=False, prompt_cache=cache)


def reference(weights: dict, config: dict):
    """mlx-lm's own model for the config, loaded strictly with the decoded weights."""
    from mlx.utils import tree_flatten

    from turboquant.manifests.architecture import build_skeleton

    model = build_skeleton(config)
    if hasattr(model, "sanitize"):  # on the stored dtypes, as the runtime does
        weights = model.sanitize(dict(weights))
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    params = dict(tree_flatten(model.parameters()))
    weights = _stack_split_experts(weights, params)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model


def _stack_split_experts(weights: dict, params: dict) -> dict:
    """Per-expert tensors mlx-lm's sanitize left alone (GPT-OSS's split BF16 layout, experts
    split from mlx-lm's own layout) stacked into its `experts.P` / `switch_mlp.P`
    parameters, written out here rather than borrowed from the runtime."""
    import re

    out = {k: v for k, v in weights.items() if k in params}
    for k, v in weights.items():
        m = re.match(r"^(.*)\.experts\.(\d+)\.(\w+)\.(weight|bias)$", k)
        if k in params or not m:
            out.setdefault(k, v)
            continue
        pre, _, proj, kind = m.groups()
        target = next((t for t in (f"{pre}.experts.{proj}.{kind}",
                                   f"{pre}.switch_mlp.{proj}.{kind}") if t in params), None)
        if target is not None and target not in out:
            n = params[target].shape[0]
            out[target] = mx.stack([weights[f"{pre}.experts.{e}.{proj}.{kind}"]
                                    for e in range(n)])
    return out


_FAMILY_RECIPES = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
                   "deepseek_v2", "deepseek_v3", "gpt_oss"}


def test_at_least_forty_model_types_and_every_kind():
    kinds = {k for k, _ in ARCHS.values()}
    assert len(ARCHS) >= 40
    assert {"dense", "moe", "mla", "sliding", "hybrid-deltanet", "hybrid-mamba", "ssm"} <= kinds
    for t in ARCHS:
        config = arch_config(t)
        assert config.get("text_config", config)["hidden_size"] == 64


def test_a_tensor_sanitize_rescales_is_kept_raw_and_refused_coded(tmp_path):
    """Falcon-H1's sanitize folds multipliers into o_proj in place: the generic recipe
    keeps it raw, and a repo that codes it anyway is refused by name at load."""
    import re

    from arch_checkpoints import hf_layout, mlx_weights
    from test_runtime_fixtures import write_repo

    from turboquant.manifests.architecture import derive
    from turboquant.runtime import RepoError

    config = arch_config("falcon_h1")
    model, params = mlx_weights(config)
    weights = hf_layout(model, "falcon_h1", params)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    arch = derive(config, {k: (tuple(v.shape), "BF16") for k, v in weights.items()})
    assert arch.decisions[o_proj].action == "keep"
    assert arch.decisions["model.layers.0.feed_forward.up_proj.weight"].action == "quantize"
    write_repo(tmp_path / "tq", config, weights, group_size=32,
               codec=lambda n, v: 4 if n == o_proj else "raw")
    with pytest.raises(RepoError, match=re.escape(o_proj) + ".*in place"):
        load(tmp_path / "tq")


# ---------------------------------------------------------------------------- flagships


@pytest.mark.parametrize("name", ["DeepSeek-V3.1", "Kimi-K2", "GLM-4.6", "Qwen3.5-397B-A17B",
                                  "MiniMax-M2", "gpt-oss-120b"])
def test_flagship_release_plans_from_its_headers(tmp_path, capsys, name):
    """The release's exact tensor names, shapes, dtypes and shards (sparse files: no disk),
    planned for a 128 GB machine from the headers alone: FP8 and MXFP4 releases get a
    verdict as the BF16 ones do (their weights are read through their scales)."""
    import json

    from arch_checkpoints import FLAGSHIPS
    from published_checkpoints import write_layout

    from turboquant.plan import main

    write_layout(tmp_path / name, name)
    index = json.loads((tmp_path / name / "model.safetensors.index.json").read_text())
    total = index["metadata"]["total_size"]
    assert total > 60e9
    rc = main([str(tmp_path / name), "--memory-gb", "128", "--context", "8192", "--json"])
    d = json.loads(capsys.readouterr().out)
    config, dtype, _ = FLAGSHIPS[name]
    assert rc == 0, d["problems"]
    # more coded weight than the machine's 128 GB must stream its experts
    assert d["verdict"] == ("STREAM" if d["weights"] > 128e9 else "RESIDENT"), d["verdict"]
    source_bits = {"BF16": 16, "F8_E4M3": 8, "MXFP4": 4.25}[dtype]
    assert d["weights"] < total * 4.5 / source_bits  # 4-bit, experts 3-bit: under 4.5 bits
    kinds = d["layers"]
    assert kinds, d


def test_docs_list_every_mlx_lm_model_type_and_the_tested_ones():
    import pkgutil
    import re
    from pathlib import Path

    import mlx_lm.models

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text()
    listed = set(re.findall(r"`([A-Za-z0-9_.-]+)`", doc))
    helpers = {"base", "cache", "activations", "rope_utils", "switch_layers", "pipeline",
               "bitlinear_layers", "gated_delta", "ssm", "mla"}
    types = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
             if m.name not in helpers and not m.name.startswith("_")}
    assert types - listed == set()
    for t in ARCHS:
        assert re.search(rf"^\| `{re.escape(t)}` \| tested \|", doc, re.M), t


def test_a_policy_only_recipe_sets_bits_per_role_from_mlx_lms_reading(tmp_path):
    """A generic recipe of one's own: no rules, only bits; mlx-lm says what is what."""
    write_arch_checkpoint(tmp_path / "src", "olmoe")
    (tmp_path / "mine.toml").write_text(
        'name = "mine"\nmodel_types = ["olmoe"]\ngeneric = true\n'
        "[quant]\nbits = 3\ngroup_size = 32\n[bits]\nexpert = 2\nembeddings = \"raw\"\n")
    plan = build_plan(LocalSource(tmp_path / "src"), recipe=str(tmp_path / "mine.toml"))
    by = {it.name: it for it in plan.items}
    assert by["model.layers.0.mlp.experts.3.down_proj.weight"].bits == 2  # no [protect]
    assert by["model.layers.1.self_attn.q_proj.weight"].bits == 3
    assert by["model.embed_tokens.weight"].codec == "raw"
    assert by["model.layers.0.mlp.gate.weight"].codec == "raw"  # the router
    assert by["model.layers.0.input_layernorm.weight"].codec == "raw"
    assert plan.recipe.generic and plan.recipe.architecture is not None


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_plan_counts_the_state_mlx_lm_keeps(model_type):
    """`plan`'s layer kinds are mlx-lm's caches: KV (full or sliding window) where a KV cache
    exists, a constant state for Gated DeltaNet, Mamba and convolution layers."""
    from mlx_lm.models.cache import (ArraysCache, CacheList, KVCache, RotatingKVCache,
                                     make_prompt_cache)

    from turboquant.manifests.architecture import build_skeleton
    from turboquant.pipeline.fit_model import model_shape

    config = arch_config(model_type)
    want = {"full": 0, "sliding": 0, "linear": 0}
    for c in make_prompt_cache(build_skeleton(config)):
        for one in (c.caches if isinstance(c, CacheList) else [c]):
            kind = ("sliding" if isinstance(one, RotatingKVCache) or
                    type(one).__name__ == "ChunkedKVCache" else
                    "full" if isinstance(one, KVCache) else
                    "linear" if isinstance(one, ArraysCache) else type(one).__name__)
            want[kind] += 1
    shape = model_shape(config)
    assert {k: shape.count(k) for k in want} == want


@pytest.mark.parametrize("model_type", sorted(t for t, (kind, _) in ARCHS.items()
                                        if kind == "ssm" or kind.startswith("hybrid")))
def test_plan_sizes_a_linear_layers_state_as_mlx_lm_holds_it(model_type):
    """The conv and recurrent state of one Gated DeltaNet, Mamba-1/2 or convolution layer,
    from the config (and mlx-lm's defaults for what it leaves out), against the arrays
    mlx-lm's own cache holds after a forward pass of the tiny model."""
    from arch_checkpoints import mlx_weights
    from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

    from turboquant.pipeline.fit_model import model_shape

    config = arch_config(model_type)
    model, _ = mlx_weights(config)
    caches = make_prompt_cache(model)
    model(TOKENS[:, :3], cache=caches)
    linear = [one for c in caches for one in (c.caches if isinstance(c, CacheList) else [c])
              if isinstance(one, ArraysCache)]
    arrays = [a for a in linear[0].cache if a is not None]
    conv, recurrent = arrays[0].size, sum(a.size for a in arrays[1:])
    assert model_shape(config).state_dims == (conv, recurrent)


def test_a_tensor_mlx_lms_model_has_no_place_for_fails_the_plan_by_name(tmp_path):
    """Caught from the headers, before any conversion, as a strict load would."""
    from turboquant.pipeline.errors import PlanError

    src = tmp_path / "src"
    write_arch_checkpoint(src, "glm4_moe")
    weights = mx.load(str(src / "model.safetensors"))
    weights["model.layers.0.mlp.mystery.weight"] = mx.zeros((64, 64), dtype=mx.bfloat16)
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "pt"})
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.mystery\.weight"):
        build_plan(LocalSource(src))


@pytest.mark.parametrize("tensor,dtype", [
    ("model.layers.0.self_attn.q_proj.weight", mx.int8),  # an int8 checkpoint's weight
    ("model.norm.weight", mx.int32),
])
def test_a_non_float_tensor_the_generic_recipe_would_keep_fails_the_plan_by_name(
        tmp_path, tensor, dtype):
    """Not kept raw in silence: one line naming the file, the tensor, and what to do."""
    from turboquant.pipeline.errors import PlanError

    src = tmp_path / "src"
    write_arch_checkpoint(src, "olmo2")  # no family recipe: the generic one
    weights = mx.load(str(src / "model.safetensors"))
    weights[tensor] = weights[tensor].astype(dtype)
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "pt"})
    with pytest.raises(PlanError) as e:
        build_plan(LocalSource(src))
    [line] = [p for p in e.value.problems if tensor in p]
    assert line.startswith(f"model.safetensors: tensor {tensor!r}")
    assert "keep (or drop) pattern" in line and "\n" not in line


def test_family_recipes_keep_their_decisions_where_mlx_lm_can_load_them():
    """The veto only keeps raw what mlx-lm could not load coded (DeepSeek-V3's kv_b_proj,
    reshaped by sanitize); an unused tied head the rules code stays coded."""
    from arch_checkpoints import hf_layout, mlx_weights

    from turboquant.manifests.architecture import derive
    from turboquant.manifests.recipe import load_recipe

    config = {**arch_config("llama"), "tie_word_embeddings": True}
    _, params = mlx_weights(config)
    tensors = {k: (tuple(v.shape), "BF16") for k, v in params.items()}
    tensors["lm_head.weight"] = ((320, 64), "BF16")
    llama = load_recipe("llama").bind(derive(config, tensors))
    assert llama.resolve("lm_head.weight").action == "quantize"

    config = arch_config("deepseek_v3")
    model, params = mlx_weights(config)
    tensors = {k: (tuple(v.shape), "BF16")
               for k, v in hf_layout(model, "deepseek_v3", params).items()}
    v3 = load_recipe("deepseek_v2").bind(derive(config, tensors))
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert v3.resolve(kv_b, 1, 2).action == "keep"
    assert v3.resolve("model.layers.1.self_attn.q_b_proj.weight", 1, 2).action == "quantize"
    assert load_recipe("deepseek_v2").resolve(kv_b, 1, 2).action == "quantize"  # unbound

"""Every family the shared checkpoint factories (tests/checkpoints.py) write, loaded by the
runtime and compared with mlx-lm on the decoded weights.

The repos come from this suite's own writer (test_runtime_fixtures.write_repo), after the
splitting docs/FORMAT.md prescribes for fused experts (GPT-OSS's stacked, interleaved
gate_up_proj -> per-expert gate_proj/up_proj, transposed to (out, in)).
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint
from test_runtime_fixtures import Written, model_class, write_repo

from turboquant.runtime import TQLinear, TQSwitchLinear, load

TOKENS = mx.array([[1, 5, 70, 33, 200, 9, 12, 250] * 5])  # 40 tokens: both expert paths


def read_checkpoint(path):
    config = json.loads((path / "config.json").read_text())
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return config, weights


def split_fused_experts(weights: dict) -> dict:
    """GPT-OSS's (E, in, out) stacked experts -> per-expert (out, in), as the format and
    manifests/recipes/gpt_oss.toml say."""
    out = {}
    for k, v in weights.items():
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$", k)
        if not m:
            out[k] = v
            continue
        pre, proj, bias = m.groups()
        for e in range(v.shape[0]):
            if proj == "gate_up_proj":
                parts = {"gate_proj": v[e][..., ::2], "up_proj": v[e][..., 1::2]}
            else:
                parts = {"down_proj": v[e]}
            for name, t in parts.items():
                if bias:
                    out[f"{pre}.{e}.{name}.bias"] = t
                else:
                    out[f"{pre}.{e}.{name}.weight"] = t.T
    return out


def stack_experts(weights: dict, experts: int) -> dict:
    """Per-expert tensors stacked into mlx-lm's GPT-OSS parameters (E, out, in) / (E, out).

    (mlx-lm's gpt_oss sanitize handles only the MXFP4 release, so the oracle is built
    directly in mlx-lm's parameter names.)
    """
    out = {k: v for k, v in weights.items() if ".experts." not in k}
    for k in weights:
        m = re.match(r"(.*\.mlp\.experts)\.0\.(\w+)\.(weight|bias)$", k)
        if m:
            pre, proj, kind = m.groups()
            out[f"{pre}.{proj}.{kind}"] = mx.stack(
                [weights[f"{pre}.{e}.{proj}.{kind}"] for e in range(experts)]
            )
    return out


def codec(name, v):
    if v.ndim != 2 or not name.endswith(".weight") or "norm" in name:
        return "raw"
    if re.search(r"\.(gate|router|shared_expert_gate)\.weight$", name):
        return "raw"  # routers
    if ".experts." in name:
        return 3
    return 4


def reference(written: Written, config: dict, fused: bool):
    model_cls, args_cls = model_class(config)
    model = model_cls(args_cls.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in written.decoded_weights().items()}
    if fused:
        weights = stack_experts(weights, config["num_local_experts"])
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    return model


FAMILIES = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen3_moe", {}),
    ("qwen2_moe", {}),
    ("mixtral", {}),
    ("deepseek_v2", {"first_dense_layers": 1}),
    ("gpt_oss", {}),
]


@pytest.mark.parametrize("family,kw", FAMILIES, ids=["-".join([f, *kw]) for f, kw in FAMILIES])
def test_family_loads_and_matches_mlx_lm(tmp_path, family, kw):
    src = tmp_path / "src"
    if family in ("llama", "qwen2", "qwen3"):
        write_llama_checkpoint(src, model_type=family, hidden=64, intermediate=96, vocab=320, **kw)
    else:
        write_moe_checkpoint(src, style=family, hidden=64, intermediate=32, vocab=320, **kw)
    config, weights = read_checkpoint(src)
    fused = family == "gpt_oss"
    if fused:
        weights = split_fused_experts(weights)
    written = write_repo(tmp_path / "tq", config, weights, codec=codec, group_size=32)
    model, _ = load(tmp_path / "tq", dtype="float32")
    ref = reference(written, config, fused)
    a, b = model(TOKENS), ref(TOKENS)
    err = (mx.abs(a - b).max() / mx.abs(b).max()).item()
    assert err < 1e-4, err
    kinds = {type(m) for _, m in model.named_modules()}
    assert TQLinear in kinds
    assert (TQSwitchLinear in kinds) == (family not in ("llama", "qwen2", "qwen3"))


def test_a_quantized_custom_layer_is_refused_by_name(tmp_path):
    """DeepSeek's router (MoEGate) has a `weight` but its own forward: never swapped."""
    from turboquant.runtime import RepoError

    write_moe_checkpoint(tmp_path / "src", style="deepseek_v2", hidden=64, intermediate=32,
                         vocab=320)
    config, weights = read_checkpoint(tmp_path / "src")
    router = "model.layers.1.mlp.gate.weight"
    write_repo(tmp_path / "tq", config, weights, group_size=32,
               codec=lambda n, v: 4 if n == router else codec(n, v))
    with pytest.raises(RepoError, match=re.escape(router) + ".*MoEGate"):
        load(tmp_path / "tq")

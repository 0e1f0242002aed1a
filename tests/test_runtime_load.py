"""End to end: write a TurboQuant repo, load it with turboquant.runtime.load, compare logits
with mlx-lm running the same architecture on the decoded weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from test_runtime_fixtures import make_checkpoint, reference_model, write_repo

from turboquant.runtime import RepoError, TQEmbedding, TQLinear, TQSwitchLinear, load

SHORT = mx.array([[1, 5, 70, 33, 200, 9, 12, 250]])
LONG = mx.array([list(range(3, 123, 3))])  # 40 tokens: SwitchGLU sorts, kernels group by expert


def _close(a, b, tol=1e-4):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (mx.abs(a - b).max() / mx.abs(b).max()).item()
    assert err < tol, err


def _count(model, cls):
    return sum(isinstance(m, cls) for _, m in model.named_modules())


CASES = [
    ("llama", 2, {}),
    ("llama", 3, {}),
    ("llama", 4, {}),
    ("llama", 4, {"tie_word_embeddings": True}),  # TQEmbedding.as_linear is the head
    ("qwen3_moe", 2, {}),
    ("qwen3_moe", 3, {}),
    ("qwen3_moe", 4, {}),
    ("qwen2_moe", 3, {}),  # q/k/v biases, a shared expert
    ("mixtral", 4, {}),  # block_sparse_moe.experts.E.w1/w2/w3
]


@pytest.mark.parametrize("kind,bits,overrides", CASES)
def test_logits_match_mlx_lm_on_decoded_weights(tmp_path, kind, bits, overrides):
    config, weights = make_checkpoint(kind, **overrides)
    written = write_repo(tmp_path, config, weights, bits=bits, group_size=32)
    model, tokenizer = load(tmp_path, dtype="float32")
    ref = reference_model(written)
    for tokens in (SHORT, LONG):
        _close(model(tokens), ref(tokens))
    assert _count(model, TQLinear) > 0
    assert _count(model, TQEmbedding) == 1
    if kind != "llama":
        layers = config["num_hidden_layers"]
        assert _count(model, TQSwitchLinear) == 3 * layers
    assert tokenizer.encode("hi") is not None


def test_ternary_experts_with_4_bit_attention(tmp_path):
    config, weights = make_checkpoint("qwen3_moe")

    def codec(name, v):
        if ".experts." in name:
            return "ternary"
        router = name.endswith("mlp.gate.weight")
        return 4 if v.ndim == 2 and "norm" not in name and not router else "raw"

    written = write_repo(tmp_path, config, weights, codec=codec, group_size=64)
    model, _ = load(tmp_path)  # MoE on the CPU: float32 by default
    sw = model.model.layers[0].mlp.switch_mlp.up_proj
    assert isinstance(sw, TQSwitchLinear) and sw.bits == "ternary" and sw.num_experts == 4
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    ref = reference_model(written)
    for tokens in (SHORT, LONG):
        _close(model(tokens), ref(tokens))


def test_experts_are_stacked_in_expert_order(tmp_path):
    config, weights = make_checkpoint("mixtral")
    written = write_repo(tmp_path, config, weights, bits=4, group_size=64, num_shards=3)
    model, _ = load(tmp_path)
    sw = model.model.layers[1].block_sparse_moe.switch_mlp.down_proj
    for e in range(4):
        qt = written.quantized[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]
        assert mx.array_equal(sw.codes[e], qt.codes).item()
        assert mx.array_equal(sw.scales[e], qt.scales).item()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_all_raw_conversion_matches_mlx_lm_exactly(tmp_path, kind):
    from mlx_lm import load as mlx_load

    config, weights = make_checkpoint(kind)
    write_repo(tmp_path, config, weights, bits="raw")
    model, _ = load(tmp_path)
    ref, _ = mlx_load(str(tmp_path))
    if kind != "llama":  # MoE on the CPU: gather_mm needs float32, and load() knows it
        ref.update(tree_map(lambda p: p.astype(mx.float32), ref.parameters()))
    params = dict(tree_flatten(model.parameters()))
    assert params.keys() == dict(tree_flatten(ref.parameters())).keys()
    for tokens in (SHORT, LONG):
        assert mx.array_equal(model(tokens), ref(tokens)).item()


def test_default_dtype_keeps_bf16_for_dense_and_float32_for_moe_on_cpu(tmp_path):
    config, weights = make_checkpoint("llama")
    write_repo(tmp_path / "dense", config, weights, bits=4)
    model, _ = load(tmp_path / "dense")
    assert model.model.norm.weight.dtype == mx.bfloat16
    assert model.model.embed_tokens(SHORT).dtype == mx.bfloat16
    assert model(SHORT).dtype == mx.bfloat16
    config, weights = make_checkpoint("qwen3_moe")
    write_repo(tmp_path / "moe", config, weights, bits=4)
    model, _ = load(tmp_path / "moe")
    assert model.model.norm.weight.dtype == mx.float32
    assert model(SHORT).dtype == mx.float32


def test_mlx_lm_generate_runs_on_the_loaded_model(tmp_path):
    from mlx_lm import generate, stream_generate

    config, weights = make_checkpoint("qwen3_moe")
    written = write_repo(tmp_path, config, weights, bits=4)
    model, tokenizer = load(tmp_path)
    prompt = tokenizer.encode("def f(x):")
    first = mx.argmax(reference_model(written)(mx.array([prompt]))[0, -1]).item()
    steps = list(stream_generate(model, tokenizer, prompt, max_tokens=6))
    assert steps[0].token == first
    assert len(steps) <= 6 and steps[-1].generation_tokens == len(steps)
    assert isinstance(generate(model, tokenizer, "x = ", max_tokens=4), str)


def test_load_by_hub_repo_id_and_offline_from_the_cache(tmp_path, hub_server):
    config, weights = make_checkpoint("llama")
    write_repo(tmp_path / "repo", config, weights, bits=3)
    api = hub_server.api()
    api.create_repo("test-user/tiny-tq")
    api.upload_folder(repo_id="test-user/tiny-tq", folder_path=tmp_path / "repo")
    model, _ = load("test-user/tiny-tq", dtype="float32")
    local, _ = load(tmp_path / "repo", dtype="float32")
    assert mx.array_equal(model(SHORT), local(SHORT)).item()
    with hub_server.offline():
        again, _ = load("test-user/tiny-tq", dtype="float32")
        assert mx.array_equal(again(SHORT), local(SHORT)).item()
    with pytest.raises(RepoError, match="test-user/absent"):
        load("test-user/absent")


def test_partial_download_names_the_missing_shard(tmp_path, hub_server):
    from huggingface_hub import snapshot_download

    config, weights = make_checkpoint("llama")
    write_repo(tmp_path / "repo", config, weights, bits=4)
    api = hub_server.api()
    api.create_repo("test-user/partial")
    api.upload_folder(repo_id="test-user/partial", folder_path=tmp_path / "repo")
    snapshot = snapshot_download("test-user/partial")
    (tmp_path / "repo" / "model-00002-of-00002.safetensors").unlink()  # not the cache's
    next(p for p in Path(snapshot).glob("model-00002-*.safetensors")).unlink()
    with hub_server.offline():  # the error names the file to fetch again
        with pytest.raises(RepoError, match="model-00002-of-00002.safetensors"):
            load("test-user/partial")
    model, _ = load("test-user/partial")  # online, the download completes
    assert model(SHORT).shape == (1, 8, config["vocab_size"])


# ---------------------------------------------------------------------------- errors


@pytest.fixture
def small(tmp_path):
    config, weights = make_checkpoint("llama")
    return tmp_path, config, weights


def test_missing_tensor_is_named(small):
    path, config, weights = small
    name = "model.layers.1.post_attention_layernorm.weight"
    write_repo(path, config, weights, bits=4, drop=(name,))
    with pytest.raises(RepoError, match=f"missing tensor {re.escape(name)}"):
        load(path)


def test_missing_quantized_tensor_is_named(small):
    path, config, weights = small
    write_repo(path, config, weights, bits=4, drop=("model.layers.0.mlp.up_proj.weight",))
    with pytest.raises(RepoError, match=r"missing tensor model\.layers\.0\.mlp\.up_proj"):
        load(path)


def test_unexpected_raw_tensor_is_named(small):
    path, config, weights = small
    extra = {"model.layers.0.extra_norm.weight": mx.ones((96,))}
    write_repo(path, config, weights, bits=4, extra=extra)
    with pytest.raises(RepoError, match=r"unexpected tensor model\.layers\.0\.extra_norm\.weight"):
        load(path)


def test_unexpected_quantized_tensor_is_named(small):
    path, config, weights = small
    extra = {"model.layers.0.mlp.extra_proj.weight": mx.random.normal((32, 96))}
    write_repo(path, config, weights, bits=4, extra=extra)
    with pytest.raises(RepoError, match=f"unexpected tensor {re.escape(next(iter(extra)))}"):
        load(path)


def test_missing_shard_is_named(small):
    path, config, weights = small
    write_repo(path, config, weights, bits=4)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(RepoError, match="model-00002-of-00002.safetensors is missing"):
        load(path)


def test_truncated_shard_is_named(small):
    path, config, weights = small
    write_repo(path, config, weights, bits=4)
    shard = path / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(RepoError, match="model-00001-of-00002.safetensors: .* header says"):
        load(path)


def test_index_and_manifest_must_agree(small):
    path, config, weights = small
    write_repo(path, config, weights, bits=4)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RepoError, match=r"unexpected tensor model\.ghost\.weight"):
        load(path)


def test_missing_manifest_and_plain_checkpoints_are_explained(small):
    path, config, weights = small
    write_repo(path, config, weights, bits=4)
    (path / "manifest.parquet").unlink()
    with pytest.raises(RepoError, match="missing manifest.parquet"):
        load(path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RepoError, match="not 'turboquant'"):
        load(path)


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(RepoError, match="does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(RepoError, match="does not exist"):
        load("./relative/nowhere/at/all")


def test_newer_format_version_is_refused(small):
    path, config, weights = small
    write_repo(path, config, weights, bits=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RepoError, match="format_version 3"):
        load(path)
    shutil.rmtree(path)

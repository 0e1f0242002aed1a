"""End to end with the real writer: checkpoints converted by the pipeline (without Prefect,
in process), loaded by the runtime, compared with mlx-lm on the same repo's decoded weights
(read back with the codec alone, test_runtime_fixtures.decoded_from_repo)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from test_runtime_fixtures import decoded_from_repo, reference_model

from turboquant.runtime import TQEmbedding, TQSwitchLinear, load

convert_mod = pytest.importorskip("turboquant.pipeline.convert")
checkpoints = pytest.importorskip("checkpoints")

TOKENS = mx.array([[1, 5, 70, 33, 200, 9, 12, 250] * 5])
REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "models"


def convert(src, out, **kw):
    opts = convert_mod.ConvertOptions(
        source=str(src), output=str(out), in_process=True, progress=False,
        check_disk=False, **kw,
    )
    return convert_mod.convert(opts)


def _err(a, b):
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    checkpoints.write_llama_checkpoint(root / "llama", hidden=64, intermediate=96, vocab=320)
    # experts' down_proj has in = intermediate: at least one group, or the recipe keeps it raw
    checkpoints.write_moe_checkpoint(root / "moe", style="qwen3_moe", hidden=64, intermediate=64,
                                     vocab=320)
    return root


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dense_conversion_matches_mlx_lm(sources, tmp_path, bits):
    convert(sources / "llama", tmp_path, bits=bits, protect_layers=0, embeddings_bits=bits,
            lm_head_bits=bits)
    model, _ = load(tmp_path, dtype="float32")
    assert isinstance(model.model.embed_tokens, TQEmbedding)
    assert model.model.layers[0].self_attn.q_proj.bits == bits
    assert _err(model(TOKENS), reference_model(decoded_from_repo(tmp_path))(TOKENS)) < 1e-4


@pytest.mark.parametrize("expert_bits", [2, 3, 4, "ternary"])
def test_moe_conversion_matches_mlx_lm(sources, tmp_path, expert_bits):
    convert(sources / "moe", tmp_path, bits=4, expert_bits=expert_bits, protect_layers=0)
    model, _ = load(tmp_path)  # MoE on the CPU: float32
    sw = model.model.layers[1].mlp.switch_mlp.down_proj
    assert isinstance(sw, TQSwitchLinear) and sw.bits == expert_bits
    assert _err(model(TOKENS), reference_model(decoded_from_repo(tmp_path))(TOKENS)) < 1e-4


def test_all_raw_conversion_matches_mlx_lm_exactly(sources, tmp_path):
    from mlx_lm import load as mlx_load

    bundled = Path(convert_mod.__file__).parents[1] / "manifests" / "recipes" / "qwen_moe.toml"
    text, n = re.subn(r"(?m)^keep = .*$", "keep = ['.*']", bundled.read_text())
    assert n == 1, "the qwen_moe recipe changed shape: update this test"
    recipe = tmp_path / "keep_all.toml"
    recipe.write_text(text.replace('name = "qwen_moe"', 'name = "keep_all"'))
    summary = convert(sources / "moe", tmp_path / "out", recipe=str(recipe))
    assert summary.repo.coded_tensors == 0
    model, _ = load(tmp_path / "out")
    ref, _ = mlx_load(str(tmp_path / "out"))
    ref.update(tree_map(lambda p: p.astype(mx.float32), ref.parameters()))
    assert mx.array_equal(model(TOKENS), ref(TOKENS)).item()


@pytest.mark.skipif(not (REFERENCE / "pystd-dense").is_dir(), reason="reference models absent")
@pytest.mark.parametrize("name", ["pystd-dense", "pystd-moe"])
def test_reference_model_at_4_bits_stays_close_to_bf16(tmp_path, name):
    """A model trained on real data (Python source): 4-bit TurboQuant keeps its predictions."""
    from mlx_lm import load as mlx_load

    convert(REFERENCE / name, tmp_path, bits=4, expert_bits=4)
    model, tokenizer = load(tmp_path, dtype="float32")
    ref, _ = mlx_load(str(REFERENCE / name))
    ref.update(tree_map(lambda p: p.astype(mx.float32), ref.parameters()))
    text = (REFERENCE.parent / "heldout.txt").read_text()[:2000]
    tokens = mx.array([tokenizer.encode(text)[:256]])

    def nll(m):
        logits = m(tokens[:, :-1]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -mx.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean().item()

    q, b = nll(model), nll(ref)
    print(f"{name}: 4-bit NLL {q:.4f}, bf16 {b:.4f}")
    assert q < b * 1.15, (q, b)  # a few percent in practice; a broken kernel is far off

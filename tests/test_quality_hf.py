"""benchmarks/quality.py --model PATH (benchmarks/quality_hf.py) on the dense reference model:
one row of held-out pydoc text, the main and mechanism tables."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quality_hf  # noqa: E402

MODEL = ROOT / "reference" / "models" / "pystd-dense"


@pytest.fixture
def short_rows(monkeypatch):
    """Held-out rows of 128 tokens instead of the benchmark's 512: the same tables and code,
    each forward pass of the reference model a quarter of the work (MLX's Linux wheel runs
    its matmuls on the reference BLAS)."""
    monkeypatch.setattr(quality_hf, "SEQ", 128)


@pytest.mark.slow
def test_main_and_mechanism_tables(short_rows, tmp_path, capsys):
    out = tmp_path / "report.txt"
    argv = ["--model", str(MODEL), "--bits", "3", "--windows", "1", "--ablation-windows", "1",
            "--tables", "main,mechanism", "--methods", "affine,tq,tq eq-s", "--out", str(out)]
    assert quality_hf.main(argv) == 0
    report = out.read_text()
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[1] == "eq-s" else ""):
            line.split() for line in report.splitlines()
            if line.startswith("  ") and line.split()[0] in ("source", "affine-3", "tq-3")
            and ": dppl" not in line}
    assert set(rows) == {"source", "affine-3", "tq-3", "tq-3 eq-s"}
    # no weight of the near-Gaussian reference model has a small column: eq-s is format 1
    # (bits/w, ppl, dppl, /affine, KL, top-1; not the encode seconds that may follow)
    assert rows["tq-3 eq-s"][2:8] == rows["tq-3"][1:7]
    assert float(rows["tq-3"][1]) < float(rows["affine-3"][1])  # bits/w: 3.25 vs 3.5
    assert "tq-3 eq-s: dppl" in report and "v_proj" in report and "small-col" in report
    assert "reproduce: " in capsys.readouterr().out


def test_tensor_classes_and_codec_bytes():
    import mlx.core as mx
    import numpy as np

    assert quality_hf.tensor_class("model.layers.3.self_attn.v_proj.weight") == "v_proj"
    assert quality_hf.tensor_class("model.embed_tokens.weight") == "embed"
    rng = np.random.default_rng(0)
    w = mx.array((rng.standard_normal((64, 256)) * np.exp(rng.normal(0, 1, 256))).astype(
        np.float32))
    _, plain, _ = quality_hf.turboquant(w, 3, "x", False)
    _, eq, _ = quality_hf.turboquant(w, 3, "x", True)
    assert plain == 64 * 256 * 3 // 8 + 64 * 4 * 2 and eq == plain + 2 * 256
    _, nbytes = quality_hf.affine(w, 3)
    assert nbytes == 64 * 256 * 3 // 8 + 2 * 2 * 64 * 4


def test_trellis_options():
    import mlx.core as mx
    import numpy as np

    base, kw = quality_hf.variant("tq eq-s trellis L12 on=v_proj+down_proj")
    assert base == "tq eq-s" and kw == {"codec": "trellis", "state_bits": 12,
                                        "trellis_classes": ["v_proj", "down_proj"]}
    assert quality_hf.scalar_peer("tq eq-s trellis L12 on=v_proj+down_proj") == "tq eq-s"
    w = mx.array(np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32))
    scalar, nbytes, e_scalar = quality_hf.turboquant(w, 3, "x", False)
    _, t_bytes, e_trellis = quality_hf.turboquant(w, 3, "x", False, codec="trellis",
                                                  state_bits=12)
    assert t_bytes == nbytes and e_trellis < 0.7 * e_scalar


def test_the_trellis_repo_recipe_is_the_llama_recipe_with_the_trellis_code(tmp_path):
    from turboquant.manifests.recipe import load_recipe

    recipe = load_recipe(str(quality_hf.trellis_recipe(tmp_path, state_bits=12)))
    res = recipe.resolve("model.layers.3.self_attn.v_proj.weight", 3, 10)
    assert res.trellis == (12, 1, 256, 1) and res.column_min_ratio is not None
    assert "{recipe}" in quality_hf.REPO_FLAGS["tq-repo trellis"]


def test_gamma_raw_and_calibrated_options():
    import mlx.core as mx
    import numpy as np

    base, kw = quality_hf.variant("tq eq-s a-0.5 raw=layers.1.self_attn+down_proj")
    assert base == "tq eq-s" and kw == {"gamma_power": -0.5,
                                        "raw": ["layers.1.self_attn", "down_proj"]}
    assert quality_hf.variant("tq eq cal") == ("tq eq", {"cal": True})
    source = {"model.layers.2.input_layernorm.weight": mx.ones((4,)),
              "model.layers.2.post_attention_layernorm.weight": mx.zeros((4,))}
    assert quality_hf.norm_weight(source, "model.layers.2.self_attn.v_proj.weight") is \
        source["model.layers.2.input_layernorm.weight"]
    assert quality_hf.norm_weight(source, "model.layers.2.mlp.up_proj.weight") is \
        source["model.layers.2.post_attention_layernorm.weight"]
    assert quality_hf.norm_weight(source, "model.layers.2.mlp.down_proj.weight") is None
    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((32, 256)).astype(np.float32))
    gamma = mx.array(np.exp(rng.normal(0, 1, 256)).astype(np.float32))
    plain, nbytes, _ = quality_hf.turboquant(w, 4, "x", False)
    folded, g_bytes, _ = quality_hf.turboquant(w, 4, "x", False, gamma=gamma, gamma_power=-0.5)
    assert g_bytes == nbytes + 2 * 256  # the t vector
    assert not np.array_equal(np.asarray(plain), np.asarray(folded))
    # calibrated: a channel with 100x the activation gets a smaller error than plain coding
    energy = np.ones(256)
    energy[7] = 1e4
    cal, c_bytes, _ = quality_hf.turboquant(w, 4, "x", True, energy=energy)
    err = lambda d: float(((np.asarray(d) - np.asarray(w))[:, 7] ** 2).sum())  # noqa: E731
    assert c_bytes == g_bytes and err(cal) < 0.5 * err(plain)


@pytest.mark.slow
def test_layers_table(short_rows, tmp_path):
    out = tmp_path / "report.txt"
    argv = ["--model", str(MODEL), "--tables", "layers", "--ablation-windows", "1",
            "--ablation-bits", "4", "--layer-classes", "v_proj", "--out", str(out)]
    assert quality_hf.main(argv) == 0
    report = out.read_text()
    assert "all coded (tq eq-s, 4 bits)" in report
    assert "  embed " in report and "model.layers.0 v_proj" in report


def test_the_column_rule_recipe_is_the_llama_recipe_without_neuron_ratio(tmp_path):
    from turboquant.manifests.recipe import load_recipe

    recipe = load_recipe(str(quality_hf.column_rule_recipe(tmp_path)))
    res = recipe.resolve("model.layers.3.mlp.down_proj.weight", 3, 10)
    assert res.neuron_ratio is None and res.column_min_ratio == 0.5
    assert load_recipe("llama").resolve("model.layers.3.mlp.down_proj.weight", 3,
                                        10).neuron_ratio == 8.0


def test_alloc_options():
    assert quality_hf.alloc_options("tq-repo alloc=3.5") == (3.5, [3, 4], None)
    assert quality_hf.alloc_options("tq-repo alloc=3 choices=2+3+4 cal=text") == \
        (3.0, [2, 3, 4], "text")


@pytest.mark.slow
def test_an_allocated_repo_against_the_uniform_one(short_rows, tmp_path):
    """`tq-repo alloc=B`: tq-repo-b's folder allocated by `turboquant allocate`, converted
    again, measured on the same rows, with its paired difference to tq-repo-b."""
    out = tmp_path / "report.txt"
    argv = ["--model", str(MODEL), "--bits", "3", "--windows", "1", "--tables", "main",
            "--methods", "tq-repo,tq-repo alloc=3.4", "--work", str(tmp_path / "w"),
            "--out", str(out)]
    assert quality_hf.main(argv) == 0
    report = out.read_text()
    row = next(ln.split() for ln in report.splitlines() if ln.startswith("  tq-repo-3 alloc"))
    assert 3.3 < float(row[2]) <= 3.4  # bits/w
    assert "tq-repo-3 alloc=3.4 against tq-repo-3: ppl" in report
    assert (tmp_path / "w" / "pystd-dense-alloc3.4-3+4-from3.toml").exists()

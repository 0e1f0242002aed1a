"""benchmarks/quality.py --model PATH --tables tensors (benchmarks/quality_tensors.py) on the
dense reference model: the table runs, its codec is the converter's, and the no-decode form
of the output error agrees with the decoded one."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quality_hf  # noqa: E402
import quality_tensors  # noqa: E402

MODEL = ROOT / "reference" / "models" / "pystd-dense"


@pytest.fixture
def short_rows(monkeypatch):
    """Held-out and calibration rows of 128 tokens instead of the benchmark's 512: the same
    table and code, each forward pass of the reference model a quarter of the work (MLX's
    Linux wheel runs its matmuls on the reference BLAS)."""
    monkeypatch.setattr(quality_hf, "SEQ", 128)
    monkeypatch.setattr(quality_tensors, "SEQ", 128)


def test_tensors_table(short_rows, tmp_path):
    out = tmp_path / "report.txt"
    argv = ["--model", str(MODEL), "--windows", "1", "--ablation-windows", "1",
            "--tables", "tensors", "--tensor-bits", "4", "--tensor-layers", "0,7",
            "--cal-rows", "2", "--work", str(tmp_path / "work"), "--out", str(out)]
    assert quality_hf.main(argv) == 0
    report = out.read_text()
    assert "4 bits, 15 tensors, each alone coded" in report
    for k in ("rel_mse", "df", "cal", "calrel"):
        assert any(line.split()[:1] == [k] for line in report.splitlines()), k
    ratio = next(line for line in report.splitlines() if "converter form" in line)
    lo, hi = (float(x) for x in ratio.split("range ")[1].split("-"))
    assert 0.8 < lo <= hi < 1.2  # the no-decode estimate within 20% of the decoded sum
    assert quality_hf.main(argv) == 0  # a rerun reads the kept ground truth
    assert out.read_text().split("total")[0] == report.split("total")[0]


def test_the_codec_is_the_converters(tmp_path):
    """default_codec gives the bytes `turboquant convert --bits 4` writes."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from safetensors import safe_open

    from turboquant.pipeline.convert import ConvertOptions, convert

    repo = tmp_path / "repo"
    convert(ConvertOptions(str(MODEL), str(repo), bits=4, in_process=True, progress=False))
    model, _ = load(str(MODEL))
    source = dict(tree_flatten(model.parameters()))
    stored = {}
    for f in repo.glob("*.safetensors"):
        with safe_open(str(f), framework="numpy") as fh:
            stored.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith(".tq_codes")})
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.2.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        _, qt = quality_tensors.default_codec(source, name, 4)
        np.testing.assert_array_equal(np.asarray(qt.codes),
                                      stored[name.replace(".weight", ".tq_codes")])

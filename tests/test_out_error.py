"""The calibrated output error: `turboquant calibrate` writes input statistics, `convert
--input-stats` records `out_error` per coded tensor (docs/FORMAT.md, docs/quality.md).

The column is checked against a hand computation from the ledger's `sq_error`, the stored t
and the statistics, and against the exact decoded error; without statistics it comes from
the weights (tests/test_input_energy.py); with them the codes are the same bytes, and the runtime and `verify` read the repo."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.pipeline.calibrate import InputStats, measure, read_stats, write_stats
from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.verify import verify_repo
from turboquant.stages import decode, encode
from turboquant.stages.proxy import output_error

ROOT = Path(__file__).resolve().parents[1]
DENSE = ROOT / "reference" / "models" / "pystd-dense"


def _weights(rows, cols, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return w * rng.uniform(0.2, 3.0, cols).astype(np.float32)  # columns of different sizes


def _exact(w, qt, a):
    e = np.asarray(decode(qt), dtype=np.float64) - w.astype(np.float64)
    return float(((e * e).sum(axis=0) * a).sum())


def test_output_error_by_hand():
    # sq_error * mean(t^2 a), with and without t
    a = np.array([1.0, 4.0, 0.0, 3.0])
    assert output_error(2.0, a) == pytest.approx(2.0 * 2.0)
    t = np.array([1.0, 0.5, 2.0, 1.0])
    assert output_error(2.0, a, t) == pytest.approx(2.0 * (1 + 1 + 0 + 3) / 4)
    with pytest.raises(ValueError, match="differ in length"):
        output_error(1.0, a, t[:3])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), scaled=st.booleans(), spike=st.booleans())
def test_output_error_matches_the_decoded_error(seed, scaled, spike):
    """The rotation spreads the coded error evenly over columns, so the error weighted by
    the input energies needs no decode: within 15% of the exact sum over 2048 rows, also
    where one channel carries most of the energy (then the sum is one column's error,
    whose spread over rows is ~sqrt(2 / rows): 3% here, 6% at 512 rows, where a 16% miss
    was seen)."""
    from turboquant.stages.scale import column_scales

    w = _weights(2048, 256, seed)
    a = np.random.default_rng(seed + 1).uniform(0.1, 2.0, 256)
    if spike:
        a[seed % 256] = 1000.0
    t = column_scales(w) if scaled else None
    qt = encode(w, 4, 64, seed=seed, in_scales=t)
    est = output_error(float(np.sum(qt.row_sq_error)), a,
                       None if t is None else t.astype(np.float64))
    assert est == pytest.approx(_exact(w, qt, a), rel=0.15)


def test_stats_file_round_trip_and_refusal(tmp_path):
    s = InputStats({"a.weight": np.arange(3.0)}, {"a.weight": 2.5},
                   {"format": "turboquant-input-stats", "version": "1", "tokens": "3"})
    write_stats(tmp_path / "s.safetensors", s)
    back = read_stats(tmp_path / "s.safetensors")
    assert back.get("a.weight", 3)[1] == 2.5
    assert back.get("a.weight", 4) is None and back.get("b.weight", 3) is None
    np.testing.assert_array_equal(back.get("a.weight", 3)[0], np.arange(3.0))
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="bad.safetensors"):
        read_stats(tmp_path / "bad.safetensors")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """pystd-dense calibrated on 1,024 tokens of the held-out text, converted with and
    without the statistics."""
    tmp = tmp_path_factory.mktemp("out_error")
    text = (ROOT / "reference" / "heldout.txt").read_text()[:20000]
    stats_path = tmp / "stats.safetensors"
    write_stats(stats_path, measure(DENSE, text, tokens=1024, seq=256))
    kw = dict(in_process=True, min_job_bytes=0, progress=False, bits=4)
    convert(ConvertOptions(str(DENSE), str(tmp / "plain"), **kw))
    convert(ConvertOptions(str(DENSE), str(tmp / "stats"), input_stats=str(stats_path), **kw))
    return tmp, read_stats(stats_path)


def test_calibrate_names_every_linear_layer(converted):
    _, stats = converted
    config = json.loads((DENSE / "config.json").read_text())
    layers = config["num_hidden_layers"]
    names = [f"model.layers.{i}.{p}.weight" for i in range(layers)
             for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert set(names) | {"model.embed_tokens.weight"} == set(stats.energy)
    assert all(v > 0 for v in stats.output_energy.values())
    assert stats.meta["tokens"] == str(4 * 256)


def test_out_error_recorded_by_hand(converted):
    tmp, stats = converted
    plain = pq.read_table(tmp / "plain" / "manifest.parquet")
    table = pq.read_table(tmp / "stats" / "manifest.parquet")
    assert set(plain.column("out_error_from").to_pylist()) == {"weights", "ones", None}
    assert set(table.column("out_error_from").to_pylist()) == {"text", None}
    assert _digest(tmp / "plain") == _digest(tmp / "stats")  # the same codes
    ledger = {}
    for f in (tmp / "stats" / ".turboquant" / "jobs").rglob("*.jsonl"):
        for line in f.read_text().splitlines():
            for it in json.loads(line)["items"]:
                ledger[it["name"]] = it
    rows = table.to_pylist()
    coded = [r for r in rows if r["codec"] != "raw"]
    assert coded and all(r["out_error"] is not None for r in coded)
    assert all(r["out_error"] is None for r in rows if r["codec"] == "raw")
    from turboquant.runtime.repo import open_repo

    for r in coded:
        name = r["name"]
        energy, _ = stats.get(name, r["shape"][1])
        t = None
        if r.get("in_scales"):
            base = name[: -len(".weight")]
            from safetensors import safe_open

            with safe_open(str(tmp / "stats" / r["shard"]), framework="numpy") as f:
                t = f.get_tensor(base + ".tq_in_scales").astype(np.float64)
        want = ledger[name]["sq_error"] * float(np.mean((1.0 if t is None else t * t) * energy))
        assert r["out_error"] == pytest.approx(want, rel=1e-12), name
    open_repo(tmp / "stats")  # the runtime's reader takes the column


def test_verify_and_runtime_accept_the_column(converted):
    tmp, _ = converted
    rep = verify_repo(tmp / "stats", source=DENSE, sample=3)
    assert rep.ok, rep.text()
    assert "out_error" in rep.text()
    from turboquant.runtime import load

    load(str(tmp / "stats"), dtype="float32")


def test_propagate_by_hand():
    """One layer, hidden 2, two heads sharing one kv head of size 1: each moment by hand."""
    from turboquant.pipeline.calibrate import propagate

    w = {"model.embed_tokens.weight": np.array([[1.0, 2.0], [3.0, 0.0]]),
         "model.layers.0.input_layernorm.weight": np.array([1.0, 2.0]),
         "model.layers.0.post_attention_layernorm.weight": np.array([1.0, 1.0]),
         "model.layers.0.self_attn.v_proj.weight": np.array([[1.0, 1.0]]),
         "model.layers.0.self_attn.o_proj.weight": np.array([[1.0, 0.0], [0.0, 2.0]]),
         "model.layers.0.mlp.gate_proj.weight": np.array([[1.0, 0.0]]),
         "model.layers.0.mlp.up_proj.weight": np.array([[0.0, 1.0]]),
         "model.layers.0.mlp.down_proj.weight": np.array([[1.0], [1.0]]),
         "model.norm.weight": np.array([1.0, 1.0])}
    for c in ("q_proj", "k_proj"):
        w[f"model.layers.0.self_attn.{c}.weight"] = np.eye(2)
    lin, resid, fin = propagate(w, layers=1, heads=2, kv_heads=1)
    e0 = np.array([5.0, 2.0])  # mean over the two tokens of each column's square
    x = np.array([1.0, 4.0]) * e0 / e0.mean()  # gamma^2 e / mean(e)
    np.testing.assert_allclose(lin["model.layers.0.self_attn.q_proj.weight"], x)
    v = x.sum()  # (1, 1) row squared times x
    np.testing.assert_allclose(lin["model.layers.0.self_attn.o_proj.weight"], [v, v])
    e1 = e0 + np.array([v, 4 * v])
    x2 = e1 / e1.mean()
    np.testing.assert_allclose(lin["model.layers.0.mlp.down_proj.weight"], [x2[0] * x2[1]])
    np.testing.assert_allclose(resid[1], e1 + x2[0] * x2[1])
    np.testing.assert_allclose(fin, resid[1] / resid[1].mean())


def test_from_weights_names_what_the_text_run_names(converted):
    from turboquant.pipeline.calibrate import from_weights

    _, measured = converted
    est = from_weights(DENSE)
    assert set(est.energy) == set(measured.energy)
    assert all(v > 0 for v in est.output_energy.values()) and est.meta["method"] == "weights"


def test_input_stats_on_a_finished_output(converted, tmp_path, capsys):
    """`convert --input-stats` on a finished output rewrites the manifest with the column
    (the same values as a fresh run); a file that is not statistics fails before any work."""
    import shutil

    from turboquant.convert import main

    tmp, _ = converted
    out = tmp_path / "plain"
    shutil.copytree(tmp / "plain", out)
    args = [str(DENSE), str(out), "--bits", "4", "--no-prefect", "--in-process", "-q",
            "--job-size", "0"]  # the fixture's layout (min_job_bytes=0)
    assert main(args + ["--input-stats", str(tmp / "stats.safetensors")]) == 0
    got = pq.read_table(out / "manifest.parquet").column("out_error").to_pylist()
    want = pq.read_table(tmp / "stats" / "manifest.parquet").column("out_error").to_pylist()
    assert got == want
    (tmp_path / "bad.safetensors").write_bytes(b"12345678")
    assert main(args + ["--input-stats", str(tmp_path / "bad.safetensors")]) == 2
    assert "bad.safetensors" in capsys.readouterr().err

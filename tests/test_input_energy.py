"""The output error every conversion records with no text (docs/quality.md, docs/FORMAT.md):
each coded matrix's ||E'||^2 weighted by input energies from its own layer's tensors (the
norm before it; a down_proj's gate/up row sums), `out_error` with `out_error_from`.

Checked by hand on names, against the ledger on a converted checkpoint, and on a built
case rel_mse cannot order: two q_proj of the same kind of weights, one behind a norm with a
large channel (what a trained model's massive activations look like), where the exact
output error, and out_error, differ by an order of magnitude and rel_mse does not."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pyarrow.parquet as pq
import pytest
from test_runtime_fixtures import decoded_from_repo

from turboquant.pipeline.input_energy import input_energy, norm_offset
from turboquant.stages.proxy import energy_factor, neuron_energy, norm_energy, value_energy

convert_mod = pytest.importorskip("turboquant.pipeline.convert")
checkpoints = pytest.importorskip("checkpoints")

L0 = "model.layers.0."
NORMS = {L0 + "input_layernorm.weight": np.array([1.0, 2.0, 3.0]),
         L0 + "post_attention_layernorm.weight": np.array([2.0, 2.0, 2.0])}
ROWS = {L0 + "mlp.gate_proj.weight": np.array([1.0, 4.0]),
        L0 + "mlp.up_proj.weight": np.array([2.0, 1.0])}


def test_energies_by_hand():
    np.testing.assert_allclose(norm_energy([1.0, -2.0]), [1.0, 4.0])
    np.testing.assert_allclose(norm_energy([0.0, -2.0], offset=1.0), [1.0, 1.0])
    np.testing.assert_allclose(neuron_energy([1.0, 4.0], [2.0, 1.0], 4.0), [32.0, 64.0])
    np.testing.assert_allclose(value_energy([1.0, 3.0], 2.0, 3), [4.0, 4.0, 4.0])
    assert energy_factor([1.0, 3.0]) == 2.0
    assert energy_factor([1.0, 3.0], [2.0, 1.0]) == pytest.approx((4 + 3) / 2)


def test_input_energy_by_name():
    def look(name, n, offset=0.0):
        return input_energy(name, n, NORMS.get, ROWS.get, offset)

    a, kind = look(L0 + "self_attn.q_proj.weight", 3)
    assert kind == "norm" and np.allclose(a, [1, 4, 9])
    a, kind = look(L0 + "mlp.up_proj.weight", 3)
    assert kind == "norm" and np.allclose(a, [4, 4, 4])
    a, kind = look(L0 + "mlp.down_proj.weight", 2)  # rows x mean(gamma^2) = 4, squared
    assert kind == "neurons" and np.allclose(a, [1 * 2 * 16, 4 * 1 * 16])
    a, kind = look(L0 + "self_attn.k_proj.weight", 3, offset=1.0)  # norms of 1 + w
    assert kind == "norm" and np.allclose(a, [4, 9, 16])
    for name, n in ((L0 + "self_attn.o_proj.weight", 3), ("model.embed_tokens.weight", 3),
                    ("model.layers.1.self_attn.q_proj.weight", 3),  # its norm is not there
                    (L0 + "mixer.in_proj.weight", 3),  # a layer the names do not know
                    (L0 + "self_attn.q_proj.weight", 4),  # a norm of another width
                    ("model.layers.0.mlp.experts.3.down_proj.weight", 2)):  # no row sums
        a, kind = look(name, n)
        assert kind == "ones" and np.array_equal(a, np.ones(n)), name
    final = {**NORMS, "model.norm.weight": np.array([1.0, 0.5, 2.0])}
    for name, tied, kind in (("lm_head.weight", False, "norm"),
                             ("model.embed_tokens.weight", True, "norm"),
                             ("model.embed_tokens.weight", False, "ones")):
        a, got = input_energy(name, 3, final.get, ROWS.get, tied=tied)
        assert got == kind and np.allclose(a, [1, 0.25, 4] if kind == "norm" else 1), name
    a, kind = input_energy(L0 + "self_attn.o_proj.weight", 4, NORMS.get,
                           {L0 + "self_attn.v_proj.weight": np.array([1.0, 3.0])}.get,
                           values=True)  # the measured candidate: mean ||v_i||^2 mean(gamma^2)
    assert kind == "values" and np.allclose(a, 2.0 * 14 / 3)
    pre = {**NORMS, L0 + "pre_feedforward_layernorm.weight": np.array([3.0, 3.0, 3.0])}
    a, kind = input_energy(L0 + "mlp.gate_proj.weight", 3, pre.get, ROWS.get)
    assert kind == "norm" and np.allclose(a, 9)  # gemma2/3: the MLP's own norm
    assert norm_offset("gemma3_text") == 1.0 and norm_offset("llama") == 0.0


def _set_norm(folder: Path, name: str, values: np.ndarray) -> None:
    for f in sorted(folder.glob("*.safetensors")):
        arrays = mx.load(str(f))
        if name in arrays:
            arrays[name] = mx.array(values.astype(np.float32)).astype(arrays[name].dtype)
            mx.save_safetensors(str(f), arrays, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} not in {folder}")


@pytest.fixture(scope="module")
def loud_channel(tmp_path_factory):
    """A llama checkpoint whose layer 0 input norm carries one channel 40x the others (layer
    1's all ones), converted with the default command."""
    root = tmp_path_factory.mktemp("energy")
    src = checkpoints.write_llama_checkpoint(root / "src", hidden=64, intermediate=128,
                                             vocab=320, dtype="float32", shards=1)
    loud = np.ones(64)
    loud[9] = 40.0
    _set_norm(src, "model.layers.0.input_layernorm.weight", loud)
    _set_norm(src, "model.layers.1.input_layernorm.weight", np.ones(64))
    out = root / "out"
    convert_mod.convert(convert_mod.ConvertOptions(source=str(src), output=str(out), bits=4,
                                                   in_process=True, progress=False,
                                                   check_disk=False, min_job_bytes=0))
    return src, out, loud


def _ledger(out: Path) -> dict:
    items = {}
    for f in (out / ".turboquant" / "jobs").rglob("*.jsonl"):
        for line in f.read_text().splitlines():
            items.update({it["name"]: it for it in json.loads(line)["items"]})
    return items


def test_recorded_by_default(loud_channel):
    src, out, loud = loud_channel
    rows = pq.read_table(out / "manifest.parquet").to_pylist()
    ledger = _ledger(out)
    coded = {r["name"]: r for r in rows if r["codec"] != "raw"}
    assert all(r["out_error"] is None and r["out_error_from"] is None
               for r in rows if r["codec"] == "raw")
    for name, r in coded.items():
        cls = name.split(".")[-2]
        want = "ones" if cls in ("o_proj", "embed_tokens") else "weights"  # untied
        assert r["out_error_from"] == want, name
        assert r["out_error"] > 0, name
    q0 = coded["model.layers.0.self_attn.q_proj.weight"]
    t = _stored_t(out, q0)
    by_hand = ledger[q0["name"]]["sq_error"] * float(np.mean(t * t * loud * loud))
    assert q0["out_error"] == pytest.approx(by_hand, rel=1e-12)
    from turboquant.pipeline.verify import verify_repo

    rep = verify_repo(out)
    assert rep.ok and "from weights" in rep.text(), rep.text()


def _stored_t(out: Path, row: dict) -> np.ndarray:
    if not row.get("in_scales"):
        return np.ones(row["shape"][1])
    from safetensors import safe_open

    with safe_open(str(out / row["shard"]), framework="numpy") as f:
        return f.get_tensor(row["name"][: -len(".weight")] + ".tq_in_scales").astype(np.float64)


def test_orders_what_rel_mse_cannot(loud_channel):
    """Inputs with E[x_j^2] = gamma_j^2: the exact output error of layer 0's q_proj is far
    above layer 1's; out_error says so within 30%, rel_mse sees two alike tensors."""
    src, out, loud = loud_channel
    rows = {r["name"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    decoded = decoded_from_repo(out).weights
    source = {}
    for f in sorted(src.glob("*.safetensors")):
        source.update(mx.load(str(f)))
    exact, figure, rel = [], [], []
    for layer, energy in ((0, loud * loud), (1, np.ones(64))):
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        e = np.asarray(decoded[name].astype(mx.float32), np.float64) \
            - np.asarray(source[name].astype(mx.float32), np.float64)
        exact.append(float((e * e).sum(axis=0) @ energy))
        figure.append(rows[name]["out_error"])
        rel.append(rows[name]["rel_mse"])
    assert exact[0] / exact[1] > 10
    assert figure[0] / figure[1] == pytest.approx(exact[0] / exact[1], rel=0.3)
    assert 0.8 < rel[0] / rel[1] < 1.25

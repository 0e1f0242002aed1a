"""Per-input-column scales end to end (format version 2): written by the converter (a
pre-pass of column sums per tensor, `P.tq_in_scales` inside the tensor's byte range),
read by the runtime (the input multiplied by t before the rotation, on every path that
runs here), refused where the version says otherwise."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pyarrow.parquet as pq
import pytest
from test_runtime_fixtures import decoded_from_repo, reference_model

from turboquant import kernels
from turboquant.kernels import dispatch
from turboquant.runtime import TQLinear, load
from turboquant.runtime.repo import RepoError, open_repo

convert_mod = pytest.importorskip("turboquant.pipeline.convert")
checkpoints = pytest.importorskip("checkpoints")

TOKENS = mx.array([[1, 5, 70, 33, 200, 9, 12, 250] * 5])
# columns a trained model's v_proj / down_proj have small: where its large activations enter
SMALL = {"v_proj": (3, 17, 40), "down_proj": (5, 60), "gate_proj": (7,)}


def convert(src, out, **kw):
    opts = convert_mod.ConvertOptions(source=str(src), output=str(out), in_process=True,
                                      progress=False, check_disk=False, **kw)
    return convert_mod.convert(opts)


def with_small_columns(folder: Path) -> Path:
    """Scale a few input columns of some projections down 20x, as trained weights have them."""
    for f in sorted(folder.glob("*.safetensors")):
        arrays = mx.load(str(f))
        for name, a in arrays.items():
            proj = name.split(".")[-2] if name.endswith("_proj.weight") else None
            if proj in SMALL:
                cols = mx.ones((a.shape[1],)).at[mx.array(SMALL[proj])].multiply(0.05)
                arrays[name] = (a.astype(mx.float32) * cols).astype(a.dtype)
        mx.save_safetensors(str(f), arrays, metadata={"format": "pt"})
    return folder


def _err(a, b):
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file() and p.suffix == ".safetensors"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    checkpoints.write_llama_checkpoint(root / "llama", hidden=64, intermediate=128, vocab=320,
                                       dtype="float32")
    with_small_columns(root / "llama")
    checkpoints.write_moe_checkpoint(root / "moe", style="qwen3_moe", hidden=64,
                                     intermediate=64, vocab=320)
    with_small_columns(root / "moe")
    return root


@pytest.fixture(scope="module")
def scaled_repo(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("v2") / "llama-tq"
    convert(sources / "llama", out, bits=3, protect_layers=0)
    return out


def test_the_converter_writes_in_scales_only_where_a_column_is_small(scaled_repo):
    config = json.loads((scaled_repo / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format_version"] == 2 and qc["in_scales"] is True
    rows = {r["name"]: r for r in pq.read_table(scaled_repo / "manifest.parquet").to_pylist()}
    written = decoded_from_repo(scaled_repo)
    for name, r in rows.items():
        proj = name.split(".")[-2]
        if r["codec"] == "raw" or "embed" in name:
            assert not r["in_scales"], name
            continue
        assert r["in_scales"], name  # every linear layer stores a vector (ones: no small column)
        t = np.asarray(written.quantized[name].in_scales.astype(mx.float32))
        if proj in SMALL:
            assert t[list(SMALL[proj])].max() < 0.2 * np.median(t), name
        else:
            assert (t == 1).all(), name
    # the vector sits inside the row's byte range: one positioned read gets the tensor
    header = open_repo(scaled_repo).headers
    for name, r in rows.items():
        if r["in_scales"]:
            base = name[: -len(".weight")]
            start, end = header[r["shard"]][base + ".tq_in_scales"]["data_offsets"]
            assert end - start == 2 * r["shape"][1]
            assert r["byte_end"] - r["byte_start"] > end - start


def test_a_v2_repo_loads_and_matches_its_decoded_weights(scaled_repo):
    model, _ = load(scaled_repo, dtype="float32")
    v = model.model.layers[0].self_attn.v_proj
    assert isinstance(v, TQLinear) and "in_scales" in v
    assert "in_scales" not in model.model.layers[0].self_attn.q_proj  # ones: dropped at load
    ref = reference_model(decoded_from_repo(scaled_repo))
    assert _err(model(TOKENS), ref(TOKENS)) < 1e-4
    one = TOKENS[:, :1]  # a decode step: the grouped path (q/k/v, gate/up) with split scales
    assert _err(model(one), ref(one)) < 1e-4


def test_a_v2_repo_on_the_reference_path(scaled_repo, monkeypatch):
    """The pure-MLX reference (every backend's oracle), not the CPU's numba kernels."""
    monkeypatch.setattr(dispatch, "backend", lambda: "reference-only")
    model, _ = load(scaled_repo, dtype="float32", fuse=False)
    ref = reference_model(decoded_from_repo(scaled_repo))
    assert _err(model(TOKENS), ref(TOKENS)) < 1e-4
    assert _err(model(TOKENS[:, :2]), ref(TOKENS[:, :2])) < 1e-4


def test_a_v2_repo_generates(scaled_repo):
    from mlx_lm import generate

    model, tokenizer = load(scaled_repo)
    text = generate(model, tokenizer, "hello", max_tokens=4, verbose=False)
    assert isinstance(text, str)


def test_column_scales_off_writes_version_1(sources, tmp_path):
    convert(sources / "llama", tmp_path, bits=3, protect_layers=0, column_scales="off")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == 1 and "in_scales" not in qc
    assert "in_scales" not in pq.read_schema(tmp_path / "manifest.parquet").names
    model, _ = load(tmp_path, dtype="float32")
    assert _err(model(TOKENS), reference_model(decoded_from_repo(tmp_path))(TOKENS)) < 1e-4


def test_reruns_and_a_kill_mid_tensor_give_the_same_bytes(sources, scaled_repo, tmp_path,
                                                           monkeypatch):
    again = tmp_path / "again"
    convert(sources / "llama", again, bits=3, protect_layers=0)
    assert snapshot(again) == snapshot(scaled_repo)
    # the pre-pass and the coding read in small chunks: a tensor in many pieces, the same t
    from turboquant.pipeline import job

    monkeypatch.setattr(job, "CHUNK_ELEMENTS", 512)
    chunked = tmp_path / "chunked"
    convert(sources / "llama", chunked, bits=3, protect_layers=0)
    assert snapshot(chunked) == snapshot(scaled_repo)


def test_a_version_1_reader_refuses_a_v2_repo(scaled_repo, tmp_path):
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(scaled_repo, edited)
    config = json.loads((edited / "config.json").read_text())
    config["quantization_config"]["format_version"] = 1
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(RepoError, match="in_scales.*format_version 1"):
        open_repo(edited)
    config["quantization_config"]["format_version"] = 3
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(RepoError, match="format_version 3"):
        open_repo(edited)


def test_a_moe_repo_with_in_scales_matches(sources, tmp_path):
    """Attention (and dense layers) carry in_scales; routed experts never do."""
    convert(sources / "moe", tmp_path, bits=4, protect_layers=0, recipe="default")
    rows = pq.read_table(tmp_path / "manifest.parquet").to_pylist()
    assert any(r["in_scales"] for r in rows)
    assert not any(r["in_scales"] for r in rows if r["expert"] is not None)
    model, _ = load(tmp_path)
    assert _err(model(TOKENS), reference_model(decoded_from_repo(tmp_path))(TOKENS)) < 1e-4


def test_verify_checks_a_v2_repo_against_its_source(sources, scaled_repo):
    from turboquant.pipeline.verify import verify_repo

    rep = verify_repo(scaled_repo, source=sources / "llama", full=True)
    assert not rep.problems, rep.problems


def test_group_with_different_scales_equals_its_members_alone():
    from turboquant.kernels.group import Extras, Member, tq_linear_group
    from turboquant.stages import column_scales, encode

    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((32, 128)).astype(np.float32) for _ in range(3)]
    ws[1][:, :8] *= 0.05
    members = []
    for i, w in enumerate(ws):
        t = column_scales(w, min_ratio=0.5)
        qt = encode(w, 4, seed=i, in_scales=t)
        members.append(Member(qt.codes, qt.scales, 4, 64, 128, 32, 128, i,
                              in_scales=qt.in_scales))
    x = mx.array(rng.standard_normal((2, 128)).astype(np.float32))
    norm = mx.array(rng.uniform(0.5, 2, 128).astype(np.float32))
    ys = tq_linear_group(x, tuple(members), extras=Extras(norm=norm, eps=1e-5))
    row = mx.fast.rms_norm(x, norm, 1e-5)
    for m, y in zip(members, ys):
        alone = kernels.tq_linear_group(row, (m,))[0]
        assert _err(y, alone) < 1e-5


def test_the_cli_flag_reaches_the_recipe_through_prefect(sources, tmp_path):
    """`turboquant convert --column-scales off` as a user types it (the Prefect flow)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "turboquant", "convert", str(sources / "llama"),
                    str(out), "-q", "--bits", "3", "--column-scales", "off"], env=env,
                   check=True, capture_output=True, timeout=300)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid_tensor:2", "unit_committed:5"])
def test_sigkill_then_resume_gives_the_same_bytes(sources, tmp_path, point):
    """The real command killed mid-tensor (after the pre-pass, a chunk coded with t) or
    between units, then rerun: the bytes of an uninterrupted run (test_pipeline_kill)."""
    import signal

    from test_pipeline_kill import check_resumed, cli
    from test_pipeline_kill import snapshot as all_files

    src = sources / "llama"
    ref = tmp_path / "ref"
    rc, text = cli(src, ref, "--no-prefect", "--in-process")
    assert rc == 0, text
    assert json.loads((ref / "config.json").read_text())["quantization_config"]["in_scales"]
    out = tmp_path / "out"
    rc, text = cli(src, out, "--no-prefect", "--in-process", crash=point)
    assert rc == -signal.SIGKILL, text
    check_resumed(src, out, all_files(ref))


def test_a_massive_neuron_gives_down_proj_the_neuron_scales(tmp_path):
    """Layer 0's MLP neuron 9 has gate and up rows 6x the others (36x the median size,
    over the recipe's neuron_ratio 8): its down_proj's t comes from the neuron sizes
    (stages.neuron_column_scales), the other layer's from the column rule (ones here)."""
    from turboquant.stages.scale import neuron_column_scales, neuron_sizes_from_sums

    src = tmp_path / "llama"
    checkpoints.write_llama_checkpoint(src, hidden=64, intermediate=128, vocab=320,
                                       dtype="float32")
    f = sorted(src.glob("*.safetensors"))
    arrays = {n: a for p in f for n, a in mx.load(str(p)).items()}
    for part in ("gate_proj", "up_proj"):
        name = f"model.layers.0.mlp.{part}.weight"
        arrays[name] = arrays[name].at[9].multiply(6.0)
    for p in f[1:]:
        p.unlink()
    mx.save_safetensors(str(f[0]), arrays, metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    out = tmp_path / "tq"
    convert(src, out, bits=4, protect_layers=0)
    written = decoded_from_repo(out)
    g, u, d = (np.asarray(arrays[f"model.layers.0.mlp.{p}.weight"], dtype=np.float64)
               for p in ("gate_proj", "up_proj", "down_proj"))
    sizes = neuron_sizes_from_sums((g * g).sum(1), (u * u).sum(1), g.shape[1])
    want = neuron_column_scales((d * d).sum(0), d.shape[0], sizes)
    t0 = np.asarray(written.quantized["model.layers.0.mlp.down_proj.weight"].in_scales
                    .astype(mx.float32))
    assert want is not None and t0.argmin() == 9
    np.testing.assert_allclose(t0, want.astype(np.float32), rtol=2e-3)
    t1 = np.asarray(written.quantized["model.layers.1.mlp.down_proj.weight"].in_scales
                    .astype(mx.float32))
    assert (t1 == 1).all()
    model, _ = load(out, dtype="float32")
    assert _err(model(TOKENS), reference_model(written)(TOKENS)) < 1e-4


def in_module_order(folder: Path) -> None:
    """Rewrite each shard with its tensors in the model's order (q, k, v, o, gate, up, down:
    as torch modules list them) instead of by name (as safetensors' own writer sorts them):
    a layer's gate/up then come before its down_proj."""
    rank = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3, "gate_proj": 4, "up_proj": 5,
            "down_proj": 6}

    def order(name: str):
        parts = name.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else -1
        return layer, rank.get(parts[-2], -1), name

    for f in sorted(folder.glob("*.safetensors")):
        arrays = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()}
        dtype = {mx.bfloat16: "bfloat16", mx.float32: "float32"}[
            next(iter(mx.load(str(f)).values())).dtype]
        specs = [checkpoints.TensorSpec(n, arrays[n].shape,
                                        lambda start, count, a=arrays[n]:
                                        a.reshape(-1)[start:start + count], dtype)
                 for n in sorted(arrays, key=order)]
        checkpoints.write_safetensors(f, specs)


@pytest.mark.parametrize("order", ["by_name", "module"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gate_and_up_are_read_once_for_both_pre_passes(tmp_path, monkeypatch, dtype, order):
    """The neuron rule reads a layer's gate/up rows for down_proj's neuron sizes; the same
    read sums their columns for their own column scales (stages.ColumnSums
    .add_with_row_sums), so gate/up are read twice (that pre-pass, then coding) like every
    other coded tensor, not three times, whichever the file lists first (the gate/up
    pre-pass or down_proj's may come first, on either of two threads); the bytes are those
    of separate reads."""
    from turboquant.pipeline import job as job_mod
    from turboquant.pipeline.safetensors_io import read_header

    src = tmp_path / "llama"
    checkpoints.write_llama_checkpoint(src, hidden=64, intermediate=128, vocab=320,
                                       dtype=dtype)
    with_small_columns(src)
    if order == "module":
        in_module_order(src)
    names = [n for f in sorted(src.glob("*.safetensors"))
             for n, _ in sorted(read_header(f).tensors.items(), key=lambda kv: kv[1].start)]
    assert (names.index("model.layers.0.mlp.gate_proj.weight")
            < names.index("model.layers.0.mlp.down_proj.weight")) == (order == "module")
    reads: dict[str, int] = {}
    real = job_mod.read_raw

    def counted(fd, info, start, count, file):
        reads[info.name] = reads.get(info.name, 0) + count * info.itemsize
        return real(fd, info, start, count, file)

    monkeypatch.setattr(job_mod, "read_raw", counted)
    monkeypatch.setattr(job_mod, "CHUNK_ELEMENTS", 64 * 40)  # several chunks a tensor
    convert(src, tmp_path / "once", bits=4, protect_layers=0)
    sizes = {n: info.nbytes for f in sorted(src.glob("*.safetensors"))
             for n, info in read_header(f).tensors.items()}
    mlp = [n for n in sizes if ".mlp." in n]
    assert mlp and all(reads[n] == 2 * sizes[n] for n in mlp), {n: reads[n] / sizes[n]
                                                                 for n in mlp}
    reads.clear()
    monkeypatch.setattr(job_mod, "_neuron_partners", lambda ctx: set())  # each reads its own
    convert(src, tmp_path / "apart", bits=4, protect_layers=0)
    assert all(reads[n] == 3 * sizes[n] for n in mlp if ".down_proj." not in n)
    assert snapshot(tmp_path / "once") == snapshot(tmp_path / "apart")

"""End to end, in this process: convert small generated checkpoints, verify them, reload
every tensor with `decode`, resume after a failure, and refuse bad inputs clearly."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pyarrow.parquet as pq
import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint
from safetensors import safe_open

from turboquant.manifests.schema import COLUMNS, stored_names
from turboquant.pipeline import job as job_module
from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.errors import ConversionError, OutputError, PlanError
from turboquant.pipeline.ledger import WorkDir
from turboquant.pipeline.plan import cut_piece, split_piece_of
from turboquant.pipeline.safetensors_io import read_float32, read_header
from turboquant.pipeline.verify import REL_MSE_BOUND, load_coded, verify_repo
from turboquant.stages import decode

DENSE = dict(layers=4, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=320)


def run(src, out, **kw):
    kw.setdefault("in_process", True)
    kw.setdefault("min_job_bytes", 0)
    kw.setdefault("progress", False)
    return convert(ConvertOptions(str(src), str(out), **kw))


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file of a repo (the work folder left out)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def source_weight(src: Path, row: dict, recipe: str) -> np.ndarray:
    from turboquant.manifests.recipe import load_recipe

    f = row["source_shard"]
    info = read_header(src / f).tensors[row["source_name"]]
    fd = os.open(src / f, os.O_RDONLY)
    try:
        if row["name"] == row["source_name"]:
            return read_float32(fd, info, 0, info.numel, f).reshape(info.shape)
        piece = split_piece_of(load_recipe(recipe), f, row["source_name"], row["name"],
                               row["expert"])
        per = info.numel // info.shape[0]
        x = read_float32(fd, info, piece.expert * per, per, f).reshape(info.shape[1:])
        return cut_piece(x, piece)
    finally:
        os.close(fd)


def check_every_tensor(src: Path, out: Path) -> list[dict]:
    """Reload each tensor from the shards and compare with the source weights."""
    rows = pq.read_table(out / "manifest.parquet").to_pylist()
    config = json.loads((out / "config.json").read_text())
    recipe = config["quantization_config"]["recipe"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in {r["shard"] for r in rows}:
        loaded[shard] = mx.load(str(out / shard))  # MLX reads the shards as they are
        with safe_open(out / shard, "numpy") as g:  # and so does safetensors
            assert set(g.keys()) == set(loaded[shard])
    assert set(index["weight_map"]) == {n for s in loaded.values() for n in s}
    for r in rows:
        ref = source_weight(src, r, recipe)
        if r["codec"] == "raw":
            got = loaded[r["shard"]][r["name"]]
            assert got.shape == ref.shape
            np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), ref)
            continue
        codes, scales = (loaded[r["shard"]][n] for n in stored_names(r["name"], r["codec"]))
        assert codes.dtype == mx.uint32 and scales.dtype == mx.float16
        qt = load_coded(out, r, read_header(out / r["shard"]))
        assert mx.array_equal(qt.codes, codes) and mx.array_equal(qt.scales, scales)
        w = np.asarray(decode(qt))
        err = float(((w - ref) ** 2).sum() / (ref**2).sum())
        bits = "ternary" if r["codec"] == "ternary" else r["bits"]
        assert err == pytest.approx(r["rel_mse"], rel=1e-4), r["name"]
        assert err < REL_MSE_BOUND[bits], (r["name"], bits, err)
    return rows


def test_dense_llama_end_to_end(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=3, **DENSE)
    out = tmp_path / "out"
    summary = run(src, out, bits=3, protect_layers=1)
    assert summary.repo.shards == 3 and summary.jobs_run == 3
    rows = check_every_tensor(src, out)
    by_name = {r["name"]: r for r in rows}
    assert by_name["model.layers.1.mlp.up_proj.weight"]["bits"] == 3
    assert by_name["model.layers.0.mlp.up_proj.weight"]["bits"] == 4  # protected layer
    # codes and scales at 3.25, and the recipe's in_scales: 16 bits a column over out rows
    up = by_name["model.layers.1.mlp.up_proj.weight"]
    assert up["bits_per_weight"] == 3.25 + 16 / up["shape"][0]
    report = verify_repo(out, source=src, full=True)
    assert report.ok, report.text()
    assert report.checksums_ok == len(rows)

    files = {p.name for p in out.iterdir()}
    assert {"config.json", "README.md", "manifest.parquet", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json"} <= files
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    # the recipe's column scales (column_scales = "auto"): format 2
    assert q["quant_method"] == "turboquant" and q["format_version"] == 2 and q["in_scales"]
    assert q["recipe"] == "llama" and len(q["recipe_hash"]) == 64
    assert (q["bits"], q["group_size"]) == (3, 64)
    assert q["overrides"]["model.layers.0.mlp.up_proj"] == {"bits": 4, "group_size": 64}
    assert q["overrides"]["model.norm"] == {"codec": "raw"}
    assert cfg["hidden_size"] == DENSE["hidden"]
    table = pq.read_table(out / "manifest.parquet")
    assert table.column_names == [*COLUMNS, "in_scales", "out_error", "out_error_from"]
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: mlx\ntags:\n- turboquant\n- mlx\n- quantized\n")
    assert "Real bits per weight" in card


@pytest.mark.parametrize("dtype, shards", [("float16", 1), ("float32", 2)])
def test_fp16_and_fp32_sources(tmp_path, dtype, shards):
    src = write_llama_checkpoint(tmp_path / "src", shards=shards, dtype=dtype, layers=2,
                                 hidden=64, intermediate=128, vocab=300)
    out = tmp_path / "out"
    run(src, out)
    rows = check_every_tensor(src, out)
    want = {"float16": "F16", "float32": "F32"}[dtype]
    assert {r["source_dtype"] for r in rows} == {want}
    assert verify_repo(out).ok


def test_moe_ternary_experts_are_contiguous(tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", style="qwen3_moe", layers=4, hidden=128,
                               intermediate=128, experts=4, shards=3)
    out = tmp_path / "out"
    run(src, out, expert_bits="ternary")
    rows = check_every_tensor(src, out)
    assert verify_repo(out, source=src, full=True).ok
    experts: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["expert"] is not None:
            experts.setdefault((r["layer"], r["expert"], r["shard"]), []).append(r)
    assert len(experts) == 4 * 4
    for (layer, e, shard), rs in experts.items():
        rs.sort(key=lambda r: r["byte_start"])
        assert len(rs) == 3
        for a, b in zip(rs, rs[1:]):
            assert a["byte_end"] == b["byte_start"]
        start, end = rs[0]["byte_start"], rs[-1]["byte_end"]
        # one positioned read gives the whole expert
        with open(out / shard, "rb") as f:
            f.seek(start)
            blob = f.read(end - start)
        for r in rs:
            piece = blob[r["byte_start"] - start : r["byte_end"] - start]
            assert hashlib.sha256(piece).hexdigest() == r["checksum"]
        codecs = {r["codec"] for r in rs}
        assert codecs == ({"turboquant"} if layer in (0, 3) else {"ternary"})
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["overrides"]["model.layers.1.mlp.experts.2.up_proj"]["codec"] == "ternary"


@pytest.mark.parametrize("style", ["gpt_oss", "mixtral", "deepseek_v2", "qwen2_moe"])
def test_other_moe_layouts(tmp_path, style):
    src = write_moe_checkpoint(tmp_path / "src", style=style, layers=3, hidden=64,
                               intermediate=64, experts=3, shards=2, first_dense_layers=1)
    out = tmp_path / "out"
    run(src, out, expert_bits=2)
    check_every_tensor(src, out)
    assert verify_repo(out, source=src, full=True).ok


def test_rerun_skips_and_output_is_unchanged(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=2, **DENSE)
    out = tmp_path / "out"
    run(src, out)
    before = snapshot(out)
    again = run(src, out)
    assert again.jobs_skipped == 2 and again.jobs_run == 0 and again.read_bytes == 0
    assert snapshot(out) == before


def test_resume_after_a_failure_mid_job_is_byte_identical(tmp_path, monkeypatch):
    src = write_llama_checkpoint(tmp_path / "src", shards=2, **DENSE)
    ref = tmp_path / "ref"
    run(src, ref)
    out = tmp_path / "out"
    real = job_module._write_item
    calls = {"n": 0}
    from turboquant.pipeline.plan import build_plan
    from turboquant.pipeline.sources import LocalSource

    first = sum(len(u.items) for u in build_plan(LocalSource(src), min_job_bytes=0).jobs[0].units)

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == first + 3:  # inside the second job
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(job_module, "_write_item", failing)
    monkeypatch.setattr(job_module, "CHUNK_ELEMENTS", 4096)  # cut tensors into chunks
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(src, out)
    work = WorkDir(out)
    assert work.done(_job(out, 0)).exists() and not work.done(_job(out, 1)).exists()
    monkeypatch.setattr(job_module, "_write_item", real)
    summary = run(src, out)
    assert summary.jobs_skipped == 1 and summary.jobs_resumed == 1
    assert snapshot(out) == snapshot(ref)
    events = [e["event"] for e in work.events()]
    assert events.count("job_resume") == 1 and "job_skip" in events


def _job(out, i):
    class J:  # enough of a Job for WorkDir's paths
        name = f"job-{i + 1:05d}"
    return J


def test_another_recipe_is_refused_and_fresh_starts_over(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=2, **DENSE)
    out = tmp_path / "out"
    run(src, out)
    before = snapshot(out)
    with pytest.raises(OutputError, match="made with recipe 'llama'.*--fresh"):
        run(src, out, bits=2)
    assert snapshot(out) == before
    run(src, out, bits=2, fresh=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 2


def test_foreign_folder_is_never_touched(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=1, layers=1, hidden=64,
                                 intermediate=64, vocab=300)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for fresh in (False, True):
        with pytest.raises(OutputError, match="not empty"):
            run(src, out, fresh=fresh)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_second_run_on_the_same_output_is_locked(tmp_path):
    from turboquant.pipeline.ledger import FileLock

    src = write_llama_checkpoint(tmp_path / "src", shards=1, layers=1, hidden=64,
                                 intermediate=64, vocab=300)
    out = tmp_path / "out"
    (out / ".turboquant").mkdir(parents=True)
    with FileLock(out / ".turboquant" / "run.lock", "x"):
        with pytest.raises(OutputError, match="locked by another process"):
            run(src, out)


# ------------------------------------------------------------------ bad input


def _truncate(path: Path, n: int = 100) -> None:
    os.truncate(path, path.stat().st_size - n)


def _lie_about(path: Path, tensor: str) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8 : 8 + n])
    a, b = h[tensor]["data_offsets"]
    h[tensor]["shape"] = [h[tensor]["shape"][0] + 1] + h[tensor]["shape"][1:]
    blob = json.dumps(h, separators=(",", ":")).encode()
    assert len(blob) <= n
    blob = blob.ljust(n)
    path.write_bytes(raw[:8] + blob + raw[8 + n :])


def _nan_in(path: Path, tensor: str) -> None:
    info = read_header(path).tensors[tensor]
    with open(path, "r+b") as f:
        f.seek(info.start + 2 * 37)
        f.write(b"\xc0\x7f")  # bf16 NaN


@pytest.mark.parametrize(
    "damage, expect",
    [
        (lambda s: _truncate(s / "model-00002-of-00002.safetensors"),
         r"model-00002-of-00002\.safetensors: tensor '[^']+': needs bytes .* truncated"),
        (lambda s: _lie_about(s / "model-00002-of-00002.safetensors", "model.norm.weight"),
         r"model-00002-of-00002\.safetensors: tensor 'model\.norm\.weight': header says"),
        (lambda s: _nan_in(s / "model-00002-of-00002.safetensors", "lm_head.weight"),
         r"model-00002-of-00002\.safetensors: tensor 'lm_head\.weight': holds non-finite"),
        (lambda s: (s / "model-00002-of-00002.safetensors").write_bytes(b"\x05" * 64),
         r"model-00002-of-00002\.safetensors: header length"),
    ],
    ids=["truncated", "lying-header", "corrupted-data", "garbage"],
)
def test_bad_source_shard_names_file_and_tensor(tmp_path, damage, expect):
    src = write_llama_checkpoint(tmp_path / "src", shards=2, **DENSE)
    out = tmp_path / "out"
    run(src, out)
    finished = snapshot(out)
    damage(src)
    other = tmp_path / "other"
    with pytest.raises(ConversionError, match=expect):
        run(src, other)
    # a finished output is never overwritten: rerunning on it fails in validation or skips
    try:
        run(src, out)
    except ConversionError:
        pass
    assert snapshot(out) == finished
    if other.exists():  # the first job finished before the damaged shard failed
        assert not (other / "model-00002-of-00002.safetensors").exists()


def test_missing_index_entry_and_unknown_architecture(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=2, **DENSE)
    p = src / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    del idx["weight_map"]["model.layers.2.self_attn.v_proj.weight"]
    p.write_text(json.dumps(idx))
    with pytest.raises(PlanError, match=r"'model\.layers\.2\.self_attn\.v_proj\.weight' is "
                                        r"missing from model\.safetensors\.index\.json"):
        run(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "bert"  # an encoder: mlx-lm has no model for it
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="unknown architecture model_type='bert'"):
        run(src, tmp_path / "out")


def test_verify_catches_a_flipped_byte(tmp_path):
    src = write_llama_checkpoint(tmp_path / "src", shards=1, layers=2, hidden=64,
                                 intermediate=128, vocab=300)
    out = tmp_path / "out"
    run(src, out)
    assert verify_repo(out).ok
    rows = pq.read_table(out / "manifest.parquet").to_pylist()
    r = next(r for r in rows if r["name"] == "model.layers.1.mlp.down_proj.weight")
    with open(out / r["shard"], "r+b") as f:
        f.seek(r["byte_start"] + 5)
        b = f.read(1)
        f.seek(r["byte_start"] + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    report = verify_repo(out)
    assert not report.ok and "model.layers.1.mlp.down_proj.weight" in report.text()


def test_cli_dry_run_errors_and_verify(tmp_path, capsys):
    from turboquant.convert import main as convert_main
    from turboquant.verify import main as verify_main

    src = write_llama_checkpoint(tmp_path / "src", shards=2, layers=2, hidden=64,
                                 intermediate=128, vocab=300)
    out = tmp_path / "out"
    assert convert_main([str(src), str(out), "--dry-run", "--job-size", "0"]) == 0
    text = capsys.readouterr().out
    assert "jobs: 2" in text and "recipe: llama" in text and not out.exists()
    args = [str(src), str(out), "--no-prefect", "--in-process", "--job-size", "0", "-q"]
    assert convert_main(args) == 0
    assert "real bits per weight" in capsys.readouterr().out
    assert convert_main(args + ["--bits", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("turboquant convert: error:") and "quant.bits: 4 -> 2" in err
    assert convert_main(args + ["--job-size", "lots"]) == 2
    assert verify_main([str(out), "--source", str(src)]) == 0
    assert "OK" in capsys.readouterr().out


def test_the_converter_codes_its_chunks_without_mlx_arrays(tmp_path, monkeypatch):
    """Every chunk goes through codec.encode_np (numpy in, numpy out): no QuantizedTensor,
    whose MLX arrays would be one more copy a chunk (a device allocation on a CUDA build)."""
    from turboquant.stages import codec

    made = []

    class Counted(codec.QuantizedTensor):
        def __post_init__(self):
            made.append(self.shape)
            super().__post_init__()

    monkeypatch.setattr(codec, "QuantizedTensor", Counted)
    src = write_llama_checkpoint(tmp_path / "src", **DENSE)
    run(src, tmp_path / "out", bits=4)
    assert (tmp_path / "out" / "manifest.parquet").exists()
    assert made == []
    codec.encode(np.ones((2, 64), np.float32), 4)
    assert made == [(2, 64)]  # the spy sees encode's

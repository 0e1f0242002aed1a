"""`verify --source` on clean conversions: the recomputed error agrees with the recorded one
within pipeline.verify.match_tolerance on both encode paths (numba and numpy), dense and MoE,
the bundled reference models; and it fails on a flipped bit and on another source."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from checkpoints import float32_to_bf16_bits, write_llama_checkpoint, write_moe_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.safetensors_io import read_float32, read_header
from turboquant.pipeline.verify import match_tolerance, verify_repo
from turboquant.stages import fast_quantize

rotate_mod = importlib.import_module("turboquant.stages.rotate")
codec_mod = importlib.import_module("turboquant.stages.codec")

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "reference" / "models"


def run(src, out, **kw):
    kw.update(in_process=True, min_job_bytes=0, progress=False)
    return convert(ConvertOptions(str(src), str(out), **kw))


@pytest.fixture(params=["numba", "numpy"])
def encode_path(request, monkeypatch):
    compiled = request.param == "numba"
    if compiled and not fast_quantize.AVAILABLE:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(rotate_mod, "_COMPILED", compiled)
    monkeypatch.setattr(codec_mod, "_COMPILED", compiled)
    return request.param


def _dense(path):  # odd input sizes: the 12 * 2^k and dense-factor rotations too
    return write_llama_checkpoint(path, layers=2, hidden=96, intermediate=300, heads=4,
                                  kv_heads=2, vocab=520, shards=2)


def _moe(path):
    return write_moe_checkpoint(path, style="qwen3_moe", layers=3, hidden=128,
                                intermediate=128, experts=4, shards=2)


SOURCES = {
    "dense": (_dense, {"bits": 3}),
    "moe-ternary": (_moe, {"expert_bits": "ternary"}),
    "dense-2bit-g32": (_dense, {"bits": 2, "group_size": 32}),
    "reference-dense": (lambda p: REFERENCE / "pystd-dense", {"bits": 3}),
    "reference-moe": (lambda p: REFERENCE / "pystd-moe", {"bits": 3}),
}


@pytest.mark.parametrize("model", list(SOURCES))
def test_clean_conversions_verify_against_their_source(tmp_path, encode_path, model):
    make, options = SOURCES[model]
    src = make(tmp_path / "src")
    out = tmp_path / "out"
    run(src, out, **options)
    report = verify_repo(out, source=src, full=True)
    assert report.ok, report.text()
    rows = {r["name"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert len(report.decoded) == sum(r["codec"] != "raw" for r in rows.values())
    assert report.source_crcs == len(rows)  # every tensor's source bytes, raw ones too
    gaps = []
    for name, recorded, measured in report.decoded:
        r = rows[name]
        tol = match_tolerance(r["group_size"], r["shape"][1], recorded)
        gaps.append(abs(measured - recorded) / tol)
    # the bound is a worst case: clean conversions sit far below it
    print(f"{model} {encode_path}: worst gap {max(gaps):.2e} of the tolerance")
    assert max(gaps) < 0.1


def test_float32_recomputation_would_cry_wolf(tmp_path):
    """What verify did before: float32 sums disagree with the record beyond 1e-4 relative
    on the reference model, the float64 recomputation does not."""
    import mlx.core as mx

    from turboquant.pipeline.verify import _SourceReader, _relative_error, load_coded
    from turboquant.stages import decode

    src = REFERENCE / "pystd-dense"
    out = tmp_path / "out"
    run(src, out, bits=3)
    reader = _SourceReader(src, "llama")
    row = next(r for r in pq.read_table(out / "manifest.parquet").to_pylist()
               if r["name"] == "model.layers.1.mlp.up_proj.weight")
    w = decode(load_coded(out, row, read_header(out / row["shard"])))
    x = mx.array(reader.weight(row))
    f32 = (mx.sum(mx.square(x - w)) / mx.sum(mx.square(x))).item()
    f64 = _relative_error(reader.weight(row), w)
    assert abs(f32 - row["rel_mse"]) > 1e-4 * row["rel_mse"]
    assert abs(f64 - row["rel_mse"]) < 1e-5 * row["rel_mse"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("verify")
    src = _dense(base / "src")
    out = base / "out"
    run(src, out, bits=3)
    return src, out


def test_flipped_bit_in_a_shard_fails(converted, tmp_path):
    src, clean = converted
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    row = next(r for r in pq.read_table(out / "manifest.parquet").to_pylist()
               if r["name"] == "model.layers.1.mlp.down_proj.weight")
    with open(out / row["shard"], "r+b") as f:
        f.seek(row["byte_start"] + 17)
        b = f.read(1)[0]
        f.seek(row["byte_start"] + 17)
        f.write(bytes([b ^ 0x04]))
    report = verify_repo(out, source=src, full=True)
    assert not report.ok
    assert "model.layers.1.mlp.down_proj.weight" in report.text()
    assert "checksum mismatch" in report.text()


@pytest.mark.parametrize("other", ["other-seed", "fine-tune-2pct"])
def test_another_source_of_the_same_shapes_fails(converted, tmp_path, other):
    src, out = converted
    if other == "other-seed":
        alt = write_llama_checkpoint(tmp_path / "alt", layers=2, hidden=96, intermediate=300,
                                     heads=4, kv_heads=2, vocab=520, shards=2, seed=7)
    else:  # every weight moved by 2% of its own size, as a light fine-tune would
        alt = _fine_tune(src, tmp_path / "alt", 0.02)
    report = verify_repo(out, source=alt, sample=4)
    assert not report.ok, report.text()
    assert "rel_mse recomputed from the source" in report.text()
    assert "not converted from this source" in report.text()


def _fine_tune(src: Path, dst: Path, amount: float) -> Path:
    """A copy of `src` whose float tensors are W + amount * std(W) * noise (bf16)."""
    shutil.copytree(src, dst)
    rng = np.random.default_rng(1)
    for f in sorted(dst.glob("*.safetensors")):
        h = read_header(f)
        fd = os.open(f, os.O_RDWR)
        try:
            for info in h.tensors.values():
                x = read_float32(fd, info, 0, info.numel, f.name)
                y = x + amount * float(x.std()) * rng.standard_normal(x.shape).astype(np.float32)
                os.pwrite(fd, float32_to_bf16_bits(y).tobytes(), info.start)
        finally:
            os.close(fd)
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"
    return dst


@pytest.mark.parametrize("other", ["another-model", "no-shards"])
def test_a_source_that_is_not_the_model_is_a_problem_not_a_traceback(converted, tmp_path,
                                                                    other):
    _, out = converted
    if other == "another-model":
        alt = write_llama_checkpoint(tmp_path / "alt", layers=2, hidden=64, intermediate=128,
                                     vocab=520, shards=2)
        want = "has shape"
    else:
        alt = tmp_path / "alt"
        alt.mkdir()
        want = "cannot open"
    report = verify_repo(out, source=alt, full=True)
    assert not report.ok and want in report.text(), report.text()


@pytest.mark.parametrize("model_type,layout,row", [
    ("qwen3_5_moe", "hf", "model.language_model.layers.1.mlp.experts.2.up_proj.weight"),
    ("qwen3_moe", "mlx", "model.layers.1.mlp.experts.2.up_proj.weight"),
], ids=["fused-experts", "stacked-experts"])
def test_rows_of_generic_splits_verify_and_a_moved_piece_fails(tmp_path, model_type, layout,
                                                               row):
    """A fused (E, 2 x I, H) or stacked (E, out, in) source tensor coded one expert (and
    part) at a time by the generic recipe: every row is checked against its own piece of
    the source, and moving one piece of the source fails that row alone."""
    import mlx.core as mx
    from arch_checkpoints import write_arch_checkpoint

    src, out = tmp_path / "src", tmp_path / "out"
    assert write_arch_checkpoint(src, model_type, layout=layout) == layout
    run(src, out, group_size=32, check_disk=False)
    rows = pq.read_table(out / "manifest.parquet").to_pylist()
    split = [r for r in rows if r["codec"] != "raw" and r["source_name"] != r["name"]]
    assert len(split) >= 16
    report = verify_repo(out, source=src, full=True)
    assert report.ok, report.text()
    assert {n for n, _, m in report.decoded if m is not None} >= {r["name"] for r in split}
    assert report.source_crcs == len(rows)  # each piece's CRC as the job read it

    # expert 2's up rows of layer 1 move by 10% in the source: only that row disagrees
    source = next(r["source_name"] for r in split if r["name"] == row)
    weights = mx.load(str(src / "model.safetensors"))
    w = weights[source]
    rows_of = slice(w.shape[1] // 2, None) if "gate_up" in source else slice(None)
    scale = mx.ones(w.shape, dtype=w.dtype)
    scale[2, rows_of] = 1.1
    weights[source] = w * scale
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "pt"})
    report = verify_repo(out, source=src, full=True)
    assert not report.ok
    bad = [p for p in report.problems if "rel_mse recomputed" in p]
    assert len(bad) == 1 and repr(row) in bad[0], report.text()


def _rewrite_tensor(src: Path, name: str, change) -> str:
    """Apply `change` to the raw bytes (uint8) of source tensor `name`; its shard's name."""
    for f in sorted(src.glob("*.safetensors")):
        info = read_header(f).tensors.get(name)
        if info is None:
            continue
        with open(f, "r+b") as fh:
            fh.seek(info.start)
            raw = bytearray(fh.read(info.end - info.start))
            change(raw)
            fh.seek(info.start)
            fh.write(bytes(raw))
        return f.name
    raise AssertionError(name)


@pytest.mark.parametrize("tensor,codec", [
    ("model.layers.1.post_attention_layernorm.weight", "raw"),
    ("model.layers.0.self_attn.o_proj.weight", "coded"),
])
def test_a_source_whose_bytes_differ_fails_its_crc_naming_file_and_tensor(converted, tmp_path,
                                                                          tensor, codec):
    """A kept raw tensor has no error to recompute, and one flipped low bit of a coded
    weight moves rel_mse far less than its tolerance: the ledger's CRC sees both."""
    src, out = converted
    alt = tmp_path / "alt"
    shutil.copytree(src, alt)

    def flip(raw):
        raw[10] ^= 0x01  # the lowest mantissa bit of one bf16 value

    shard = _rewrite_tensor(alt, tensor, flip)
    report = verify_repo(out, source=alt, full=True)
    assert not report.ok, report.text()
    assert len(report.problems) == 1, report.text()
    assert "CRC-32" in report.problems[0]
    assert f"{alt / shard}: tensor {tensor!r}" in report.problems[0]
    assert "not converted from this source" in report.problems[0]
    if codec == "coded":  # the recomputed error alone would have passed it
        assert tensor in {n for n, _, m in report.decoded if m is not None}


def test_a_repo_without_its_ledger_skips_the_crcs(converted, tmp_path):
    """A repo downloaded from the Hub has no .turboquant/: only the errors are compared."""
    src, clean = converted
    out = tmp_path / "out"
    shutil.copytree(clean, out, ignore=shutil.ignore_patterns(".turboquant"))
    report = verify_repo(out, source=src, full=True)
    assert report.ok and report.source_crcs is None, report.text()
    assert "source CRC-32" not in report.text()


def test_verify_cli_shows_the_crc_count(converted, capsys):
    from turboquant import verify

    src, out = converted
    assert verify.main([str(out), "--source", str(src), "--sample", "2"]) == 0
    assert "source CRC-32 compared for 4 tensors" in capsys.readouterr().out


def test_a_sampled_tensor_source_is_read_once_for_its_error_and_its_crc(tmp_path, monkeypatch):
    """verify --source reads each decoded tensor's source once: the CRC it compares with the
    ledger's comes from the same read as the weight it recomputes the error with."""
    from turboquant.pipeline import safetensors_io
    from turboquant.pipeline import verify as verify_mod

    src = _moe(tmp_path / "src")
    out = tmp_path / "out"
    run(src, out, expert_bits="ternary")
    reads: dict[str, int] = {}
    real = verify_mod.read_raw

    def counted(fd, info, start, count, file):
        reads[info.name] = reads.get(info.name, 0) + 1
        return real(fd, info, start, count, file)

    monkeypatch.setattr(verify_mod, "read_raw", counted)
    monkeypatch.setattr(safetensors_io, "read_raw", counted)  # read_float32's
    report = verify_repo(out, source=src, full=True)
    assert report.ok, report.text()
    rows = pq.read_table(out / "manifest.parquet").to_pylist()
    assert report.source_crcs == len(rows)
    coded = [r for r in rows if r["codec"] != "raw" and r["source_name"] == r["name"]]
    assert coded and all(reads[r["source_name"]] == 1 for r in coded), reads

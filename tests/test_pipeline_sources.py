"""Source reading: safetensors headers checked against the file, positioned reads, dtypes,
and the synthetic checkpoint factories (loadable by safetensors and mlx-lm)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from checkpoints import (MOE_STYLES, TensorSpec, float32_to_bf16_bits, random_fill,
                         write_llama_checkpoint, write_moe_checkpoint, write_safetensors)

from turboquant.pipeline.errors import ConversionError, SourceError
from turboquant.pipeline.safetensors_io import read_float32, read_header, read_raw, to_float32
from turboquant.pipeline.sources import LocalSource, open_source


def _file(tmp_path, specs, name="x.safetensors"):
    p = tmp_path / name
    write_safetensors(p, specs)
    return p


def _spec(name, shape, dtype="bfloat16", seed=0):
    return TensorSpec(name, shape, random_fill(seed, name, 1.0), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_read_rows_match_the_values_written(tmp_path, dtype):
    p = _file(tmp_path, [_spec("a", (5, 7), dtype), _spec("b", (3, 4, 2), dtype)])
    h = read_header(p)
    assert list(h.tensors) == ["a", "b"]
    want = random_fill(0, "b", 1.0)(0, 24)
    if dtype == "bfloat16":
        want = (float32_to_bf16_bits(want).astype(np.uint32) << 16).view(np.float32)
    else:
        want = want.astype(dtype).astype(np.float32)
    fd = os.open(p, os.O_RDONLY)
    try:
        got = read_float32(fd, h.tensors["b"], 0, 24, "x")
        np.testing.assert_array_equal(got, want)
        # a positioned read of a middle slice
        np.testing.assert_array_equal(read_float32(fd, h.tensors["b"], 5, 9, "x"), want[5:14])
    finally:
        os.close(fd)


def test_bf16_conversion_is_exact_and_rounds_to_nearest_even():
    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, 1.00390625], dtype=np.float32)
    bits = float32_to_bf16_bits(x)
    back = to_float32(bits.view(np.uint8), "BF16")
    np.testing.assert_allclose(back, x, rtol=2**-8)
    assert float32_to_bf16_bits(np.array([1.00390625], np.float32))[0] == 0x3F80  # tie -> even


def test_truncated_file_names_file_and_tensor(tmp_path):
    p = _file(tmp_path, [_spec("a", (4, 4)), _spec("tail.weight", (8, 8))])
    size = p.stat().st_size
    os.truncate(p, size - 10)
    with pytest.raises(SourceError) as e:
        read_header(p)
    assert "x.safetensors" in str(e.value) and "tail.weight" in str(e.value)
    assert "truncated" in str(e.value)


def test_header_lying_about_a_tensor_size(tmp_path):
    p = _file(tmp_path, [_spec("a", (4, 4)), _spec("b", (2, 2))])
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["a"]["shape"] = [4, 5]  # says 40 bytes, offsets span 32
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    with pytest.raises(SourceError, match=r"x\.safetensors: tensor 'a': header says BF16 \(4, 5\)"):
        read_header(p)


def test_trailing_bytes_and_gaps_are_reported(tmp_path):
    p = _file(tmp_path, [_spec("a", (4, 4))])
    with open(p, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(SourceError, match="after the last tensor"):
        read_header(p)


def test_garbage_header_and_tiny_file(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 6) + b"{nope}")
    with pytest.raises(SourceError, match="bad.safetensors: header is not valid JSON"):
        read_header(p)
    p.write_bytes(b"abc")
    with pytest.raises(SourceError, match="truncated"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SourceError, match="header length"):
        read_header(p)


def test_short_read_names_the_tensor(tmp_path):
    p = _file(tmp_path, [_spec("w", (16, 16))])
    h = read_header(p)
    os.truncate(p, p.stat().st_size - 64)  # shrinks after the header was read
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(SourceError, match="'w'.*truncated"):
            read_raw(fd, h.tensors["w"], 0, 256, "x.safetensors")
    finally:
        os.close(fd)


@pytest.mark.parametrize("shards", [1, 3])
def test_local_source_lists_shards_and_identities(tmp_path, shards):
    src = write_llama_checkpoint(tmp_path / "m", shards=shards)
    s = LocalSource(src)
    assert len(s.shard_files()) == shards
    assert (s.index() is None) == (shards == 1)
    ident = s.identity(s.shard_files()[0])
    assert ident["size"] == (src / s.shard_files()[0]).stat().st_size
    assert "tokenizer.json" in s.aux_files() and "config.json" not in s.aux_files()
    assert s.config()["model_type"] == "llama"


def test_open_source_rejects_nonsense_and_local_delete(tmp_path):
    with pytest.raises(ConversionError, match="source folder .* does not exist"):
        open_source(str(tmp_path / "a" / "b" / "c"))
    src = write_llama_checkpoint(tmp_path / "m", shards=1)
    with pytest.raises(ConversionError, match="Hub sources only"):
        open_source(str(src), delete_after=True)


def test_factories_load_in_mlx_lm(tmp_path):
    from mlx_lm.utils import load_model, load_tokenizer

    for kind in ("llama", "qwen3", "qwen2"):
        p = write_llama_checkpoint(tmp_path / kind, model_type=kind, shards=2)
        load_model(p)
    tok = load_tokenizer(tmp_path / "llama")
    assert tok.decode(tok.encode("hello")) == "hello"
    for style in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2"):
        p = write_moe_checkpoint(tmp_path / style, style=style, shards=2, first_dense_layers=1)
        load_model(p)


@pytest.mark.parametrize("style", MOE_STYLES)
def test_moe_factory_layouts(tmp_path, style):
    p = write_moe_checkpoint(tmp_path / style, style=style, experts=3, shards=1)
    names = set(LocalSource(p).header("model.safetensors").tensors)
    if style == "gpt_oss":
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
        assert LocalSource(p).header("model.safetensors").tensors[
            "model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 64, 64)
    elif style == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.2.w2.weight" in names
    else:
        assert "model.layers.1.mlp.experts.2.down_proj.weight" in names

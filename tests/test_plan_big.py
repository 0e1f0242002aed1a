"""Planning a 200B+ model from its headers: Qwen3-235B-A22B's published layout (config.json,
the exact tensor names and shapes, 118 shards), written as safetensors files whose headers
are real and whose data is a hole (sparse files: a few MB on disk for 470 GB of bf16).

`write_qwen3_235b_layout(path)` is also used by benchmarks/plan.py.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import pytest

from turboquant.pipeline.fit import GB, Machine, project
from turboquant.pipeline.fit_weights import inventory
from turboquant.pipeline.sources import LocalSource
from turboquant.stages import words_per_row

# Qwen/Qwen3-235B-A22B config.json as published (transformers 4.51).
QWEN3_235B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 94, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
SHARDS = 118  # model-00001-of-00118.safetensors ... as on the Hub


def qwen3_moe_tensors(c: dict):
    """(name, shape) of every tensor of a Qwen3-MoE checkpoint, in Hugging Face order."""
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, \
        c["moe_intermediate_size"]
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        for e in range(c["num_experts"]):
            x = f"{p}.mlp.experts.{e}"
            yield f"{x}.down_proj.weight", (h, inter)
            yield f"{x}.gate_proj.weight", (inter, h)
            yield f"{x}.up_proj.weight", (inter, h)
        yield f"{p}.mlp.gate.weight", (c["num_experts"], h)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.self_attn.k_norm.weight", (hd,)
        yield f"{p}.self_attn.k_proj.weight", (kv, h)
        yield f"{p}.self_attn.o_proj.weight", (h, q)
        yield f"{p}.self_attn.q_norm.weight", (hd,)
        yield f"{p}.self_attn.q_proj.weight", (q, h)
        yield f"{p}.self_attn.v_proj.weight", (kv, h)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


def write_sparse_checkpoint(path: str | os.PathLike, config: dict, tensors, shards: int
                            ) -> int:
    """Real safetensors headers, data left as a hole (`truncate`); returns the bytes the
    tensors claim. Also writes config.json and model.safetensors.index.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = list(tensors)
    total = sum(math.prod(s) * 2 for _, s in tensors)
    groups: list[list] = [[] for _ in range(shards)]
    acc = 0
    for name, shape in tensors:
        groups[min(shards - 1, acc * shards // total)].append((name, shape))
        acc += math.prod(shape) * 2
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape in group:
            n = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)  # a hole: no blocks on disk
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return total


def write_qwen3_235b_layout(path: str | os.PathLike) -> int:
    return write_sparse_checkpoint(path, QWEN3_235B_CONFIG,
                                   qwen3_moe_tensors(QWEN3_235B_CONFIG), SHARDS)


@pytest.fixture(scope="module")
def qwen235(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-235b") / "Qwen3-235B-A22B"
    total = write_qwen3_235b_layout(path)
    return path, total


def _coded(out: int, inp: int, bits: int, group: int = 64) -> int:
    return out * words_per_row(inp, bits) * 4 + out * (inp // group) * 2


def test_layout_is_235b_and_sparse(qwen235):
    path, total = qwen235
    params = total // 2
    assert 234.5e9 < params < 235.5e9
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == SHARDS
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    assert apparent > 470e9 and on_disk < 64e6  # headers only


def test_plan_235b_from_headers(qwen235, capsys):
    path, _ = qwen235
    t0 = time.perf_counter()
    inv = inventory(LocalSource(path))
    p = project(inv, 4096, Machine("cpu", 24 * GB, "test"))
    seconds = time.perf_counter() - t0
    print(f"planned Qwen3-235B-A22B layout in {seconds:.2f} s")
    assert seconds < 30  # a timing target lives in benchmarks/plan.py; this guards regressions
    assert inv.tensors == 1 + 94 * (128 * 3 + 9) + 2 and inv.files == SHARDS
    assert not inv.problems

    # qwen_moe recipe: experts 3-bit, first and last layer protected at 4 bits
    e3 = 2 * _coded(1536, 4096, 3) + _coded(4096, 1536, 3)
    e4 = 2 * _coded(1536, 4096, 4) + _coded(4096, 1536, 4)
    assert p.experts == 128 * (92 * e3 + 2 * e4)
    assert p.min_expert_budget == 8 * (92 * e3 + 2 * e4)
    # KV: float32 activations (MoE on the CPU), 94 layers x 4 heads x (128 + 128)
    assert p.dtype == "float32" and p.kv == 94 * 4096 * 4 * 256 * 4
    assert 4e9 < p.nonexpert < 5e9 and 90e9 < p.experts < 95e9
    assert p.verdict == "STREAM"
    assert p.min_expert_budget <= p.expert_budget < p.experts


def test_235b_verdicts(qwen235):
    path, _ = qwen235
    inv = inventory(LocalSource(path))
    mac = project(inv, 32768, Machine("metal", 192 * GB, "test"))
    assert mac.verdict == "RESIDENT" and mac.dtype == "bfloat16"
    assert project(inv, 4096, Machine("cpu", 8 * GB, "test")).verdict == "WON'T FIT"
    small = project(inv, 4096, Machine("cpu", 20 * GB, "test"))
    assert small.verdict == "STREAM"
    assert small.max_context("RESIDENT") == 0 and small.max_context("STREAM") >= 4096


def test_plan_cli_on_235b(qwen235, capsys):
    from turboquant.plan import main

    path, _ = qwen235
    assert main([str(path), "--memory-gb", "24", "--backend", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "STREAM" and d["expert_budget"] > d["min_expert_budget"]
    assert any("--expert-budget" in c for c in d["commands"])
    assert d["commands"][0].startswith(f"turboquant convert {path} ")

    assert main([str(path), "--memory-gb", "24", "--backend", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "verdict: STREAM" in text and "routed experts" in text
    assert "expert streaming: see" in text

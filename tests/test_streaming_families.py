"""Expert streaming on every MoE family the checkpoint factories write: the streamed model
at its minimum budget (every multi-token step runs in chunks) gives the resident model's
bits. The repos come from the runtime suite's own writer, whose shards are ordered by
name, so an expert's tensors need not be one range: the cache then reads several."""

from __future__ import annotations

import mlx.core as mx
import pytest
from checkpoints import write_moe_checkpoint
from test_runtime_families import codec, read_checkpoint, split_fused_experts
from test_runtime_fixtures import write_repo

from turboquant.runtime import ExpertBudgetError, expert_cache, expert_stats, load
from turboquant.runtime.experts import StreamedExperts

TOKENS = mx.array([[1, 5, 70, 33, 200, 9, 12, 250] * 5])
FAMILIES = [
    ("qwen2_moe", {}),  # shared expert stays resident
    ("mixtral", {}),  # block_sparse_moe.experts.E.w1/w2/w3
    ("deepseek_v2", {"first_dense_layers": 1}),  # MoEGate router, a dense first layer
    ("gpt_oss", {}),  # split fused experts, expert biases, custom activation
]


def _minimum(path) -> int:
    with pytest.raises(ExpertBudgetError) as e:
        load(path, expert_budget=1)
    return int(str(e.value).split("minimum is ")[1].split("(")[1].split(" bytes")[0])


@pytest.mark.parametrize("family,kw", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_family_streams_bit_identically(tmp_path, family, kw):
    write_moe_checkpoint(tmp_path / "src", style=family, hidden=64, intermediate=32, vocab=320,
                         experts=6, **kw)
    config, weights = read_checkpoint(tmp_path / "src")
    if family == "gpt_oss":
        weights = split_fused_experts(weights)
    write_repo(tmp_path / "tq", config, weights, codec=codec, group_size=32)
    model, _ = load(tmp_path / "tq")
    want_long, want_one = model(TOKENS), model(TOKENS[:, :1])
    budget = _minimum(tmp_path / "tq")
    streamed, _ = load(tmp_path / "tq", expert_budget=budget, expert_prefetch=True)
    assert any(isinstance(m, StreamedExperts) for _, m in streamed.named_modules())
    assert mx.array_equal(streamed(TOKENS), want_long).item()
    assert mx.array_equal(streamed(TOKENS[:, :1]), want_one).item()
    assert expert_cache(streamed).resident_bytes <= budget
    assert expert_stats(streamed).misses > 0

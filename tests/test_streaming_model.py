"""Expert streaming (runtime/experts.py): a model loaded with an expert budget gives the
same bits as the fully loaded one, at every budget from the minimum to all experts, and
its cache never holds more than the budget.

Repos: the reference MoE (reference/models/pystd-moe, trained on real data) converted by
the pipeline with 4-bit and with ternary experts, and a synthetic Qwen3-MoE
(tests/checkpoints.py) with 3-bit experts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turboquant.runtime import (
    ExpertBudgetError,
    ExpertReadError,
    RepoError,
    expert_cache,
    expert_stats,
    load,
)
from turboquant.runtime.experts import StreamedExperts

convert_mod = pytest.importorskip("turboquant.pipeline.convert")
checkpoints = pytest.importorskip("checkpoints")

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "models"
PROMPT = [5, 70, 33, 200, 9, 12, 250, 41, 7, 99, 120, 3, 64, 18, 77, 150, 2, 31, 8, 60]


def convert(src, out, **kw):
    opts = convert_mod.ConvertOptions(
        source=str(src), output=str(out), in_process=True, progress=False,
        check_disk=False, **kw,
    )
    convert_mod.convert(opts)
    return Path(out)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    out = {}
    checkpoints.write_moe_checkpoint(root / "src", style="qwen3_moe", layers=3, hidden=64,
                                     intermediate=64, experts=8, experts_per_tok=2, vocab=320)
    out["synthetic"] = convert(root / "src", root / "synthetic", bits=4, expert_bits=3,
                               protect_layers=0)
    if (REFERENCE / "pystd-moe").is_dir():
        out["pystd"] = convert(REFERENCE / "pystd-moe", root / "pystd", bits=4, expert_bits=4)
        out["pystd-ternary"] = convert(REFERENCE / "pystd-moe", root / "pystd-ternary", bits=4,
                                       expert_bits="ternary")
    return out


def repo(repos, name):
    if name not in repos:
        pytest.skip("reference models absent")
    return repos[name]


def generate(model, prompt, n=6):
    """Greedy tokens and the log-probabilities of every step (mlx-lm's own loop)."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n,
                                 sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        logprobs.append(lp)
    return tokens, mx.stack(logprobs)


_RESIDENT: dict = {}


def resident(path):
    """Resident model's outputs (prompt logits, a one-token step, greedy generation)."""
    if path not in _RESIDENT:
        model, _ = load(path)
        prompt = mx.array([PROMPT])
        _RESIDENT[path] = dict(
            logits=model(prompt), one=model(prompt[:, :1]), gen=generate(model, PROMPT),
        )
        mx.eval(_RESIDENT[path]["logits"], _RESIDENT[path]["one"])
    return _RESIDENT[path]


def streamed_outputs(model):
    prompt = mx.array([PROMPT])
    return dict(logits=model(prompt), one=model(prompt[:, :1]), gen=generate(model, PROMPT))


def minimum(path) -> int:
    try:
        load(path, expert_budget=1)
    except ExpertBudgetError as e:
        return int(str(e).split("minimum is ")[1].split("(")[1].split(" bytes")[0])
    raise AssertionError("a 1-byte budget loaded")


def check_budget(model, budget):
    cache = expert_cache(model)
    assert cache.resident_bytes <= budget
    assert expert_stats(model).peak_resident_bytes <= budget
    assert sum(p.slots * p.layout.nbytes for p in cache._pools.values()) <= budget


BUDGETS = ["min", "min+1", "25%", "50%", "100%"]


@pytest.mark.parametrize("name", ["synthetic", "pystd", "pystd-ternary"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_bit_identical_to_resident(repos, name, budget):
    path = repo(repos, name)
    ref = resident(path)
    if budget.startswith("min"):
        m = minimum(path)
        budget = m if budget == "min" else m + m // 2  # one more expert
    model, _ = load(path, expert_budget=budget)
    got = streamed_outputs(model)
    assert mx.array_equal(got["logits"], ref["logits"]).item()
    assert mx.array_equal(got["one"], ref["one"]).item()
    assert got["gen"][0] == ref["gen"][0]
    assert mx.array_equal(got["gen"][1], ref["gen"][1]).item()
    if isinstance(budget, int):
        check_budget(model, budget)
    stats = expert_stats(model)
    assert stats.misses > 0 and stats.bytes_read > 0
    if budget == "100%":  # everything fits: each expert is read at most once
        assert stats.misses <= expert_cache(model).slots


@pytest.mark.parametrize("length", [1, 8, 20, 40])
def test_every_kernel_path_at_the_minimum(repos, length):
    """1 and 8 tokens: per-pair gather; 20: grouped by expert; 40: mlx-lm sorts first. At
    the minimum budget every prompt over one token runs in chunks."""
    path = repos["synthetic"]
    model, _ = load(path)
    tokens = mx.array([(PROMPT * 2)[:length]])
    want = model(tokens)
    streamed, _ = load(path, expert_budget=minimum(path))
    assert mx.array_equal(streamed(tokens), want).item()


def test_the_cache_never_exceeds_its_budget(repos):
    path = repos["synthetic"]
    budget = minimum(path) * 2
    model, _ = load(path, expert_budget=budget, expert_prefetch=True)
    cache = expert_cache(model)
    seen = []
    for method in ("acquire", "prefetch"):
        original = getattr(cache, method)

        def watched(*a, _original=original, **k):
            out = _original(*a, **k)
            seen.append(cache.resident_bytes)
            assert cache.resident_bytes <= budget
            return out

        setattr(cache, method, watched)
    generate(model, PROMPT, n=8)
    assert len(seen) > 20 and max(seen) <= budget
    assert expert_stats(model).peak_resident_bytes <= budget


@pytest.mark.parametrize("budget", ["min+1", "50%"])
def test_prefetch_changes_nothing_but_the_reads(repos, budget):
    path = repo(repos, "pystd")
    ref = resident(path)
    if budget == "min+1":  # room to prefetch one expert of the two the next layer needs
        budget = minimum(path) * 3 // 2
    model, _ = load(path, expert_budget=budget, expert_prefetch=True)
    got = streamed_outputs(model)
    assert got["gen"][0] == ref["gen"][0]
    assert mx.array_equal(got["gen"][1], ref["gen"][1]).item()
    stats = expert_stats(model)
    assert stats.prefetched > 0 and stats.prefetch_hits > 0


def test_pinned_experts_stay_resident(repos, tmp_path):
    path = repos["synthetic"]
    ref = resident(path)
    pins = [[0, 1], [1, 5], [2, 7]]
    (tmp_path / "pins.json").write_text(json.dumps({"experts": pins}))
    budget = 3 * minimum(path)  # six experts: the three pins and three more
    model, _ = load(path, expert_budget=budget, expert_pin=tmp_path / "pins.json")
    cache = expert_cache(model)
    pinned = {(cache.groups[g].blobs[e].layer, cache.groups[g].blobs[e].expert)
              for p in cache._pools.values() for g, e in p.pinned}
    assert pinned == {tuple(p) for p in pins}
    got = streamed_outputs(model)
    assert got["gen"][0] == ref["gen"][0]
    assert mx.array_equal(got["logits"], ref["logits"]).item()
    after = {(cache.groups[g].blobs[e].layer, cache.groups[g].blobs[e].expert)
             for p in cache._pools.values() for g, e in p.pinned}
    assert after == pinned
    assert expert_stats(model).pinned == 3
    hot = cache.hot(4)
    assert len(hot) == 4 and all(len(p) == 2 for p in hot)


def test_pin_errors_name_the_problem(repos):
    path = repos["synthetic"]
    with pytest.raises(ExpertBudgetError, match="expert 99 of layer 0"):
        load(path, expert_budget="100%", expert_pin=[[0, 99]])
    with pytest.raises(ExpertBudgetError, match="pinning 2 experts .* at least"):
        load(path, expert_budget=minimum(path), expert_pin=[[0, 1], [1, 1]])
    with pytest.raises(ExpertBudgetError, match="pin file .*missing.json"):
        load(path, expert_budget="100%", expert_pin="/nonexistent/missing.json")


def test_a_budget_below_one_tokens_experts_says_the_minimum(repos):
    path = repos["synthetic"]
    m = minimum(path)
    with pytest.raises(ExpertBudgetError, match=rf"too small.*needs the experts it routes "
                                                rf"to in one layer.*\(2 x .*minimum is .*\({m} bytes"):
        load(path, expert_budget=m - 1)
    model, _ = load(path, expert_budget=m)
    assert expert_cache(model).slots == 2


def test_a_dense_model_has_nothing_to_stream(tmp_path):
    checkpoints.write_llama_checkpoint(tmp_path / "src", hidden=64, intermediate=96, vocab=320)
    convert(tmp_path / "src", tmp_path / "tq", bits=4)
    with pytest.raises(ExpertBudgetError, match="no quantized expert layers"):
        load(tmp_path / "tq", expert_budget="50%")


def test_a_truncated_expert_range_is_a_clear_error(repos, tmp_path):
    src = repos["synthetic"]
    path = tmp_path / "repo"
    shutil.copytree(src, path)
    model, _ = load(path, expert_budget=minimum(path))
    cache = expert_cache(model)
    blob = cache.groups[-1].blobs[-1]  # the last expert of the last layer: near the end
    seg = blob.segments[0]
    with open(path / seg.shard, "r+b") as f:
        f.truncate(seg.start + (seg.end - seg.start) // 2)
    with pytest.raises(ExpertReadError, match=rf"{seg.shard}: expert {blob.expert} of layer "
                                              rf"{blob.layer} is bytes .*truncated"):
        layer = next(m for _, m in model.named_modules()
                     if isinstance(m, StreamedExperts) and m.gid == len(cache.groups) - 1)
        for e in range(len(cache.groups[-1].blobs)):  # sooner or later the router needs it
            layer(mx.zeros((1, 1, 64)), mx.array([[[e, (e + 1) % 8]]], dtype=mx.uint32))
    # and before loading, the shard check names the file
    with pytest.raises(RepoError, match=seg.shard):
        load(path, expert_budget="50%")


def test_stats_add_up(repos):
    path = repos["synthetic"]
    model, _ = load(path, expert_budget="100%")
    generate(model, PROMPT, n=4)
    s = expert_stats(model)
    cache = expert_cache(model)
    blob = cache.groups[0].blobs[0]
    assert s.reads == s.misses
    assert s.bytes_read == s.misses * blob.disk_bytes
    assert 0 < s.hit_rate < 1 and s.read_seconds > 0 and s.read_throughput > 0
    assert s.budget_bytes == s.expert_bytes == cache.slots * cache.groups[0].layout.nbytes
    assert "hit rate" in s.summary() and "read" in s.summary()


def test_argsort_is_stable():
    """Streaming renames experts to slot numbers; the result is bit-identical only if MLX's
    argsort keeps equal keys in order (grouped rows then meet each expert in the same order)."""
    rng = np.random.default_rng(0)
    for n, k in [(40, 4), (64, 8), (1000, 8), (5000, 128)]:
        idx = rng.integers(0, k, n).astype(np.uint32)
        got = np.array(mx.argsort(mx.array(idx)))
        assert (got == np.argsort(idx, kind="stable")).all(), n

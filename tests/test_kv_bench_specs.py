"""benchmarks/kv.py's cache names: what each option selects for a config of a run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kv  # noqa: E402  (the benchmark script)

from turboquant.kernels import cuda_kv_plan  # noqa: E402


def test_options_parse():
    spec = kv.CacheSpec.parse("K4V3:p2:w64:f256:plain")
    assert (spec.kind, spec.bits_k, spec.bits_v, spec.protect, spec.window) == ("tq", 4, 3, 2, 64)
    assert spec.fp_tokens == 256 and spec.plain and not spec.mma and not spec.vec
    assert kv.CacheSpec.parse("K8V3:mma").mma and kv.CacheSpec.parse("fp16").kind == "fp16"
    assert kv.CacheSpec.parse("K4V3:exact").exact and not spec.exact
    assert kv.CacheSpec.parse("K8V8:b8").stage_batch and not spec.stage_batch
    with pytest.raises(ValueError, match="unknown option 'x'"):
        kv.CacheSpec.parse("K4V3:x")


@pytest.mark.parametrize("name, mma, vec, fp, exact", [
    ("K4V3", True, False, cuda_kv_plan.TILE, False),  # the defaults
    ("K4V3:plain", False, False, cuda_kv_plan.TILE, False),
    ("K4V3:vec:f256", True, True, 256, False),
    ("K4V3:exact", True, False, cuda_kv_plan.TILE, True),
    ("K4V3:b8", True, False, cuda_kv_plan.TILE, False),
    ("K4V3:wide", True, False, cuda_kv_plan.TILE, False),
])
def test_attention_path_sets_the_kernel_switches_for_a_config_only(name, mma, vec, fp, exact,
                                                                   monkeypatch):
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_MMA", True)
    monkeypatch.setattr(cuda_kv_plan, "KV_PARTIAL_VEC", False)
    monkeypatch.setattr(cuda_kv_plan, "KV_MMA_EXACT", False)
    monkeypatch.setattr(cuda_kv_plan, "KV_STAGE_BATCH", "auto")
    monkeypatch.setattr(cuda_kv_plan, "FP_TOKENS_PER_CHUNK", cuda_kv_plan.TILE)
    monkeypatch.setattr(cuda_kv_plan, "KV_MERGE_WIDE", False)
    with kv._attention_path(kv.CacheSpec.parse(name)):
        assert (cuda_kv_plan.KV_PARTIAL_MMA, cuda_kv_plan.KV_PARTIAL_VEC) == (mma, vec)
        assert cuda_kv_plan.FP_TOKENS_PER_CHUNK == fp and cuda_kv_plan.KV_MMA_EXACT == exact
        assert (cuda_kv_plan.KV_STAGE_BATCH == "1") == name.endswith(":b8")
        assert cuda_kv_plan.KV_MERGE_WIDE == name.endswith(":wide")
    assert not cuda_kv_plan.KV_MERGE_WIDE
    p = cuda_kv_plan
    assert (p.KV_PARTIAL_MMA, p.KV_PARTIAL_VEC, p.FP_TOKENS_PER_CHUNK, p.KV_MMA_EXACT,
            p.KV_STAGE_BATCH) == (True, False, p.TILE, False, "auto")


@pytest.mark.parametrize("name, during", [("K4V3", "auto"), ("K4V3:eager", "0")])
def test_eager_option_turns_the_compiled_compression_off_for_its_config(name, during,
                                                                        monkeypatch):
    from turboquant.runtime import kvcache

    monkeypatch.setattr(kvcache, "COMPILED_FLUSH", "auto")
    assert kv.CacheSpec.parse(name).eager_flush == (during == "0")
    with kv._attention_path(kv.CacheSpec.parse(name)):
        assert kvcache.COMPILED_FLUSH == during
    assert kvcache.COMPILED_FLUSH == "auto"

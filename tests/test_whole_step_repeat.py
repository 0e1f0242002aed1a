"""tools/whole_step_repeat.py: the whole step against the per-layer step, repeated, and the
rows of the first layer's cache that differ (the H200's `[llama-launch]` hunt)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import whole_step_repeat  # noqa: E402


def test_differing_rows_names_a_changed_row_and_a_row_never_stored():
    want = mx.ones((1, 2, 8, 4))
    got = mx.array(want)
    got[:, :, 3] = 0.0  # never stored
    got[:, 1, 5, 2] = 1.5  # stored wrong in one head
    found = whole_step_repeat.differing_rows(want, got, rows=8)
    assert found == {"rows": [3, 5], "count": 2, "zero_rows": [3]}
    assert whole_step_repeat.differing_rows(want, got, rows=3)["count"] == 0


def test_a_run_on_the_cpu_finds_the_whole_step_storing_every_row(tmp_path, monkeypatch):
    import decode

    from turboquant.kernels import cuda_attend
    from turboquant.runtime import whole_step

    # the tool sets these process-wide: restored after the test
    monkeypatch.setattr(decode, "LLAMA3_8B", dict(decode.LLAMA3_8B))
    for module, name in ((whole_step, "GROW"), (whole_step, "WHOLE_STEP"), (cuda_attend, "MERGE")):
        monkeypatch.setattr(module, name, getattr(module, name))
    out = tmp_path / "runs.jsonl"
    whole_step_repeat.main(["--tiny", "--runs", "1", "--steps", "12", "--json", str(out)])
    run = json.loads(out.read_text())
    assert run["offset"] == len(whole_step_repeat.PROMPT) + 12
    assert run["keys"]["count"] == 0 and run["values"]["count"] == 0

"""`turboquant generate --expert-budget`: the same text as the resident model, stats on
stderr, and clear errors (a subprocess per run, as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

checkpoints = pytest.importorskip("checkpoints")
convert_mod = pytest.importorskip("turboquant.pipeline.convert")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming-cli")
    checkpoints.write_moe_checkpoint(root / "src", style="qwen3_moe", layers=2, hidden=64,
                                     intermediate=64, experts=8, experts_per_tok=2, vocab=320)
    convert_mod.convert(convert_mod.ConvertOptions(
        source=str(root / "src"), output=str(root / "tq"), in_process=True, progress=False,
        check_disk=False, bits=4, expert_bits=4, protect_layers=0,
    ))
    return root / "tq"


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "turboquant", "generate", *map(str, args)],
        capture_output=True, text=True, timeout=120,
    )


def test_generate_with_a_budget_prints_the_same_text_and_stats(repo, tmp_path):
    base = ["--model", repo, "--prompt", "hello world", "--max-tokens", "12"]
    resident = run(*base)
    assert resident.returncode == 0, resident.stderr
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps([[0, 0], [1, 3]]))
    streamed = run(*base, "--expert-budget", "50%", "--expert-pin", pins, "--expert-prefetch")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == resident.stdout
    assert "experts: budget" in streamed.stderr and "hit rate" in streamed.stderr
    assert "experts:" not in resident.stderr


def test_budget_errors_exit_2_and_say_why(repo):
    small = run("--model", repo, "--prompt", "x", "--expert-budget", "1KB")
    assert small.returncode == 2
    assert "too small" in small.stderr and "minimum is" in small.stderr
    bad = run("--model", repo, "--prompt", "x", "--expert-budget", "lots")
    assert bad.returncode == 2 and "expert budget 'lots'" in bad.stderr
    orphan = run("--model", repo, "--prompt", "x", "--expert-prefetch")
    assert orphan.returncode == 2 and "need --expert-budget" in orphan.stderr
